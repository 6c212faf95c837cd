//! `moeserve bench offline`: B sequences of P random prompt tokens and N generated tokens
//! through the engine (no HTTP), timed in two phases, like llama-bench's pp / tg:
//!
//! - **prefill**: from submission until every sequence has its first token. Prefill tokens/s
//!   is B·P over that time; GFLOP/s counts the matmuls (2 FLOPs per active parameter per
//!   prompt token, lm_head once per sequence; attention scores left out).
//! - **decode**: the steps after that, when every sequence is decoding. Decode tokens/s is the
//!   tokens generated in them (summed over sequences) per second. Each step's weight bytes are
//!   the dense matrices plus every expert that step's routing hit (read from the engine's
//!   per-expert counters), so GB/s is what the step had to stream from memory at least.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Args;
use moeserve_core::SamplingParams;
use moeserve_engine::assets::ModelAssets;
use moeserve_engine::engine_core::{EngineCore, RequestEvent};
use moeserve_engine::request::{GenerateRequest, Prompt};
use rand::{Rng, SeedableRng};
use serde::Serialize;

use super::engine_args::EngineArgs;

#[derive(Debug, Args)]
pub struct BenchOfflineArgs {
    /// Model directory in Hugging Face format.
    #[arg(long)]
    model: PathBuf,
    /// Sequences run together.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Prompt tokens per sequence (random ids, seeded).
    #[arg(long, default_value_t = 128)]
    prompt_len: usize,
    /// Tokens generated per sequence (end-of-sequence ignored).
    #[arg(long, default_value_t = 64)]
    output_len: usize,
    /// Seed of the random prompts.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// Skip measuring the machine's read bandwidth and FMA peak (the ratios' denominators).
    #[arg(long)]
    no_probe: bool,
    #[command(flatten)]
    engine: EngineArgs,
}

/// The figures of one run (`--json`).
#[derive(Debug, Serialize)]
struct OfflineReport {
    model: String,
    kernels: String,
    quantization: String,
    threads: usize,
    batch: usize,
    prompt_len: usize,
    output_len: usize,
    prefill_seconds: f64,
    prefill_tokens_per_s: f64,
    prefill_gflops: f64,
    decode_steps: usize,
    decode_seconds: f64,
    /// Generated tokens per second, summed over all sequences.
    decode_tokens_per_s: f64,
    /// Mean over decode steps of the weight bytes a step read (dense + experts hit).
    decode_weight_bytes_per_step: f64,
    decode_gbps: f64,
    /// Mean decode step time in ms (the time per output token of each sequence).
    decode_step_ms: f64,
    /// Memory read bandwidth measured in this run, all threads (GB/s); `None` with --no-probe.
    stream_gbps: Option<f64>,
    /// decode_gbps / stream_gbps.
    decode_bandwidth_fraction: Option<f64>,
    /// f32 FMA peak of the kernels' ISA measured in this run, all threads (GFLOP/s).
    fma_peak_gflops: Option<f64>,
    /// prefill_gflops / fma_peak_gflops.
    prefill_peak_fraction: Option<f64>,
    /// Mean over decode steps of the matmul FLOPs a step did (2 per multiply-add: the
    /// dense and routed experts' matrices of every token, and the lm_head).
    decode_flops_per_step: f64,
    /// The roofline of a decode step over its measured time: max(weight bytes ÷ read
    /// bandwidth, FLOPs ÷ FMA peak), both measured in this run, ÷ the step's time.
    decode_roofline_fraction: Option<f64>,
}

pub fn run(args: BenchOfflineArgs) -> anyhow::Result<()> {
    if args.batch == 0 || args.prompt_len == 0 || args.output_len < 2 {
        bail!("--batch and --prompt-len must be at least 1 and --output-len at least 2");
    }
    let device = super::device::select(args.engine.device)?;
    let threads = args.engine.init_kernels(&args.model)?;
    let assets = Arc::new(
        ModelAssets::load_for(&args.model, &device)
            .with_context(|| format!("loading {}", args.model.display()))?,
    );
    let mut config = args.engine.to_config(device);
    config.scheduler.max_num_seqs = config.scheduler.max_num_seqs.max(args.batch);
    let mut core = EngineCore::new(assets.clone(), &config)?;
    let model = &assets.model;
    let vocab = model.config().vocab_size as u32;

    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(args.seed);
    // Requests that have not produced their first token yet.
    let mut prefilling = HashSet::new();
    for _ in 0..args.batch {
        // Ids from 3 up avoid the usual special tokens.
        let ids: Vec<u32> = (0..args.prompt_len)
            .map(|_| rng.random_range(3.min(vocab - 1)..vocab))
            .collect();
        let mut params = SamplingParams::greedy(args.output_len);
        params.ignore_eos = true;
        prefilling.insert(core.add_request(GenerateRequest {
            prompt: Prompt::TokenIds(ids),
            params,
            grammar: None,
            routed_experts: Default::default(),
        })?);
    }

    let start = Instant::now();
    while !prefilling.is_empty() {
        for event in core.step()? {
            match event {
                RequestEvent::Token { id, .. } => {
                    prefilling.remove(&id);
                }
                RequestEvent::Failed { error, .. } => bail!("a request failed: {error}"),
                RequestEvent::Finished { .. } => {}
            }
        }
    }
    let prefill_seconds = start.elapsed().as_secs_f64();

    let expert_hits = |core: &EngineCore| -> Vec<Vec<u64>> {
        core.moe_stats()
            .layers
            .into_iter()
            .map(|l| l.cumulative_load)
            .collect()
    };
    let dense = model.dense_matrix_bytes();
    let (mut decode_steps, mut decode_tokens, mut bytes) = (0usize, 0usize, 0f64);
    let mut before = expert_hits(&core);
    // Only the steps are timed: the per-expert snapshot below is the benchmark's bookkeeping.
    let mut decode_seconds = 0.0;
    while core.has_unfinished() {
        let step_start = Instant::now();
        let events = core.step()?;
        decode_seconds += step_start.elapsed().as_secs_f64();
        decode_steps += 1;
        for event in &events {
            match event {
                RequestEvent::Token { .. } => decode_tokens += 1,
                RequestEvent::Failed { error, .. } => bail!("a request failed: {error}"),
                RequestEvent::Finished { .. } => {}
            }
        }
        let after = expert_hits(&core);
        let mut step_bytes = dense;
        for (layer, (a, b)) in after.iter().zip(&before).enumerate() {
            if a.is_empty() {
                bail!("bench offline needs per-expert counters (drop --expert-metrics off)");
            }
            for (expert, (x, y)) in a.iter().zip(b).enumerate() {
                if x > y {
                    step_bytes += model.expert_bytes(layer, expert);
                }
            }
        }
        bytes += step_bytes as f64;
        before = after;
    }
    if decode_steps == 0 {
        bail!("no decode steps ran (output length {})", args.output_len);
    }

    // Measured after the run so the model's weights are not competing for the page cache.
    let (stream_gbps, fma_peak_gflops) = if args.no_probe {
        (None, None)
    } else {
        (
            Some(moeserve_backend::cpu::probe::read_bandwidth_gbps(
                1 << 30,
                5,
            )),
            Some(moeserve_backend::cpu::probe::fma_peak_gflops()),
        )
    };
    let prompt_tokens = (args.batch * args.prompt_len) as f64;
    let decode_flops_per_step = 2.0
        * (decode_tokens as f64 / decode_steps as f64)
        * (model.active_matmul_params() + model.lm_head_params()) as f64;
    let step_seconds = decode_seconds / decode_steps as f64;
    let bytes_per_step = bytes / decode_steps as f64;
    let prefill_flops = 2.0
        * (prompt_tokens * model.active_matmul_params() as f64
            + args.batch as f64 * model.lm_head_params() as f64);
    let report = OfflineReport {
        model: args.model.display().to_string(),
        kernels: super::device::kernels_name(&config.device),
        quantization: moeserve_backend::cpu::weight_quantization().to_string(),
        threads,
        batch: args.batch,
        prompt_len: args.prompt_len,
        output_len: args.output_len,
        prefill_seconds,
        prefill_tokens_per_s: prompt_tokens / prefill_seconds,
        prefill_gflops: prefill_flops / prefill_seconds / 1e9,
        decode_steps,
        decode_seconds,
        decode_tokens_per_s: decode_tokens as f64 / decode_seconds,
        decode_weight_bytes_per_step: bytes_per_step,
        decode_gbps: bytes / decode_seconds / 1e9,
        decode_step_ms: step_seconds * 1e3,
        stream_gbps,
        decode_bandwidth_fraction: stream_gbps.map(|s| bytes / decode_seconds / 1e9 / s),
        fma_peak_gflops,
        prefill_peak_fraction: fma_peak_gflops.map(|p| prefill_flops / prefill_seconds / 1e9 / p),
        decode_flops_per_step,
        decode_roofline_fraction: stream_gbps.zip(fma_peak_gflops).map(|(bw, peak)| {
            let bound = (bytes_per_step / (bw * 1e9)).max(decode_flops_per_step / (peak * 1e9));
            bound / step_seconds
        }),
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_report(&report);
    }
    Ok(())
}

fn print_report(r: &OfflineReport) {
    println!(
        "{} — batch {}, prompt {}, output {} ({} kernels, quantization {}, {} threads)",
        r.model, r.batch, r.prompt_len, r.output_len, r.kernels, r.quantization, r.threads
    );
    println!(
        "prefill: {:.1} tokens/s, {:.1} GFLOP/s ({:.2} s)",
        r.prefill_tokens_per_s, r.prefill_gflops, r.prefill_seconds
    );
    println!(
        "decode:  {:.1} tokens/s, {:.1} ms/step, {:.2} GB of weights per step, {:.1} GB/s \
         ({} steps, {:.2} s)",
        r.decode_tokens_per_s,
        r.decode_step_ms,
        r.decode_weight_bytes_per_step / 1e9,
        r.decode_gbps,
        r.decode_steps,
        r.decode_seconds
    );
    if let (Some(bw), Some(peak)) = (r.stream_gbps, r.fma_peak_gflops) {
        println!(
            "machine (this run): read bandwidth {bw:.1} GB/s → decode at {:.0} % of it; \
             f32 FMA peak {peak:.0} GFLOP/s → prefill at {:.0} % of it",
            100.0 * r.decode_gbps / bw,
            100.0 * r.prefill_gflops / peak
        );
    }
    if let Some(roofline) = r.decode_roofline_fraction {
        println!(
            "decode roofline: {:.1} GFLOP per step → {:.0} % of max(bytes ÷ bandwidth, FLOPs ÷ \
             peak)",
            r.decode_flops_per_step / 1e9,
            100.0 * roofline
        );
    }
}
