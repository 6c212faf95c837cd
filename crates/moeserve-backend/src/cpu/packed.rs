//! Weights repacked for the AVX-512 GEMM: the `[n, k]` matrix is cut into panels of
//! `PANEL` = 32 output rows, each stored k-major, so the kernel reads one contiguous stream per
//! panel and keeps 32 outputs per activation row in two 16-lane accumulators (no horizontal
//! sums). The last panel is padded with zero rows.
//!
//! ```text
//! panel q, position p:  w[32q + 0][p], w[32q + 1][p], …, w[32q + 31][p]
//! ```
//! bf16 panels store a position's two halves interleaved instead (see [`PanelSlot`]):
//!
//! ```text
//! panel q, position p:  w[32q + 0][p], w[32q + 16][p], w[32q + 1][p], w[32q + 17][p], …
//! ```
//! Packing happens once per weight, on first use (see `Weight::packed`).

use std::sync::Arc;

use half::{bf16, f16};

use super::fp8::E4m3;
use super::int4::Int4Panels;
use super::int8::Int8Panels;
use super::mxfp4::Mxfp4Panels;
use crate::WeightData;

/// Output rows per panel (two 16-lane vectors).
pub const PANEL: usize = 32;

/// A weight in panel layout; elements keep their stored type.
#[derive(Clone)]
pub enum PackedWeight {
    F32(PackedPanels<f32>),
    F16(PackedPanels<f16>),
    BF16(PackedPanels<bf16>),
    /// Weight-only int8 (`--quantization int8`), in its own quad panels for the integer dot
    /// products (see `int8.rs`).
    I8(Int8Panels),
    /// FP8 block weights, still one byte each: `w[32q + c][p] = panels[q][p][c] ·
    /// scales[q][p / block_cols]` (a panel's 32 rows lie in one row of blocks). The kernels
    /// widen an element to its value / 2^8 (see the SIMD `Lanes` of `E4m3`), so the scales are
    /// the blocks' times 2^8 (exact).
    F8 {
        panels: PackedPanels<E4m3>,
        /// `[num_panels, k.div_ceil(block_cols)]`
        scales: Vec<f32>,
        block_cols: usize,
    },
    /// MXFP4, packed at load into its own 4-bit panels (see `mxfp4.rs`): the weight's only
    /// copy, shared with [`crate::WeightData::Mxfp4`].
    Mxfp4(Arc<Mxfp4Panels>),
    /// GPTQ / AWQ int4, packed at load into its own 4-bit panels (see `int4.rs`): the weight's
    /// only copy, shared with [`crate::WeightData::Int4`].
    Int4(Arc<Int4Panels>),
}

/// Where a panel position keeps its columns.
pub trait PanelSlot {
    /// Columns `c` and `c + 16` share the 32-bit lane `c` of a position (`c` in the low half).
    /// For bf16 that lets the kernels widen a whole position with one shift (`lane << 16`: the
    /// low columns) and one mask (`lane & 0xffff0000`: the high ones), loads folded in, instead
    /// of a zero-extension and a shift per 16 columns: half the vector ALU work on the ports
    /// the FMAs need.
    const PAIRED_HALVES: bool = false;
}

impl PanelSlot for f32 {}
impl PanelSlot for f16 {}
impl PanelSlot for E4m3 {}
impl PanelSlot for bf16 {
    const PAIRED_HALVES: bool = true;
}

/// The slot of column `c` (`< PANEL`) within a position of a `T` panel.
#[inline]
pub fn slot<T: PanelSlot>(c: usize) -> usize {
    const HALF: usize = PANEL / 2;
    if T::PAIRED_HALVES {
        2 * (c % HALF) + c / HALF
    } else {
        c
    }
}

/// `num_panels × k × PANEL` elements.
#[derive(Clone)]
pub struct PackedPanels<T> {
    pub n: usize,
    pub k: usize,
    pub data: Vec<T>,
}

impl<T: Copy + Default + PanelSlot> PackedPanels<T> {
    pub(super) fn pack(src: &[T], n: usize, k: usize) -> Self {
        let mut data = zeroed_panels::<T>(n, k);
        for (q, panel) in data.chunks_exact_mut(k * PANEL).enumerate() {
            for r in 0..PANEL.min(n - q * PANEL) {
                let row = &src[(q * PANEL + r) * k..(q * PANEL + r + 1) * k];
                let at = slot::<T>(r);
                for (p, v) in row.iter().enumerate() {
                    panel[p * PANEL + at] = *v;
                }
            }
        }
        PackedPanels { n, k, data }
    }

    /// Packs the `[n, k]` matrix whose row `r` is column `first + r · step` of the input-major
    /// `src: [k, n · step]` (GPT-OSS's `gate_up_proj` / `down_proj`), with no row-major copy.
    pub fn pack_columns(src: &[T], k: usize, (first, step): (usize, usize)) -> Self {
        let cols = src.len() / k;
        assert!(src.len() == k * cols && first < step && cols.is_multiple_of(step));
        let n = cols / step;
        let mut data = zeroed_panels::<T>(n, k);
        for (q, panel) in data.chunks_exact_mut(k * PANEL).enumerate() {
            let rows = PANEL.min(n - q * PANEL);
            for (p, (position, stored)) in panel
                .chunks_exact_mut(PANEL)
                .zip(src.chunks_exact(cols))
                .enumerate()
            {
                debug_assert!(p < k);
                for c in 0..rows {
                    position[slot::<T>(c)] = stored[first + (q * PANEL + c) * step];
                }
            }
        }
        PackedPanels { n, k, data }
    }
}

impl<T> PackedPanels<T> {
    pub fn num_panels(&self) -> usize {
        self.n.div_ceil(PANEL)
    }

    /// The `k × PANEL` elements of panel `q`.
    pub fn panel(&self, q: usize) -> &[T] {
        &self.data[q * self.k * PANEL..(q + 1) * self.k * PANEL]
    }
}

/// The zeroed `num_panels × k × PANEL` elements of an `[n, k]` weight, on huge pages.
fn zeroed_panels<T: Copy + Default>(n: usize, k: usize) -> Vec<T> {
    let len = n.div_ceil(PANEL) * k * PANEL;
    let mut data: Vec<T> = Vec::with_capacity(len);
    advise_huge_pages(data.as_mut_ptr() as *mut u8, len * std::mem::size_of::<T>());
    data.resize(len, T::default());
    data
}

/// Asks for 2 MiB pages behind a weight buffer before it is first touched: decode streams every
/// weight once per step, and with 4 KiB pages the hardware prefetchers stop at every page and
/// the TLB misses on every one. `madvise` wants a page-aligned start, and only whole 2 MiB
/// pages can be huge, so the advice covers the aligned 2 MiB pages inside the buffer.
pub(super) fn advise_huge_pages(ptr: *mut u8, bytes: usize) {
    const HUGE: usize = 2 << 20;
    #[cfg(target_os = "linux")]
    {
        let start = (ptr as usize).next_multiple_of(HUGE);
        let end = (ptr as usize + bytes) / HUGE * HUGE;
        if end > start {
            // SAFETY: [start, end) lies inside one live allocation; MADV_HUGEPAGE only changes
            // how the kernel backs it, and a refusal is harmless.
            unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
            }
        }
    }
}

impl PackedWeight {
    /// Quantizes a row-major `[n, k]` weight to int8 rows with group scales and offsets, then
    /// packs it.
    pub fn pack_int8(data: WeightData<'_>, n: usize, k: usize) -> Self {
        Self::pack_int8_rows(&super::quant::quantize_rows_int8(data, n, k), n, k)
    }

    /// Packs int8 rows made elsewhere (a GPTQ checkpoint's, `moeserve quantize`).
    pub fn pack_int8_rows(rows: &super::quant::Int8Rows, n: usize, k: usize) -> Self {
        PackedWeight::I8(Int8Panels::new(rows, n, k))
    }

    /// Element `(r, p)` of a float weight's panels (f32, f16, bf16), as f32.
    pub fn float_value(&self, r: usize, p: usize) -> f32 {
        fn at<T: PanelSlot>(w: &PackedPanels<T>, r: usize, p: usize) -> usize {
            debug_assert!(r < w.n && p < w.k);
            ((r / PANEL) * w.k + p) * PANEL + slot::<T>(r % PANEL)
        }
        match self {
            PackedWeight::F32(w) => w.data[at(w, r, p)],
            PackedWeight::F16(w) => w.data[at(w, r, p)].to_f32(),
            PackedWeight::BF16(w) => w.data[at(w, r, p)].to_f32(),
            _ => unreachable!("only float panels are read back element by element"),
        }
    }

    /// Bytes the kernels read for one pass over the weight (scales included).
    pub fn size_in_bytes(&self) -> usize {
        match self {
            PackedWeight::F32(p) => p.data.len() * 4,
            PackedWeight::F16(p) => p.data.len() * 2,
            PackedWeight::BF16(p) => p.data.len() * 2,
            PackedWeight::I8(p) => p.size_in_bytes(),
            PackedWeight::F8 { panels, scales, .. } => panels.data.len() + scales.len() * 4,
            PackedWeight::Mxfp4(p) => p.size_in_bytes(),
            PackedWeight::Int4(p) => p.size_in_bytes(),
        }
    }

    /// Repacks a row-major `[n, k]` weight.
    pub fn pack(data: WeightData<'_>, n: usize, k: usize) -> Self {
        match data {
            // Already in panels: made so at load.
            WeightData::Mxfp4(p) => PackedWeight::Mxfp4(Arc::new(p.clone())),
            WeightData::Int4(p) => PackedWeight::Int4(Arc::new(p.clone())),
            WeightData::F32(v) => PackedWeight::F32(PackedPanels::pack(v, n, k)),
            WeightData::F16(v) => PackedWeight::F16(PackedPanels::pack(v, n, k)),
            WeightData::BF16(v) => PackedWeight::BF16(PackedPanels::pack(v, n, k)),
            WeightData::F8E4M3(v, blocks) if blocks.block[0].is_multiple_of(PANEL) => {
                let panels = PackedPanels::pack(v, n, k);
                let block_cols = blocks.block[1];
                let per_panel = k.div_ceil(block_cols);
                let scales = (0..panels.num_panels())
                    .flat_map(|q| {
                        (0..per_panel).map(move |j| 256.0 * blocks.at(q * PANEL, j * block_cols))
                    })
                    .collect();
                PackedWeight::F8 {
                    panels,
                    scales,
                    block_cols,
                }
            }
            // Blocks that split a panel's rows (no release has them): the exact values in f32.
            WeightData::F8E4M3(..) => {
                let mut values = vec![0.0; n * k];
                super::convert::widen_into(data, &mut values);
                PackedWeight::F32(PackedPanels::pack(&values, n, k))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panels_are_k_major_and_zero_padded() {
        let (n, k) = (33, 3);
        let src: Vec<f32> = (0..n * k).map(|i| i as f32).collect();
        let packed = PackedPanels::pack(&src, n, k);
        assert_eq!(packed.num_panels(), 2);
        // Row 1, position 2 sits at p * PANEL + r in panel 0.
        assert_eq!(packed.panel(0)[2 * PANEL + 1], src[k + 2]);
        // Row 32 is the first row of panel 1; rows 33.. are padding.
        assert_eq!(packed.panel(1)[0], src[32 * k]);
        assert_eq!(packed.panel(1)[1], 0.0);
    }

    #[test]
    fn bf16_panels_pair_each_column_with_the_one_16_later() {
        let (n, k) = (40, 2);
        let src: Vec<bf16> = (0..n * k).map(|i| bf16::from_f32(i as f32)).collect();
        let packed = PackedPanels::pack(&src, n, k);
        // Position 1 of panel 0: row 0, row 16, row 1, row 17, …
        let position = &packed.panel(0)[PANEL..2 * PANEL];
        for c in 0..16 {
            assert_eq!(position[2 * c], src[c * k + 1]);
            assert_eq!(position[2 * c + 1], src[(c + 16) * k + 1]);
        }
        // Every element reads back through float_value, padding rows included as zeros.
        let w = PackedWeight::BF16(packed);
        for r in 0..n {
            for p in 0..k {
                assert_eq!(w.float_value(r, p), src[r * k + p].to_f32());
            }
        }
        let PackedWeight::BF16(packed) = w else {
            unreachable!()
        };
        // Panel 1 holds rows 32..40: slots of rows 40.. (padding) are zero.
        let position = &packed.panel(1)[..PANEL];
        for c in 8..PANEL {
            assert_eq!(position[slot::<bf16>(c)], bf16::ZERO);
        }
    }

    #[test]
    fn columns_of_an_input_major_matrix_pack_as_its_transposed_rows() {
        // src [k, n·step]: rows r of the packed matrix are columns first + r·step.
        let (k, n, step) = (5, 35, 2);
        let src: Vec<f32> = (0..k * n * step).map(|i| i as f32).collect();
        for first in 0..step {
            let rows: Vec<f32> = (0..n)
                .flat_map(|r| (0..k).map(move |p| (p * n * step + first + r * step) as f32))
                .collect();
            let want = PackedPanels::pack(&rows, n, k);
            let got = PackedPanels::pack_columns(&src, k, (first, step));
            assert_eq!((got.n, got.k, &got.data), (want.n, want.k, &want.data));
        }
    }
}
