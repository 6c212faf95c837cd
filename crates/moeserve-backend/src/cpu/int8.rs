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
//! panel q, group g: scales [q][g][c], offsets [q][g][c]
//! ```
//!
//! Activations: each row's group of 64 positions becomes `x ≈ x̂ · sx` with 15-bit
//! `x̂ ∈ [−16383, 16383]` (`sx = max|x| / 16383`, round half to even), split into bytes
//! `x̂ = 128 · h + l` (`h ∈ [−128, 127]`, `l ∈ [0, 127]`, both valid signed operands of
//! `vpdpbusd`). Each quad of positions is two i32 words, its four `h` and its four `l`, in the
//! tile order of the kernel ([`DotKernel::tile_rows`]); beside them the group's exact `Σx`
//! (f32) and `128 · Σx̂`. The VNNI kernels take `Σ u·x̂ = 128 · Σ u·h + Σ u·l` as two byte
//! products, two passes over the group, `h` then `l`, the sums shifted left by 7 between (the
//! second pass reads the codes from L1; one sweep with separate sums for `h` and `l` measured
//! no faster at batch 1); AVX2 rebuilds `x̂` in 16-bit lanes and runs once. A group then adds
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

use super::matmul::TiledRows;
use super::packed::PANEL;
use super::quant::{GROUP, Int8Rows};

/// Positions per 32-bit lane of the dot products.
const QUAD: usize = 4;
/// i32 words per quad of activations: its high bytes `h`, then its low bytes `l`.
const WORDS: usize = 2;
/// The largest `|x̂|`: 15 bits, so that `x̂ = 128 · h + l` with `h`, `l` signed bytes.
const X_MAX: f32 = 16383.0;
/// Quads per group: a group's integer sum is finished before its grids apply.
const QUADS_PER_GROUP: usize = GROUP / QUAD;
const _: () = assert!(GROUP.is_multiple_of(QUAD));

/// Activations (rows × positions) below which quantizing them runs on the calling thread:
/// decode's few rows are done before the pool's threads would wake.
pub(super) const SERIAL_QUANTIZE: usize = 1 << 16;

/// Groups per block when several row tiles share a panel: 4 KiB of codes stay in L1 while
/// every tile runs through them.
const BLOCK_GROUPS: usize = 2;

/// The integer dot product the int8 kernels run, chosen from the ISA and the CPU (the results
/// are the same bits on each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DotKernel {
    /// AVX-512 VNNI `vpdpbusd`, 16 lanes: 64 products per instruction (Ice Lake and later
    /// Xeons, Zen 4).
    Vnni512,
    /// AVX-VNNI `vpdpbusd`, 8 lanes (Alder Lake and later cores, Zen 5).
    AvxVnni,
    /// AVX2: codes split into even and odd bytes widened to 16 bits, two `vpmaddwd` per 16
    /// products (Zen 2/3, Haswell–Skylake).
    Avx2Madd,
}

impl std::fmt::Display for DotKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DotKernel::Vnni512 => "avx512-vnni",
            DotKernel::AvxVnni => "avx-vnni",
            DotKernel::Avx2Madd => "avx2-madd",
        })
    }
}

impl DotKernel {
    /// The fastest kernel `isa`'s CPU runs, or a narrower one named by `MOESERVE_INT8_DOT`
    /// (`avx-vnni`, `avx2-madd`; for comparisons). `None` on the scalar path (int8 needs the
    /// packed kernels).
    pub fn for_isa(isa: super::Isa) -> Option<Self> {
        let widest = match isa {
            super::Isa::Scalar => return None,
            super::Isa::Avx512 => [Self::Vnni512, Self::AvxVnni, Self::Avx2Madd],
            super::Isa::Avx2 => [Self::AvxVnni, Self::Avx2Madd, Self::Avx2Madd],
        };
        let wanted = WANTED.get_or_init(|| std::env::var("MOESERVE_INT8_DOT").ok());
        widest
            .into_iter()
            .filter(|k| k.supported())
            .find(|k| wanted.as_deref().is_none_or(|w| w == k.to_string()))
            .or_else(|| widest.into_iter().find(|k| k.supported()))
    }

    /// Whether this CPU runs the kernel.
    pub fn supported(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            match self {
                DotKernel::Vnni512 => has!("avx512f") && has!("avx512bw") && has!("avx512vnni"),
                DotKernel::AvxVnni => has!("avx2") && has!("avxvnni"),
                DotKernel::Avx2Madd => has!("avx2"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    /// Activation rows per kernel call (its register budget: 2 accumulators a row on
    /// AVX-512, 4 on AVX2, which `vpmaddwd`'s operands crowd further).
    pub fn tile_rows(self) -> usize {
        match self {
            DotKernel::Vnni512 => 12,
            DotKernel::AvxVnni => 3,
            DotKernel::Avx2Madd => 2,
        }
    }
}

static WANTED: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();

/// An int8 matrix `[n, k]` in the quad panel layout of the module note. Padding rows of the
/// last panel and positions past `k` in its last quad are `q = 0` under scale and offset 0.
#[derive(Clone)]
pub struct Int8Panels {
    n: usize,
    k: usize,
    /// `[num_panels, quads, PANEL, QUAD]`: `q + 128`.
    codes: Vec<u8>,
    /// `[num_panels, groups, PANEL]`.
    scales: Vec<f32>,
    /// `[num_panels, groups, PANEL]`.
    offsets: Vec<f32>,
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
            scales,
            offsets,
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
        self.codes.len() + (self.scales.len() + self.offsets.len()) * 4
    }

    /// The dequantised weight `(r, p)`: `q · scale + offset`.
    pub fn value(&self, r: usize, p: usize) -> f32 {
        assert!(r < self.n && p < self.k);
        let (quads, groups) = (self.k.div_ceil(QUAD), self.k.div_ceil(GROUP));
        let (q, c) = (r / PANEL, r % PANEL);
        let code = self.codes[((q * quads + p / QUAD) * PANEL + c) * QUAD + p % QUAD];
        let g = (q * groups + p / GROUP) * PANEL + c;
        f32::from((code ^ 0x80) as i8) * self.scales[g] + self.offsets[g]
    }

    /// Panel `q` of `x · Wᵀ` into `acc: [m, PANEL]`: one tile of rows runs the whole panel in
    /// one call; more tiles share each block of [`BLOCK_GROUPS`] groups while it is in L1.
    #[cfg(target_arch = "x86_64")]
    pub(super) fn panel_product(
        &self,
        kernel: DotKernel,
        x: QuantizedRows<'_>,
        q: usize,
        acc: &mut [f32],
    ) {
        debug_assert!(
            x.k == self.k
                && x.kernel == kernel
                && acc.len() == x.m * PANEL
                && q < self.num_panels()
        );
        let (quads, groups) = (self.k.div_ceil(QUAD), self.k.div_ceil(GROUP));
        let step = if x.m <= kernel.tile_rows() {
            groups
        } else {
            BLOCK_GROUPS
        };
        for g0 in (0..groups).step_by(step) {
            for (i0, mr) in super::matmul::row_tiles(x.m, kernel.tile_rows()) {
                let t = DotTile {
                    x: x.words[i0 * quads * WORDS..].as_ptr(),
                    stride: mr,
                    w: self.codes[q * quads * PANEL * QUAD..].as_ptr(),
                    k: self.k,
                    groups: (g0, (g0 + step).min(groups)),
                    num_groups: groups,
                    sx: x.scales[i0 * groups..].as_ptr(),
                    sum_x: x.sums[i0 * groups..].as_ptr(),
                    correction: x.corrections[i0 * groups..].as_ptr(),
                    scales: self.scales[q * groups * PANEL..].as_ptr(),
                    offsets: self.offsets[q * groups * PANEL..].as_ptr(),
                    acc: acc[i0 * PANEL..(i0 + mr) * PANEL].as_mut_ptr(),
                };
                // SAFETY: `kernel` was chosen for this CPU (`DotKernel::for_isa`); the tile's
                // quads, metadata, the panel's codes and grids and `acc` cover what `DotTile`
                // describes for mr rows.
                unsafe { t.run(kernel, mr) };
            }
        }
    }
}

/// Activation rows quantized for the int8 kernels, owned: a product's, or (the grouped
/// SwiGLU) every expert's, each expert's rows a consecutive block (see [`QuantizedRows`]).
/// Reused across steps, so they allocate nothing once they have held as many.
#[derive(Default)]
pub struct Int8Activations {
    /// Two i32 words per quad (four positions' `h`, then their `l`), in each block's tile
    /// order.
    words: Vec<i32>,
    /// `[rows, groups]`: `sx`.
    scales: Vec<f32>,
    /// `[rows, groups]`: `Σx`.
    sums: Vec<f32>,
    /// `[rows, groups]`: `128 · Σx̂`.
    corrections: Vec<i32>,
}

/// A block of `m` quantized rows of `k` positions: tile `(i0, mr)` of the kernel's
/// [`DotKernel::tile_rows`] holds row `i0 + i`'s quad `j` at words
/// `WORDS · (i0 · quads + j · mr + i) + {0: h, 1: l}`; the metadata is row-major `[m, groups]`.
#[derive(Clone, Copy)]
pub(super) struct QuantizedRows<'a> {
    words: &'a [i32],
    scales: &'a [f32],
    sums: &'a [f32],
    corrections: &'a [i32],
    pub m: usize,
    pub k: usize,
    kernel: DotKernel,
}

/// Where one row's quantized groups go: its first quad's words (the next quad's `stride`
/// words on) and its metadata.
#[derive(Clone, Copy)]
struct RowOut {
    words: *mut i32,
    stride: usize,
    meta: usize,
}

/// Raw pointers to an [`Int8Activations`]' buffers, shared by tasks that write disjoint rows.
#[derive(Clone, Copy)]
pub(super) struct ActivationsOut {
    words: *mut i32,
    scales: *mut f32,
    sums: *mut f32,
    corrections: *mut i32,
}
// SAFETY: tasks write disjoint rows (distinct quads and metadata elements).
unsafe impl Send for ActivationsOut {}
unsafe impl Sync for ActivationsOut {}

impl Int8Activations {
    /// Room for `rows_words` words and `rows_groups` (row, group) entries in all (as
    /// [`quantized_len`] counts them); the buffers keep their contents' capacity.
    pub(super) fn prepare(&mut self, rows_words: usize, rows_groups: usize) -> ActivationsOut {
        self.words.resize(rows_words, 0);
        self.scales.resize(rows_groups, 0.0);
        self.sums.resize(rows_groups, 0.0);
        self.corrections.resize(rows_groups, 0);
        ActivationsOut {
            words: self.words.as_mut_ptr(),
            scales: self.scales.as_mut_ptr(),
            sums: self.sums.as_mut_ptr(),
            corrections: self.corrections.as_mut_ptr(),
        }
    }

    /// `x` quantized for `kernel` into these buffers (all its rows, in parallel when large).
    pub(super) fn quantize(&mut self, kernel: DotKernel, x: TiledRows<'_>) -> QuantizedRows<'_> {
        let (words, groups) = quantized_len(x.m, x.k);
        let out = self.prepare(words, groups);
        let row = |i| {
            // SAFETY: the buffers hold m rows; each row is written by one call.
            unsafe { out.quantize_row(kernel, x, i, (0, 0)) }
        };
        if x.m * x.k < SERIAL_QUANTIZE {
            (0..x.m).for_each(row);
        } else {
            use rayon::prelude::*;
            (0..x.m).into_par_iter().for_each(row);
        }
        self.rows(kernel, (0, 0), x.m, x.k)
    }

    /// The block of `m` rows of `k` positions at offsets `(words, metadata entries)`.
    pub(super) fn rows(
        &self,
        kernel: DotKernel,
        (word0, meta0): (usize, usize),
        m: usize,
        k: usize,
    ) -> QuantizedRows<'_> {
        let (words, groups) = quantized_len(m, k);
        QuantizedRows {
            words: &self.words[word0..word0 + words],
            scales: &self.scales[meta0..meta0 + groups],
            sums: &self.sums[meta0..meta0 + groups],
            corrections: &self.corrections[meta0..meta0 + groups],
            m,
            k,
            kernel,
        }
    }
}

/// Words and (row, group) entries of `m` quantized rows of `k` positions.
pub(super) fn quantized_len(m: usize, k: usize) -> (usize, usize) {
    (m * k.div_ceil(QUAD) * WORDS, m * k.div_ceil(GROUP))
}

impl ActivationsOut {
    /// Quantizes row `i` of `x` into the block at offsets `(words, metadata entries)`.
    ///
    /// # Safety
    /// The block of `x.m` rows lies inside the buffers, and no other thread writes row `i`
    /// of it.
    pub(super) unsafe fn quantize_row(
        self,
        kernel: DotKernel,
        x: TiledRows<'_>,
        i: usize,
        (word0, meta0): (usize, usize),
    ) {
        let (quads, groups) = (x.k.div_ceil(QUAD), x.k.div_ceil(GROUP));
        let (i0, mr) = super::matmul::tile_of(x.m, kernel.tile_rows(), i);
        let out = RowOut {
            // SAFETY: inside the block (caller).
            words: unsafe { self.words.add(word0 + WORDS * (i0 * quads + i - i0)) },
            stride: WORDS * mr,
            meta: meta0 + i * groups,
        };
        let (row, step) = x.row(i);
        let mut values = [0.0f32; GROUP];
        for g in 0..groups {
            let p0 = g * GROUP;
            let len = GROUP.min(x.k - p0);
            if step == 1 {
                values[..len].copy_from_slice(&row[p0..p0 + len]);
            } else {
                for (p, v) in values[..len].iter_mut().enumerate() {
                    *v = row[(p0 + p) * step];
                }
            }
            values[len..].fill(0.0);
            let mut codes = [0i16; GROUP];
            // SAFETY: the int8 kernels run on AVX2 CPUs alone (`DotKernel::supported`).
            let (scale, sum, sum_q) = unsafe { quantize_group_avx2(&values, &mut codes) };
            // SAFETY: the row's entries and words are inside the block (caller).
            unsafe {
                *self.scales.add(out.meta + g) = scale;
                *self.sums.add(out.meta + g) = sum;
                *self.corrections.add(out.meta + g) = 128 * sum_q;
                for j in 0..len.div_ceil(QUAD) {
                    let x = |t: usize| codes[j * QUAD + t];
                    let high = |t| (x(t) >> 7) as u8;
                    let low = |t| (x(t) & 127) as u8;
                    let w = out.words.add((g * QUADS_PER_GROUP + j) * out.stride);
                    *w = i32::from_le_bytes([high(0), high(1), high(2), high(3)]);
                    *w.add(1) = i32::from_le_bytes([low(0), low(1), low(2), low(3)]);
                }
            }
        }
    }
}

/// One group of a row: `x̂` into `codes` (zero past `values`), and `(sx, Σx, Σx̂)`, the
/// definition [`quantize_group_avx2`] computes: `Σx` adds eight interleaved partial sums (lane
/// `t` takes positions `t, t + 8, …` in order) combined pairwise, as eight-lane vectors do.
#[cfg_attr(not(test), allow(dead_code))]
fn quantize_group(values: &[f32], codes: &mut [i16; GROUP]) -> (f32, f32, i32) {
    let amax = values.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let mut lanes = [0.0f32; 8];
    for chunk in values.chunks(8) {
        for (l, v) in lanes.iter_mut().zip(chunk) {
            *l += v;
        }
    }
    let [a, b, c, d, e, f, g, h] = lanes;
    let sum = ((a + b) + (c + d)) + ((e + f) + (g + h));
    if amax == 0.0 || !amax.is_finite() {
        // All zero (or not a number to scale): the offsets' term alone carries the group.
        codes.fill(0);
        return (0.0, sum, 0);
    }
    let inv = X_MAX / amax;
    let mut sum_q = 0i32;
    for (q, v) in codes.iter_mut().zip(values) {
        *q = (v * inv).round_ties_even().clamp(-X_MAX, X_MAX) as i16;
        sum_q += i32::from(*q);
    }
    codes[values.len()..].fill(0);
    (amax / X_MAX, sum, sum_q)
}

/// [`quantize_group`] on a whole group (`values` zero past the row's end), in AVX2: the same
/// operations in the same order, so the same bits for finite values (`vcvtps2dq` rounds half
/// to even, as `round_ties_even`; lanes never hold −0, so adding the padding's +0 changes
/// nothing). A NaN makes `Σx`, and so the group's outputs, NaN either way.
///
/// # Safety
/// The CPU supports AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_group_avx2(values: &[f32; GROUP], codes: &mut [i16; GROUP]) -> (f32, f32, i32) {
    use std::arch::x86_64::*;
    const LANES: usize = 8;
    let v: [__m256; GROUP / LANES] =
        // SAFETY: chunk c holds values 8c .. 8c + 8.
        std::array::from_fn(|c| unsafe { _mm256_loadu_ps(values.as_ptr().add(LANES * c)) });
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
    let (mut amax, mut sum) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    for c in v {
        amax = _mm256_max_ps(amax, _mm256_and_ps(c, abs_mask));
        sum = _mm256_add_ps(sum, c);
    }
    let mut lanes = [0.0f32; LANES];
    // SAFETY: 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), amax) };
    let amax = lanes.iter().fold(0.0f32, |a, l| a.max(*l));
    // SAFETY: 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), sum) };
    let [a, b, c, d, e, f, g, h] = lanes;
    let sum = ((a + b) + (c + d)) + ((e + f) + (g + h));
    if amax == 0.0 || !amax.is_finite() {
        codes.fill(0);
        return (0.0, sum, 0);
    }
    let inv = _mm256_set1_ps(X_MAX / amax);
    let (lo, hi) = (
        _mm256_set1_epi32(-(X_MAX as i32)),
        _mm256_set1_epi32(X_MAX as i32),
    );
    let mut sum_q = _mm256_setzero_si256();
    let mut q = [0i32; GROUP];
    for (c, x) in v.into_iter().enumerate() {
        let r = _mm256_cvtps_epi32(_mm256_mul_ps(x, inv));
        let r = _mm256_min_epi32(_mm256_max_epi32(r, lo), hi);
        sum_q = _mm256_add_epi32(sum_q, r);
        // SAFETY: 8 i32 at 8c.
        unsafe { _mm256_storeu_si256(q.as_mut_ptr().add(LANES * c) as *mut __m256i, r) };
    }
    for (code, r) in codes.iter_mut().zip(q) {
        *code = r as i16;
    }
    let mut parts = [0i32; LANES];
    // SAFETY: 8 i32.
    unsafe { _mm256_storeu_si256(parts.as_mut_ptr() as *mut __m256i, sum_q) };
    (amax / X_MAX, sum, parts.iter().sum())
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
    /// Metadata entries per row.
    num_groups: usize,
    /// The tile's first row's metadata (rows `num_groups` apart).
    sx: *const f32,
    sum_x: *const f32,
    correction: *const i32,
    /// The panel's grids, `[groups, PANEL]`.
    scales: *const f32,
    offsets: *const f32,
    /// `stride × PANEL` sums.
    acc: *mut f32,
}

#[cfg(target_arch = "x86_64")]
impl DotTile {
    /// # Safety
    /// `kernel` runs on this CPU; the pointers cover what [`DotTile`] says; `mr == stride ≤
    /// kernel.tile_rows()`.
    unsafe fn run(self, kernel: DotKernel, mr: usize) {
        debug_assert!(mr == self.stride && mr <= kernel.tile_rows());
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
                DotKernel::Vnni512 => rows!(vnni512, 1 2 3 4 5 6 7 8 9 10 11 12),
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

/// Prefetches the codes [`super::avx512::PREFETCH_BYTES`] ahead of a quad (128 bytes, two
/// lines).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_quad(wp: *const u8) {
    use std::arch::x86_64::{_MM_HINT_T2, _mm_prefetch};
    let ahead = wp.wrapping_add(super::avx512::PREFETCH_BYTES);
    // SAFETY: a prefetch of any address is harmless (it never faults).
    unsafe {
        _mm_prefetch::<_MM_HINT_T2>(ahead as *const i8);
        _mm_prefetch::<_MM_HINT_T2>(ahead.wrapping_add(64) as *const i8);
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
                        prefetch_quad(wp);
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
            let s = t.scales.add(g * PANEL);
            let o = t.offsets.add(g * PANEL);
            let (s, o) = ([s, s.add(16)], [o, o.add(16)]);
            for i in 0..MR {
                let meta = i * t.num_groups + g;
                let correction = _mm512_set1_epi32(*t.correction.add(meta));
                let sx = _mm512_set1_ps(*t.sx.add(meta));
                let sum_x = _mm512_set1_ps(*t.sum_x.add(meta));
                for (h, dot) in [lo[i], hi[i]].into_iter().enumerate() {
                    let part = _mm512_cvtepi32_ps(_mm512_sub_epi32(dot, correction));
                    let scale = _mm512_mul_ps(_mm512_loadu_ps(s[h]), sx);
                    let offset = _mm512_mul_ps(sum_x, _mm512_loadu_ps(o[h]));
                    let add = _mm512_add_ps(_mm512_mul_ps(part, scale), offset);
                    let a = t.acc.add(i * PANEL + 16 * h);
                    let sum = if g == 0 {
                        add
                    } else {
                        _mm512_add_ps(_mm512_loadu_ps(a), add)
                    };
                    _mm512_storeu_ps(a, sum);
                }
            }
        }
    }
}

/// The f32 epilogue of one group for 8 outputs on AVX2 (the AVX-512 one's operations).
///
/// # Safety
/// The CPU supports AVX2; `s`, `o` and `a` point at 8 elements.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn epilogue8(
    dot: std::arch::x86_64::__m256i,
    (correction, sx, sum_x): (i32, f32, f32),
    (s, o): (*const f32, *const f32),
    a: *mut f32,
    first: bool,
) {
    use std::arch::x86_64::*;
    unsafe {
        let part = _mm256_cvtepi32_ps(_mm256_sub_epi32(dot, _mm256_set1_epi32(correction)));
        let scale = _mm256_mul_ps(_mm256_loadu_ps(s), _mm256_set1_ps(sx));
        let offset = _mm256_mul_ps(_mm256_set1_ps(sum_x), _mm256_loadu_ps(o));
        let add = _mm256_add_ps(_mm256_mul_ps(part, scale), offset);
        let sum = if first {
            add
        } else {
            _mm256_add_ps(_mm256_loadu_ps(a), add)
        };
        _mm256_storeu_ps(a, sum);
    }
}

/// The epilogue of group `g` for every row of an AVX2 tile (`dots[i][v]`: row `i`, outputs
/// `8v .. 8v + 8`).
///
/// # Safety
/// As [`DotTile::run`]; the CPU supports AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn epilogue_avx2<const MR: usize>(
    t: &DotTile,
    g: usize,
    dots: &[[std::arch::x86_64::__m256i; 4]; MR],
) {
    unsafe {
        for (i, row) in dots.iter().enumerate() {
            let meta = i * t.num_groups + g;
            let row_meta = (*t.correction.add(meta), *t.sx.add(meta), *t.sum_x.add(meta));
            for (v, dot) in row.iter().enumerate() {
                let grids = (
                    t.scales.add(g * PANEL + 8 * v),
                    t.offsets.add(g * PANEL + 8 * v),
                );
                epilogue8(*dot, row_meta, grids, t.acc.add(i * PANEL + 8 * v), g == 0);
            }
        }
    }
}

/// # Safety
/// The CPU supports AVX2 and AVX-VNNI; `t` as [`DotTile::run`] requires, `MR` rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avxvnni")]
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
                        prefetch_quad(wp);
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
            epilogue_avx2::<MR>(&t, g, &dots);
        }
    }
}

/// # Safety
/// The CPU supports AVX2; `t` as [`DotTile::run`] requires, `MR` rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
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
                prefetch_quad(wp);
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
            epilogue_avx2::<MR>(&t, g, &dots);
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
            let mut codes = [0i16; GROUP];
            let (sx, sum_x, sum_q) = quantize_group(&x[i * k + p0..][..len], &mut codes);
            for j in 0..n {
                let dot: i32 = (0..len)
                    .map(|p| i32::from(codes[p]) * (i32::from(rows.q[j * k + p0 + p]) + 128))
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

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    #[test]
    fn the_avx2_quantizer_is_the_definition_bit_for_bit() {
        if !DotKernel::Avx2Madd.supported() {
            return;
        }
        let mut seed = 7u32;
        let mut next = || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (seed >> 8) as f32 / (1 << 24) as f32 - 0.5
        };
        for len in [1, 5, 8, 13, 63, 64] {
            for scale in [0.0, 1e-30, 1.0, 300.0] {
                let mut values = [0.0f32; GROUP];
                values[..len].iter_mut().for_each(|v| *v = next() * scale);
                // Ties: with max |x| = 16383 the grid's step is 1, so halves round to even.
                if len > 4 && scale > 0.0 {
                    values[..4].copy_from_slice(&[X_MAX, 0.5, -1.5, 2.5]);
                }
                let (mut want, mut got) = ([0i16; GROUP], [0i16; GROUP]);
                let w = quantize_group(&values[..len], &mut want);
                // SAFETY: AVX2 checked above.
                let g = unsafe { quantize_group_avx2(&values, &mut got) };
                assert_eq!(
                    (w.0.to_bits(), w.1.to_bits(), w.2),
                    (g.0.to_bits(), g.1.to_bits(), g.2),
                    "len {len}, scale {scale}"
                );
                assert_eq!(want, got, "len {len}, scale {scale}");
                if len > 4 && scale > 0.0 {
                    assert_eq!(&got[..4], &[16383, 0, -2, 2], "ties round to even");
                }
            }
        }
    }
}
