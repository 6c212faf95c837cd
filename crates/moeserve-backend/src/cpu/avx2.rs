//! AVX2 + FMA microkernel for `x · Wᵀ` over the same panel-packed weights as the AVX-512 one
//! (`packed.rs`), for x86-64 CPUs without AVX-512 (AMD Zen 2/3, most Intel client cores).
//!
//! A 32-column panel row is four 8-lane vectors. With 16 vector registers a tile of up to 3
//! activation rows takes the whole panel width at once ([`panel_tile`]: 12 accumulators, one
//! weight vector, three broadcasts); a tile of 4 to [`MAX_MR`] rows takes it in two halves of
//! 16 columns ([`half_panel_tile`]: 12 accumulators, two weight vectors, one broadcast — the
//! 6 × 16 shape of BLIS's Haswell kernel). Every output lane is the same FMA chain over
//! `p = 0..k` in order as on AVX-512, so the two paths give bit-identical results (a test
//! checks it) and batch invariance carries over.

use std::arch::x86_64::*;

use half::{bf16, f16};

use super::packed::PANEL;

/// Activation rows per microkernel call.
pub(super) const MAX_MR: usize = 6;

/// The most rows a tile takes across the whole panel width ([`panel_tile`]); wider tiles are
/// [`half_panel_tile`]s.
pub(super) const MAX_FULL_WIDTH_MR: usize = 3;

/// An element type whose panel positions (32 columns, see `packed.rs`) can be widened to f32,
/// 8 lanes at a time.
pub(super) trait Lanes8: Copy {
    /// Whether a product of more rows than one tile widens each block to f32 once, in its first
    /// tile, for the others to read from L1 (`matmul::Block::run_tiles_widening`) rather than
    /// each tile converting the block itself: it pays where the conversion is several
    /// instructions (FP8: 1.2–1.3× at 16–32 rows, `STREAM_DTYPE=fp8 examples/stream_matmul`),
    /// not for bf16 and f16 (one instruction per 8 columns; widening cost them 5–20 %).
    const WIDEN_ONCE: bool = false;

    /// Columns `8j .. 8j + 8` of the panel position at `p`, `j < 4`.
    ///
    /// # Safety
    /// `p` must point at a position's 32 readable elements and the CPU must support AVX2, FMA
    /// and F16C.
    unsafe fn load_columns<const J: usize>(p: *const Self) -> __m256;

    /// Runs a 3-row tile's loop over the block in hand-allocated registers and returns
    /// `true`, for element types that have such a loop; `false` (the caller runs the generic
    /// one) for the others.
    ///
    /// # Safety
    /// As [`panel_tile`]'s, with `acc` the tile's running sums (`acc[4i + j]`: row `i`,
    /// columns `8j .. 8j + 8`).
    #[inline(always)]
    unsafe fn rows3_loop(_t: &super::avx512::PanelTile<Self>, _acc: &mut [__m256; 12]) -> bool {
        false
    }
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

    #[inline(always)]
    unsafe fn rows3_loop(t: &super::avx512::PanelTile<Self>, acc: &mut [__m256; 12]) -> bool {
        // SAFETY: the caller's.
        unsafe { bf16_rows3_loop(t, acc) }
    }
}

/// A 3-row tile's loop in assembly, so that the registers are ours ([`Lanes8::rows3_loop`]).
///
/// A 3-row tile fills all 16 vector registers (12 sums, 3 broadcasts, the weights). Compiled
/// from the generic loop, LLVM spilled one or two sums for every element type (for bf16 and
/// FP8 to keep a widening constant in a register): a store and a reload on those sums' FMA
/// chains at every position. Here a constant is read from L1 at each use. The FMAs are the
/// generic loop's, in the same order, so the bits are the same (the kernel tests compare a
/// batch of 3 with each row alone, which runs the 1-row loop). A 3-row f16 product from the
/// caches ran 1.3–2× faster with it (bench/RESULTS.md).
///
/// Each position: the three rows' activations broadcast into ymm12–14; the weights' four
/// 8-column vectors in ymm15 in turn, each put there by `$load` (`{w}`: the position,
/// `{mask}`: the element type's constant); sum
/// (row i, vector j) in ymm(4i + j). `$bytes`: a position's bytes.
macro_rules! rows3_asm {
    ($t:expr, $acc:expr, $mask:expr, $bytes:literal, [$l0:literal, $l1:literal, $l2:literal, $l3:literal]) => {
        std::arch::asm!(
            "/* constant at {mask} */",
            "2:",
            "vbroadcastss ymm12, dword ptr [{x}]",
            "vbroadcastss ymm13, dword ptr [{x} + 4]",
            "vbroadcastss ymm14, dword ptr [{x} + 8]",
            "prefetcht2 byte ptr [{ahead}]",
            $l0,
            "vfmadd231ps ymm0, ymm15, ymm12",
            "vfmadd231ps ymm4, ymm15, ymm13",
            "vfmadd231ps ymm8, ymm15, ymm14",
            $l1,
            "vfmadd231ps ymm1, ymm15, ymm12",
            "vfmadd231ps ymm5, ymm15, ymm13",
            "vfmadd231ps ymm9, ymm15, ymm14",
            $l2,
            "vfmadd231ps ymm2, ymm15, ymm12",
            "vfmadd231ps ymm6, ymm15, ymm13",
            "vfmadd231ps ymm10, ymm15, ymm14",
            $l3,
            "vfmadd231ps ymm3, ymm15, ymm12",
            "vfmadd231ps ymm7, ymm15, ymm13",
            "vfmadd231ps ymm11, ymm15, ymm14",
            "add {x}, 12",
            "add {ahead}, {step}",
            concat!("add {w}, ", $bytes),
            "dec {n}",
            "jnz 2b",
            x = inout(reg) $t.x => _,
            w = inout(reg) $t.w => _,
            n = inout(reg) $t.kc => _,
            mask = in(reg) $mask,
            ahead = inout(reg) $t.prefetch => _,
            step = in(reg) $t.prefetch_step,
            inout("ymm0") $acc[0],
            inout("ymm1") $acc[1],
            inout("ymm2") $acc[2],
            inout("ymm3") $acc[3],
            inout("ymm4") $acc[4],
            inout("ymm5") $acc[5],
            inout("ymm6") $acc[6],
            inout("ymm7") $acc[7],
            inout("ymm8") $acc[8],
            inout("ymm9") $acc[9],
            inout("ymm10") $acc[10],
            inout("ymm11") $acc[11],
            out("ymm12") _,
            out("ymm13") _,
            out("ymm14") _,
            out("ymm15") _,
            options(nostack),
        )
    };
}

/// [`rows3_asm`] for one element type: `$name(t, acc)` runs the loop and returns
/// `true`, or `false` (nothing run) when the tile does not prefetch or is empty.
macro_rules! rows3_loop {
    ($name:ident, $elem:ty, $mask:expr, $bytes:literal, $loads:tt) => {
        /// # Safety
        /// As [`panel_tile`]'s; the CPU supports AVX2, FMA and F16C.
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn $name(t: &super::avx512::PanelTile<$elem>, acc: &mut [__m256; 12]) -> bool {
            if t.prefetch_step == 0 || t.kc == 0 {
                return false;
            }
            // SAFETY: the caller's: x holds kc × 3 activations and w kc positions; the
            // constants are aligned for their loads.
            unsafe { rows3_asm!(t, acc, $mask, $bytes, $loads) };
            true
        }
    };
}

// bf16: columns 0–7 and 8–15 are the two 32-byte halves shifted up, 16–23 and 24–31 the
// halves masked (see `load_columns`).
rows3_loop!(
    bf16_rows3_loop,
    bf16,
    HIGH_HALVES.0.as_ptr(),
    "64",
    [
        "vmovdqu ymm15, ymmword ptr [{w}]\nvpslld ymm15, ymm15, 16",
        "vmovdqu ymm15, ymmword ptr [{w} + 32]\nvpslld ymm15, ymm15, 16",
        "vmovdqa ymm15, ymmword ptr [{mask}]\nvpand ymm15, ymm15, ymmword ptr [{w}]",
        "vmovdqa ymm15, ymmword ptr [{mask}]\nvpand ymm15, ymm15, ymmword ptr [{w} + 32]"
    ]
);

// f16: each 8 columns converted.
rows3_loop!(
    f16_rows3_loop,
    f16,
    std::ptr::null::<u8>(),
    "64",
    [
        "vcvtph2ps ymm15, xmmword ptr [{w}]",
        "vcvtph2ps ymm15, xmmword ptr [{w} + 16]",
        "vcvtph2ps ymm15, xmmword ptr [{w} + 32]",
        "vcvtph2ps ymm15, xmmword ptr [{w} + 48]"
    ]
);

// FP8 e4m3: each 8 columns sign-extended, shifted and masked into f16s, then converted (see
// the `E4m3` `load_columns`).
rows3_loop!(
    fp8_rows3_loop,
    super::fp8::E4m3,
    F16_OF_E4M3.0.as_ptr(),
    "32",
    [
        "vpmovsxbw xmm15, qword ptr [{w}]\nvpsllw xmm15, xmm15, 7\nvpand xmm15, xmm15, xmmword ptr [{mask}]\nvcvtph2ps ymm15, xmm15",
        "vpmovsxbw xmm15, qword ptr [{w} + 8]\nvpsllw xmm15, xmm15, 7\nvpand xmm15, xmm15, xmmword ptr [{mask}]\nvcvtph2ps ymm15, xmm15",
        "vpmovsxbw xmm15, qword ptr [{w} + 16]\nvpsllw xmm15, xmm15, 7\nvpand xmm15, xmm15, xmmword ptr [{mask}]\nvcvtph2ps ymm15, xmm15",
        "vpmovsxbw xmm15, qword ptr [{w} + 24]\nvpsllw xmm15, xmm15, 7\nvpand xmm15, xmm15, xmmword ptr [{mask}]\nvcvtph2ps ymm15, xmm15"
    ]
);

/// Keeps the high 16 bits of each 32-bit lane (bf16's `rows3_loop`).
#[repr(align(32))]
struct Mask([u32; 8]);
static HIGH_HALVES: Mask = Mask([0xffff_0000; 8]);

/// Clears bit 14 of each 16-bit lane (FP8's `rows3_loop`, see the `E4m3` `load_columns`).
#[repr(align(16))]
struct Mask16([u16; 8]);
static F16_OF_E4M3: Mask16 = Mask16([!0x4000; 8]);

impl Lanes8 for f16 {
    #[inline(always)]
    unsafe fn load_columns<const J: usize>(p: *const Self) -> __m256 {
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.add(8 * J) as *const __m128i)) }
    }

    #[inline(always)]
    unsafe fn rows3_loop(t: &super::avx512::PanelTile<Self>, acc: &mut [__m256; 12]) -> bool {
        // SAFETY: the caller's.
        unsafe { f16_rows3_loop(t, acc) }
    }
}

impl Lanes8 for super::fp8::E4m3 {
    const WIDEN_ONCE: bool = true;

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

    #[inline(always)]
    unsafe fn rows3_loop(t: &super::avx512::PanelTile<Self>, acc: &mut [__m256; 12]) -> bool {
        // SAFETY: the caller's.
        unsafe { fp8_rows3_loop(t, acc) }
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
/// operands as for the AVX-512 kernel ([`super::avx512::PanelTile`]), for `MR` ≤
/// [`MAX_FULL_WIDTH_MR`]. These small tiles never widen a block for others: a product of more
/// rows starts with a [`half_panel_tile`].
///
/// # Safety
/// The CPU supports AVX2, FMA and F16C and the pointers cover the sizes `PanelTile` describes.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn panel_tile<T: Lanes8, const MR: usize>(t: super::avx512::PanelTile<T>) {
    let mut acc = [[_mm256_setzero_ps(); 4]; MR];
    unsafe {
        if !t.first {
            for (i, row) in acc.iter_mut().enumerate() {
                for (j, a) in row.iter_mut().enumerate() {
                    *a = _mm256_loadu_ps(t.acc.add(i * PANEL + 8 * j));
                }
            }
        }
        if MR == 3 {
            let mut sums: [__m256; 12] = std::array::from_fn(|r| acc[r / 4][r % 4]);
            if T::rows3_loop(&t, &mut sums) {
                for (r, s) in sums.into_iter().enumerate() {
                    _mm256_storeu_ps(t.acc.add((r / 4) * PANEL + 8 * (r % 4)), s);
                }
                return;
            }
        }
        for p in 0..t.kc {
            let wp = t.w.add(p * PANEL);
            if t.prefetch_step != 0 {
                _mm_prefetch::<_MM_HINT_T2>(
                    t.prefetch.wrapping_add(p * t.prefetch_step) as *const i8
                );
            }
            let xs: [__m256; MR] = std::array::from_fn(|i| _mm256_set1_ps(*t.x.add(p * MR + i)));
            for j in 0..4 {
                let w = load_columns(wp, j);
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

/// One activation row through two whole panels at once (of one weight, or of two with the same
/// `k`): `acc[s][c] = Σ_p x[p] · w[s][p][c]` over `p < k`, from zero.
///
/// One row through one panel is four FMA chains of one FMA per position, so a position costs
/// at least the FMA latency (4 cycles on Zen 3) and a core reading from memory has no speed to
/// spare for catching up after a late line: streaming from DRAM on Zen 3, a 1-row loop read
/// 0.84 of what a plain sum of the same bytes did on one core, two panels interleaved (eight
/// chains, two streams) 1.05 (two cores: 0.90 against 1.05; bench/RESULTS.md, "Batch-1 decode
/// at the read bandwidth on AVX2"). Each output lane is still the one FMA chain
/// over `p = 0..k` in order, so the bits are [`panel_tile`]'s. Each stream prefetches
/// `PREFETCH_BYTES` ahead of its position, as a 1-row tile does.
///
/// # Safety
/// The CPU supports AVX2, FMA and F16C; `x` holds `k` activations, each `w[s]` `k × PANEL`
/// elements and each `acc[s]` `PANEL` sums.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn panel_pair_row<T: Lanes8>(
    x: *const f32,
    k: usize,
    w: [*const T; 2],
    acc: [*mut f32; 2],
) {
    let mut sums = [[_mm256_setzero_ps(); 4]; 2];
    let ahead = super::avx512::PREFETCH_BYTES;
    unsafe {
        for p in 0..k {
            let xb = _mm256_set1_ps(*x.add(p));
            for (s, sum) in sums.iter_mut().enumerate() {
                let wp = w[s].add(p * PANEL);
                _mm_prefetch::<_MM_HINT_T2>(wp.cast::<u8>().wrapping_add(ahead) as *const i8);
                for (j, a) in sum.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(load_columns(wp, j), xb, *a);
                }
            }
        }
        for (sum, out) in sums.iter().zip(acc) {
            for (j, a) in sum.iter().enumerate() {
                _mm256_storeu_ps(out.add(8 * j), *a);
            }
        }
    }
}

/// [`panel_tile`] for 4 to [`MAX_MR`] rows, in two passes over the block: columns 0–7 and
/// 16–23, then 8–15 and 24–31 (for bf16 each pass's columns are one 32-byte load: its lanes
/// shifted up, and masked). A position of a pass is two weight vectors, `MR` broadcasts and
/// `2 · MR` FMAs: 6 rows convert 4 weight vectors per 24 FMAs over both passes where two
/// 3-row full-width tiles convert 8 (the 16 registers hold no more than 3 full-width rows),
/// and the extra broadcasts cost nothing measurable on Zen 3 (an L1-resident loop of either
/// form runs at the FMA peak). Measured on Zen 3 against 3-row tiles after a widening first tile
/// (bench/RESULTS.md): ≈ 1.08× at 8 and at 16 rows per expert. With `WIDEN` (the product's
/// first tile, for element types with [`Lanes8::WIDEN_ONCE`]) each position is also stored
/// widened into `t.widen_to`. Each pass prefetches its share of the weight stream.
///
/// # Safety
/// As [`panel_tile`]'s, `3 < MR ≤ MAX_MR`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn half_panel_tile<T: Lanes8, const MR: usize, const WIDEN: bool>(
    t: super::avx512::PanelTile<T>,
) {
    unsafe {
        for h in 0..2 {
            let mut acc = [[_mm256_setzero_ps(); 2]; MR];
            if !t.first {
                for (i, row) in acc.iter_mut().enumerate() {
                    row[0] = _mm256_loadu_ps(t.acc.add(i * PANEL + 8 * h));
                    row[1] = _mm256_loadu_ps(t.acc.add(i * PANEL + 8 * (h + 2)));
                }
            }
            for p in 0..t.kc {
                let wp = t.w.add(p * PANEL);
                if t.prefetch_step != 0 {
                    let ahead = (h * t.kc + p) * t.prefetch_step;
                    _mm_prefetch::<_MM_HINT_T2>(t.prefetch.wrapping_add(ahead) as *const i8);
                }
                let w0 = load_columns(wp, h);
                let w1 = load_columns(wp, h + 2);
                if WIDEN {
                    _mm256_storeu_ps(t.widen_to.add(p * PANEL + 8 * h), w0);
                    _mm256_storeu_ps(t.widen_to.add(p * PANEL + 8 * (h + 2)), w1);
                }
                for (i, row) in acc.iter_mut().enumerate() {
                    let x = _mm256_set1_ps(*t.x.add(p * MR + i));
                    row[0] = _mm256_fmadd_ps(w0, x, row[0]);
                    row[1] = _mm256_fmadd_ps(w1, x, row[1]);
                }
            }
            for (i, row) in acc.iter().enumerate() {
                _mm256_storeu_ps(t.acc.add(i * PANEL + 8 * h), row[0]);
                _mm256_storeu_ps(t.acc.add(i * PANEL + 8 * (h + 2)), row[1]);
            }
        }
    }
}
