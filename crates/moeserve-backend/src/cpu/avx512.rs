//! AVX-512 microkernel for `x · Wᵀ` over panel-packed weights (see `packed.rs`).
//!
//! A call computes `MR` activation rows against one 32-row weight panel: per position `p`, two
//! weight vectors are loaded (16 outputs each), each activation `x[i][p]` is broadcast and
//! multiplied into the row's two accumulators.
//!
//! NOTE: every output lane is one FMA chain over `p = 0..k` in order, whatever `MR` is, so a
//! token's result does not depend on how many tokens share the step (batch invariance), and
//! decode equals prefill bit for bit.

use std::arch::x86_64::*;

use half::{bf16, f16};

use super::packed::PANEL;

/// How far ahead in the panel stream to prefetch (128 positions of a bf16 panel); hardware
/// prefetchers stop at 4 KiB pages. 8 KiB beat 1 KiB by 7–8 % in batch-1 and batch-32 decode of
/// mixtral-bench-1b (alternating runs); in `examples/stream_matmul` 2–32 KiB were all within
/// the noise of 8 KiB.
/// The hint is T2 (to the outer caches, not L1): 2–5 % faster decode than T0 in alternating
/// runs, likely because an L1 prefetch holds one of the core's few fill buffers until its line
/// arrives, which caps the misses in flight.
pub(super) const PREFETCH_BYTES: usize = 8192;

/// An element type whose panel positions (32 columns, see `packed.rs`) can be widened to f32.
pub(super) trait Lanes: Copy {
    /// Columns 0–15 and 16–31 of the panel position at `p`.
    ///
    /// # Safety
    /// `p` must point at a position's 32 readable elements and the CPU must support
    /// AVX-512F/BW.
    unsafe fn load_position(p: *const Self) -> [__m512; 2];
}

/// A position of 16-lane loads: columns in order.
macro_rules! by_sixteen {
    ($load16:expr) => {
        #[inline(always)]
        unsafe fn load_position(p: *const Self) -> [__m512; 2] {
            unsafe { [$load16(p), $load16(p.add(16))] }
        }
    };
}

impl Lanes for f32 {
    by_sixteen!(|p: *const f32| _mm512_loadu_ps(p));
}

impl Lanes for bf16 {
    /// bf16 → f32 is a 16-bit left shift of the raw bits, and a bf16 in the high half of a
    /// 32-bit lane already is its f32: the panel pairs column `c` (low half) with `c + 16`
    /// (high half) in lane `c` ([`super::packed::PanelSlot`]), so a shift and a mask widen the
    /// whole position.
    #[inline(always)]
    unsafe fn load_position(p: *const Self) -> [__m512; 2] {
        unsafe {
            let lanes = _mm512_loadu_si512(p as *const __m512i);
            let low = _mm512_slli_epi32(lanes, 16);
            let high = _mm512_and_si512(lanes, _mm512_set1_epi32(0xffff_0000_u32 as i32));
            [_mm512_castsi512_ps(low), _mm512_castsi512_ps(high)]
        }
    }
}

/// e4m3 → the f16 of value / 2^8 → f32: sign-extended to 16 bits and shifted up by 7, the
/// exponent and mantissa land in an f16's and the sign's copies in bits 15 and 14; clearing bit
/// 14 leaves the sign alone. The 2^8 is in the panel's scales
/// ([`super::packed::PackedWeight::F8`]), so this is exact and four instructions.
impl Lanes for super::fp8::E4m3 {
    by_sixteen!(|p: *const super::fp8::E4m3| {
        let wide = _mm256_cvtepi8_epi16(_mm_loadu_si128(p as *const __m128i));
        let bits = _mm256_and_si256(_mm256_slli_epi16(wide, 7), _mm256_set1_epi16(!0x4000));
        _mm512_cvtph_ps(bits)
    });
}

impl Lanes for f16 {
    by_sixteen!(|p: *const f16| _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)));
}

/// Operands of one microkernel call.
#[derive(Clone, Copy)]
pub(super) struct PanelTile<T> {
    /// The tile's `MR` activation rows at the block's first position, in tile order
    /// (`x[p * MR + i]` is row `i` at position `p`, see `matmul::TiledRows`).
    pub x: *const f32,
    /// The block of the panel: `kc × PANEL` elements.
    pub w: *const T,
    /// Positions in this block.
    pub kc: usize,
    /// `MR × PANEL` running sums, row stride `PANEL`: read (unless `first`) and written back.
    pub acc: *mut f32,
    /// The first block of the panel: the sums start from zero.
    pub first: bool,
    /// The weight stream's lines this call prefetches: at position `p` of its pass `h` (a
    /// tile makes one pass over the block, or two on AVX2 with more than three rows),
    /// `prefetch + (h · kc + p) · prefetch_step` (the block's row tiles share its stream out
    /// over their passes: `matmul::StreamShare`).
    pub prefetch: *const u8,
    /// Bytes between two prefetches; 0: the call prefetches nothing.
    pub prefetch_step: usize,
    /// Where a widening call ([`panel_tile`]'s `WIDEN`) stores each position of `w`, widened
    /// to f32, as it reads it (`kc × PANEL` elements), for the block's other row tiles; null
    /// otherwise.
    pub widen_to: *mut f32,
}

/// One activation row through two whole panels at once (of one weight, or of two with the same
/// `k`): `acc[s][c] = Σ_p x[p] · w[s][p][c]` over `p < k`, from zero.
///
/// A 1-row [`panel_tile`] is two FMA chains of one FMA per position, so a position costs at
/// least the FMA latency and a core reading from memory has no speed to spare for catching up
/// after a late line; two panels interleaved are four chains and two streams (the AVX2 form,
/// [`super::avx2::panel_pair_row`], has eight). Each output lane is still the one FMA chain over
/// `p = 0..k` in order, so the bits are [`panel_tile`]'s. Each stream prefetches
/// [`PREFETCH_BYTES`] ahead of its position, as a 1-row tile does.
///
/// # Safety
/// The CPU supports AVX-512F/BW; `x` holds `k` activations, each `w[s]` `k × PANEL` elements
/// and each `acc[s]` `PANEL` sums.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn panel_pair_row<T: Lanes>(
    x: *const f32,
    k: usize,
    w: [*const T; 2],
    acc: [*mut f32; 2],
) {
    let mut sums = [[_mm512_setzero_ps(); 2]; 2];
    unsafe {
        for p in 0..k {
            let xv = _mm512_set1_ps(*x.add(p));
            for (s, sum) in sums.iter_mut().enumerate() {
                let wp = w[s].add(p * PANEL);
                _mm_prefetch::<_MM_HINT_T2>(
                    wp.cast::<u8>().wrapping_add(PREFETCH_BYTES) as *const i8
                );
                let [w0, w1] = T::load_position(wp);
                sum[0] = _mm512_fmadd_ps(w0, xv, sum[0]);
                sum[1] = _mm512_fmadd_ps(w1, xv, sum[1]);
            }
        }
        for (sum, out) in sums.iter().zip(acc) {
            _mm512_storeu_ps(out, sum[0]);
            _mm512_storeu_ps(out.add(16), sum[1]);
        }
    }
}

/// `acc[i][c] += Σ_p x[i][p] · panel[p][c]` for `i < MR`, `c < PANEL`, `p` in the block;
/// with `WIDEN`, also each position widened to f32 into `t.widen_to` (a separate
/// instantiation, so the plain kernels' register use does not change).
///
/// Sums are carried through `acc` from block to block without rounding (an `f32` stored and
/// reloaded is the same `f32`), so a blocked product equals one unbroken FMA chain.
///
/// # Safety
/// The CPU supports AVX-512F/BW and the pointers cover the sizes described on [`PanelTile`].
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn panel_tile<T: Lanes, const MR: usize, const WIDEN: bool>(t: PanelTile<T>) {
    let mut lo = [_mm512_setzero_ps(); MR];
    let mut hi = [_mm512_setzero_ps(); MR];
    unsafe {
        if !t.first {
            for i in 0..MR {
                lo[i] = _mm512_loadu_ps(t.acc.add(i * PANEL));
                hi[i] = _mm512_loadu_ps(t.acc.add(i * PANEL + 16));
            }
        }
        for p in 0..t.kc {
            let wp = t.w.add(p * PANEL);
            if t.prefetch_step != 0 {
                _mm_prefetch::<_MM_HINT_T2>(
                    t.prefetch.wrapping_add(p * t.prefetch_step) as *const i8
                );
            }
            let [w0, w1] = T::load_position(wp);
            if WIDEN {
                _mm512_storeu_ps(t.widen_to.add(p * PANEL), w0);
                _mm512_storeu_ps(t.widen_to.add(p * PANEL + 16), w1);
            }
            for i in 0..MR {
                let xv = _mm512_set1_ps(*t.x.add(p * MR + i));
                lo[i] = _mm512_fmadd_ps(w0, xv, lo[i]);
                hi[i] = _mm512_fmadd_ps(w1, xv, hi[i]);
            }
        }
        for i in 0..MR {
            _mm512_storeu_ps(t.acc.add(i * PANEL), lo[i]);
            _mm512_storeu_ps(t.acc.add(i * PANEL + 16), hi[i]);
        }
    }
}
