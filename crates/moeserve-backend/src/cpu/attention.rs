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

#[cfg(target_arch = "x86_64")]
pub(super) mod avx512 {
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
                            acc = _mm512_fmadd_ps(
                                _mm512_loadu_ps(q.add(c)),
                                T::load16(k.add(c)),
                                acc,
                            );
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
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
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
            let mut acc: [__m256; V] =
                std::array::from_fn(|i| _mm256_loadu_ps(o.as_ptr().add(8 * i)));
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
