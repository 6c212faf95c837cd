//! The int4 kernels (see the parent module's note): one call runs a tile of activation rows
//! against one panel's blocks, summing codes × activation bytes in i32 and scaling each block
//! once (`intdot::TileGrids`).

use super::super::intdot::{DotKernel, Format, TileGrids};
use super::super::packed::PANEL;
use super::{QUAD, QUAD_BYTES, QUADS_PER_BLOCK, WORDS};

/// Bytes of one quad unpacked to a byte per code (AVX-VNNI's row tiles, see
/// [`super::Int4Panels::panel_product`]).
pub(super) const UNPACKED_QUAD_BYTES: usize = PANEL * QUAD;

/// One kernel call: `MR` rows of a tile against a panel, blocks `blocks.0 .. blocks.1`; `acc`
/// is written at block 0 and added to after.
#[derive(Clone, Copy)]
pub(super) struct Int4Tile {
    /// The tile's words from quad 0: row `i`'s quad `j` at `x[WORDS · (j · MR + i)]` (`h`)
    /// and the two words after (`m`, `l`).
    pub x: *const i32,
    /// The panel's codes from quad 0: `[quads, QUAD_BYTES]`.
    pub w: *const u8,
    /// Or null: the step's codes unpacked to a byte each from quad `quad0`, `[quads,
    /// UNPACKED_QUAD_BYTES]` (as [`quad_codes_avx2`] gives them), which AVX-VNNI's tiles of
    /// several rows read instead.
    pub unpacked: *const u8,
    pub quad0: usize,
    pub quads: usize,
    pub blocks: (usize, usize),
    /// The rows' metadata (a block's group from the panel's `block_group`), the panel's grids
    /// and the `MR × PANEL` sums.
    pub grids: TileGrids,
}

impl Int4Tile {
    /// # Safety
    /// `kernel` runs on this CPU; the pointers cover what [`Int4Tile`] says for `mr ≤
    /// kernel.tile_rows(Format::Int4)` rows.
    pub(super) unsafe fn run(self, kernel: DotKernel, mr: usize) {
        debug_assert!(mr <= kernel.tile_rows(Format::Int4));
        macro_rules! rows {
            ($f:ident, $($n:literal)*) => {
                match mr {
                    $($n => $f::<$n>(self),)*
                    _ => unreachable!("{kernel} tiles of {mr} rows"),
                }
            };
        }
        // SAFETY: as the caller guarantees.
        unsafe {
            match kernel {
                // Few rows: one sweep, a sum per byte of x̂; more: a pass per byte.
                DotKernel::Vnni512 if mr <= SWEEP_ROWS => rows!(vnni512_sweep, 1 2 3 4),
                DotKernel::Vnni512 => rows!(vnni512, 5 6 7 8 9 10 11 12),
                // One row in one sweep (decode, or a batch's last tile).
                DotKernel::AvxVnni if mr == 1 => avx_vnni_row(self),
                DotKernel::AvxVnni => rows!(avx_vnni, 2),
                DotKernel::Avx2Madd if mr == 1 => avx2_maddubs_row(self),
                DotKernel::Avx2Madd => rows!(avx2_madd, 2),
            }
        }
    }

    /// Quads `j0 .. j1` of block `b`.
    fn quads(&self, b: usize) -> (usize, usize) {
        let j0 = b * QUADS_PER_BLOCK;
        (j0, (j0 + QUADS_PER_BLOCK).min(self.quads))
    }
}

/// Prefetches the codes [`super::super::avx512::PREFETCH_BYTES`] ahead of a quad (one line). For int4
/// batch-1 decode (alternating runs, 2026-12-04): 8 KiB ahead to L2 ran 60 tokens/s, 16 KiB 61,
/// to L1 (T0) 56, no prefetch 47.
#[inline(always)]
fn prefetch_quad(wp: *const u8) {
    use std::arch::x86_64::{_MM_HINT_T2, _mm_prefetch};
    let ahead = wp.wrapping_add(super::super::avx512::PREFETCH_BYTES);
    // SAFETY: a prefetch of any address is harmless (it never faults).
    unsafe { _mm_prefetch::<_MM_HINT_T2>(ahead as *const i8) };
}

/// The most rows [`vnni512_sweep`] takes: six sums a row in 32 registers.
const SWEEP_ROWS: usize = 4;

/// [`vnni512`] in one sweep over the codes, unpacked once for the three bytes of `x̂`: the
/// decode case, where the passes' unpacking would bound the speed. The same integer sums.
///
/// # Safety
/// As [`vnni512`].
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn vnni512_sweep<const MR: usize>(t: Int4Tile) {
    use std::arch::x86_64::*;
    unsafe {
        let nibble = _mm512_set1_epi8(0xF);
        for b in t.blocks.0..t.blocks.1 {
            // [byte][row]: outputs 0–15 and 16–31 of the panel.
            let mut lo = [[_mm512_setzero_si512(); MR]; WORDS];
            let mut hi = [[_mm512_setzero_si512(); MR]; WORDS];
            let (j0, j1) = t.quads(b);
            for j in j0..j1 {
                let wp = t.w.add(j * QUAD_BYTES);
                prefetch_quad(wp);
                let v = _mm512_loadu_si512(wp as *const __m512i);
                let w0 = _mm512_and_si512(v, nibble);
                let w1 = _mm512_and_si512(_mm512_srli_epi16::<4>(v), nibble);
                for i in 0..MR {
                    let x = t.x.add(WORDS * (j * MR + i));
                    let h = _mm512_set1_epi32(*x);
                    lo[0][i] = _mm512_dpbusd_epi32(lo[0][i], w0, h);
                    hi[0][i] = _mm512_dpbusd_epi32(hi[0][i], w1, h);
                    for byte in 1..WORDS {
                        let xv = _mm512_set1_epi32(*x.add(byte));
                        lo[byte][i] = _mm512_dpbusd_epi32(lo[byte][i], xv, w0);
                        hi[byte][i] = _mm512_dpbusd_epi32(hi[byte][i], xv, w1);
                    }
                }
            }
            // (2^8 · h + m) · 2^8 + l, each row's sums.
            let join = |s: [[__m512i; MR]; WORDS]| {
                std::array::from_fn(|i| {
                    let hm = _mm512_add_epi32(_mm512_slli_epi32::<8>(s[0][i]), s[1][i]);
                    _mm512_add_epi32(_mm512_slli_epi32::<8>(hm), s[2][i])
                })
            };
            t.grids.epilogue_avx512::<MR>(b, &join(lo), &join(hi));
        }
    }
}

/// # Safety
/// The CPU supports AVX-512F/BW/VNNI; `t` as [`Int4Tile::run`] requires, `MR` rows.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn vnni512<const MR: usize>(t: Int4Tile) {
    use std::arch::x86_64::*;
    unsafe {
        let nibble = _mm512_set1_epi8(0xF);
        for b in t.blocks.0..t.blocks.1 {
            // Outputs 0–15 and 16–31 of the panel.
            let mut lo = [_mm512_setzero_si512(); MR];
            let mut hi = [_mm512_setzero_si512(); MR];
            let (j0, j1) = t.quads(b);
            // Codes × high bytes, then (the sums × 256 before each) the middle and low bytes ×
            // codes; the later passes read the block's codes from L1.
            for word in 0..WORDS {
                if word > 0 {
                    for i in 0..MR {
                        lo[i] = _mm512_slli_epi32::<8>(lo[i]);
                        hi[i] = _mm512_slli_epi32::<8>(hi[i]);
                    }
                }
                for j in j0..j1 {
                    let wp = t.w.add(j * QUAD_BYTES);
                    if word == 0 {
                        prefetch_quad(wp);
                    }
                    let v = _mm512_loadu_si512(wp as *const __m512i);
                    let w0 = _mm512_and_si512(v, nibble);
                    let w1 = _mm512_and_si512(_mm512_srli_epi16::<4>(v), nibble);
                    for i in 0..MR {
                        let xv = _mm512_set1_epi32(*t.x.add(WORDS * (j * MR + i) + word));
                        if word == 0 {
                            lo[i] = _mm512_dpbusd_epi32(lo[i], w0, xv);
                            hi[i] = _mm512_dpbusd_epi32(hi[i], w1, xv);
                        } else {
                            lo[i] = _mm512_dpbusd_epi32(lo[i], xv, w0);
                            hi[i] = _mm512_dpbusd_epi32(hi[i], xv, w1);
                        }
                    }
                }
            }
            t.grids.epilogue_avx512::<MR>(b, &lo, &hi);
        }
    }
}

/// A quad's codes as four registers of 8 outputs × 4 slots (outputs 0–7, 8–15, 16–23, 24–31).
///
/// # Safety
/// The CPU supports AVX2; `wp` points at a quad's [`QUAD_BYTES`].
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn quad_codes_avx2(wp: *const u8) -> [std::arch::x86_64::__m256i; 4] {
    use std::arch::x86_64::*;
    unsafe {
        let nibble = _mm256_set1_epi8(0xF);
        let v0 = _mm256_loadu_si256(wp as *const __m256i);
        let v1 = _mm256_loadu_si256(wp.add(32) as *const __m256i);
        [
            _mm256_and_si256(v0, nibble),
            _mm256_and_si256(v1, nibble),
            _mm256_and_si256(_mm256_srli_epi16::<4>(v0), nibble),
            _mm256_and_si256(_mm256_srli_epi16::<4>(v1), nibble),
        ]
    }
}

/// Quad `j`'s codes as [`quad_codes_avx2`] gives them, from the packed or the unpacked codes.
///
/// # Safety
/// The CPU supports AVX2; quad `j` is inside `t`'s codes.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn tile_codes_avx2(t: &Int4Tile, j: usize) -> [std::arch::x86_64::__m256i; 4] {
    use std::arch::x86_64::*;
    unsafe {
        if !t.unpacked.is_null() {
            let wp = t.unpacked.add((j - t.quad0) * UNPACKED_QUAD_BYTES);
            std::array::from_fn(|v| _mm256_loadu_si256(wp.add(32 * v) as *const __m256i))
        } else {
            let wp = t.w.add(j * QUAD_BYTES);
            prefetch_quad(wp);
            quad_codes_avx2(wp)
        }
    }
}

/// `codes` (whole quads) unpacked to a byte per code into `out`, as [`quad_codes_avx2`] gives
/// them.
///
/// # Safety
/// The CPU supports AVX2; `out` holds `UNPACKED_QUAD_BYTES` per quad of `codes`.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn unpack_avx2(codes: &[u8], out: &mut [u8]) {
    use std::arch::x86_64::*;
    assert!(out.len() * QUAD_BYTES == codes.len() * UNPACKED_QUAD_BYTES);
    for (quad, dst) in codes
        .chunks_exact(QUAD_BYTES)
        .zip(out.chunks_exact_mut(UNPACKED_QUAD_BYTES))
    {
        // SAFETY: a quad's bytes in, its unpacked bytes out.
        unsafe {
            prefetch_quad(quad.as_ptr());
            for (v, reg) in quad_codes_avx2(quad.as_ptr()).into_iter().enumerate() {
                _mm256_storeu_si256(dst.as_mut_ptr().add(32 * v) as *mut __m256i, reg);
            }
        }
    }
}

/// # Safety
/// The CPU supports AVX2, AVX-VNNI and F16C; `t` as [`Int4Tile::run`] requires, `MR` rows.
#[target_feature(enable = "avx2,avxvnni,f16c")]
unsafe fn avx_vnni<const MR: usize>(t: Int4Tile) {
    use std::arch::x86_64::*;
    unsafe {
        for b in t.blocks.0..t.blocks.1 {
            let mut dots = [[_mm256_setzero_si256(); 4]; MR];
            let (j0, j1) = t.quads(b);
            // As the AVX-512 kernel: codes × high bytes, then sums × 256 and middle, low bytes ×
            // codes.
            for word in 0..WORDS {
                if word > 0 {
                    // By value: a loop over `&mut` kept the sums on the stack.
                    dots = dots.map(|row| row.map(|d| _mm256_slli_epi32::<8>(d)));
                }
                for j in j0..j1 {
                    let xs: [__m256i; MR] = std::array::from_fn(|i| {
                        _mm256_set1_epi32(*t.x.add(WORDS * (j * MR + i) + word))
                    });
                    for (v, w) in tile_codes_avx2(&t, j).into_iter().enumerate() {
                        for (row, x) in dots.iter_mut().zip(&xs) {
                            row[v] = if word == 0 {
                                _mm256_dpbusd_avx_epi32(row[v], w, *x)
                            } else {
                                _mm256_dpbusd_avx_epi32(row[v], *x, w)
                            };
                        }
                    }
                }
            }
            t.grids.epilogue_avx2::<MR>(b, &dots);
        }
    }
}

/// # Safety
/// The CPU supports AVX2 and F16C; `t` as [`Int4Tile::run`] requires, `MR` rows.
#[target_feature(enable = "avx2,f16c")]
unsafe fn avx2_madd<const MR: usize>(t: Int4Tile) {
    use std::arch::x86_64::*;
    unsafe {
        let low_bytes = _mm256_set1_epi16(0xFF);
        let high_bytes = _mm256_set1_epi16(0xFF00u16 as i16);
        for b in t.blocks.0..t.blocks.1 {
            let mut dots = [[_mm256_setzero_si256(); 4]; MR];
            let (j0, j1) = t.quads(b);
            // x̂ = 2^8 · (2^8 · h + m) + l: the 16-bit high part, the sums × 256, then l.
            for pass in 0..2 {
                if pass == 1 {
                    // By value: a loop over `&mut` kept the sums on the stack.
                    dots = dots.map(|row| row.map(|d| _mm256_slli_epi32::<8>(d)));
                }
                for j in j0..j1 {
                    // A lane's four operands as 16-bit pairs: slots (0, 2) and (1, 3).
                    let xs: [(__m256i, __m256i); MR] = std::array::from_fn(|i| {
                        let word = |n: usize| _mm256_set1_epi32(*t.x.add(WORDS * (j * MR + i) + n));
                        if pass == 0 {
                            // (h << 8) + m, h signed: |2^8 · h + m| ≤ 2^14.
                            let (h, m) = (word(0), word(1));
                            let (even_h, odd_h) =
                                (_mm256_slli_epi16(h, 8), _mm256_and_si256(h, high_bytes));
                            let (even_m, odd_m) =
                                (_mm256_and_si256(m, low_bytes), _mm256_srli_epi16(m, 8));
                            (
                                _mm256_add_epi16(even_h, even_m),
                                _mm256_add_epi16(odd_h, odd_m),
                            )
                        } else {
                            let l = word(2);
                            (_mm256_and_si256(l, low_bytes), _mm256_srli_epi16(l, 8))
                        }
                    });
                    for (v, w) in tile_codes_avx2(&t, j).into_iter().enumerate() {
                        // The codes of slots (0, 2) and (1, 3), zero-extended to 16 bits.
                        let (even, odd) = (_mm256_and_si256(w, low_bytes), _mm256_srli_epi16(w, 8));
                        for (row, (xe, xo)) in dots.iter_mut().zip(&xs) {
                            let pairs = _mm256_add_epi32(
                                _mm256_madd_epi16(even, *xe),
                                _mm256_madd_epi16(odd, *xo),
                            );
                            row[v] = _mm256_add_epi32(row[v], pairs);
                        }
                    }
                }
            }
            t.grids.epilogue_avx2::<MR>(b, &dots);
        }
    }
}

/// Quad `j`'s codes of outputs `8v .. 8v + 8` as unsigned bytes (bytes `32 · (v % 2)` on, low
/// nibbles for `v < 2`), for the one-row kernels; prefetches at `v = 0`.
///
/// # Safety
/// The CPU supports AVX2 and F16C; quad `j` is inside `t`'s packed codes.
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn row_codes_avx2(t: &Int4Tile, j: usize, v: usize) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    unsafe {
        let wp = t.w.add(j * QUAD_BYTES);
        if v == 0 {
            prefetch_quad(wp);
        }
        let nibble = _mm256_set1_epi8(0xF);
        let bytes = _mm256_loadu_si256(wp.add(32 * (v % 2)) as *const __m256i);
        if v < 2 {
            _mm256_and_si256(bytes, nibble)
        } else {
            _mm256_and_si256(_mm256_srli_epi16::<4>(bytes), nibble)
        }
    }
}

/// [`avx_vnni`] for one row (decode) in one sweep per 8 outputs, a sum per byte of `x̂`: the
/// codes unpacked once for the three bytes. The same integer sums.
///
/// # Safety
/// The CPU supports AVX2, AVX-VNNI and F16C; `t` as [`Int4Tile::run`] requires, 1 row.
#[target_feature(enable = "avx2,avxvnni,f16c")]
unsafe fn avx_vnni_row(t: Int4Tile) {
    use std::arch::x86_64::*;
    unsafe {
        for b in t.blocks.0..t.blocks.1 {
            let (j0, j1) = t.quads(b);
            let mut dots = [_mm256_setzero_si256(); 4];
            for (v, dot) in dots.iter_mut().enumerate() {
                let mut sums = [_mm256_setzero_si256(); WORDS];
                for j in j0..j1 {
                    let c = row_codes_avx2(&t, j, v);
                    let x = t.x.add(WORDS * j);
                    let word = |n: usize| _mm256_set1_epi32(*x.add(n));
                    sums[0] = _mm256_dpbusd_avx_epi32(sums[0], c, word(0));
                    sums[1] = _mm256_dpbusd_avx_epi32(sums[1], word(1), c);
                    sums[2] = _mm256_dpbusd_avx_epi32(sums[2], word(2), c);
                }
                let hm = _mm256_add_epi32(_mm256_slli_epi32::<8>(sums[0]), sums[1]);
                *dot = _mm256_add_epi32(_mm256_slli_epi32::<8>(hm), sums[2]);
            }
            t.grids.epilogue_avx2::<1>(b, &[dots]);
        }
    }
}

/// [`avx2_madd`] for one row (decode) in one sweep per 8 outputs with `vpmaddubsw`: byte
/// products summed in pairs to 16 bits — the codes unsigned × `h` signed, `m` and `l` unsigned
/// × the codes as signed (a pair ≤ 2 · 255 · 15 < 2^15) — added up in 16 bits over 4 quads
/// (8 for `h`, whose pairs stay under 2 · 15 · 64), then widened by `vpmaddwd` with ones. About
/// half the instructions of the 16-bit kernel per weight; the same integer sums.
///
/// # Safety
/// The CPU supports AVX2 and F16C; `t` as [`Int4Tile::run`] requires, 1 row.
#[target_feature(enable = "avx2,f16c")]
unsafe fn avx2_maddubs_row(t: Int4Tile) {
    use std::arch::x86_64::*;
    unsafe {
        let ones = _mm256_set1_epi16(1);
        for b in t.blocks.0..t.blocks.1 {
            let (j0, j1) = t.quads(b);
            let mut dots = [_mm256_setzero_si256(); 4];
            for (v, dot) in dots.iter_mut().enumerate() {
                // Outputs 8v .. 8v + 8: bytes 32 · (v % 2) .., low nibbles for v < 2.
                let (mut h16, mut m16, mut l16) = (
                    _mm256_setzero_si256(),
                    _mm256_setzero_si256(),
                    _mm256_setzero_si256(),
                );
                let (mut m32, mut l32) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                for j in j0..j1 {
                    let c = row_codes_avx2(&t, j, v);
                    let x = t.x.add(WORDS * j);
                    let word = |n: usize| _mm256_set1_epi32(*x.add(n));
                    h16 = _mm256_add_epi16(h16, _mm256_maddubs_epi16(c, word(0)));
                    m16 = _mm256_add_epi16(m16, _mm256_maddubs_epi16(word(1), c));
                    l16 = _mm256_add_epi16(l16, _mm256_maddubs_epi16(word(2), c));
                    if (j - j0) % 4 == 3 {
                        m32 = _mm256_add_epi32(m32, _mm256_madd_epi16(m16, ones));
                        l32 = _mm256_add_epi32(l32, _mm256_madd_epi16(l16, ones));
                        (m16, l16) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                    }
                }
                m32 = _mm256_add_epi32(m32, _mm256_madd_epi16(m16, ones));
                l32 = _mm256_add_epi32(l32, _mm256_madd_epi16(l16, ones));
                let h32 = _mm256_madd_epi16(h16, ones);
                let hm = _mm256_add_epi32(_mm256_slli_epi32::<8>(h32), m32);
                *dot = _mm256_add_epi32(_mm256_slli_epi32::<8>(hm), l32);
            }
            t.grids.epilogue_avx2::<1>(b, &[dots]);
        }
    }
}
