//! AVX-512 register-tiled kernel for `x · Wᵀ` with f32 activations and f32/f16/bf16 weights.
//!
//! A tile computes `MR` activation rows against `NR` weight rows with `MR × NR` 16-lane
//! accumulators, so each loaded weight vector feeds `MR` FMAs and each activation vector `NR`.
//!
//! NOTE: every output element is accumulated in the same order whatever the tile shape: one
//! 16-lane accumulator over `k` in steps of 16, then `_mm512_reduce_add_ps`, then the scalar
//! tail. A token's result therefore does not depend on how many other tokens share the step
//! (batch invariance), and decode equals prefill bit for bit.

use std::arch::x86_64::*;

use half::{bf16, f16};

/// How far ahead of the current weight position to prefetch.
const PREFETCH_BYTES: usize = 1024;

/// An element type that can be widened to 16 f32 lanes at once.
pub(super) trait Lanes: Copy {
    /// # Safety
    /// `p` must point at 16 readable elements and the CPU must support AVX-512F/BW.
    unsafe fn load16(p: *const Self) -> __m512;
    fn widen(self) -> f32;
}

impl Lanes for f32 {
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> __m512 {
        unsafe { _mm512_loadu_ps(p) }
    }
    #[inline(always)]
    fn widen(self) -> f32 {
        self
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
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

impl Lanes for f16 {
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> __m512 {
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) }
    }
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

/// Operands of one tile: `x` rows start at `x`, weight rows at `w`, both with row stride `k`;
/// results go to `out` with row stride `ldo`.
#[derive(Clone, Copy)]
pub(super) struct Tile<T> {
    pub x: *const f32,
    pub w: *const T,
    pub k: usize,
    pub out: *mut f32,
    pub ldo: usize,
}

/// `out[i][j] = Σ_p x[i][p] · w[j][p]` for `i < MR`, `j < NR`.
///
/// # Safety
/// The CPU supports AVX-512F/BW; `x` holds `MR` rows and `w` `NR` rows of `k` elements;
/// `out` has room for `MR` rows of stride `ldo` with `NR` columns each.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn tile<T: Lanes, const MR: usize, const NR: usize>(t: Tile<T>) {
    let mut acc = [[_mm512_setzero_ps(); NR]; MR];
    let mut p = 0;
    unsafe {
        while p + 16 <= t.k {
            let mut wv = [_mm512_setzero_ps(); NR];
            for (j, v) in wv.iter_mut().enumerate() {
                // Weights are read once per step: prefetch well ahead (hardware prefetchers
                // stop at 4 KiB page boundaries).
                let ahead = t.w.add(j * t.k + p).wrapping_byte_add(PREFETCH_BYTES) as *const i8;
                _mm_prefetch::<_MM_HINT_T0>(ahead);
                *v = T::load16(t.w.add(j * t.k + p));
            }
            for (i, row) in acc.iter_mut().enumerate() {
                let xv = _mm512_loadu_ps(t.x.add(i * t.k + p));
                for (a, v) in row.iter_mut().zip(&wv) {
                    *a = _mm512_fmadd_ps(*v, xv, *a);
                }
            }
            p += 16;
        }
        for (i, row) in acc.iter().enumerate() {
            for (j, a) in row.iter().enumerate() {
                let mut s = _mm512_reduce_add_ps(*a);
                for q in p..t.k {
                    s += (*t.w.add(j * t.k + q)).widen() * *t.x.add(i * t.k + q);
                }
                *t.out.add(i * t.ldo + j) = s;
            }
        }
    }
}
