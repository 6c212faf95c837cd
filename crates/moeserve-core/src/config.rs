//! Engine configuration shared by the CLI, the TOML config file and the engine, each validated
//! once at start-up. Names and defaults follow vLLM's engine arguments.

use serde::{Deserialize, Serialize};

/// A configuration value outside its allowed range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("invalid `{field}`: {message}")]
pub struct ConfigError {
    pub field: &'static str,
    pub message: String,
}

fn invalid(field: &'static str, message: String) -> Result<(), ConfigError> {
    Err(ConfigError { field, message })
}

/// Element type of the KV cache (`--kv-cache-dtype`, vLLM's flag and names).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvCacheDtype {
    /// f32 on the CPU, where activations are f32 and a cached row is then exactly what
    /// recomputing it gives; the weights' dtype on CUDA.
    #[default]
    Auto,
    #[serde(alias = "fp32", alias = "f32")]
    Float32,
    /// Half the bytes per token of f32: twice the tokens per `--kv-cache-memory`, half the
    /// bytes each decode step's attention reads; keys and values rounded to bf16 once when
    /// written (vLLM's `auto` on a bf16 model).
    #[serde(alias = "bf16")]
    Bfloat16,
}

impl KvCacheDtype {
    pub fn name(self) -> &'static str {
        match self {
            KvCacheDtype::Auto => "auto",
            KvCacheDtype::Float32 => "float32",
            KvCacheDtype::Bfloat16 => "bfloat16",
        }
    }
}

impl std::str::FromStr for KvCacheDtype {
    type Err = String;

    /// `auto`, or a dtype name as [`crate::DType::parse`] reads it (`fp32` too) that is f32
    /// or bf16.
    fn from_str(s: &str) -> Result<Self, String> {
        use crate::DType;
        let lower = s.to_ascii_lowercase();
        match lower.as_str() {
            "auto" => Ok(KvCacheDtype::Auto),
            "fp32" => Ok(KvCacheDtype::Float32),
            _ => match DType::parse(&lower) {
                Some(DType::F32) => Ok(KvCacheDtype::Float32),
                Some(DType::BF16) => Ok(KvCacheDtype::Bfloat16),
                _ => Err(format!(
                    "{s:?} is not a KV cache dtype: auto, float32 or bfloat16 (fp8 is not \
                     supported)"
                )),
            },
        }
    }
}

/// Paged KV cache settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CacheConfig {
    /// Tokens per KV block (`--block-size`, 8–256).
    pub block_size: usize,
    /// Bytes for the KV cache (`--kv-cache-memory`); `None` = a share of free memory.
    pub kv_cache_memory: Option<u64>,
    /// Reuse full blocks across requests with a common prefix (`--enable-prefix-caching`).
    pub enable_prefix_caching: bool,
    /// Element type of the cached keys and values (`--kv-cache-dtype`, as vLLM).
    pub kv_cache_dtype: KvCacheDtype,
    /// Share of a GPU's memory the engine may use, weights and KV cache together
    /// (`--gpu-memory-utilization`, as vLLM); sizes the KV cache on CUDA when
    /// `kv_cache_memory` is not given.
    pub gpu_memory_utilization: f32,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            block_size: 16,
            kv_cache_memory: None,
            enable_prefix_caching: true,
            kv_cache_dtype: KvCacheDtype::Auto,
            gpu_memory_utilization: 0.9,
        }
    }
}

impl CacheConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(8..=256).contains(&self.block_size) {
            return invalid(
                "block_size",
                format!("must be in 8..=256, got {}", self.block_size),
            );
        }
        if self.kv_cache_memory == Some(0) {
            return invalid("kv_cache_memory", "must be more than 0 bytes".to_string());
        }
        let u = self.gpu_memory_utilization;
        if !(u > 0.0 && u <= 1.0) {
            return invalid(
                "gpu_memory_utilization",
                format!("must be in (0, 1], got {u}"),
            );
        }
        Ok(())
    }
}

/// Continuous-batching settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SchedulerConfig {
    /// Most sequences in one step (`--max-num-seqs`).
    pub max_num_seqs: usize,
    /// Token budget of one step (`--max-num-batched-tokens`).
    pub max_num_batched_tokens: usize,
    /// Split long prompts across steps, after the running decodes (`--enable-chunked-prefill`).
    pub enable_chunked_prefill: bool,
    /// Longest prompt + output (`--max-model-len`); `None` = the model's context.
    pub max_model_len: Option<usize>,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            max_num_seqs: 256,
            max_num_batched_tokens: 2048,
            enable_chunked_prefill: true,
            max_model_len: None,
        }
    }
}

impl SchedulerConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.max_num_seqs == 0 {
            return invalid("max_num_seqs", "must be at least 1".to_string());
        }
        if self.max_num_batched_tokens == 0 {
            return invalid("max_num_batched_tokens", "must be at least 1".to_string());
        }
        if self.max_model_len == Some(0) {
            return invalid("max_model_len", "must be at least 1".to_string());
        }
        if !self.enable_chunked_prefill
            && let Some(len) = self.max_model_len
            && len > self.max_num_batched_tokens
        {
            return invalid(
                "max_num_batched_tokens",
                format!(
                    "without chunked prefill it must be at least max_model_len ({len}), got {}",
                    self.max_num_batched_tokens
                ),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_cache_dtypes_parse_by_their_usual_names() {
        for (name, want) in [
            ("auto", KvCacheDtype::Auto),
            ("float32", KvCacheDtype::Float32),
            ("FP32", KvCacheDtype::Float32),
            ("f32", KvCacheDtype::Float32),
            ("bfloat16", KvCacheDtype::Bfloat16),
            ("bf16", KvCacheDtype::Bfloat16),
        ] {
            assert_eq!(name.parse::<KvCacheDtype>(), Ok(want), "{name}");
        }
        for refused in ["fp8", "float16", "f8_e4m3", ""] {
            let err = refused.parse::<KvCacheDtype>().unwrap_err();
            assert!(
                err.contains("auto, float32 or bfloat16"),
                "{refused}: {err}"
            );
        }
    }

    #[test]
    fn defaults_are_valid() {
        CacheConfig::default().validate().unwrap();
        SchedulerConfig::default().validate().unwrap();
    }

    #[test]
    fn gpu_memory_utilization_must_be_a_share() {
        for u in [0.0, -0.5, 1.01, f32::NAN] {
            let c = CacheConfig {
                gpu_memory_utilization: u,
                ..Default::default()
            };
            assert_eq!(
                c.validate().unwrap_err().field,
                "gpu_memory_utilization",
                "{u}"
            );
        }
    }

    #[test]
    fn block_size_out_of_range_is_named() {
        let c = CacheConfig {
            block_size: 4,
            ..Default::default()
        };
        assert_eq!(c.validate().unwrap_err().field, "block_size");
    }

    #[test]
    fn unchunked_prefill_needs_budget_for_a_whole_prompt() {
        let c = SchedulerConfig {
            enable_chunked_prefill: false,
            max_model_len: Some(4096),
            max_num_batched_tokens: 2048,
            ..Default::default()
        };
        assert_eq!(c.validate().unwrap_err().field, "max_num_batched_tokens");
    }
}
