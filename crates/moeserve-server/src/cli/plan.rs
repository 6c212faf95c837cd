//! `moeserve plan`: sizes a deployment from a `bench serve` result. The largest batch whose
//! TPOT (and TTFT) meets the target and whose KV cache fits, Little's law for the concurrency an
//! arrival rate needs and the replicas that implies, and the engine flags to run it with (the
//! planner itself is `moeserve_bench::planner`).
//!
//! NOTE: KV bytes per token come from the model's config (`--model DIR`, the engine's own
//! layout: keys and values of every layer in f32) or `--kv-bytes-per-token`; without either the
//! memory bound is left out and said so. A bench result does not carry them because it measures
//! any OpenAI-compatible server.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use moeserve_bench::planner::{KvMemory, PlanRequest, plan};
use moeserve_bench::report::BenchResult;
use moeserve_bench::stats::Statistic;
use moeserve_core::KvCacheDtype;
use moeserve_model::config::ModelConfig;
use moeserve_model::kv_cache::{KvCacheLayout, KvDtype};

use super::engine_args::parse_size;

/// The engine's KV cache default cap (`--kv-cache-memory` unset: a quarter of free memory, at
/// most 4 GiB), assumed when the flag is not given here.
const DEFAULT_KV_CACHE_BYTES: u64 = 4 << 30;

#[derive(Debug, Args)]
pub struct PlanArgs {
    /// A result file of `moeserve bench serve`.
    #[arg(long)]
    from: PathBuf,
    /// TPOT target, e.g. 50ms or 0.1s.
    #[arg(long, value_parser = parse_millis)]
    target_tpot: f64,
    /// TTFT target, e.g. 2s.
    #[arg(long, value_parser = parse_millis)]
    target_ttft: Option<f64>,
    /// Which statistic must meet the targets: mean, p50, p90, p99.
    #[arg(long, default_value = "p50")]
    percentile: Statistic,
    /// Arrival rate λ in requests per second, to size replicas with L = λ·W.
    #[arg(long)]
    arrival_rate: Option<f64>,
    /// Mean prompt tokens (default: the benchmark's).
    #[arg(long)]
    mean_prompt: Option<f64>,
    /// Mean output tokens (default: the benchmark's).
    #[arg(long)]
    mean_output: Option<f64>,
    /// The served model's directory: gives the KV bytes per token.
    #[arg(long)]
    model: Option<PathBuf>,
    /// KV bytes per token, when the model directory is not at hand.
    #[arg(long, conflicts_with = "model")]
    kv_bytes_per_token: Option<u64>,
    /// KV cache size of the server, e.g. 4GiB (default 4GiB, the engine's cap).
    #[arg(long, value_parser = parse_size)]
    kv_cache_memory: Option<u64>,
    /// The KV cache's element type as `serve --kv-cache-dtype` (auto and float32: 4 bytes per
    /// value on the CPU; bfloat16: 2).
    #[arg(long, default_value = "auto")]
    kv_cache_dtype: KvCacheDtype,
    /// Tokens per KV block of the server.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Print the plan as JSON.
    #[arg(long)]
    json: bool,
}

pub fn run(args: PlanArgs) -> anyhow::Result<()> {
    let result = BenchResult::load(&args.from)?;
    let config = args
        .model
        .as_deref()
        .map(|dir| ModelConfig::from_dir(dir).with_context(|| format!("reading {}", dir.display())))
        .transpose()?;
    let bytes_per_token = match (&config, args.kv_bytes_per_token) {
        (Some(config), _) => Some(kv_bytes_per_token(config, args.kv_cache_dtype)),
        (None, bytes) => bytes,
    };
    let row_summary = config.as_ref().map(ModelConfig::kv_cache_row_summary);
    let memory = bytes_per_token.map(|bytes_per_token| KvMemory {
        bytes_per_token,
        cache_bytes: args.kv_cache_memory.unwrap_or(DEFAULT_KV_CACHE_BYTES),
        block_size: args.block_size,
    });
    let request = PlanRequest {
        target_tpot_ms: args.target_tpot,
        target_ttft_ms: args.target_ttft,
        statistic: args.percentile,
        arrival_rate: args.arrival_rate,
        mean_prompt: args.mean_prompt.unwrap_or(result.setup.prompt_len),
        mean_output: args.mean_output.unwrap_or(result.setup.output_len),
        memory,
    };
    let plan = plan(&result, &request)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&plan)?);
        return Ok(());
    }
    println!(
        "from {} ({}, {} levels, {}): prompt {:.0}, output {:.0} tokens",
        args.from.display(),
        result.setup.model,
        result.levels.len(),
        result.date,
        request.mean_prompt,
        request.mean_output
    );
    match memory {
        Some(m) => println!(
            "KV cache: {} bytes per token{}, {:.2} GiB",
            m.bytes_per_token,
            row_summary.map_or(String::new(), |s| format!(" ({s})")),
            m.cache_bytes as f64 / (1u64 << 30) as f64
        ),
        None => println!("KV cache: not checked (give --model DIR or --kv-bytes-per-token)"),
    }
    print!("{}", plan.render(&request));
    Ok(())
}

/// Keys and values of every layer, as the CPU engine lays them out (MLA: the latent row), in
/// `dtype`.
fn kv_bytes_per_token(config: &ModelConfig, dtype: KvCacheDtype) -> u64 {
    let element = KvDtype::on_cpu(dtype).size_in_bytes();
    KvCacheLayout::for_model(config, 0, 1).bytes_per_token_in(element) as u64
}

/// `50ms`, `0.1s`, `2s` or a bare number of milliseconds → milliseconds.
fn parse_millis(text: &str) -> Result<f64, String> {
    let t = text.trim();
    let (number, scale) = if let Some(n) = t.strip_suffix("ms") {
        (n, 1.0)
    } else if let Some(n) = t.strip_suffix('s') {
        (n, 1e3)
    } else {
        (t, 1.0)
    };
    match number.trim().parse::<f64>() {
        Ok(v) if v > 0.0 && v.is_finite() => Ok(v * scale),
        _ => Err(format!("{text:?} is not a duration like 50ms or 2s")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_to_milliseconds() {
        assert_eq!(parse_millis("50ms"), Ok(50.0));
        assert_eq!(parse_millis("0.1s"), Ok(100.0));
        assert_eq!(parse_millis("2s"), Ok(2000.0));
        assert_eq!(parse_millis("75"), Ok(75.0));
        assert!(parse_millis("fast").is_err());
        assert!(parse_millis("-5ms").is_err());
    }
}
