//! The AVX-512 attention of one (token, KV head): see the parent module.

use std::arch::x86_64::*;

use super::{KvElement, KvHeadQuery};

/// Query heads whose outputs one pass over the values accumulates (× [`VALUE_VECTORS`]
/// vectors = 16 accumulator registers).
const VALUE_HEADS: usize = 4;
/// 16-lane vectors of each value row one pass over the values covers (64 columns).
const VALUE_VECTORS: usize = 4;

/// As `attend_scalar`, 16 lanes at a time:
/// - scores, 16 keys at a time: each key's lane products are summed together with the other
///   15 keys' by one transposing tree ([`sum_lanes_16`]), not one horizontal sum per key;
///   every head of the group runs through a chunk of keys while it is in L1, so each key
///   row comes from memory once;
/// - softmax of each head's row with a vectorised `exp` (`exp.rs`);
/// - the output, an FMA chain over the rows in order held in registers, up to
///   [`VALUE_HEADS`] heads at a time, so each value row is loaded once for all of them.
///
/// Every sum has a fixed order, so a token's result does not depend on the batch.
///
/// # Safety
/// AVX-512F is available and `head_dim` and `value_dim` are multiples of 16.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn attend<T: KvElement>(
    a: &KvHeadQuery<'_, T>,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let (d, dv, n) = (a.head_dim, a.value_dim, a.slots.len());
    let group = a.q.len() / d;
    unsafe {
        for (b, keys) in a.slots.chunks(16).enumerate() {
            let next = &a.slots[(16 * b + 16).min(n)..(16 * b + 32).min(n)];
            a.keys.prefetch(next, 0, d);
            for h in 0..group {
                let q = a.q.as_ptr().add(h * d);
                let mut lanes = [_mm512_setzero_ps(); 16];
                for (l, slot) in lanes.iter_mut().zip(keys) {
                    let k = a.keys.row(*slot, d).as_ptr();
                    let mut acc = _mm512_mul_ps(_mm512_loadu_ps(q), T::load16(k));
                    for c in (16..d).step_by(16) {
                        acc = _mm512_fmadd_ps(_mm512_loadu_ps(q.add(c)), T::load16(k.add(c)), acc);
                    }
                    *l = acc;
                }
                let sums = _mm512_mul_ps(sum_lanes_16(&lanes), _mm512_set1_ps(a.scale));
                let row = scores.as_mut_ptr().add(h * n + 16 * b);
                _mm512_mask_storeu_ps(row, mask(keys.len()), sums);
            }
        }
        for (h, row) in scores.chunks_exact_mut(n).enumerate() {
            softmax(row, a.sink(h));
        }
        for h0 in (0..group).step_by(VALUE_HEADS) {
            let heads = (group - h0).min(VALUE_HEADS);
            for c0 in (0..dv).step_by(16 * VALUE_VECTORS) {
                let width = ((dv - c0) / 16).min(VALUE_VECTORS);
                let pass = ValuePass {
                    a,
                    scores,
                    h0,
                    c0,
                    out: out.as_mut_ptr(),
                };
                // Compile-time counts keep the accumulators in registers: with run-time
                // bounds the compiler turned the row loads and output stores into memcpy
                // calls (with register spills) inside the loop over the values.
                macro_rules! dispatch {
                    ($($h:literal $w:literal),*) => {
                        match (heads, width) {
                            $(($h, $w) => value_pass::<T, $h, $w>(&pass),)*
                            _ => unreachable!("1..=4 heads and vectors"),
                        }
                    };
                }
                dispatch!(1 1, 1 2, 1 3, 1 4, 2 1, 2 2, 2 3, 2 4,
                          3 1, 3 2, 3 3, 3 4, 4 1, 4 2, 4 3, 4 4);
            }
        }
    }
}

/// One pass over the values for heads `h0..h0 + HEADS`, columns `c0..c0 + 16 · WIDTH`.
struct ValuePass<'p, 'q, T> {
    a: &'p KvHeadQuery<'q, T>,
    /// `[group, n]` softmaxed scores.
    scores: &'p [f32],
    h0: usize,
    c0: usize,
    /// `[group, value_dim]`
    out: *mut f32,
}

/// `out[h][c] = Σ_s scores[h][s] · value[s][c]`, an FMA chain over the rows in order.
///
/// # Safety
/// AVX-512F is available; the heads and columns are inside the query's group and head.
#[target_feature(enable = "avx512f")]
unsafe fn value_pass<T: KvElement, const HEADS: usize, const WIDTH: usize>(
    p: &ValuePass<'_, '_, T>,
) {
    let (dv, n) = (p.a.value_dim, p.a.slots.len());
    let mut o = [[_mm512_setzero_ps(); WIDTH]; HEADS];
    unsafe {
        for (s, slot) in p.a.slots.iter().enumerate() {
            if s % 16 == 0 {
                let next = &p.a.slots[(s + 16).min(n)..(s + 32).min(n)];
                p.a.values.prefetch(next, p.c0, 16 * WIDTH);
            }
            let v = p.a.values.row(*slot, dv).as_ptr().add(p.c0);
            let rows: [__m512; WIDTH] = std::array::from_fn(|i| T::load16(v.add(16 * i)));
            for (j, o) in o.iter_mut().enumerate() {
                let w = _mm512_set1_ps(*p.scores.get_unchecked((p.h0 + j) * n + s));
                for (o, r) in o.iter_mut().zip(&rows) {
                    *o = _mm512_fmadd_ps(w, *r, *o);
                }
            }
        }
        for (j, o) in o.iter().enumerate() {
            for (i, o) in o.iter().enumerate() {
                let at = (p.h0 + j) * dv + p.c0 + 16 * i;
                _mm512_storeu_ps(p.out.add(at), *o);
            }
        }
    }
}

/// The low `len` lanes (all 16 from 16 up): a row's tail chunk.
pub(in crate::cpu) fn mask(len: usize) -> __mmask16 {
    if len >= 16 { 0xFFFF } else { (1u16 << len) - 1 }
}

/// `[Σ lanes of v[0], …, Σ lanes of v[15]]`: pairs of vectors interleaved and added within
/// 128-bit lanes, then the four 128-bit lanes folded — 15 adds for 16 sums.
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) fn sum_lanes_16(v: &[__m512; 16]) -> __m512 {
    // Per 128-bit lane L: [a0+a2, b0+b2, a1+a3, b1+b3] of that lane's 4 elements.
    let pair = |a, b| _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    // Per lane: [Σ a, Σ b, Σ c, Σ d] over that lane's elements.
    let quad = |ab, cd| {
        _mm512_add_ps(
            _mm512_shuffle_ps::<0x44>(ab, cd),
            _mm512_shuffle_ps::<0xEE>(ab, cd),
        )
    };
    let q: [__m512; 4] = std::array::from_fn(|i| {
        quad(
            pair(v[4 * i], v[4 * i + 1]),
            pair(v[4 * i + 2], v[4 * i + 3]),
        )
    });
    // Lanes 0+1 and 2+3 of two quads, then of those: each 128-bit lane ends with four sums.
    let fold = |x, y| {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x88>(x, y),
            _mm512_shuffle_f32x4::<0xDD>(x, y),
        )
    };
    fold(fold(q[0], q[1]), fold(q[2], q[3]))
}

/// Softmax of one row in place: max, `exp(x - max)`, sum, scale — 16 lanes at a time; a
/// sink joins the max and the sum (see `softmax_with_sink`).
#[target_feature(enable = "avx512f")]
unsafe fn softmax(row: &mut [f32], sink: Option<f32>) {
    let p = row.as_mut_ptr();
    let chunks = row.len().div_ceil(16);
    let mask_of = |c: usize| mask(row.len() - 16 * c);
    unsafe {
        let neg_inf = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut max = neg_inf;
        for c in 0..chunks {
            let x = _mm512_mask_loadu_ps(neg_inf, mask_of(c), p.add(16 * c));
            max = _mm512_max_ps(max, x);
        }
        let max = _mm512_reduce_max_ps(max);
        let max = _mm512_set1_ps(sink.map_or(max, |s| max.max(s)));
        let mut sum = _mm512_setzero_ps();
        for c in 0..chunks {
            let m = mask_of(c);
            let e = crate::cpu::exp::avx512::exp(_mm512_sub_ps(
                _mm512_maskz_loadu_ps(m, p.add(16 * c)),
                max,
            ));
            sum = _mm512_mask_add_ps(sum, m, sum, e);
            _mm512_mask_storeu_ps(p.add(16 * c), m, e);
        }
        let mut total = _mm512_reduce_add_ps(sum);
        if let Some(sink) = sink {
            total += (sink - _mm_cvtss_f32(_mm512_castps512_ps128(max))).exp();
        }
        let inv = _mm512_set1_ps(1.0 / total);
        for c in 0..chunks {
            let m = mask_of(c);
            let e = _mm512_maskz_loadu_ps(m, p.add(16 * c));
            _mm512_mask_storeu_ps(p.add(16 * c), m, _mm512_mul_ps(e, inv));
        }
    }
}
