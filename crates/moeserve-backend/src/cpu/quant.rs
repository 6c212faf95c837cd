//! Weight-only int8 (`--quantization int8`): each output row of a matrix is cut into groups of
//! `GROUP` positions, each stored as int8 with one f32 scale (`max |w| / 127`, round to
//! nearest), made at load from the checkpoint's bf16/f16/f32 values. The GEMM widens int8 to
//! f32 like bf16, sums a group as one k-block, then adds that partial sum times the group's
//! scale; activations and sums stay f32 and decode reads 0.53× the bytes of bf16. Chosen once
//! per process, before any weight is packed.

use std::sync::OnceLock;

use crate::WeightData;

/// How matrices are stored for the kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum WeightQuantization {
    /// As in the checkpoint.
    #[default]
    None,
    /// int8 with a per-output-channel scale.
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

/// Positions per scale; the GEMM runs int8 weights in k-blocks of one group. Measured on the
/// demo model against the transformers references (mean |Δlogprob|) and batch-1 decode of
/// mixtral-bench-1b: 256 → 0.037; 64 → 0.028, 5–7 % slower; 32 (GGML's Q8_0) → 0.026, 14 %
/// slower (more bytes and a kernel call and scale pass per 32 positions).
pub const GROUP: usize = 64;
const _: () = assert!(GROUP <= super::matmul::KC);

/// `[n, k]` weights as int8 and their scales, `[n, k.div_ceil(GROUP)]` (`w ≈ q · scale`).
pub fn quantize_rows_int8(data: WeightData<'_>, n: usize, k: usize) -> (Vec<i8>, Vec<f32>) {
    let mut q = Vec::with_capacity(n * k);
    let mut scales = Vec::with_capacity(n);
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
        }
        for group in row.chunks(GROUP) {
            let max = group.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let scale = if max > 0.0 { max / 127.0 } else { 1.0 };
            q.extend(
                group
                    .iter()
                    .map(|v| (v / scale).round().clamp(-127.0, 127.0) as i8),
            );
            scales.push(scale);
        }
    }
    (q, scales)
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
        let (q, scales) = quantize_rows_int8(WeightData::F32(&w), n, k);
        assert_eq!(q[1], -127, "the largest magnitude maps to ±127");
        assert_eq!(&q[5..10], &[0; 5], "a zero row stays zero");
        assert_eq!(scales.len(), n, "one group per row when k ≤ GROUP");
        for (i, v) in w.iter().enumerate() {
            let s = scales[i / k];
            assert!((q[i] as f32 * s - v).abs() <= s / 2.0 + 1e-9, "{i}: {v}");
        }
    }
}
