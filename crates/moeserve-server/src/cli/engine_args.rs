//! Engine flags shared by `generate` and `serve`, named as vLLM's engine arguments.

use clap::Args;
use moeserve_backend::device::{Device, DeviceRequest};
use moeserve_core::{CacheConfig, KvCacheDtype, SchedulerConfig};
use moeserve_engine::engine_core::EngineConfig;

use super::moe_args::MoeArgs;

#[derive(Debug, Clone, Args)]
pub struct EngineArgs {
    /// Most sequences in one step.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Token budget of one step.
    #[arg(long, default_value_t = 2048)]
    pub max_num_batched_tokens: usize,
    /// Tokens per KV-cache block (8–256).
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// KV cache size, e.g. 4GiB, 512MiB, 2GB (default: a quarter of free memory, at most 4 GiB).
    #[arg(long, value_parser = parse_size)]
    pub kv_cache_memory: Option<u64>,
    /// Element type of the KV cache: auto (on the CPU f32, the activations' type, so a cached
    /// row is exactly what recomputing it gives; on CUDA the weights' dtype), float32, or
    /// bfloat16 (half the bytes per token: twice the tokens per --kv-cache-memory and half
    /// the bytes each decode step's attention reads; rows rounded to bf16 once, when written).
    #[arg(long, default_value = "auto")]
    pub kv_cache_dtype: KvCacheDtype,
    /// Share of the GPU's memory for weights and KV cache with `--device cuda` (sizes the KV
    /// cache when --kv-cache-memory is not given).
    #[arg(long, default_value_t = 0.9)]
    pub gpu_memory_utilization: f32,
    /// Longest prompt + output (default: the model's context length).
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Split long prompts across steps after the running decodes (on by default).
    #[arg(long, overrides_with = "no_enable_chunked_prefill")]
    pub enable_chunked_prefill: bool,
    #[arg(long, hide = true)]
    pub no_enable_chunked_prefill: bool,
    /// Reuse KV blocks across requests with a common prefix (on by default).
    #[arg(long, overrides_with = "no_enable_prefix_caching")]
    pub enable_prefix_caching: bool,
    #[arg(long, hide = true)]
    pub no_enable_prefix_caching: bool,
    /// Device: auto (CUDA when it can serve the model, else the CPU, saying why), cpu or cuda.
    #[arg(long, env = "MOESERVE_DEVICE", default_value = "auto")]
    pub device: DeviceRequest,
    /// Threads for the CPU kernels (default: one per core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Weight quantization: none (as stored) or int8 (a scale and offset per output row and
    /// 64 positions, multiplied in integers by activations quantized at run time to 15 bits
    /// per row and 64 positions; 0.56× the bytes per decode step of bf16). Default: int8
    /// for a checkpoint written by `moeserve quantize` (its GPTQ integers), else none; int8 on
    /// another checkpoint rounds its weights to nearest at load. Routers stay as stored.
    #[arg(long)]
    pub quantization: Option<moeserve_backend::cpu::WeightQuantization>,
    #[command(flatten)]
    pub moe: MoeArgs,
}

impl EngineArgs {
    /// Starts the kernels' thread pool (`--threads`) and fixes `--quantization` (by default
    /// what the checkpoint in `model` says); call once, before loading it. Returns the pool's
    /// size.
    pub fn init_kernels(&self, model: &std::path::Path) -> anyhow::Result<usize> {
        use moeserve_backend::cpu::WeightQuantization;
        let quantization = match self.quantization {
            Some(q) => q,
            // A directory without a readable config.json is reported by the loader.
            None => match moeserve_model::quantize::stored_int8(model) {
                Ok(true) => WeightQuantization::Int8,
                Ok(false) | Err(moeserve_model::ModelError::Io { .. }) => WeightQuantization::None,
                Err(e) => return Err(e.into()),
            },
        };
        moeserve_backend::cpu::set_weight_quantization(quantization).map_err(anyhow::Error::msg)?;
        moeserve_backend::cpu::init_threads(self.threads).map_err(anyhow::Error::msg)
    }

    /// The engine settings of these flags, running on `device` (from [`super::device::select`]).
    pub fn to_config(&self, device: Device) -> EngineConfig {
        EngineConfig {
            cache: CacheConfig {
                block_size: self.block_size,
                kv_cache_memory: self.kv_cache_memory,
                kv_cache_dtype: self.kv_cache_dtype,
                gpu_memory_utilization: self.gpu_memory_utilization,
                enable_prefix_caching: !self.no_enable_prefix_caching,
            },
            scheduler: SchedulerConfig {
                max_num_seqs: self.max_num_seqs,
                max_num_batched_tokens: self.max_num_batched_tokens,
                enable_chunked_prefill: !self.no_enable_chunked_prefill,
                max_model_len: self.max_model_len,
            },
            moe: self.moe.to_config(),
            device,
        }
    }
}

/// Parses `4GiB`, `512MiB`, `2GB`, `1024` (bytes), case-insensitively.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size like 4GiB or 512MiB"))?;
    let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1_000,
        "kib" => 1 << 10,
        "m" | "mb" => 1_000_000,
        "mib" => 1 << 20,
        "g" | "gb" => 1_000_000_000,
        "gib" => 1 << 30,
        other => {
            return Err(format!(
                "unknown size unit {other:?} in {text:?} (use B, KiB, MiB, GiB, KB, MB, GB)"
            ));
        }
    };
    Ok((value * scale as f64) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_and_decimal_units() {
        assert_eq!(parse_size("4GiB"), Ok(4 << 30));
        assert_eq!(parse_size("512mib"), Ok(512 << 20));
        assert_eq!(parse_size("2GB"), Ok(2_000_000_000));
        assert_eq!(parse_size("1024"), Ok(1024));
        assert!(parse_size("4XB").unwrap_err().contains("unknown size unit"));
        assert!(parse_size("lots").is_err());
    }
}
