//! Weight-only int8 (`--quantization int8`) multiplied in integers: the activations are
//! quantized per row and group at run time and the GEMM sums integer products in i32 — VNNI
//! `vpdpbusd` (64 byte products per instruction on AVX-512, 32 with AVX-VNNI), or AVX2's
//! `vpmaddwd` on the codes widened to 16 bits — then applies both grids once per group.
//!
//! Weights (`w ≈ q · s + o` per row and group of [`GROUP`] positions, `quant.rs`) are stored
//! as `u = q + 128` (unsigned: `vpdpbusd` multiplies unsigned by signed bytes), four positions
//! of an output side by side — a "quad", one 32-bit lane of the dot product:
//!
//! ```text
//! panel q, quad j:  codes [q][j][c][t] = q(32q + c, 4j + t) + 128    (c < 32, t < 4)
//! panel q, group g: scales [q][g][c], offsets [q][g][c]   (f32, `grids.rs`)
//! ```
//!
//! Activations (quantized by `intdot.rs`, shared with int4): each row's group of 64 positions
//! becomes `x ≈ x̂ · sx` with 15-bit `x̂ ∈ [−16383, 16383]` (`sx = max|x| / 16383`, round half
//! to even), split into bytes
//! `x̂ = 128 · h + l` (`h ∈ [−128, 127]`, `l ∈ [0, 127]`, both valid signed operands of
//! `vpdpbusd`). Each quad of positions is two i32 words, its four `h` and its four `l`, in the
//! tile order of the kernel ([`DotKernel::tile_rows`]); beside them the group's exact `Σx`
//! (f32) and `128 · Σx̂`. The VNNI kernels take `Σ u·x̂ = 128 · Σ u·h + Σ u·l` as two byte
//! products: AVX-512 tiles of up to 4 rows in one sweep over the group with separate sums for
//! `h` and `l` (`vnni512_sweep`: batch-1 decode 1.08× two passes on Zen 4, bench/RESULTS.md;
//! it had measured no faster on Sapphire Rapids), larger tiles and AVX-VNNI in two passes, `h`
//! then `l`, the sums shifted left by 7 between (the second pass reads the codes from L1);
//! AVX2 rebuilds `x̂` in 16-bit lanes and runs once. A group then adds
//!
//! ```text
//! Σ_p x_p · w_p ≈ (Σ u·x̂ − 128·Σx̂) · (s · sx) + Σx · o
//! ```
//!
//! The integer sum is exact (|Σ| ≤ 64 · 255 · 16383 < 2^31) and the same on every kernel, and
//! the f32 epilogue is the same operations in the same order (no FMA) on every ISA, so the three
//! kernels give the same bits, and a row's result does not depend on the batch. Only the
//! activations' rounding departs from the f32 product: the offset term takes the exact `Σx`, so
//! the error is `s · Σ_p (x_p − x̂_p · sx) · q_p`, bounded by half a step of `sx` per position.
//!
//! Why 15 bits and not 8: 8-bit activations (`x̂ ∈ [−127, 127]`, one `vpdpbusd` pass) cost the
//! demo model mean |Δlogprob| 0.060 against transformers where the weights' rounding alone costs
//! 0.017 (`moeserve quantize`, crates/moeserve-model/tests/int8.rs): SmolLM2's hidden states have
//! outlier channels, and a group holding one leaves its other positions a few steps of `sx`.
//! 15 bits cost nothing measurable there (0.0168 on smolmoe-demo, 0.0180 on smolmoe-eval, against
//! 0.0167 / 0.0179 with f32 activations). The second byte product halves the integer
//! throughput, which batch-1 decode (bandwidth-bound) does not feel.

use super::grids::PanelGrids;
pub use super::intdot::DotKernel;
use super::intdot::{Format, QUAD, QuantizedRows, TileGrids, prefetch_two_lines};
use super::packed::PANEL;
use super::quant::{GROUP, Int8Rows};

/// Quads per group: a group's integer sum is finished before its grids apply.
const QUADS_PER_GROUP: usize = GROUP / QUAD;
const _: () = assert!(GROUP == Format::Int8.block());
/// i32 words per quad of activations: its high bytes `h`, then its low bytes `l`.
const WORDS: usize = Format::Int8.words();
const _: () = assert!(WORDS == 2, "the kernels take x̂ as two bytes");

/// Groups per block when several row tiles share a panel: 4 KiB of codes stay in L1 while
/// every tile runs through them.
const BLOCK_GROUPS: usize = 2;

/// An int8 matrix `[n, k]` in the quad panel layout of the module note. Padding rows of the
/// last panel and positions past `k` in its last quad are `q = 0` under scale and offset 0.
#[derive(Clone)]
pub struct Int8Panels {
    n: usize,
    k: usize,
    /// `[num_panels, quads, PANEL, QUAD]`: `q + 128`.
    codes: Vec<u8>,
    grids: PanelGrids,
}

impl Int8Panels {
    /// Packs rows quantized by `quant.rs` (at load, or read from a `moeserve quantize`
    /// checkpoint).
    pub fn new(rows: &Int8Rows, n: usize, k: usize) -> Self {
        let (quads, groups) = (k.div_ceil(QUAD), k.div_ceil(GROUP));
        assert!(
            rows.q.len() == n * k && rows.scales.len() == n * groups,
            "Int8Panels: rows are not [{n}, {k}]"
        );
        let panels = n.div_ceil(PANEL);
        let len = panels * quads * PANEL * QUAD;
        let mut codes: Vec<u8> = Vec::with_capacity(len);
        super::packed::advise_huge_pages(codes.as_mut_ptr(), len);
        codes.resize(len, 128);
        let mut scales = vec![0.0; panels * groups * PANEL];
        let mut offsets = vec![0.0; panels * groups * PANEL];
        for r in 0..n {
            let (q, c) = (r / PANEL, r % PANEL);
            let panel = &mut codes[q * quads * PANEL * QUAD..][..quads * PANEL * QUAD];
            for (p, v) in rows.q[r * k..(r + 1) * k].iter().enumerate() {
                panel[((p / QUAD) * PANEL + c) * QUAD + p % QUAD] = (*v as u8) ^ 0x80;
            }
            for g in 0..groups {
                scales[(q * groups + g) * PANEL + c] = rows.scales[r * groups + g];
                offsets[(q * groups + g) * PANEL + c] = rows.offsets[r * groups + g];
            }
        }
        Int8Panels {
            n,
            k,
            codes,
            grids: PanelGrids::float(scales, offsets),
        }
    }

    pub fn shape(&self) -> [usize; 2] {
        [self.n, self.k]
    }

    pub fn num_panels(&self) -> usize {
        self.n.div_ceil(PANEL)
    }

    /// Bytes one pass of the kernels reads: a byte per weight, 8 per group and row.
    pub fn size_in_bytes(&self) -> usize {
        self.codes.len() + self.grids.size_in_bytes()
    }

    /// The dequantised weight `(r, p)`: `q · scale + offset`.
    pub fn value(&self, r: usize, p: usize) -> f32 {
        assert!(r < self.n && p < self.k);
        let (quads, groups) = (self.k.div_ceil(QUAD), self.k.div_ceil(GROUP));
        let (q, c) = (r / PANEL, r % PANEL);
        let code = self.codes[((q * quads + p / QUAD) * PANEL + c) * QUAD + p % QUAD];
        let (scale, offset) = self.grids.scale_offset(groups, (q, p / GROUP, c));
        f32::from((code ^ 0x80) as i8) * scale + offset
    }

    /// Panel `q` of `x · Wᵀ` into `acc: [m, PANEL]`: one tile of rows runs the whole panel in
    /// one call; more tiles share each block of [`BLOCK_GROUPS`] groups while it is in L1.
    #[cfg(target_arch = "x86_64")]
    pub(super) fn panel_product(&self, x: QuantizedRows<'_>, q: usize, acc: &mut [f32]) {
        assert!(
            x.k == self.k && x.format == Format::Int8,
            "int8 weights take activations quantized for them"
        );
        debug_assert!(acc.len() == x.m * PANEL && q < self.num_panels());
        let kernel = x.kernel;
        let (quads, groups) = (self.k.div_ceil(QUAD), self.k.div_ceil(GROUP));
        let step = if x.m <= kernel.tile_rows(Format::Int8) {
            groups
        } else {
            BLOCK_GROUPS
        };
        for g0 in (0..groups).step_by(step) {
            for (i0, mr) in super::matmul::row_tiles(x.m, kernel.tile_rows(Format::Int8)) {
                let t = DotTile {
                    x: x.words[i0 * quads * WORDS..].as_ptr(),
                    stride: mr,
                    w: self.codes[q * quads * PANEL * QUAD..].as_ptr(),
                    k: self.k,
                    groups: (g0, (g0 + step).min(groups)),
                    grids: TileGrids {
                        num_blocks: groups,
                        sx: x.scales[i0 * groups..].as_ptr(),
                        sum_x: x.sums[i0 * groups..].as_ptr(),
                        correction: x.corrections[i0 * groups..].as_ptr(),
                        block_group: std::ptr::null(),
                        grid: self.grids.panel(groups, q),
                        acc: acc[i0 * PANEL..(i0 + mr) * PANEL].as_mut_ptr(),
                    },
                };
                // SAFETY: `kernel` was chosen for this CPU (`DotKernel::for_isa`); the tile's
                // quads, metadata, the panel's codes and grids and `acc` cover what `DotTile`
                // describes for mr rows.
                unsafe { t.run(kernel, mr) };
            }
        }
    }
}

/// One kernel call: `stride` rows of a tile (the kernel takes all of them) against a panel,
/// groups `groups.0 .. groups.1`; `acc` is written at the first group and added to after.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct DotTile {
    /// The tile's words from quad 0: row `i`'s quad `j` at `x[WORDS · (j · stride + i)]`
    /// (`h`) and the word after (`l`).
    x: *const i32,
    stride: usize,
    /// The panel's codes from quad 0: `[quads, PANEL, QUAD]`.
    w: *const u8,
    k: usize,
    groups: (usize, usize),
    /// The rows' metadata (a block per group) and the panel's grids and sums.
    grids: TileGrids,
}

#[cfg(target_arch = "x86_64")]
impl DotTile {
    /// # Safety
    /// `kernel` runs on this CPU; the pointers cover what [`DotTile`] says; `mr == stride ≤
    /// kernel.tile_rows(Format::Int8)`.
    unsafe fn run(self, kernel: DotKernel, mr: usize) {
        debug_assert!(mr == self.stride && mr <= kernel.tile_rows(Format::Int8));
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
                DotKernel::Vnni512 if mr <= SWEEP_ROWS => rows!(vnni512_sweep, 1 2 3 4),
                DotKernel::Vnni512 => rows!(vnni512, 5 6 7 8 9 10 11 12),
                DotKernel::AvxVnni => rows!(avx_vnni, 1 2 3),
                DotKernel::Avx2Madd => rows!(avx2_madd, 1 2),
            }
        }
    }

    /// Quads `j0 .. j1` of group `g`.
    fn quads(&self, g: usize) -> (usize, usize) {
        let j0 = g * QUADS_PER_GROUP;
        (j0, (j0 + QUADS_PER_GROUP).min(self.k.div_ceil(QUAD)))
    }
}

/// The most rows [`vnni512_sweep`] takes: four sums a row.
const SWEEP_ROWS: usize = 4;

/// [`vnni512`] in one sweep over a group's codes, a sum per byte of `x̂` (four chains a row, the
/// codes loaded once): `128 · Σ u·h + Σ u·l` is the same integer however it is summed.
///
/// # Safety
/// As [`vnni512`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn vnni512_sweep<const MR: usize>(t: DotTile) {
    use std::arch::x86_64::*;
    unsafe {
        for g in t.groups.0..t.groups.1 {
            // [byte][row]: outputs 0–15 and 16–31 of the panel.
            let mut lo = [[_mm512_setzero_si512(); MR]; WORDS];
            let mut hi = [[_mm512_setzero_si512(); MR]; WORDS];
            let (j0, j1) = t.quads(g);
            for j in j0..j1 {
                let wp = t.w.add(j * PANEL * QUAD);
                prefetch_two_lines(wp);
                let w0 = _mm512_loadu_si512(wp as *const __m512i);
                let w1 = _mm512_loadu_si512(wp.add(64) as *const __m512i);
                for i in 0..MR {
                    for word in 0..WORDS {
                        let xv = _mm512_set1_epi32(*t.x.add(WORDS * (j * MR + i) + word));
                        lo[word][i] = _mm512_dpbusd_epi32(lo[word][i], w0, xv);
                        hi[word][i] = _mm512_dpbusd_epi32(hi[word][i], w1, xv);
                    }
                }
            }
            let join = |s: [[__m512i; MR]; WORDS]| {
                std::array::from_fn(|i| _mm512_add_epi32(_mm512_slli_epi32::<7>(s[0][i]), s[1][i]))
            };
            t.grids.epilogue_avx512::<MR>(g, &join(lo), &join(hi));
        }
    }
}

/// # Safety
/// The CPU supports AVX-512F/BW/VNNI; `t` as [`DotTile::run`] requires, `MR` rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn vnni512<const MR: usize>(t: DotTile) {
    use std::arch::x86_64::*;
    unsafe {
        for g in t.groups.0..t.groups.1 {
            // Outputs 0–15 and 16–31 of the panel.
            let mut lo = [_mm512_setzero_si512(); MR];
            let mut hi = [_mm512_setzero_si512(); MR];
            let (j0, j1) = t.quads(g);
            // The high bytes, then (the sums ×128) the low bytes; the second pass reads
            // the group's codes from L1.
            for word in 0..WORDS {
                if word == 1 {
                    for i in 0..MR {
                        lo[i] = _mm512_slli_epi32::<7>(lo[i]);
                        hi[i] = _mm512_slli_epi32::<7>(hi[i]);
                    }
                }
                for j in j0..j1 {
                    let wp = t.w.add(j * PANEL * QUAD);
                    if word == 0 {
                        prefetch_two_lines(wp);
                    }
                    let w0 = _mm512_loadu_si512(wp as *const __m512i);
                    let w1 = _mm512_loadu_si512(wp.add(64) as *const __m512i);
                    for i in 0..MR {
                        let xv = _mm512_set1_epi32(*t.x.add(WORDS * (j * MR + i) + word));
                        lo[i] = _mm512_dpbusd_epi32(lo[i], w0, xv);
                        hi[i] = _mm512_dpbusd_epi32(hi[i], w1, xv);
                    }
                }
            }
            t.grids.epilogue_avx512::<MR>(g, &lo, &hi);
        }
    }
}

/// # Safety
/// The CPU supports AVX2, AVX-VNNI and F16C; `t` as [`DotTile::run`] requires, `MR` rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avxvnni,f16c")]
unsafe fn avx_vnni<const MR: usize>(t: DotTile) {
    use std::arch::x86_64::*;
    unsafe {
        for g in t.groups.0..t.groups.1 {
            let mut dots = [[_mm256_setzero_si256(); 4]; MR];
            let (j0, j1) = t.quads(g);
            // As the AVX-512 kernel: high bytes, sums ×128, low bytes.
            for word in 0..WORDS {
                if word == 1 {
                    for dot in dots.iter_mut().flatten() {
                        *dot = _mm256_slli_epi32::<7>(*dot);
                    }
                }
                for j in j0..j1 {
                    let wp = t.w.add(j * PANEL * QUAD);
                    if word == 0 {
                        prefetch_two_lines(wp);
                    }
                    let xs: [__m256i; MR] = std::array::from_fn(|i| {
                        _mm256_set1_epi32(*t.x.add(WORDS * (j * MR + i) + word))
                    });
                    for v in 0..4 {
                        let w = _mm256_loadu_si256(wp.add(32 * v) as *const __m256i);
                        for (row, x) in dots.iter_mut().zip(&xs) {
                            row[v] = _mm256_dpbusd_avx_epi32(row[v], w, *x);
                        }
                    }
                }
            }
            t.grids.epilogue_avx2::<MR>(g, &dots);
        }
    }
}

/// # Safety
/// The CPU supports AVX2 and F16C; `t` as [`DotTile::run`] requires, `MR` rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn avx2_madd<const MR: usize>(t: DotTile) {
    use std::arch::x86_64::*;
    unsafe {
        let low_bytes = _mm256_set1_epi16(0xFF);
        let high_bytes = _mm256_set1_epi16(0xFF00u16 as i16);
        for g in t.groups.0..t.groups.1 {
            let mut dots = [[_mm256_setzero_si256(); 4]; MR];
            let (j0, j1) = t.quads(g);
            for j in j0..j1 {
                let wp = t.w.add(j * PANEL * QUAD);
                prefetch_two_lines(wp);
                // A lane's four x̂ = 128 · h + l as 16-bit pairs: positions (0, 2) and (1, 3).
                let xs: [(__m256i, __m256i); MR] = std::array::from_fn(|i| {
                    let h = _mm256_set1_epi32(*t.x.add(WORDS * (j * MR + i)));
                    let l = _mm256_set1_epi32(*t.x.add(WORDS * (j * MR + i) + 1));
                    // (h << 8) >> 1 is 128 · h, sign kept; l < 128 is its own sign extension.
                    let even_h = _mm256_srai_epi16(_mm256_slli_epi16(h, 8), 1);
                    let odd_h = _mm256_srai_epi16(_mm256_and_si256(h, high_bytes), 1);
                    let even_l = _mm256_and_si256(l, low_bytes);
                    let odd_l = _mm256_srli_epi16(l, 8);
                    (
                        _mm256_add_epi16(even_h, even_l),
                        _mm256_add_epi16(odd_h, odd_l),
                    )
                });
                for v in 0..4 {
                    let w = _mm256_loadu_si256(wp.add(32 * v) as *const __m256i);
                    // The codes of positions (0, 2) and (1, 3), zero-extended to 16 bits.
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
            t.grids.epilogue_avx2::<MR>(g, &dots);
        }
    }
}

/// `x · Wᵀ` as the kernels compute it, in scalar code (tests): the same quantized activations,
/// integer sums and f32 epilogue.
#[cfg(test)]
pub(super) fn reference_product(
    x: &[f32],
    m: usize,
    rows: &Int8Rows,
    n: usize,
    k: usize,
) -> Vec<f32> {
    let groups = k.div_ceil(GROUP);
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for g in 0..groups {
            let p0 = g * GROUP;
            let len = GROUP.min(k - p0);
            let mut codes = [0i32; GROUP];
            let (sx, sum_x, sum_q) = super::intdot::quantize_block(
                &x[i * k + p0..][..len],
                Format::Int8.x_max(),
                &mut codes,
            );
            for j in 0..n {
                let dot: i32 = (0..len)
                    .map(|p| codes[p] * (i32::from(rows.q[j * k + p0 + p]) + 128))
                    .sum();
                let part = (dot - 128 * sum_q) as f32;
                let (s, o) = (rows.scales[j * groups + g], rows.offsets[j * groups + g]);
                let add = part * (s * sx) + sum_x * o;
                let a = &mut out[i * n + j];
                *a = if g == 0 { add } else { *a + add };
            }
        }
    }
    out
}
