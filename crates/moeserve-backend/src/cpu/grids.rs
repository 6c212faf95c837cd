//! The grids of the integer kernels' weights — a scale and an offset per panel, group and
//! output — stored in the smallest form that holds them exactly, and the view of one panel's
//! that the kernels' epilogues read (`intdot::TileGrids`).
//!
//! - int4 (GPTQ, AWQ) checkpoints give f16 scales and 4-bit zero points: 3 bytes a group and
//!   output, the offset `−zero · scale` made in f32 by the epilogue, exactly (an 11-bit
//!   significand times at most 16). Against 8 bytes, 0.31 bits less per weight with groups of
//!   128: int4 batch-1 decode 1.08× on Zen 4 (bench/RESULTS.md).
//! - Anything else (bf16 or f32 scales in an int4 checkpoint, int8's own grids): f32 scales and
//!   offsets, 8 bytes. (int8's grids rounded to f16 where that cost nothing, 8.5 bits per weight
//!   instead of 9, measured no faster on Zen 4: 8 alternated rounds, median ratio 1.00.)
//!
//! Every form gives the epilogue the same f32 scale and offset, so the form changes the bytes
//! read, never a result.

use half::f16;

use super::packed::PANEL;

/// A panel's grids as the epilogues read them, per group and output.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(super) enum Grid {
    /// `[groups, PANEL]` f32 scales and offsets.
    Float {
        scales: *const f32,
        offsets: *const f32,
    },
    /// `[groups, ZERO_GRID_BYTES]`: a group's `PANEL` f16 scales, then its `PANEL` zero points
    /// as bytes (offset `−zero · scale`).
    F16Zeros { grids: *const u8 },
}

/// Bytes of one group of a [`Grid::F16Zeros`] panel.
pub(super) const ZERO_GRID_BYTES: usize = PANEL * 3;

/// A matrix's grids per panel, group and output (`[num_panels, groups, …]`).
#[derive(Clone)]
pub(super) enum PanelGrids {
    /// `[num_panels, groups, ZERO_GRID_BYTES]` as [`Grid::F16Zeros`] reads them.
    F16Zeros(Vec<u8>),
    /// `[num_panels, groups, PANEL]` each.
    Float { scales: Vec<f32>, offsets: Vec<f32> },
}

fn is_f16(v: &f32) -> bool {
    f16::from_f32(*v).to_f32().to_bits() == v.to_bits()
}

/// Packs a group's `PANEL` f16 values at the start of `out`.
fn put_f16(values: &[f32], out: &mut [u8]) {
    for (c, v) in values.iter().enumerate() {
        out[2 * c..2 * c + 2].copy_from_slice(&f16::from_f32(*v).to_le_bytes());
    }
}

fn get_f16(bytes: &[u8], c: usize) -> f32 {
    f16::from_le_bytes([bytes[2 * c], bytes[2 * c + 1]]).to_f32()
}

impl PanelGrids {
    /// Scales (finite) and zero points (≤ 16) at `(q · groups + g) · PANEL + c`: f16 scales
    /// and the zero points where every scale is an f16, else f32 scales and offsets.
    pub(super) fn with_zeros(scales: Vec<f32>, zeros: Vec<u8>) -> Self {
        if !scales.iter().all(is_f16) {
            let offsets = scales
                .iter()
                .zip(&zeros)
                .map(|(s, &z)| -f32::from(z) * s)
                .collect();
            return PanelGrids::Float { scales, offsets };
        }
        let mut grids = vec![0u8; scales.len() / PANEL * ZERO_GRID_BYTES];
        for (at, group) in grids.chunks_exact_mut(ZERO_GRID_BYTES).enumerate() {
            let (half_scales, half_zeros) = group.split_at_mut(2 * PANEL);
            put_f16(&scales[at * PANEL..][..PANEL], half_scales);
            half_zeros.copy_from_slice(&zeros[at * PANEL..][..PANEL]);
        }
        PanelGrids::F16Zeros(grids)
    }

    /// f32 scales and offsets at `(q · groups + g) · PANEL + c`.
    pub(super) fn float(scales: Vec<f32>, offsets: Vec<f32>) -> Self {
        PanelGrids::Float { scales, offsets }
    }

    /// Whether the grids are stored as f16.
    #[cfg(test)]
    pub(super) fn is_f16(&self) -> bool {
        !matches!(self, PanelGrids::Float { .. })
    }

    /// The scale and the offset of output `c` of panel `q`'s group `g`, as the epilogues
    /// make them.
    pub(super) fn scale_offset(
        &self,
        groups: usize,
        (q, g, c): (usize, usize, usize),
    ) -> (f32, f32) {
        let at = q * groups + g;
        match self {
            PanelGrids::F16Zeros(grids) => {
                let group = &grids[at * ZERO_GRID_BYTES..][..ZERO_GRID_BYTES];
                let s = get_f16(group, c);
                (s, -f32::from(group[2 * PANEL + c]) * s)
            }
            PanelGrids::Float { scales, offsets } => {
                (scales[at * PANEL + c], offsets[at * PANEL + c])
            }
        }
    }

    pub(super) fn size_in_bytes(&self) -> usize {
        match self {
            PanelGrids::F16Zeros(grids) => grids.len(),
            PanelGrids::Float { scales, offsets } => (scales.len() + offsets.len()) * 4,
        }
    }

    /// Panel `q`'s grids for the kernels.
    #[cfg(target_arch = "x86_64")]
    pub(super) fn panel(&self, groups: usize, q: usize) -> Grid {
        match self {
            PanelGrids::F16Zeros(grids) => Grid::F16Zeros {
                grids: grids[q * groups * ZERO_GRID_BYTES..].as_ptr(),
            },
            PanelGrids::Float { scales, offsets } => Grid::Float {
                scales: scales[q * groups * PANEL..].as_ptr(),
                offsets: offsets[q * groups * PANEL..].as_ptr(),
            },
        }
    }
}
