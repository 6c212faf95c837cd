//! Attention of one query token against the cached rows of one KV head, for every query head
//! that shares it (grouped-query attention): `softmax(q·kᵀ · scale) · v`. Values may be
//! narrower than keys: multi-head latent attention reads its values as the leading part of
//! the same cached latent rows its keys are. A head may have a sink (GPT-OSS): a learned logit
//! that joins the softmax's denominator and contributes no value.
//!
//! The cache holds f32 or bf16 rows ([`KvElement`]); a bf16 row is widened to f32 as it is
//! loaded, so the arithmetic is the f32 path's on the widened values, bit for bit.
//!
//! The caller (the model's attention layer) runs one call per (token, KV head), in parallel, so
//! a batch-1 decode keeps every core busy. Each key and value row is loaded once per call and
//! used by all heads of the group. A call's arithmetic depends only on its own query and rows —
//! never on which other tokens share the step — so results do not depend on the batch.

use half::bf16;

use super::{Isa, isa};

#[cfg(target_arch = "x86_64")]
pub(super) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(super) mod avx512;

/// An element type of cached key and value rows: f32, or bf16 (half the bytes per token,
/// vLLM's `--kv-cache-dtype` of a bf16 model).
pub trait KvElement: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;

    /// 8 elements at `p`, widened.
    ///
    /// # Safety
    /// `p` points at 8 readable elements; the CPU supports AVX2.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;

    /// 16 elements at `p`, widened.
    ///
    /// # Safety
    /// `p` points at 16 readable elements; the CPU supports AVX-512F.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
}

impl KvElement for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        // SAFETY: the caller's.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512 {
        // SAFETY: the caller's.
        unsafe { std::arch::x86_64::_mm512_loadu_ps(p) }
    }
}

impl KvElement for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }

    /// A bf16 is the high half of its f32: zero-extended and shifted up.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's.
        unsafe {
            let h = _mm_loadu_si128(p as *const __m128i);
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's.
        unsafe {
            let h = _mm256_loadu_si256(p as *const __m256i);
            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
        }
    }
}

/// One KV head's rows inside a layer's cache: row of slot `s` is
/// `data[s * stride + offset .. s * stride + offset + head_dim]`.
#[derive(Clone, Copy)]
pub struct HeadRows<'a, T = f32> {
    pub data: &'a [T],
    pub stride: usize,
    pub offset: usize,
}

impl<T> HeadRows<'_, T> {
    fn row(&self, slot: usize, head_dim: usize) -> &[T] {
        let start = slot * self.stride + self.offset;
        &self.data[start..start + head_dim]
    }

    /// Asks for the lines of `width` elements from `col` of each slot's row, into L1. A head's
    /// rows are a few hundred bytes each, a cache row apart, so the hardware's prefetchers
    /// leave each to a miss of its own, and at batch 1 the cache comes from DRAM (a step's
    /// weights evict it). Asking a chunk ahead: batch-1 decode at 2,000 tokens of context
    /// 1.12× on Zen 4, no change at 128–384 (bench/RESULTS.md).
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn prefetch(&self, slots: &[usize], col: usize, width: usize) {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        let bytes = width * std::mem::size_of::<T>();
        for &slot in slots {
            let start = self
                .data
                .as_ptr()
                .wrapping_add(slot * self.stride + self.offset + col);
            for line in (0..bytes).step_by(64) {
                // SAFETY: a prefetch of any address is harmless (it never faults).
                unsafe { _mm_prefetch::<_MM_HINT_T0>(start.cast::<i8>().wrapping_add(line)) };
            }
        }
    }
}

/// The operands of one (token, KV head) attention.
pub struct KvHeadQuery<'a, T = f32> {
    /// `[group, head_dim]`: the query heads that read this KV head.
    pub q: &'a [f32],
    /// The width of a query head and of a key row.
    pub head_dim: usize,
    /// The width of a value row and of an output head (`head_dim` but for latent attention).
    pub value_dim: usize,
    /// Multiplies every score (`head_dim^-0.5`).
    pub scale: f32,
    pub keys: HeadRows<'a, T>,
    pub values: HeadRows<'a, T>,
    /// The visible positions' slots, in position order.
    pub slots: &'a [usize],
    /// `[group]`: each query head's sink logit (GPT-OSS's `self_attn.sinks`), if it has one.
    pub sinks: Option<&'a [f32]>,
}

impl<T> KvHeadQuery<'_, T> {
    /// Query head `h`'s sink logit, if the heads have sinks.
    fn sink(&self, h: usize) -> Option<f32> {
        self.sinks.map(|s| s[h])
    }
}

/// Softmax of one row of scores in place, with `sink` joining the denominator when set:
/// `e^{x_i - m} / (Σ_j e^{x_j - m} + e^{sink - m})`, `m` the largest of the row and the sink
/// (HF `eager_attention_forward` of GPT-OSS concatenates the sink and drops its column).
fn softmax_with_sink(row: &mut [f32], sink: Option<f32>) {
    let Some(sink) = sink else {
        super::softmax_in_place(row);
        return;
    };
    let max = row.iter().copied().fold(sink, f32::max);
    let mut sum = (sink - max).exp();
    for v in row.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    row.iter_mut().for_each(|v| *v *= inv);
}

/// `out: [group, value_dim]` ← attention of each query head of `a`; `scores` is scratch,
/// resized to `group × slots.len()`.
pub fn attend_kv_head<T: KvElement>(
    a: &KvHeadQuery<'_, T>,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let (d, dv) = (a.head_dim, a.value_dim);
    let group = a.q.len() / d;
    assert_eq!(a.q.len(), group * d, "attention: q is not whole heads");
    assert_eq!(
        out.len(),
        group * dv,
        "attention: out must be group × value_dim"
    );
    let n = a.slots.len();
    scores.clear();
    scores.resize(group * n, 0.0);
    #[cfg(target_arch = "x86_64")]
    match isa() {
        Isa::Avx512 if d.is_multiple_of(16) && dv.is_multiple_of(16) => {
            // SAFETY: AVX-512F was detected; rows hold head_dim and value_dim = 16·j elements.
            unsafe { avx512::attend(a, scores, out) };
            return;
        }
        Isa::Avx2 if d.is_multiple_of(8) && dv.is_multiple_of(8) => {
            // SAFETY: AVX2 and FMA were detected; rows hold head_dim and value_dim = 8·j elements.
            unsafe { avx2::attend(a, scores, out) };
            return;
        }
        _ => {}
    }
    attend_scalar(a, scores, out);
}

/// The portable path: the same steps, one head and one row at a time.
fn attend_scalar<T: KvElement>(a: &KvHeadQuery<'_, T>, scores: &mut [f32], out: &mut [f32]) {
    let (d, dv, n) = (a.head_dim, a.value_dim, a.slots.len());
    for (s, slot) in a.slots.iter().enumerate() {
        let k = a.keys.row(*slot, d);
        for (h, qh) in a.q.chunks_exact(d).enumerate() {
            let dot = qh.iter().zip(k).map(|(x, y)| x * y.to_f32()).sum::<f32>();
            scores[h * n + s] = dot * a.scale;
        }
    }
    for (h, row) in scores.chunks_exact_mut(n).enumerate() {
        softmax_with_sink(row, a.sink(h));
    }
    out.fill(0.0);
    for (s, slot) in a.slots.iter().enumerate() {
        let v = a.values.row(*slot, dv);
        for (h, oh) in out.chunks_exact_mut(dv).enumerate() {
            let p = scores[h * n + s];
            oh.iter_mut().zip(v).for_each(|(o, v)| *o += p * v.to_f32());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::reference::pseudo_random;

    /// softmax(q·kᵀ·scale)·v in f64, the definition; a head's sink is one more logit in the
    /// softmax whose probability multiplies no value.
    fn reference(a: &KvHeadQuery<'_>) -> Vec<f64> {
        let d = a.head_dim;
        let mut out = vec![0.0f64; a.q.len() / d * a.value_dim];
        for (h, qh) in a.q.chunks_exact(d).enumerate() {
            let s: Vec<f64> = a
                .slots
                .iter()
                .map(|slot| {
                    let k = a.keys.row(*slot, d);
                    qh.iter()
                        .zip(k)
                        .map(|(x, y)| *x as f64 * *y as f64)
                        .sum::<f64>()
                        * a.scale as f64
                })
                .collect();
            let sink = a.sinks.map(|s| s[h] as f64);
            let max = s
                .iter()
                .copied()
                .fold(sink.unwrap_or(f64::NEG_INFINITY), f64::max);
            let e: Vec<f64> = s.iter().map(|v| (v - max).exp()).collect();
            let sum: f64 = e.iter().sum::<f64>() + sink.map_or(0.0, |s| (s - max).exp());
            let dv = a.value_dim;
            for (p, slot) in e.iter().zip(a.slots) {
                let v = a.values.row(*slot, dv);
                for c in 0..dv {
                    out[h * dv + c] += p / sum * v[c] as f64;
                }
            }
        }
        out
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn lane_sums_are_exact() {
        use std::arch::x86_64::*;
        if !std::arch::is_x86_feature_detected!("avx512f") {
            return;
        }
        // SAFETY: AVX-512F was detected.
        unsafe {
            let v: [__m512; 16] = std::array::from_fn(|j| {
                let lanes: [f32; 16] = std::array::from_fn(|i| (j * 16 + i) as f32);
                _mm512_loadu_ps(lanes.as_ptr())
            });
            let mut sums = [0.0f32; 16];
            _mm512_storeu_ps(sums.as_mut_ptr(), avx512::sum_lanes_16(&v));
            let want: [f32; 16] =
                std::array::from_fn(|j| (0..16).map(|i| (j * 16 + i) as f32).sum());
            assert_eq!(sums, want);
        }
    }

    /// Each AVX2 score is its own lanes in the documented order, bit for bit, whatever the
    /// other seven vectors hold — so a key's score does not depend on where its chunk starts.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn avx2_lane_sums_keep_one_order_per_key() {
        use std::arch::x86_64::*;
        if !std::arch::is_x86_feature_detected!("avx2") {
            eprintln!("skipped: needs AVX2");
            return;
        }
        // Magnitudes far apart, so that every order of the sum rounds differently.
        let scales = [1.0f32, 3e3, 1e-3, 7e5, 0.3, 1e-6, 2e4, 11.0];
        let lanes: Vec<f32> = (pseudo_random(64, 21).iter().enumerate())
            .map(|(i, v)| v * scales[(i + i / 8) % 8])
            .collect();
        let order = |l: &[f32]| ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
        // SAFETY: AVX2 was detected; 8 lanes per vector.
        let sums = unsafe {
            let v: [__m256; 8] = std::array::from_fn(|j| _mm256_loadu_ps(lanes[8 * j..].as_ptr()));
            let mut sums = [0.0f32; 8];
            _mm256_storeu_ps(sums.as_mut_ptr(), avx2::sum_lanes_8(&v));
            sums
        };
        for (j, got) in sums.iter().enumerate() {
            assert_eq!(
                got.to_bits(),
                order(&lanes[8 * j..8 * j + 8]).to_bits(),
                "key {j}"
            );
        }
    }

    #[test]
    fn bf16_rows_give_the_bits_of_their_widened_f32_rows() {
        use half::bf16;
        // SIMD widths (64, 128 with one pass's tail), a sink, and an odd size for the
        // portable path.
        for (head_dim, group, sink) in [
            (64, 4, false),
            (128, 8, true),
            (80, 5, false),
            (12, 2, true),
        ] {
            let num_slots = 70;
            let narrow = |seed| -> Vec<bf16> {
                let v = pseudo_random(num_slots * head_dim, seed);
                v.into_iter().map(bf16::from_f32).collect()
            };
            let (k16, v16) = (narrow(1), narrow(2));
            let wide = |v: &[bf16]| -> Vec<f32> { v.iter().map(|x| x.to_f32()).collect() };
            let (k32, v32) = (wide(&k16), wide(&v16));
            let q = pseudo_random(group * head_dim, 3);
            let sinks = pseudo_random(group, 4);
            let slots: Vec<usize> = (0..67).map(|i| (i * 11) % num_slots).collect();
            let sinks = sink.then_some(&sinks[..]);
            // One query against rows of either element type.
            fn attend<T: KvElement>(
                (q, head_dim): (&[f32], usize),
                (k, v): (&[T], &[T]),
                slots: &[usize],
                sinks: Option<&[f32]>,
            ) -> Vec<f32> {
                let rows = |data| HeadRows {
                    data,
                    stride: head_dim,
                    offset: 0,
                };
                let a = KvHeadQuery {
                    q,
                    head_dim,
                    value_dim: head_dim,
                    scale: (head_dim as f32).powf(-0.5),
                    keys: rows(k),
                    values: rows(v),
                    slots,
                    sinks,
                };
                let mut out = vec![f32::NAN; q.len()];
                attend_kv_head(&a, &mut Vec::new(), &mut out);
                out
            }
            let a = attend((&q, head_dim), (&k16, &v16), &slots, sinks);
            let b = attend((&q, head_dim), (&k32, &v32), &slots, sinks);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a), bits(&b), "head_dim {head_dim}");
            assert!(a.iter().all(|x| x.is_finite()));
        }
    }

    #[test]
    fn matches_the_definition_for_simd_and_odd_head_sizes() {
        // Groups past one pass over the values (5, 8 heads), rows past one pass (128, 80
        // columns), odd sizes for the portable path.
        for (head_dim, group, kv_heads, kvh) in [
            (64, 4, 4, 2),
            (16, 1, 1, 0),
            (128, 8, 2, 1),
            (80, 5, 1, 0),
            (12, 2, 3, 1),
        ] {
            let stride = kv_heads * head_dim;
            let num_slots = 40;
            let k = pseudo_random(num_slots * stride, 1);
            let v = pseudo_random(num_slots * stride, 2);
            let q = pseudo_random(group * head_dim, 3);
            let slots: Vec<usize> = (0..29).map(|i| (i * 7) % num_slots).collect();
            let a = KvHeadQuery {
                q: &q,
                head_dim,
                value_dim: head_dim,
                scale: (head_dim as f32).powf(-0.5),
                keys: HeadRows {
                    data: &k,
                    stride,
                    offset: kvh * head_dim,
                },
                values: HeadRows {
                    data: &v,
                    stride,
                    offset: kvh * head_dim,
                },
                slots: &slots,
                sinks: None,
            };
            let mut out = vec![f32::NAN; q.len()];
            attend_kv_head(&a, &mut Vec::new(), &mut out);
            for (got, want) in out.iter().zip(reference(&a)) {
                assert!(
                    (*got as f64 - want).abs() < 1e-5,
                    "d={head_dim}: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn sinks_join_the_denominator_on_every_path() {
        // Sinks below, among and above the scores (a sink of 8 takes most of the mass), for the
        // AVX-512, AVX2 and portable widths; then a sink that dominates every head equals
        // scaling the plain outputs down.
        for head_dim in [64, 24, 12] {
            let (group, num_slots) = (4, 19);
            let k = pseudo_random(num_slots * head_dim, 11);
            let v = pseudo_random(num_slots * head_dim, 12);
            let q = pseudo_random(group * head_dim, 13);
            let slots: Vec<usize> = (0..num_slots).collect();
            let sinks = [-3.0, 0.2, 1.5, 8.0];
            let rows = |data| HeadRows {
                data,
                stride: head_dim,
                offset: 0,
            };
            let a = KvHeadQuery {
                q: &q,
                head_dim,
                value_dim: head_dim,
                scale: (head_dim as f32).powf(-0.5),
                keys: rows(&k),
                values: rows(&v),
                slots: &slots,
                sinks: Some(&sinks),
            };
            let mut out = vec![f32::NAN; q.len()];
            attend_kv_head(&a, &mut Vec::new(), &mut out);
            let plain = reference(&KvHeadQuery { sinks: None, ..a });
            for (i, (got, want)) in out.iter().zip(reference(&a)).enumerate() {
                assert!(
                    (*got as f64 - want).abs() < 1e-5,
                    "d={head_dim}, head {}: {got} vs {want}",
                    i / head_dim
                );
            }
            // The sink of 8 leaves the last head only a small part of its plain output.
            let last = (group - 1) * head_dim..group * head_dim;
            let ratio: f64 = out[last.clone()]
                .iter()
                .map(|x| x.abs() as f64)
                .sum::<f64>()
                / plain[last].iter().map(|x| x.abs()).sum::<f64>();
            assert!(
                ratio < 0.01,
                "d={head_dim}: sink 8 keeps {ratio} of the output"
            );
        }
    }

    #[test]
    fn latent_values_are_the_leading_part_of_the_key_rows() {
        // Multi-head latent attention: one cached row [latent | rope] per slot is every head's
        // key, its latent part every head's value (SIMD widths, then odd ones).
        for (latent, rope, group) in [(32, 16, 4), (512, 64, 16), (20, 6, 3)] {
            let width = latent + rope;
            let num_slots = 24;
            let rows = pseudo_random(num_slots * width, 4);
            let q = pseudo_random(group * width, 5);
            let slots: Vec<usize> = (0..17).map(|i| (i * 5) % num_slots).collect();
            let cached = HeadRows {
                data: &rows,
                stride: width,
                offset: 0,
            };
            let a = KvHeadQuery {
                q: &q,
                head_dim: width,
                value_dim: latent,
                scale: 0.1,
                keys: cached,
                values: cached,
                slots: &slots,
                sinks: None,
            };
            let mut out = vec![f32::NAN; group * latent];
            attend_kv_head(&a, &mut Vec::new(), &mut out);
            for (got, want) in out.iter().zip(reference(&a)) {
                assert!(
                    (*got as f64 - want).abs() < 1e-5,
                    "latent {latent}: {got} vs {want}"
                );
            }
        }
    }
}
