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

/// An element type that can be widened to 16 f32 lanes at once.
pub(super) trait Lanes: Copy {
    /// # Safety
    /// `p` must point at 16 readable elements and the CPU must support AVX-512F/BW.
    unsafe fn load16(p: *const Self) -> __m512;
}

impl Lanes for f32 {
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> __m512 {
        unsafe { _mm512_loadu_ps(p) }
    }
}

impl Lanes for bf16 {
    /// bf16 → f32 is a 16-bit left shift of the raw bits.
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> __m512 {
        unsafe {
            let raw = _mm256_loadu_si256(p as *const __m256i);
            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))
        }
    }
}

impl Lanes for i8 {
    /// int8 → i32 → f32 (exact); the row's scale is applied to the finished sum.
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> __m512 {
        unsafe { _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i))) }
    }
}

impl Lanes for super::fp8::E4m3 {
    /// e4m3 → the f16 of value / 2^8 → f32: sign-extended to 16 bits and shifted up by 7, the
    /// exponent and mantissa land in an f16's and the sign's copies in bits 15 and 14; clearing
    /// bit 14 leaves the sign alone. The 2^8 is in the panel's scales
    /// ([`super::packed::PackedWeight::F8`]), so this is exact and four instructions.
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> __m512 {
        unsafe {
            let wide = _mm256_cvtepi8_epi16(_mm_loadu_si128(p as *const __m128i));
            let bits = _mm256_and_si256(_mm256_slli_epi16(wide, 7), _mm256_set1_epi16(!0x4000));
            _mm512_cvtph_ps(bits)
        }
    }
}

impl Lanes for f16 {
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> __m512 {
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) }
    }
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
    /// `w` is the weight stream itself (not a block already widened into a scratch buffer,
    /// whose source [`widen`] prefetched): prefetch ahead of it.
    pub prefetch: bool,
}

/// `acc[i][c] += Σ_p x[i][p] · panel[p][c]` for `i < MR`, `c < PANEL`, `p` in the block.
///
/// Sums are carried through `acc` from block to block without rounding (an `f32` stored and
/// reloaded is the same `f32`), so a blocked product equals one unbroken FMA chain.
///
/// # Safety
/// The CPU supports AVX-512F/BW and the pointers cover the sizes described on [`PanelTile`].
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn panel_tile<T: Lanes, const MR: usize>(t: PanelTile<T>) {
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
            if t.prefetch {
                _mm_prefetch::<_MM_HINT_T2>(wp.wrapping_byte_add(PREFETCH_BYTES) as *const i8);
            }
            let (w0, w1) = (T::load16(wp), T::load16(wp.add(16)));
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

/// Operands of [`int8_panel_scaled`]: a whole int8 panel for one tile of `MR` rows.
#[derive(Clone, Copy)]
pub(super) struct ScaledInt8Panel {
    /// The tile's rows from position 0, in tile order (`x[p * MR + i]`).
    pub x: *const f32,
    /// The panel: `k × PANEL` int8 weights.
    pub w: *const i8,
    pub k: usize,
    /// Positions per scale.
    pub group: usize,
    /// The panel's scales and offsets, `[k.div_ceil(group), PANEL]` each.
    pub scales: *const f32,
    pub offsets: *const f32,
    /// `MR × PANEL` outputs, written.
    pub acc: *mut f32,
}

/// An int8 panel for a few rows (decode) with each group's grid applied in registers: per group
/// the partial sums start from zero and run the same FMA chain as [`panel_tile`], while a
/// vector sums each row's activations over the group (lane `i` = row `i`, adds in position
/// order); then `sum + (partial · scale + Σx · offset)` — the operations, in the order, that
/// the general path performs through memory one k-block at a time, so the results are equal bit
/// for bit (batch invariance), without a kernel call, an accumulator round trip and a scalar
/// pass per group.
///
/// # Safety
/// The CPU supports AVX-512F/BW, `MR ≤ 6` (30 registers), and the pointers cover the sizes
/// described on [`ScaledInt8Panel`].
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn int8_panel_scaled<const MR: usize>(t: ScaledInt8Panel) {
    let mut lo = [_mm512_setzero_ps(); MR];
    let mut hi = [_mm512_setzero_ps(); MR];
    let rows: __mmask16 = (1 << MR) - 1;
    unsafe {
        for (g, k0) in (0..t.k).step_by(t.group).enumerate() {
            let mut part_lo = [_mm512_setzero_ps(); MR];
            let mut part_hi = [_mm512_setzero_ps(); MR];
            let mut sums_x = _mm512_setzero_ps();
            for p in k0..(k0 + t.group).min(t.k) {
                let wp = t.w.add(p * PANEL);
                _mm_prefetch::<_MM_HINT_T2>(wp.wrapping_byte_add(PREFETCH_BYTES));
                let (w0, w1) = (i8::load16(wp), i8::load16(wp.add(16)));
                let xp = t.x.add(p * MR);
                sums_x = _mm512_add_ps(sums_x, _mm512_maskz_loadu_ps(rows, xp));
                for i in 0..MR {
                    let xv = _mm512_set1_ps(*xp.add(i));
                    part_lo[i] = _mm512_fmadd_ps(w0, xv, part_lo[i]);
                    part_hi[i] = _mm512_fmadd_ps(w1, xv, part_hi[i]);
                }
            }
            let (s, o) = (t.scales.add(g * PANEL), t.offsets.add(g * PANEL));
            let (s0, s1) = (_mm512_loadu_ps(s), _mm512_loadu_ps(s.add(16)));
            let (o0, o1) = (_mm512_loadu_ps(o), _mm512_loadu_ps(o.add(16)));
            for i in 0..MR {
                let sx = _mm512_permutexvar_ps(_mm512_set1_epi32(i as i32), sums_x);
                let grid_lo = _mm512_add_ps(_mm512_mul_ps(part_lo[i], s0), _mm512_mul_ps(sx, o0));
                let grid_hi = _mm512_add_ps(_mm512_mul_ps(part_hi[i], s1), _mm512_mul_ps(sx, o1));
                lo[i] = _mm512_add_ps(lo[i], grid_lo);
                hi[i] = _mm512_add_ps(hi[i], grid_hi);
            }
        }
        for i in 0..MR {
            _mm512_storeu_ps(t.acc.add(i * PANEL), lo[i]);
            _mm512_storeu_ps(t.acc.add(i * PANEL + 16), hi[i]);
        }
    }
}

/// `sums[i] = Σ_p run[p · mr + i]` (lane `i` adds in position order from 0.0), for a tile of
/// `mr ≤ 16` rows.
///
/// # Safety
/// The CPU supports AVX-512F.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn sum_positions(run: &[f32], mr: usize, sums: &mut [f32]) {
    assert!(mr <= 16 && sums.len() == mr && run.len().is_multiple_of(mr));
    let rows: __mmask16 = ((1u32 << mr) - 1) as __mmask16;
    let mut acc = _mm512_setzero_ps();
    for column in run.chunks_exact(mr) {
        // SAFETY: the masked lanes are the column's mr elements.
        acc = _mm512_add_ps(acc, unsafe { _mm512_maskz_loadu_ps(rows, column.as_ptr()) });
    }
    // SAFETY: the masked lanes are sums' mr elements.
    unsafe { _mm512_mask_storeu_ps(sums.as_mut_ptr(), rows, acc) };
}

/// `dst[i] = src[i]` widened to f32, 16 lanes at a time (`src.len()` a multiple of 16),
/// prefetching the weight stream [`PREFETCH_BYTES`] ahead as the microkernel does (the tiles
/// that then read `dst` do not prefetch).
///
/// # Safety
/// The CPU supports AVX-512F/BW.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn widen<T: Lanes>(src: &[T], dst: &mut [f32]) {
    assert!(src.len().is_multiple_of(16) && dst.len() == src.len());
    for (s, d) in src.chunks_exact(16).zip(dst.chunks_exact_mut(16)) {
        let p = s.as_ptr();
        _mm_prefetch::<_MM_HINT_T2>(p.wrapping_byte_add(PREFETCH_BYTES) as *const i8);
        // SAFETY: both chunks hold 16 elements.
        unsafe { _mm512_storeu_ps(d.as_mut_ptr(), T::load16(p)) };
    }
}
