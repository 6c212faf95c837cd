//! AVX2 + FMA microkernel for `x · Wᵀ` over the same panel-packed weights as the AVX-512 one
//! (`packed.rs`), for x86-64 CPUs without AVX-512 (AMD Zen 2/3, most Intel client cores).
//!
//! A 32-column panel row is four 8-lane vectors; with 16 vector registers a call takes at most
//! [`MAX_MR`] activation rows (12 accumulators, one weight vector, three broadcasts). Every
//! output lane is the same FMA chain over `p = 0..k` in order as on AVX-512, so the two paths
//! give bit-identical results (a test checks it) and batch invariance carries over.

use std::arch::x86_64::*;

use half::{bf16, f16};

use super::packed::PANEL;

/// Activation rows per microkernel call.
pub(super) const MAX_MR: usize = 3;

/// An element type whose panel positions (32 columns, see `packed.rs`) can be widened to f32,
/// 8 lanes at a time.
pub(super) trait Lanes8: Copy {
    /// Columns `8j .. 8j + 8` of the panel position at `p`, `j < 4`.
    ///
    /// # Safety
    /// `p` must point at a position's 32 readable elements and the CPU must support AVX2, FMA
    /// and F16C.
    unsafe fn load_columns<const J: usize>(p: *const Self) -> __m256;
}

impl Lanes8 for f32 {
    #[inline(always)]
    unsafe fn load_columns<const J: usize>(p: *const Self) -> __m256 {
        unsafe { _mm256_loadu_ps(p.add(8 * J)) }
    }
}

impl Lanes8 for bf16 {
    /// The panel pairs column `c` (low half) with `c + 16` (high half) in 32-bit lane `c`
    /// ([`super::packed::PanelSlot`]): columns 0–7 and 16–23 are the lanes of the first 32
    /// bytes shifted up by 16 and masked, 8–15 and 24–31 those of the next 32.
    #[inline(always)]
    unsafe fn load_columns<const J: usize>(p: *const Self) -> __m256 {
        unsafe {
            let lanes = _mm256_loadu_si256(p.add(16 * (J % 2)) as *const __m256i);
            let wide = if J < 2 {
                _mm256_slli_epi32(lanes, 16)
            } else {
                _mm256_and_si256(lanes, _mm256_set1_epi32(0xffff_0000_u32 as i32))
            };
            _mm256_castsi256_ps(wide)
        }
    }
}

impl Lanes8 for f16 {
    #[inline(always)]
    unsafe fn load_columns<const J: usize>(p: *const Self) -> __m256 {
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.add(8 * J) as *const __m128i)) }
    }
}

impl Lanes8 for super::fp8::E4m3 {
    /// As the AVX-512 variant: the f16 of value / 2^8 (the 2^8 is in the panel's scales).
    #[inline(always)]
    unsafe fn load_columns<const J: usize>(p: *const Self) -> __m256 {
        unsafe {
            let p = p.add(8 * J);
            let wide = _mm_cvtepi8_epi16(_mm_loadl_epi64(p as *const __m128i));
            let bits = _mm_and_si128(_mm_slli_epi16(wide, 7), _mm_set1_epi16(!0x4000));
            _mm256_cvtph_ps(bits)
        }
    }
}

/// Columns `8j .. 8j + 8` of the position at `p` for a run-time `j < 4`, which the unrolled
/// loops below turn into constants.
#[inline(always)]
unsafe fn load_columns<T: Lanes8>(p: *const T, j: usize) -> __m256 {
    unsafe {
        match j {
            0 => T::load_columns::<0>(p),
            1 => T::load_columns::<1>(p),
            2 => T::load_columns::<2>(p),
            _ => T::load_columns::<3>(p),
        }
    }
}

/// `acc[i][c] += Σ_p x[i][p] · panel[p][c]` for `i < MR`, `c < PANEL`, `p` in the block; the
/// operands as for the AVX-512 kernel ([`super::avx512::PanelTile`]), `WIDEN` as there.
///
/// # Safety
/// The CPU supports AVX2, FMA and F16C and the pointers cover the sizes `PanelTile` describes.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn panel_tile<T: Lanes8, const MR: usize, const WIDEN: bool>(
    t: super::avx512::PanelTile<T>,
) {
    let mut acc = [[_mm256_setzero_ps(); 4]; MR];
    unsafe {
        if !t.first {
            for (i, row) in acc.iter_mut().enumerate() {
                for (j, a) in row.iter_mut().enumerate() {
                    *a = _mm256_loadu_ps(t.acc.add(i * PANEL + 8 * j));
                }
            }
        }
        for p in 0..t.kc {
            let wp = t.w.add(p * PANEL);
            if t.prefetch {
                _mm_prefetch::<_MM_HINT_T2>(
                    wp.wrapping_byte_add(super::avx512::PREFETCH_BYTES) as *const i8
                );
            }
            let xs: [__m256; MR] = std::array::from_fn(|i| _mm256_set1_ps(*t.x.add(p * MR + i)));
            for j in 0..4 {
                let w = load_columns(wp, j);
                if WIDEN {
                    _mm256_storeu_ps(t.widen_to.add(p * PANEL + 8 * j), w);
                }
                for (row, x) in acc.iter_mut().zip(&xs) {
                    row[j] = _mm256_fmadd_ps(w, *x, row[j]);
                }
            }
        }
        for (i, row) in acc.iter().enumerate() {
            for (j, a) in row.iter().enumerate() {
                _mm256_storeu_ps(t.acc.add(i * PANEL + 8 * j), *a);
            }
        }
    }
}
