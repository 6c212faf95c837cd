//! Dot products of one weight row (f32, f16 or bf16) with f32 activations, per ISA.

use half::{bf16, f16};

use super::Isa;

/// `sum(w[i] * x[i])` in f32.
#[inline]
pub(crate) fn dot_f32(isa: Isa, w: &[f32], x: &[f32]) -> f32 {
    debug_assert_eq!(w.len(), x.len());
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx512` is only chosen when the CPU reports avx512f and avx512bw.
        Isa::Avx512 => unsafe { avx512::dot_f32(w, x) },
        _ => super::reference::dot_f32(w, x),
    }
}

#[inline]
pub(crate) fn dot_bf16(isa: Isa, w: &[bf16], x: &[f32]) -> f32 {
    debug_assert_eq!(w.len(), x.len());
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: see `dot_f32`.
        Isa::Avx512 => unsafe { avx512::dot_bf16(w, x) },
        _ => super::reference::dot_bf16(w, x),
    }
}

#[inline]
pub(crate) fn dot_f16(isa: Isa, w: &[f16], x: &[f32]) -> f32 {
    debug_assert_eq!(w.len(), x.len());
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: see `dot_f32`.
        Isa::Avx512 => unsafe { avx512::dot_f16(w, x) },
        _ => super::reference::dot_f16(w, x),
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use half::{bf16, f16};

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
        fn widen(self) -> f32 {
            self.to_f32()
        }
    }

    impl Lanes for f16 {
        #[inline(always)]
        unsafe fn load16(p: *const Self) -> __m512 {
            unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) }
        }
        fn widen(self) -> f32 {
            self.to_f32()
        }
    }

    /// Four independent accumulators hide the FMA latency; the tail is done in scalar code.
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn dot<T: Lanes>(w: &[T], x: &[f32]) -> f32 {
        let n = w.len();
        let (wp, xp) = (w.as_ptr(), x.as_ptr());
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        unsafe {
            while i + 64 <= n {
                for (a, acc) in acc.iter_mut().enumerate() {
                    let o = i + 16 * a;
                    *acc = _mm512_fmadd_ps(T::load16(wp.add(o)), _mm512_loadu_ps(xp.add(o)), *acc);
                }
                i += 64;
            }
            while i + 16 <= n {
                acc[0] = _mm512_fmadd_ps(T::load16(wp.add(i)), _mm512_loadu_ps(xp.add(i)), acc[0]);
                i += 16;
            }
            let sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
            let mut s = _mm512_reduce_add_ps(sum);
            while i < n {
                s += (*wp.add(i)).widen() * *xp.add(i);
                i += 1;
            }
            s
        }
    }

    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
        unsafe { dot(w, x) }
    }

    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn dot_bf16(w: &[bf16], x: &[f32]) -> f32 {
        unsafe { dot(w, x) }
    }

    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn dot_f16(w: &[f16], x: &[f32]) -> f32 {
        unsafe { dot(w, x) }
    }
}
