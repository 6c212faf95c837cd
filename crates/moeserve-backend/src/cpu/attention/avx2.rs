//! The AVX2 attention of one (token, KV head): see the parent module.

use std::arch::x86_64::*;

use super::{KvElement, KvHeadQuery};

/// Keys (and values) per pass over the group's query heads, read from memory once and from
/// L1 by the other heads. A head's part of every cached row sits at the same offset in
/// rows a whole number of KiB apart, so a chunk's rows fall in a quarter of L1's sets or
/// fewer: 64 rows of a 64-wide f32 head (16 KiB) overflowed them (16 lines per set of 8
/// ways). 16 rows fit: 1.13× over 64 at 4,096 keys, 1.3× at 256 (benches/kernels
/// `attention`); 32 was as fast at 4,096.
const CHUNK: usize = 16;

/// As the AVX-512 variant, 8 lanes at a time:
/// - scores, 8 keys at a time: 8 independent FMA chains over the head's width sharing each
///   load of the query, then one transposing tree ([`sum_lanes_8`]) instead of a
///   horizontal sum per key — a key's score is its lanes summed in one fixed order
///   whatever its neighbours, so it depends on the query and the key alone;
/// - the output of each head, 8 vectors at a time held in registers over a chunk of value
///   rows (an FMA chain over the rows in order, as before: the same bits).
///
/// # Safety
/// AVX2 and FMA are available and `head_dim` and `value_dim` are multiples of 8.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn attend<T: KvElement>(
    a: &KvHeadQuery<'_, T>,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let (d, dv, n) = (a.head_dim, a.value_dim, a.slots.len());
    let group = a.q.len() / d;
    let scale = _mm256_set1_ps(a.scale);
    // The chunk's rows, looked up (and bounds-checked) once for all heads of the group.
    let mut chunk_rows = [std::ptr::null::<T>(); CHUNK];
    for c0 in (0..n).step_by(CHUNK) {
        let c1 = (c0 + CHUNK).min(n);
        a.keys.prefetch(&a.slots[c1..(c1 + CHUNK).min(n)], 0, d);
        for (r, slot) in chunk_rows.iter_mut().zip(&a.slots[c0..c1]) {
            *r = a.keys.row(*slot, d).as_ptr();
        }
        for h in 0..group {
            let q = &a.q[h * d..(h + 1) * d];
            for s0 in (c0..c1).step_by(8) {
                let keys = (c1 - s0).min(8);
                // Past the last key, the last key again; its sums are cleared below.
                let rows: [*const T; 8] =
                    std::array::from_fn(|j| chunk_rows[s0 - c0 + j.min(keys - 1)]);
                let mut acc = [_mm256_setzero_ps(); 8];
                // SAFETY: q and every row hold d = 8·i elements.
                unsafe {
                    let qv = _mm256_loadu_ps(q.as_ptr());
                    for (acc, row) in acc.iter_mut().zip(&rows) {
                        *acc = _mm256_mul_ps(qv, T::load8(*row));
                    }
                    for c in (8..d).step_by(8) {
                        let qv = _mm256_loadu_ps(q.as_ptr().add(c));
                        for (acc, row) in acc.iter_mut().zip(&rows) {
                            *acc = _mm256_fmadd_ps(qv, T::load8(row.add(c)), *acc);
                        }
                    }
                }
                acc[keys..].fill(_mm256_setzero_ps());
                let mut sums = [0.0f32; 8];
                // SAFETY: 8 elements.
                unsafe {
                    _mm256_storeu_ps(sums.as_mut_ptr(), _mm256_mul_ps(sum_lanes_8(&acc), scale))
                };
                scores[h * n + s0..h * n + s0 + keys].copy_from_slice(&sums[..keys]);
            }
        }
    }
    for (h, row) in scores.chunks_exact_mut(n).enumerate() {
        softmax(row, a.sink(h));
    }
    out.fill(0.0);
    for c0 in (0..n).step_by(CHUNK) {
        let c1 = (c0 + CHUNK).min(n);
        a.values.prefetch(&a.slots[c1..(c1 + CHUNK).min(n)], 0, dv);
        for (r, slot) in chunk_rows.iter_mut().zip(&a.slots[c0..c1]) {
            *r = a.values.row(*slot, dv).as_ptr();
        }
        let rows = &chunk_rows[..c1 - c0];
        for h in 0..group {
            let p = &scores[h * n + c0..h * n + c1];
            // 64 columns at a time, then any last columns 8 at a time.
            for col in (0..dv).step_by(64) {
                let width = (dv - col).min(64);
                let o = &mut out[h * dv + col..h * dv + col + width];
                // SAFETY: every value row holds dv elements, `o` the columns' width.
                unsafe {
                    if width == 64 {
                        weigh_values::<T, 8>(rows, p, col, o);
                    } else {
                        for (i, o) in o.chunks_exact_mut(8).enumerate() {
                            weigh_values::<T, 1>(rows, p, col + 8 * i, o);
                        }
                    }
                }
            }
        }
    }
}

/// `o += Σ_s p[s] · rows[s][col .. col + 8·V]` in `V` registers, an FMA chain over the
/// rows in order.
///
/// # Safety
/// AVX2 and FMA are available; `o` holds `8·V` elements and each row `col + 8·V`.
#[target_feature(enable = "avx2,fma")]
unsafe fn weigh_values<T: KvElement, const V: usize>(
    rows: &[*const T],
    p: &[f32],
    col: usize,
    o: &mut [f32],
) {
    debug_assert_eq!(o.len(), 8 * V);
    // SAFETY: the caller's sizes.
    unsafe {
        let mut acc: [__m256; V] = std::array::from_fn(|i| _mm256_loadu_ps(o.as_ptr().add(8 * i)));
        for (row, p) in rows.iter().zip(p) {
            let v = row.add(col);
            let p = _mm256_set1_ps(*p);
            for (i, acc) in acc.iter_mut().enumerate() {
                *acc = _mm256_fmadd_ps(p, T::load8(v.add(8 * i)), *acc);
            }
        }
        for (i, acc) in acc.iter().enumerate() {
            _mm256_storeu_ps(o.as_mut_ptr().add(8 * i), *acc);
        }
    }
}

/// The low `len` lanes set (all 8 from 8 up), as `maskload` and `maskstore` take them: a
/// row's tail chunk.
#[target_feature(enable = "avx2")]
pub(in crate::cpu) fn mask(len: usize) -> __m256i {
    let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_cmpgt_epi32(_mm256_set1_epi32(len.min(8) as i32), lanes)
}

/// `[Σ lanes of v[0], …, Σ lanes of v[7]]`, each as `((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7))`
/// (`hadd` pairs lanes within each 128-bit half, the last add joins the halves).
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn sum_lanes_8(v: &[__m256; 8]) -> __m256 {
    let t = [
        _mm256_hadd_ps(v[0], v[1]),
        _mm256_hadd_ps(v[2], v[3]),
        _mm256_hadd_ps(v[4], v[5]),
        _mm256_hadd_ps(v[6], v[7]),
    ];
    let (u0, u1) = (_mm256_hadd_ps(t[0], t[1]), _mm256_hadd_ps(t[2], t[3]));
    _mm256_add_ps(
        _mm256_permute2f128_ps::<0x20>(u0, u1),
        _mm256_permute2f128_ps::<0x31>(u0, u1),
    )
}

/// Softmax of one row in place as the AVX-512 variant, 8 lanes at a time (the last part
/// under a [`mask`]); a sink joins the max and the sum.
#[target_feature(enable = "avx2,fma")]
fn softmax(row: &mut [f32], sink: Option<f32>) {
    let (n, p) = (row.len(), row.as_mut_ptr());
    let max = (row.iter().copied()).fold(sink.unwrap_or(f32::NEG_INFINITY), f32::max);
    let vmax = _mm256_set1_ps(max);
    let mut sum = _mm256_setzero_ps();
    for c in (0..n).step_by(8) {
        let m = mask(n - c);
        // SAFETY: lanes under the mask are inside the row; the others read and write
        // nothing, and their `exp(0)` is cleared before the sum.
        unsafe {
            let x = _mm256_blendv_ps(
                vmax,
                _mm256_maskload_ps(p.add(c), m),
                _mm256_castsi256_ps(m),
            );
            let e = _mm256_and_ps(
                crate::cpu::exp::avx2::exp(_mm256_sub_ps(x, vmax)),
                _mm256_castsi256_ps(m),
            );
            sum = _mm256_add_ps(sum, e);
            // A masked store is slow on some cores: only for the last part.
            if n - c >= 8 {
                _mm256_storeu_ps(p.add(c), e);
            } else {
                _mm256_maskstore_ps(p.add(c), m, e);
            }
        }
    }
    let four = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps::<1>(sum));
    let two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    let mut total = _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps::<1>(two, two)));
    if let Some(sink) = sink {
        total += (sink - max).exp();
    }
    let inv = 1.0 / total;
    row.iter_mut().for_each(|v| *v *= inv);
}
