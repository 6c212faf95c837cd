//! Weight-only int8 (`--quantization int8`): each output row of a matrix is cut into groups of
//! `GROUP` positions, each stored as int8 `q` with an f32 scale and offset spanning the group's
//! own range (`w ≈ q · scale + offset`, `q ∈ [-128, 127]`, round to nearest), made at load from
//! the checkpoint's bf16/f16/f32 values (or read from a `moeserve quantize` checkpoint). The
//! GEMM multiplies in integers (`int8.rs`): activations quantized per row and group at run time,
//! integer sums per group, then `partial · scale · sx + Σx · offset` (`Σx` the activations'
//! exact sum over the group); decode reads 0.56× the bytes of bf16. Chosen once per process,
//! before any weight is packed.
//!
//! Why an offset: a symmetric grid (`max |w| / 127`) leaves unused whichever side of zero the
//! group does not reach; spanning `[min, max]` makes the step 11–17 % smaller on Gaussian or
//! Laplace weights and 21 % on the demo model's, for 4 more bytes per 64 weights.

use std::sync::OnceLock;

use crate::WeightData;

/// How matrices are stored for the kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum WeightQuantization {
    /// As in the checkpoint.
    #[default]
    None,
    /// int8 with a scale and offset per output row and `GROUP` positions.
    Int8,
}

impl std::fmt::Display for WeightQuantization {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            WeightQuantization::None => "none",
            WeightQuantization::Int8 => "int8",
        })
    }
}

impl std::str::FromStr for WeightQuantization {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "none" => Ok(WeightQuantization::None),
            "int8" => Ok(WeightQuantization::Int8),
            other => Err(format!("unknown quantization {other:?} (none or int8)")),
        }
    }
}

static QUANTIZATION: OnceLock<WeightQuantization> = OnceLock::new();

/// The quantization in force (`None` unless [`set_weight_quantization`] chose another).
pub fn weight_quantization() -> WeightQuantization {
    *QUANTIZATION.get_or_init(WeightQuantization::default)
}

/// Chooses the quantization for this process; call before loading a model.
pub fn set_weight_quantization(q: WeightQuantization) -> Result<(), String> {
    if q == WeightQuantization::Int8 && !super::isa().packs_weights() {
        return Err(
            "--quantization int8 needs the AVX-512 or AVX2 kernels (this CPU or \
                    MOESERVE_ISA=scalar rules them out)"
                .into(),
        );
    }
    let current = *QUANTIZATION.get_or_init(|| q);
    if current != q {
        return Err(format!(
            "weight quantization is already {current}; it is chosen once, before loading"
        ));
    }
    Ok(())
}

/// Positions per scale and offset; the GEMM runs int8 weights in k-blocks of one group.
/// Measured with symmetric groups on the demo model against the transformers references (mean
/// |Δlogprob|) and batch-1 decode of mixtral-bench-1b: 256 → 0.037; 64 → 0.028, 5–7 % slower;
/// 32 (GGML's Q8_0) → 0.026, 14 % slower (more bytes and a kernel call and scale pass per 32
/// positions, before the fused decode kernel). With offsets 64 → 0.020 (bench/RESULTS.md).
pub const GROUP: usize = 64;
const _: () = assert!(GROUP <= super::matmul::KC);

/// A matrix quantized by [`quantize_rows_int8`]: `w[j][p] ≈ q[j][p] · scales[j][p / GROUP] +
/// offsets[j][p / GROUP]`.
pub struct Int8Rows {
    /// `[n, k]`.
    pub q: Vec<i8>,
    /// `[n, k.div_ceil(GROUP)]`.
    pub scales: Vec<f32>,
    /// `[n, k.div_ceil(GROUP)]`.
    pub offsets: Vec<f32>,
}

#[cfg(test)]
impl Int8Rows {
    /// Element `i` of the flattened `[n, k]` matrix as the kernels see it.
    pub fn dequantized(&self, i: usize, k: usize) -> f32 {
        let g = (i / k) * k.div_ceil(GROUP) + (i % k) / GROUP;
        f32::from(self.q[i]) * self.scales[g] + self.offsets[g]
    }
}

/// Quantizes `[n, k]` weights row by row, group by group (see the module note).
pub fn quantize_rows_int8(data: WeightData<'_>, n: usize, k: usize) -> Int8Rows {
    let groups = n * k.div_ceil(GROUP);
    let mut out = Int8Rows {
        q: Vec::with_capacity(n * k),
        scales: Vec::with_capacity(groups),
        offsets: Vec::with_capacity(groups),
    };
    // One row widened at a time: no f32 copy of the whole matrix at load.
    let mut row = vec![0.0f32; k];
    for r in 0..n {
        let span = r * k..(r + 1) * k;
        match &data {
            WeightData::F32(v) => row.copy_from_slice(&v[span]),
            WeightData::F16(v) => row
                .iter_mut()
                .zip(&v[span])
                .for_each(|(d, s)| *d = s.to_f32()),
            WeightData::BF16(v) => row
                .iter_mut()
                .zip(&v[span])
                .for_each(|(d, s)| *d = s.to_f32()),
            WeightData::F8E4M3(v, blocks) => blocks.dequantize_row(v, r, &mut row),
            WeightData::Mxfp4(p) => p.row_into(r, &mut row),
            WeightData::Int4(p) => p.row_into(r, &mut row),
        }
        for group in row.chunks(GROUP) {
            let (lo, hi) = group
                .iter()
                .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), v| {
                    (lo.min(*v), hi.max(*v))
                });
            // A constant group is its offset exactly (q = 0, scale 0).
            let scale = if hi > lo { (hi - lo) / 255.0 } else { 0.0 };
            let offset = if hi > lo { lo + 128.0 * scale } else { lo };
            out.q.extend(group.iter().map(|v| {
                if scale == 0.0 {
                    0
                } else {
                    ((v - offset) / scale).round().clamp(-128.0, 127.0) as i8
                }
            }));
            out.scales.push(scale);
            out.offsets.push(offset);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_round_trip_within_half_a_step() {
        let (n, k) = (3, 5);
        let w: Vec<f32> = vec![
            0.5, -1.0, 0.25, 0.0, 0.9, //
            0.0, 0.0, 0.0, 0.0, 0.0, //
            1e-3, -2e-3, 3e-3, 0.0, 5e-4,
        ];
        let rows = quantize_rows_int8(WeightData::F32(&w), n, k);
        assert_eq!(
            (rows.q[1], rows.q[4]),
            (-128, 127),
            "the group's range spans the whole grid"
        );
        assert_eq!(&rows.q[5..10], &[0; 5], "a constant row is its offset");
        assert_eq!((rows.scales[1], rows.offsets[1]), (0.0, 0.0));
        assert_eq!(rows.scales.len(), n, "one group per row when k ≤ GROUP");
        for (i, v) in w.iter().enumerate() {
            let s = rows.scales[i / k];
            assert!(
                (rows.dequantized(i, k) - v).abs() <= s / 2.0 + 1e-6 * v.abs() + 1e-9,
                "{i}: {v} vs {}",
                rows.dequantized(i, k)
            );
        }
    }

    #[test]
    fn groups_are_cut_along_each_row() {
        // Row 0: a group of small values and a group of large ones get their own grids.
        let k = GROUP + 3;
        let w: Vec<f32> = (0..k)
            .map(|p| {
                if p < GROUP {
                    p as f32 * 1e-3
                } else {
                    10.0 + p as f32
                }
            })
            .collect();
        let rows = quantize_rows_int8(WeightData::F32(&w), 1, k);
        assert_eq!(rows.scales.len(), 2);
        for (i, v) in w.iter().enumerate() {
            let s = rows.scales[i / GROUP];
            assert!((rows.dequantized(i, k) - v).abs() <= s / 2.0 + 1e-6 * v.abs());
        }
        assert!(
            rows.scales[0] < 1e-3 / 2.0,
            "the small group keeps its resolution"
        );
    }
}
