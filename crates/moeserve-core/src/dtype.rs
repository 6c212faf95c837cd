//! Element types of stored tensors.

use serde::{Deserialize, Serialize};

/// Element type of a weight or activation tensor as stored in a checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    F16,
    BF16,
    /// float8 e4m3 (`float8_e4m3fn`: no infinities, one NaN), with block scales beside it
    /// (FP8 block checkpoints: DeepSeek-V3/R1, the Qwen3 FP8 releases).
    F8E4M3,
    /// OCP MXFP4: e2m1 elements, two per byte, with an e8m0 scale per 32 along a row (the
    /// gpt-oss release's experts). Never a plain tensor's type: checkpoints store it as u8
    /// blocks and scales, and the weights hold it in the kernels' panels.
    Mxfp4,
    /// 4-bit integers with a scale and zero point per group of input positions (GPTQ and AWQ
    /// checkpoints). Never a plain tensor's type: checkpoints pack it into i32 words beside
    /// its scales and zeros, and the weights hold it in the kernels' panels.
    Int4,
}

impl DType {
    /// Bytes per element, for the types plain tensors have (not [`DType::Mxfp4`] or
    /// [`DType::Int4`]).
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::F8E4M3 => 1,
            DType::Mxfp4 => unreachable!(
                "MXFP4 elements are half a byte and their scales lie apart: size such a weight \
                 by its blocks (Weight::size_in_bytes)"
            ),
            DType::Int4 => unreachable!(
                "int4 elements are half a byte and their group scales lie apart: size such a \
                 weight by its panels (Weight::size_in_bytes)"
            ),
        }
    }

    /// The name used by safetensors headers and `torch_dtype` in config.json.
    pub fn safetensors_name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::F8E4M3 => "F8_E4M3",
            // As its blocks are stored.
            DType::Mxfp4 => "U8",
            // As GPTQ and AWQ pack it.
            DType::Int4 => "I32",
        }
    }

    /// Parses names as they appear in HF configs and on the command line
    /// (`bfloat16`, `bf16`, `float16`, `f16`, `half`, `float32`, `f32`, `float`).
    pub fn parse(name: &str) -> Option<DType> {
        match name.to_ascii_lowercase().as_str() {
            "bf16" | "bfloat16" => Some(DType::BF16),
            "f16" | "float16" | "half" => Some(DType::F16),
            "f32" | "float32" | "float" => Some(DType::F32),
            "f8_e4m3" | "float8_e4m3fn" => Some(DType::F8E4M3),
            _ => None,
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DType::F32 => "float32",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F8E4M3 => "float8_e4m3fn",
            DType::Mxfp4 => "mxfp4",
            DType::Int4 => "int4",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_hf_and_short_names() {
        assert_eq!(DType::parse("bfloat16"), Some(DType::BF16));
        assert_eq!(DType::parse("F16"), Some(DType::F16));
        assert_eq!(DType::parse("float32"), Some(DType::F32));
        assert_eq!(DType::parse("int8"), None);
    }
}
