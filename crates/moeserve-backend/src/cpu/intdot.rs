//! What the integer weight kernels (int8, `int8.rs`; int4, `int4.rs`) share: the choice of
//! dot-product instructions for this CPU, and the activations quantized per row and block of
//! positions at run time.
//!
//! A row's block of positions becomes `x ≈ x̂ · sx` (`sx = max|x| / X_MAX`, round half to even),
//! split into bytes, each an operand of a byte dot product. Each quad of four positions (one
//! 32-bit lane of the products) is one i32 word per byte of `x̂` (its four positions' high
//! bytes, then the next), in the tile order of the kernel ([`DotKernel::tile_rows`]); beside
//! them the block's exact `Σx` (f32, for the weights' offsets) and `128 · Σx̂` (int8's
//! correction). The weights' format sets the grid ([`Format`]):
//!
//! - int8 codes are unsigned bytes (`q + 128`), so both activation bytes must be signed:
//!   15-bit `x̂ ∈ [−16383, 16383]`, `x̂ = 128 · h + l`, blocks of 64;
//! - int4 codes (`0..16`) are valid as signed bytes too, so the lower bytes may be unsigned
//!   and take the codes as signed: 23-bit `x̂ ∈ [−(2^22 − 1), 2^22 − 1]`,
//!   `x̂ = 2^16 · h + 2^8 · m + l` (`h` signed, `m` and `l` unsigned), blocks of 32 (GPTQ's
//!   smallest group; `32 · 15 · 2^22 < 2^31`, so a block's sum is exact in i32). 16 bits
//!   were not enough: the GPTQ fixture's logprobs moved by 4e-4 from transformers' on the
//!   dequantised weights; 23 bits put the rounding at f32's own.
//!
//! A weight may read its positions in another order (GPTQ's act-order groups made
//! consecutive, groups padded to whole blocks): the quantizer then gathers each row through
//! the weight's order, a padding slot reading 0.

#[cfg(target_arch = "x86_64")]
use super::grids::{Grid, ZERO_GRID_BYTES};
use super::matmul::TiledRows;
#[cfg(target_arch = "x86_64")]
use super::packed::PANEL;

/// Positions per 32-bit lane of the dot products.
pub(super) const QUAD: usize = 4;
/// The most positions in a block.
const MAX_BLOCK: usize = 64;

/// Activations (rows × positions) below which quantizing them runs on the calling thread:
/// decode's few rows are done before the pool's threads would wake.
pub(super) const SERIAL_QUANTIZE: usize = 1 << 16;

/// A slot of a weight's order that reads no position (padding to a whole block).
pub const PADDING: u32 = u32::MAX;

/// The activations' grid, set by the weights they multiply (see the module note).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// For int8 codes: 15 bits in two bytes, blocks of 64.
    Int8,
    /// For int4 codes: 23 bits in three bytes, blocks of 32.
    Int4,
}

impl Format {
    /// Positions per block (one `sx`, `Σx` and integer sum).
    pub const fn block(self) -> usize {
        match self {
            Format::Int8 => super::quant::GROUP,
            Format::Int4 => 32,
        }
    }

    /// The largest `|x̂|`.
    pub const fn x_max(self) -> f32 {
        match self {
            Format::Int8 => 16383.0,
            Format::Int4 => 4194303.0,
        }
    }

    /// i32 words per quad: one per byte of `x̂`.
    pub const fn words(self) -> usize {
        match self {
            Format::Int8 => 2,
            Format::Int4 => 3,
        }
    }

    /// `x̂`'s bytes, highest first (the unused last one 0).
    fn split(self, x: i32) -> [u8; 3] {
        match self {
            Format::Int8 => [(x >> 7) as u8, (x & 127) as u8, 0],
            Format::Int4 => [(x >> 16) as u8, (x >> 8) as u8, x as u8],
        }
    }
}
const _: () = assert!(Format::Int8.block() <= MAX_BLOCK && Format::Int4.block() <= MAX_BLOCK);
const _: () =
    assert!(Format::Int8.block().is_multiple_of(8) && Format::Int4.block().is_multiple_of(8));

/// The integer dot product the integer kernels run, chosen from the ISA and the CPU (the
/// results are the same bits on each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DotKernel {
    /// AVX-512 VNNI `vpdpbusd`, 16 lanes: 64 products per instruction (Ice Lake and later
    /// Xeons, Zen 4).
    Vnni512,
    /// AVX-VNNI `vpdpbusd`, 8 lanes (Alder Lake and later cores, Zen 5).
    AvxVnni,
    /// AVX2: codes widened to 16 bits, `vpmaddwd` on 16-bit pairs (Zen 2/3,
    /// Haswell–Skylake).
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
    /// (`avx-vnni`, `avx2-madd`; for comparisons). `None` on the scalar path (the integer
    /// kernels need the packed ones).
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
                DotKernel::AvxVnni => has!("avx2") && has!("avxvnni") && has!("f16c"),
                DotKernel::Avx2Madd => has!("avx2") && has!("f16c"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    /// Activation rows per kernel call for weights of `format` (its register budget: 2
    /// accumulators a row on AVX-512, 4 on AVX2, which `vpmaddwd`'s operands crowd further).
    /// AVX-VNNI's int4 tiles hold 2 rows: 3 rows' 12 sums, 3 broadcast words and a vector
    /// of codes take all of AVX2's 16 registers, and int4 prefill ran 15 % slower with them
    /// (Sapphire Rapids, `MOESERVE_ISA=avx2`); int8's 3-row tiles measured 2–5 % faster than
    /// 2-row ones there.
    pub fn tile_rows(self, format: Format) -> usize {
        match (self, format) {
            (DotKernel::Vnni512, _) => 12,
            (DotKernel::AvxVnni, Format::Int8) => 3,
            (DotKernel::AvxVnni, Format::Int4) => 2,
            (DotKernel::Avx2Madd, _) => 2,
        }
    }
}

static WANTED: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();

/// Activation rows quantized for the integer kernels, owned: a product's, or (the grouped
/// SwiGLU) every expert's, each expert's rows a consecutive block (see [`QuantizedRows`]).
/// Reused across steps, so they allocate nothing once they have held as many.
#[derive(Default)]
pub struct IntActivations {
    /// [`Format::words`] i32 words per quad (four positions' high bytes, then the next), in
    /// each block's tile order.
    words: Vec<i32>,
    /// `[rows, blocks]`: `sx`.
    scales: Vec<f32>,
    /// `[rows, blocks]`: `Σx`.
    sums: Vec<f32>,
    /// `[rows, blocks]`: `128 · Σx̂` (int8's codes are `q + 128`).
    corrections: Vec<i32>,
}

/// A block of `m` quantized rows of `k` positions (in the weight's order): tile `(i0, mr)` of
/// the kernel's [`DotKernel::tile_rows`] holds row `i0 + i`'s quad `j` at words
/// `words · (i0 · quads + j · mr + i) + byte` (`words` = [`Format::words`], bytes highest
/// first); the metadata is row-major `[m, blocks]`.
#[derive(Clone, Copy)]
pub(super) struct QuantizedRows<'a> {
    pub words: &'a [i32],
    pub scales: &'a [f32],
    pub sums: &'a [f32],
    pub corrections: &'a [i32],
    pub m: usize,
    pub k: usize,
    pub kernel: DotKernel,
    pub format: Format,
}

/// Where one row's quantized blocks go: its first quad's words (the next quad's `stride`
/// words on) and its metadata.
#[derive(Clone, Copy)]
struct RowOut {
    words: *mut i32,
    stride: usize,
    meta: usize,
}

/// Raw pointers to an [`IntActivations`]' buffers, shared by tasks that write disjoint rows.
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

/// How a product reads its activations: for which kernel and grid, and through which order
/// of positions (`None`: positions `0..k` as they are).
#[derive(Clone, Copy)]
pub(super) struct Quantizer<'a> {
    pub kernel: DotKernel,
    pub format: Format,
    pub order: Option<&'a [u32]>,
}

impl Quantizer<'_> {
    /// Positions of a quantized row of `k` activations.
    pub fn len(&self, k: usize) -> usize {
        self.order.map_or(k, <[u32]>::len)
    }

    /// Whether both quantize the same rows alike (an expert's gate and up projections under
    /// GPTQ's act-order share their order, as both come from one input's Hessian; int4 keeps
    /// equal orders as one allocation, so the pointers tell).
    pub fn same_as(&self, other: &Quantizer<'_>) -> bool {
        self.kernel == other.kernel
            && self.format == other.format
            && match (self.order, other.order) {
                (None, None) => true,
                (Some(a), Some(b)) => std::ptr::eq(a, b),
                _ => false,
            }
    }
}

impl IntActivations {
    /// Room for `rows_words` words and `rows_blocks` (row, block) entries in all (as
    /// [`quantized_len`] counts them); the buffers keep their contents' capacity.
    pub(super) fn prepare(&mut self, rows_words: usize, rows_blocks: usize) -> ActivationsOut {
        self.words.resize(rows_words, 0);
        self.scales.resize(rows_blocks, 0.0);
        self.sums.resize(rows_blocks, 0.0);
        self.corrections.resize(rows_blocks, 0);
        ActivationsOut {
            words: self.words.as_mut_ptr(),
            scales: self.scales.as_mut_ptr(),
            sums: self.sums.as_mut_ptr(),
            corrections: self.corrections.as_mut_ptr(),
        }
    }

    /// `x` quantized by `how` into these buffers (all its rows, in parallel when large).
    pub(super) fn quantize(&mut self, how: Quantizer<'_>, x: TiledRows<'_>) -> QuantizedRows<'_> {
        let k = how.len(x.k);
        let (words, blocks) = quantized_len(how.format, x.m, k);
        let out = self.prepare(words, blocks);
        let row = |i| {
            // SAFETY: the buffers hold m rows; each row is written by one call.
            unsafe { out.quantize_row(how, x, i, (0, 0)) }
        };
        if x.m * x.k < SERIAL_QUANTIZE {
            (0..x.m).for_each(row);
        } else {
            use rayon::prelude::*;
            (0..x.m).into_par_iter().for_each(row);
        }
        self.rows(how.kernel, how.format, (0, 0), x.m, k)
    }

    /// The block of `m` rows of `k` positions (in the weight's order) at offsets
    /// `(words, metadata entries)`.
    pub(super) fn rows(
        &self,
        kernel: DotKernel,
        format: Format,
        (word0, meta0): (usize, usize),
        m: usize,
        k: usize,
    ) -> QuantizedRows<'_> {
        let (words, blocks) = quantized_len(format, m, k);
        QuantizedRows {
            words: &self.words[word0..word0 + words],
            scales: &self.scales[meta0..meta0 + blocks],
            sums: &self.sums[meta0..meta0 + blocks],
            corrections: &self.corrections[meta0..meta0 + blocks],
            m,
            k,
            kernel,
            format,
        }
    }
}

/// Words and (row, block) entries of `m` quantized rows of `k` positions.
pub(super) fn quantized_len(format: Format, m: usize, k: usize) -> (usize, usize) {
    (
        m * k.div_ceil(QUAD) * format.words(),
        m * k.div_ceil(format.block()),
    )
}

impl ActivationsOut {
    /// Quantizes row `i` of `x` by `how` into the block at offsets `(words, metadata
    /// entries)`.
    ///
    /// # Safety
    /// The block of `x.m` rows lies inside the buffers, and no other thread writes row `i`
    /// of it.
    pub(super) unsafe fn quantize_row(
        self,
        how: Quantizer<'_>,
        x: TiledRows<'_>,
        i: usize,
        (word0, meta0): (usize, usize),
    ) {
        let (format, block) = (how.format, how.format.block());
        let k = how.len(x.k);
        let (quads, blocks) = (k.div_ceil(QUAD), k.div_ceil(block));
        let (i0, mr) = super::matmul::tile_of(x.m, how.kernel.tile_rows(how.format), i);
        let words = format.words();
        let out = RowOut {
            // SAFETY: inside the block (caller).
            words: unsafe { self.words.add(word0 + words * (i0 * quads + i - i0)) },
            stride: words * mr,
            meta: meta0 + i * blocks,
        };
        let (row, step) = x.row(i);
        let mut values = [0.0f32; MAX_BLOCK];
        for b in 0..blocks {
            let p0 = b * block;
            let len = block.min(k - p0);
            match how.order {
                None if step == 1 => values[..len].copy_from_slice(&row[p0..p0 + len]),
                None => {
                    for (p, v) in values[..len].iter_mut().enumerate() {
                        *v = row[(p0 + p) * step];
                    }
                }
                Some(order) => {
                    for (v, &src) in values[..len].iter_mut().zip(&order[p0..p0 + len]) {
                        *v = if src == PADDING {
                            0.0
                        } else {
                            row[src as usize * step]
                        };
                    }
                }
            }
            values[len..block].fill(0.0);
            let mut codes = [0i32; MAX_BLOCK];
            // SAFETY: the integer kernels run on AVX2 CPUs alone (`DotKernel::supported`).
            let (scale, sum, sum_q) =
                unsafe { quantize_block_avx2(&values[..block], format.x_max(), &mut codes) };
            // SAFETY: the row's entries and words are inside the block (caller).
            unsafe {
                *self.scales.add(out.meta + b) = scale;
                *self.sums.add(out.meta + b) = sum;
                *self.corrections.add(out.meta + b) = match format {
                    Format::Int8 => 128 * sum_q,
                    Format::Int4 => 0,
                };
                for j in 0..len.div_ceil(QUAD) {
                    let bytes = [0, 1, 2, 3].map(|t| format.split(codes[j * QUAD + t]));
                    let w = out.words.add((b * block / QUAD + j) * out.stride);
                    for byte in 0..words {
                        *w.add(byte) = i32::from_le_bytes(bytes.map(|x| x[byte]));
                    }
                }
            }
        }
    }
}

/// One block of a row: `x̂` into `codes` (zero past `values`), and `(sx, Σx, Σx̂)`, the
/// definition [`quantize_block_avx2`] computes: `Σx` adds eight interleaved partial sums (lane
/// `t` takes positions `t, t + 8, …` in order) combined pairwise, as eight-lane vectors do.
#[cfg_attr(not(test), allow(dead_code))]
pub(super) fn quantize_block(values: &[f32], x_max: f32, codes: &mut [i32]) -> (f32, f32, i32) {
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
        // All zero (or not a number to scale): the offsets' term alone carries the block.
        codes.fill(0);
        return (0.0, sum, 0);
    }
    let inv = x_max / amax;
    let mut sum_q = 0i32;
    for (q, v) in codes.iter_mut().zip(values) {
        *q = (v * inv).round_ties_even().clamp(-x_max, x_max) as i32;
        sum_q = sum_q.wrapping_add(*q);
    }
    codes[values.len()..].fill(0);
    (amax / x_max, sum, sum_q)
}

/// [`quantize_block`] on a whole block (`values`: a multiple of 8 long, at most 64, zero past
/// the row's end), in AVX2: the same operations in the same order, so the same bits for
/// finite values (`vcvtps2dq` rounds half to even, as `round_ties_even`; lanes never hold −0,
/// so adding the padding's +0 changes nothing). A NaN makes `Σx`, and so the block's outputs,
/// NaN either way.
///
/// # Safety
/// The CPU supports AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_block_avx2(values: &[f32], x_max: f32, codes: &mut [i32]) -> (f32, f32, i32) {
    use std::arch::x86_64::*;
    const LANES: usize = 8;
    assert!(values.len().is_multiple_of(LANES) && values.len() <= MAX_BLOCK);
    let chunks = values.len() / LANES;
    let mut v = [_mm256_setzero_ps(); MAX_BLOCK / LANES];
    for (c, chunk) in v[..chunks].iter_mut().enumerate() {
        // SAFETY: chunk c holds values 8c .. 8c + 8.
        *chunk = unsafe { _mm256_loadu_ps(values.as_ptr().add(LANES * c)) };
    }
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
    let (mut amax, mut sum) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    for c in &v[..chunks] {
        amax = _mm256_max_ps(amax, _mm256_and_ps(*c, abs_mask));
        sum = _mm256_add_ps(sum, *c);
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
    let inv = _mm256_set1_ps(x_max / amax);
    let (lo, hi) = (
        _mm256_set1_epi32(-(x_max as i32)),
        _mm256_set1_epi32(x_max as i32),
    );
    let mut sum_q = _mm256_setzero_si256();
    assert!(codes.len() >= values.len());
    for (c, x) in v[..chunks].iter().enumerate() {
        let r = _mm256_cvtps_epi32(_mm256_mul_ps(*x, inv));
        let r = _mm256_min_epi32(_mm256_max_epi32(r, lo), hi);
        sum_q = _mm256_add_epi32(sum_q, r);
        // SAFETY: 8 i32 at 8c, inside `codes` (asserted).
        unsafe { _mm256_storeu_si256(codes.as_mut_ptr().add(LANES * c) as *mut __m256i, r) };
    }
    let mut parts = [0i32; LANES];
    // SAFETY: 8 i32.
    unsafe { _mm256_storeu_si256(parts.as_mut_ptr() as *mut __m256i, sum_q) };
    let sum_q = parts.iter().fold(0i32, |a, p| a.wrapping_add(*p));
    (amax / x_max, sum, sum_q)
}

/// Prefetches the codes [`super::avx512::PREFETCH_BYTES`] ahead of `wp` (two lines).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn prefetch_two_lines(wp: *const u8) {
    use std::arch::x86_64::{_MM_HINT_T2, _mm_prefetch};
    let ahead = wp.wrapping_add(super::avx512::PREFETCH_BYTES);
    // SAFETY: a prefetch of any address is harmless (it never faults).
    unsafe {
        _mm_prefetch::<_MM_HINT_T2>(ahead as *const i8);
        _mm_prefetch::<_MM_HINT_T2>(ahead.wrapping_add(64) as *const i8);
    }
}

/// What the integer kernels' epilogues read for one tile of rows against one panel: the rows'
/// block metadata and the panel's grids.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(super) struct TileGrids {
    /// Metadata entries (blocks) per row.
    pub num_blocks: usize,
    /// The tile's first row's `sx`, `Σx` and int8's `128 · Σx̂` (rows `num_blocks` apart);
    /// `correction` null where the codes need none (int4's are unsigned).
    pub sx: *const f32,
    pub sum_x: *const f32,
    pub correction: *const i32,
    /// The group of each block, or null where blocks are the groups (int8).
    pub block_group: *const u32,
    /// The panel's grids.
    pub grid: Grid,
    /// `rows × PANEL` sums, written at block 0 and added to after.
    pub acc: *mut f32,
}

/// One group's grids for outputs `c0..`: f32 scales and offsets, or f16 scales and zero
/// points.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
enum GridAt {
    Float(*const f32, *const f32),
    F16Zeros(*const u16, *const u8),
}

#[cfg(target_arch = "x86_64")]
impl TileGrids {
    /// Block `b` of row `i` for outputs `c0..`: `((correction, sx, Σx), grids, sums)`.
    ///
    /// # Safety
    /// `i` and `b` inside the tile; `c0` inside the panel.
    #[inline(always)]
    unsafe fn at(&self, i: usize, b: usize, c0: usize) -> ((i32, f32, f32), GridAt, *mut f32) {
        // SAFETY: as the caller guarantees.
        unsafe {
            let meta = i * self.num_blocks + b;
            let correction = if self.correction.is_null() {
                0
            } else {
                *self.correction.add(meta)
            };
            let g = if self.block_group.is_null() {
                b
            } else {
                *self.block_group.add(b) as usize
            };
            let grid = match self.grid {
                Grid::Float { scales, offsets } => {
                    GridAt::Float(scales.add(g * PANEL + c0), offsets.add(g * PANEL + c0))
                }
                Grid::F16Zeros { grids } => {
                    let group = grids.add(g * ZERO_GRID_BYTES);
                    GridAt::F16Zeros((group as *const u16).add(c0), group.add(2 * PANEL + c0))
                }
            };
            (
                (correction, *self.sx.add(meta), *self.sum_x.add(meta)),
                grid,
                self.acc.add(i * PANEL + c0),
            )
        }
    }

    /// The epilogue of block `b` for every row of an AVX2 tile (`dots[i][v]`: row `i`, outputs
    /// `8v .. 8v + 8`).
    ///
    /// # Safety
    /// The CPU supports AVX2 and F16C; the tile holds `MR` rows and block `b`.
    ///
    /// Inlined, as [`Self::epilogue_avx512`]: the AVX2 kernels enable F16C for it.
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    pub(super) unsafe fn epilogue_avx2<const MR: usize>(
        &self,
        b: usize,
        dots: &[[std::arch::x86_64::__m256i; 4]; MR],
    ) {
        for (i, row) in dots.iter().enumerate() {
            for (v, dot) in row.iter().enumerate() {
                // SAFETY: as the caller guarantees.
                unsafe {
                    let (meta, grids, acc) = self.at(i, b, 8 * v);
                    epilogue8(*dot, meta, grids, acc, b == 0);
                }
            }
        }
    }

    /// The epilogue of block `b` for every row of an AVX-512 tile (`lo[i]`, `hi[i]`: row `i`,
    /// outputs 0–15 and 16–31).
    ///
    /// # Safety
    /// The CPU supports AVX-512F; the tile holds `MR` rows and block `b`.
    ///
    /// Inlined into the kernels, whose sums then stay in registers: called per block, with
    /// the sums passed through memory, it held int4 prefill at half its speed (Zen 4, a
    /// 32-token prompt: 110 → 227 tokens/s).
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(super) unsafe fn epilogue_avx512<const MR: usize>(
        &self,
        b: usize,
        lo: &[std::arch::x86_64::__m512i; MR],
        hi: &[std::arch::x86_64::__m512i; MR],
    ) {
        for i in 0..MR {
            for (h, dot) in [lo[i], hi[i]].into_iter().enumerate() {
                // SAFETY: as the caller guarantees.
                unsafe {
                    let (meta, grids, acc) = self.at(i, b, 16 * h);
                    epilogue16(dot, meta, grids, acc, b == 0);
                }
            }
        }
    }
}

/// The f32 epilogue of one block for 8 outputs on AVX2 (the AVX-512 kernels' operations):
/// `acc (+)= (dot − correction) · (s · sx) + Σx · o`.
///
/// # Safety
/// The CPU supports AVX2 and F16C; `grid` and `a` point at 8 elements.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn epilogue8(
    dot: std::arch::x86_64::__m256i,
    (correction, sx, sum_x): (i32, f32, f32),
    grid: GridAt,
    a: *mut f32,
    first: bool,
) {
    use std::arch::x86_64::*;
    unsafe {
        let (s, o) = match grid {
            GridAt::Float(s, o) => (_mm256_loadu_ps(s), _mm256_loadu_ps(o)),
            GridAt::F16Zeros(s, z) => {
                let s = _mm256_cvtph_ps(_mm_loadu_si128(s as *const __m128i));
                let z =
                    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(z as *const __m128i)));
                // −(z · s), which is (−z) · s to the bit, zeros' signs included.
                let o = _mm256_xor_ps(_mm256_mul_ps(z, s), _mm256_set1_ps(-0.0));
                (s, o)
            }
        };
        let part = _mm256_cvtepi32_ps(_mm256_sub_epi32(dot, _mm256_set1_epi32(correction)));
        let scale = _mm256_mul_ps(s, _mm256_set1_ps(sx));
        let offset = _mm256_mul_ps(_mm256_set1_ps(sum_x), o);
        let add = _mm256_add_ps(_mm256_mul_ps(part, scale), offset);
        let sum = if first {
            add
        } else {
            _mm256_add_ps(_mm256_loadu_ps(a), add)
        };
        _mm256_storeu_ps(a, sum);
    }
}

/// [`epilogue8`] for 16 outputs on AVX-512.
///
/// # Safety
/// The CPU supports AVX-512F; `grid` and `a` point at 16 elements.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn epilogue16(
    dot: std::arch::x86_64::__m512i,
    (correction, sx, sum_x): (i32, f32, f32),
    grid: GridAt,
    a: *mut f32,
    first: bool,
) {
    use std::arch::x86_64::*;
    unsafe {
        let (s, o) = match grid {
            GridAt::Float(s, o) => (_mm512_loadu_ps(s), _mm512_loadu_ps(o)),
            GridAt::F16Zeros(s, z) => {
                let s = _mm512_cvtph_ps(_mm256_loadu_si256(s as *const __m256i));
                let z =
                    _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(z as *const __m128i)));
                // As `epilogue8`.
                let o = _mm512_castsi512_ps(_mm512_xor_si512(
                    _mm512_castps_si512(_mm512_mul_ps(z, s)),
                    _mm512_set1_epi32(i32::MIN),
                ));
                (s, o)
            }
        };
        let part = _mm512_cvtepi32_ps(_mm512_sub_epi32(dot, _mm512_set1_epi32(correction)));
        let scale = _mm512_mul_ps(s, _mm512_set1_ps(sx));
        let offset = _mm512_mul_ps(_mm512_set1_ps(sum_x), o);
        let add = _mm512_add_ps(_mm512_mul_ps(part, scale), offset);
        let sum = if first {
            add
        } else {
            _mm512_add_ps(_mm512_loadu_ps(a), add)
        };
        _mm512_storeu_ps(a, sum);
    }
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
        for format in [Format::Int8, Format::Int4] {
            let (block, x_max) = (format.block(), format.x_max());
            for len in [1, 5, 8, 13, 31, 32, 63, 64]
                .into_iter()
                .filter(|&l| l <= block)
            {
                for scale in [0.0, 1e-30, 1.0, 300.0] {
                    let mut values = [0.0f32; MAX_BLOCK];
                    values[..len].iter_mut().for_each(|v| *v = next() * scale);
                    // Ties: with max |x| = X_MAX the grid's step is 1, so halves round to even.
                    if len > 4 && scale > 0.0 {
                        values[..4].copy_from_slice(&[x_max, 0.5, -1.5, 2.5]);
                    }
                    let (mut want, mut got) = ([0i32; MAX_BLOCK], [0i32; MAX_BLOCK]);
                    let w = quantize_block(&values[..len], x_max, &mut want[..block]);
                    // SAFETY: AVX2 checked above.
                    let g =
                        unsafe { quantize_block_avx2(&values[..block], x_max, &mut got[..block]) };
                    let at = format!("{format:?} len {len}, scale {scale}");
                    assert_eq!(
                        (w.0.to_bits(), w.1.to_bits(), w.2),
                        (g.0.to_bits(), g.1.to_bits(), g.2),
                        "{at}"
                    );
                    assert_eq!(want, got, "{at}");
                    if len > 4 && scale > 0.0 {
                        assert_eq!(&got[..4], &[x_max as i32, 0, -2, 2], "ties round to even");
                    }
                }
            }
        }
    }

    #[test]
    fn the_bytes_rebuild_x() {
        for format in [Format::Int8, Format::Int4] {
            let x_max = format.x_max() as i32;
            for x in [
                -x_max, -70000, -300, -129, -128, -1, 0, 1, 127, 128, 255, 256, 16383,
            ] {
                let x = x.clamp(-x_max, x_max);
                let [h, m, l] = format.split(x);
                let rebuilt = match format {
                    // Both bytes signed operands: the low one below 128.
                    Format::Int8 => {
                        assert!(m < 128 && l == 0);
                        i32::from(h as i8) * 128 + i32::from(m)
                    }
                    Format::Int4 => {
                        assert!((-64..64).contains(&i32::from(h as i8)));
                        (i32::from(h as i8) << 16) + (i32::from(m) << 8) + i32::from(l)
                    }
                };
                assert_eq!(rebuilt, x, "{format:?}");
            }
        }
    }
}
