//! The AVX-512 attention of one (token, KV head): see the parent module.

use std::arch::x86_64::*;

use super::{KvElement, KvHeadQuery};

/// Query heads whose outputs one pass over the values accumulates (× [`VALUE_VECTORS`]
/// vectors = 16 accumulator registers).
const VALUE_HEADS: usize = 4;
/// 16-lane vectors of each value row one pass over the values covers (64 columns).
const VALUE_VECTORS: usize = 4;

/// As `attend_scalar`, 16 lanes at a time:
/// - scores, 16 keys at a time ([`chunk_scores`]): every head of the group runs through a
///   chunk of keys while it is in L1, so each key row comes from memory once;
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
            let chunk = ScoreChunk {
                a,
                keys,
                first: 16 * b,
                scores: scores.as_mut_ptr(),
            };
            chunk_scores(&chunk);
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

/// One chunk of up to 16 keys against every query head of the group.
struct ScoreChunk<'p, 'q, T> {
    a: &'p KvHeadQuery<'q, T>,
    keys: &'p [usize],
    /// The chunk's first key among the query's.
    first: usize,
    /// `[group, n]` scores.
    scores: *mut f32,
}

/// The scaled scores of a chunk's keys for every head, into `scores`: each key's lane
/// products summed with the other 15 keys' by one transposing tree ([`sum_lanes_16`]).
/// Where the heads' query vectors fit in registers (a head of 16, 32, 64 or 128 columns), a
/// few heads at a time hold them there and load each key row once for
/// all of them ([`heads_in_registers`]); else each head loads its query and the rows again.
/// The same products in the same order either way, so the same bits.
///
/// # Safety
/// AVX-512F is available; `head_dim` is a multiple of 16.
#[target_feature(enable = "avx512f")]
unsafe fn chunk_scores<T: KvElement>(c: &ScoreChunk<'_, '_, T>) {
    let (a, d) = (c.a, c.a.head_dim);
    let group = a.q.len() / d;
    let vectors = d / 16;
    let per_pass = match vectors {
        1 | 2 | 4 => 4,
        8 => 2,
        _ => 0,
    };
    unsafe {
        if per_pass == 0 {
            for h in 0..group {
                one_head(c, h);
            }
            return;
        }
        for h0 in (0..group).step_by(per_pass) {
            // Compile-time counts, so the query vectors stay in registers.
            macro_rules! dispatch {
                ($($h:literal $v:literal),*) => {
                    match ((group - h0).min(per_pass), vectors) {
                        $(($h, $v) => heads_in_registers::<T, $h, $v>(c, h0),)*
                        _ => unreachable!("1..=4 heads of 1, 2 or 4 vectors, 1..=2 of 8"),
                    }
                };
            }
            dispatch!(1 1, 2 1, 3 1, 4 1, 1 2, 2 2, 3 2, 4 2,
                      1 4, 2 4, 3 4, 4 4, 1 8, 2 8);
        }
    }
}

/// Head `h`'s scores of the chunk, its query and the key rows loaded per key.
///
/// # Safety
/// As [`chunk_scores`]; `h` is inside the group.
#[target_feature(enable = "avx512f")]
unsafe fn one_head<T: KvElement>(c: &ScoreChunk<'_, '_, T>, h: usize) {
    let (a, d, n) = (c.a, c.a.head_dim, c.a.slots.len());
    unsafe {
        let q = a.q.as_ptr().add(h * d);
        let mut lanes = [_mm512_setzero_ps(); 16];
        for (l, slot) in lanes.iter_mut().zip(c.keys) {
            let k = a.keys.row(*slot, d).as_ptr();
            let mut acc = _mm512_mul_ps(_mm512_loadu_ps(q), T::load16(k));
            for col in (16..d).step_by(16) {
                acc = _mm512_fmadd_ps(_mm512_loadu_ps(q.add(col)), T::load16(k.add(col)), acc);
            }
            *l = acc;
        }
        let sums = _mm512_mul_ps(sum_lanes_16(&lanes), _mm512_set1_ps(a.scale));
        let row = c.scores.add(h * n + c.first);
        _mm512_mask_storeu_ps(row, mask(c.keys.len()), sums);
    }
}

/// Heads `h0..h0 + HEADS`' scores of the chunk, their query vectors in registers and each key
/// row loaded once for all of them: the products of [`one_head`], in its order.
///
/// # Safety
/// As [`chunk_scores`]; `head_dim` is `16 · VECS`; the heads are inside the group.
#[target_feature(enable = "avx512f")]
unsafe fn heads_in_registers<T: KvElement, const HEADS: usize, const VECS: usize>(
    c: &ScoreChunk<'_, '_, T>,
    h0: usize,
) {
    let (a, d, n) = (c.a, c.a.head_dim, c.a.slots.len());
    unsafe {
        let q: [[__m512; VECS]; HEADS] = std::array::from_fn(|h| {
            std::array::from_fn(|v| _mm512_loadu_ps(a.q.as_ptr().add((h0 + h) * d + 16 * v)))
        });
        let mut lanes = [[_mm512_setzero_ps(); 16]; HEADS];
        for (j, slot) in c.keys.iter().enumerate() {
            let k = a.keys.row(*slot, d).as_ptr();
            let key: [__m512; VECS] = std::array::from_fn(|v| T::load16(k.add(16 * v)));
            for (lanes, q) in lanes.iter_mut().zip(&q) {
                let mut acc = _mm512_mul_ps(q[0], key[0]);
                for v in 1..VECS {
                    acc = _mm512_fmadd_ps(q[v], key[v], acc);
                }
                lanes[j] = acc;
            }
        }
        for (h, lanes) in lanes.iter().enumerate() {
            let sums = _mm512_mul_ps(sum_lanes_16(lanes), _mm512_set1_ps(a.scale));
            let row = c.scores.add((h0 + h) * n + c.first);
            _mm512_mask_storeu_ps(row, mask(c.keys.len()), sums);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::attention::HeadRows;

    #[test]
    fn query_heads_in_registers_give_the_bits_of_one_head_at_a_time() {
        if !is_x86_feature_detected!("avx512f") {
            return;
        }
        let value =
            |i: usize, seed: usize| ((i * 2654435761 + seed * 97) % 1009) as f32 / 500.0 - 1.0;
        // Every head width the registers take (1, 2, 4, 8 vectors) with every group size up to
        // 8 (so every pass of 1..=4 or 1..=2 heads), a tail chunk (29 keys), and a width they
        // do not take (3 vectors).
        for (head_dim, group) in [16, 32, 64, 128, 48]
            .into_iter()
            .flat_map(|d| (1..=8).map(move |g| (d, g)))
        {
            let stride = 2 * head_dim;
            let slots: Vec<usize> = (0..29).map(|i| (i * 7) % 40).collect();
            let rows: Vec<f32> = (0..40 * stride).map(|i| value(i, 1)).collect();
            let q: Vec<f32> = (0..group * head_dim).map(|i| value(i, 2)).collect();
            let heads = HeadRows {
                data: &rows,
                stride,
                offset: head_dim,
            };
            let a = KvHeadQuery {
                q: &q,
                head_dim,
                value_dim: head_dim,
                scale: 0.125,
                keys: heads,
                values: heads,
                slots: &slots,
                sinks: None,
            };
            // The path `attend` takes, against each head alone.
            let scores = |in_registers: bool| {
                let mut scores = vec![f32::NAN; group * slots.len()];
                for (b, keys) in slots.chunks(16).enumerate() {
                    let chunk = ScoreChunk {
                        a: &a,
                        keys,
                        first: 16 * b,
                        scores: scores.as_mut_ptr(),
                    };
                    // SAFETY: AVX-512F was detected; head_dim is a multiple of 16.
                    unsafe {
                        match in_registers {
                            true => chunk_scores(&chunk),
                            false => (0..group).for_each(|h| one_head(&chunk, h)),
                        }
                    }
                }
                scores.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            };
            let (fast, general) = (scores(true), scores(false));
            assert!(general.iter().all(|b| f32::from_bits(*b).is_finite()));
            assert_eq!(fast, general, "head_dim {head_dim}, group {group}");
        }
    }
}
