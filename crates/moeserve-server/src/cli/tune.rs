//! `moeserve tune capacity-factor`: picks the capacity factor α with data. Per α and overflow
//! policy it reports the dropped-pair rate and, when it runs the prompts, the step time, TPOT
//! and the quality loss against dropless routing; it recommends the smallest α within the
//! quality budget.
//!
//! Two sources:
//! - `--trace FILE`: a routing trace (`--record-routing` of `serve` or `generate`) replayed at
//!   each α (`tune/replay.rs`): exact drop counts for the batches that were served, no model run.
//! - `--prompts FILE`: the prompts run greedily through the engine (offline, continuously
//!   batched) once dropless, recording its routing, and once per α × policy; quality is measured
//!   against the dropless run (`tune/quality.rs`), and the dropless trace is replayed as well.

mod quality;
mod replay;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use clap::{Args, Subcommand};
use moeserve_core::{OverflowPolicy, SamplingParams};
use moeserve_engine::assets::ModelAssets;
use moeserve_engine::engine_core::EngineConfig;
use moeserve_engine::moe::MoeRequestCounts;
use moeserve_engine::offline::LlmEngine;
use moeserve_engine::placement::{RoutingTraceReader, RoutingTraceRecord};
use moeserve_engine::request::{GenerateOutput, GenerateRequest};
use moeserve_model::config::ModelConfig;
use serde::Serialize;

use self::quality::Quality;
use self::replay::ReplayCounts;
use super::engine_args::parse_size;

#[derive(Debug, Subcommand)]
pub enum TuneCommand {
    /// Capacity factor α × overflow policy: drop rates, step time, quality against dropless.
    CapacityFactor(CapacityFactorArgs),
}

#[derive(Debug, Args)]
pub struct CapacityFactorArgs {
    /// Model directory (its config gives the number of experts; --prompts runs it).
    #[arg(long)]
    model: PathBuf,
    /// A routing trace (JSONL from --record-routing) to replay.
    #[arg(long, group = "source", required = true)]
    trace: Option<PathBuf>,
    /// Prompts to run (JSONL as `generate --prompts-file`: {"prompt": ...} or {"prompt_ids": [...]}).
    #[arg(long, group = "source", required = true)]
    prompts: Option<PathBuf>,
    /// Capacity factors to try.
    #[arg(long, value_delimiter = ',', default_value = "1.0,1.25,1.5,2.0")]
    alphas: Vec<f32>,
    /// Overflow policies to try: drop, reroute, spill.
    #[arg(long, value_delimiter = ',', default_value = "drop,reroute")]
    policies: Vec<OverflowPolicy>,
    /// Largest acceptable mean |Δlogprob| (nats per token) against dropless; with --trace only,
    /// the largest acceptable dropped-pair rate.
    #[arg(long, default_value_t = 0.01)]
    quality_budget: f64,
    /// Output tokens per prompt (--prompts; greedy, ignoring end-of-sequence).
    #[arg(long, default_value_t = 32)]
    max_tokens: usize,
    /// Sequences batched together (--prompts; default: all prompts at once).
    #[arg(long)]
    max_num_seqs: Option<usize>,
    #[arg(long, default_value = "2GiB", value_parser = parse_size)]
    kv_cache_memory: u64,
    /// Keep the dropless run's routing trace here (--prompts).
    #[arg(long)]
    record_routing: Option<PathBuf>,
    /// Also write the table as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// One row of the table.
#[derive(Debug, Serialize)]
struct Row {
    alpha: Option<f32>,
    policy: String,
    /// Replayed from the (dropless) trace; `None` for reroute (see `replay`).
    replayed: Option<ReplayCounts>,
    /// Measured in the run (--prompts).
    measured: Option<Measured>,
}

/// One engine run over the prompts.
#[derive(Debug, Serialize)]
struct Measured {
    dropped_rate: f64,
    rerouted_rate: f64,
    spilled_rate: f64,
    mean_step_ms: f64,
    mean_tpot_ms: f64,
    output_tokens_per_s: f64,
    quality: Quality,
}

#[derive(Serialize)]
struct Report<'a> {
    source: String,
    quality_budget: f64,
    rows: &'a [Row],
    recommendation: Option<Recommendation>,
}

#[derive(Clone, Debug, Serialize)]
struct Recommendation {
    alpha: f32,
    policy: String,
    /// What the budget was checked against.
    measure: &'static str,
    value: f64,
}

pub fn run(command: TuneCommand) -> anyhow::Result<()> {
    match command {
        TuneCommand::CapacityFactor(args) => capacity_factor(args),
    }
}

fn capacity_factor(args: CapacityFactorArgs) -> anyhow::Result<()> {
    anyhow::ensure!(!args.alphas.is_empty(), "--alphas is empty");
    for &alpha in &args.alphas {
        anyhow::ensure!(
            alpha.is_finite() && alpha > 0.0,
            "--alphas: {alpha} is not a positive number"
        );
    }
    let config = ModelConfig::from_dir(&args.model)
        .with_context(|| format!("reading {}", args.model.display()))?;
    let (source, rows) = match (&args.trace, &args.prompts) {
        (Some(trace), _) => {
            let records = read_trace(trace, config.num_experts_per_tok)?;
            let rows = replay_rows(&args, &records, config.num_local_experts, None);
            (format!("trace {}", trace.display()), rows)
        }
        (None, Some(prompts)) => (
            format!("prompts {}", prompts.display()),
            run_prompts(&args, prompts, config.num_local_experts)?,
        ),
        (None, None) => anyhow::bail!("give --trace or --prompts"),
    };
    let recommendation = recommend(&rows, args.quality_budget);
    print!("{}", table(&rows));
    match &recommendation {
        Some(r) => println!(
            "recommended: --capacity-factor {} --moe-overflow {} ({} {:.4} ≤ budget {})",
            r.alpha, r.policy, r.measure, r.value, args.quality_budget
        ),
        None => println!(
            "no α tried stays within the budget {}: keep dropless routing (no --capacity-factor)",
            args.quality_budget
        ),
    }
    if let Some(path) = &args.json {
        let report = Report {
            source,
            quality_budget: args.quality_budget,
            rows: &rows,
            recommendation,
        };
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn read_trace(path: &Path, top_k: usize) -> anyhow::Result<Vec<RoutingTraceRecord>> {
    let records: Vec<RoutingTraceRecord> = RoutingTraceReader::open(path)?
        .collect::<Result<_, _>>()
        .with_context(|| format!("reading the routing trace {}", path.display()))?;
    anyhow::ensure!(!records.is_empty(), "{} holds no routing", path.display());
    if let Some(bad) = records
        .iter()
        .flat_map(|r| &r.experts)
        .find(|t| t.len() != top_k)
    {
        anyhow::bail!(
            "{}: a token has {} experts but the model routes to {top_k}; is it this model's trace?",
            path.display(),
            bad.len()
        );
    }
    Ok(records)
}

/// Rows from replaying `records`; `measured` fills in the runs' figures when there are any.
fn replay_rows(
    args: &CapacityFactorArgs,
    records: &[RoutingTraceRecord],
    num_experts: usize,
    mut measured: Option<&mut dyn FnMut(f32, OverflowPolicy) -> anyhow::Result<Measured>>,
) -> Vec<Row> {
    let mut rows = Vec::new();
    for &alpha in &args.alphas {
        for &policy in &args.policies {
            let replayed = (policy != OverflowPolicy::Reroute)
                .then(|| replay::replay(records, num_experts, alpha, policy));
            let measured = match measured.as_mut() {
                Some(run) => match run(alpha, policy) {
                    Ok(m) => Some(m),
                    Err(e) => {
                        tracing::warn!("α = {alpha}, {policy}: {e:#}");
                        None
                    }
                },
                None => None,
            };
            rows.push(Row {
                alpha: Some(alpha),
                policy: policy.to_string(),
                replayed,
                measured,
            });
        }
    }
    rows
}

/// The engine runs of `--prompts`: dropless first (its trace is replayed), then every α × policy.
fn run_prompts(
    args: &CapacityFactorArgs,
    prompts: &Path,
    num_experts: usize,
) -> anyhow::Result<Vec<Row>> {
    let defaults = SamplingParams {
        temperature: 0.0,
        max_tokens: args.max_tokens,
        ignore_eos: true,
        logprobs: Some(20),
        ..SamplingParams::default()
    };
    let requests = super::generate::read_prompts_file(prompts, &defaults, false)?;
    let assets = Arc::new(
        ModelAssets::load(&args.model)
            .with_context(|| format!("loading {}", args.model.display()))?,
    );
    let scratch = std::env::temp_dir().join(format!("moeserve-tune-{}.jsonl", std::process::id()));
    let trace_path = args.record_routing.clone().unwrap_or(scratch.clone());
    let mut base_config = EngineConfig::default();
    base_config.cache.kv_cache_memory = Some(args.kv_cache_memory);
    base_config.scheduler.max_num_seqs = args.max_num_seqs.unwrap_or(requests.len());
    let mut dropless_config = base_config.clone();
    dropless_config.moe.record_routing = Some(trace_path.clone());
    tracing::info!("dropless: {} prompts", requests.len());
    let (reference, dropless) = run_engine(&assets, &dropless_config, &requests, None)?;
    let records = read_trace(&trace_path, assets.model.config().num_experts_per_tok);
    if args.record_routing.is_none() {
        let _ = std::fs::remove_file(&scratch);
    }
    let records = records?;
    let mut measure = |alpha: f32, policy: OverflowPolicy| -> anyhow::Result<Measured> {
        tracing::info!("α = {alpha}, {policy}");
        let mut config = base_config.clone();
        config.moe.capacity_factor = Some(alpha);
        config.moe.moe_overflow = policy;
        Ok(run_engine(&assets, &config, &requests, Some(&reference))?.1)
    };
    let mut rows = vec![Row {
        alpha: None,
        policy: "dropless".into(),
        replayed: None,
        measured: Some(dropless),
    }];
    rows.extend(replay_rows(args, &records, num_experts, Some(&mut measure)));
    Ok(rows)
}

/// Runs `requests` once; quality is measured against `reference` when given (else perfect).
fn run_engine(
    assets: &Arc<ModelAssets>,
    config: &EngineConfig,
    requests: &[GenerateRequest],
    reference: Option<&[GenerateOutput]>,
) -> anyhow::Result<(Vec<GenerateOutput>, Measured)> {
    let mut engine = LlmEngine::new(assets.clone(), config)?;
    let start = Instant::now();
    let outputs = engine
        .generate(requests.to_vec(), |_, _| {})
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    let seconds = start.elapsed().as_secs_f64();
    let steps = engine.core().stats().num_steps.max(1);
    let mut moe = MoeRequestCounts::default();
    outputs
        .iter()
        .filter_map(|o| o.moe.as_ref())
        .for_each(|c| moe.accumulate(c));
    let rate = |n: u64| {
        if moe.pairs == 0 {
            0.0
        } else {
            n as f64 / moe.pairs as f64
        }
    };
    let tpots: Vec<f64> = outputs
        .iter()
        .filter(|o| o.token_ids.len() > 1)
        .map(|o| o.timings.decode_seconds / (o.token_ids.len() - 1) as f64)
        .collect();
    let generated: usize = outputs.iter().map(|o| o.token_ids.len()).sum();
    let quality = match reference {
        Some(reference) => quality::compare(reference, &outputs),
        None => quality::compare(&outputs, &outputs),
    };
    let measured = Measured {
        dropped_rate: rate(moe.dropped),
        rerouted_rate: rate(moe.rerouted),
        spilled_rate: rate(moe.spilled),
        mean_step_ms: seconds * 1e3 / steps as f64,
        mean_tpot_ms: tpots.iter().sum::<f64>() * 1e3 / tpots.len().max(1) as f64,
        output_tokens_per_s: generated as f64 / seconds,
        quality,
    };
    Ok((outputs, measured))
}

/// The smallest α within the budget: by mean |Δlogprob| when the prompts ran, else by the
/// replayed dropped-pair rate. Ties in α go to the policy listed first.
///
/// NOTE: `spill` is never recommended: it computes every pair (dropless results at any α), so
/// its α only sets the size of the extra passes and trades no quality for time.
fn recommend(rows: &[Row], budget: f64) -> Option<Recommendation> {
    let candidates = rows.iter().filter_map(|row| {
        let alpha = row.alpha?;
        if row.policy == OverflowPolicy::Spill.to_string() {
            return None;
        }
        let (measure, value) = match (&row.measured, &row.replayed) {
            (Some(m), _) => ("mean |Δlogprob|", m.quality.mean_abs_delta_logprob),
            (None, Some(r)) => ("replayed dropped-pair rate", r.dropped_rate()),
            (None, None) => return None,
        };
        (value <= budget).then(|| Recommendation {
            alpha,
            policy: row.policy.clone(),
            measure,
            value,
        })
    });
    candidates.fold(None, |best: Option<Recommendation>, c| match best {
        Some(b) if b.alpha <= c.alpha => Some(b),
        _ => Some(c),
    })
}

/// The rows as a Markdown table (replay columns only when nothing ran).
fn table(rows: &[Row]) -> String {
    let ran = rows.iter().any(|r| r.measured.is_some());
    let mut out = String::from(if ran {
        "| α | policy | replayed dropped pairs | dropped tokens | dropped pairs | rerouted pairs | step (ms) | TPOT (ms) | output tok/s | greedy agreement | mean abs Δlogprob |\n\
         |---|---|---|---|---|---|---|---|---|---|---|\n"
    } else {
        "| α | policy | replayed dropped pairs | dropped tokens |\n|---|---|---|---|\n"
    });
    let pct = |v: f64| format!("{:.2} %", 100.0 * v);
    for row in rows {
        let alpha = row.alpha.map_or("–".into(), |a| a.to_string());
        let (replayed, tokens) = match &row.replayed {
            Some(r) if row.policy == "spill" => (
                format!(
                    "0 ({} spilled, ≤ {} passes)",
                    pct(r.spilled_rate()),
                    r.max_passes
                ),
                "0".into(),
            ),
            Some(r) => (pct(r.dropped_rate()), r.dropped_tokens.to_string()),
            None if row.alpha.is_none() => ("0 %".into(), "0".into()),
            None => ("n/a (top-k trace)".into(), "–".into()),
        };
        let measured = match &row.measured {
            Some(m) => format!(
                "{} | {} | {:.1} | {:.1} | {:.1} | {:.1} % | {}{:.4}",
                pct(m.dropped_rate),
                pct(m.rerouted_rate),
                m.mean_step_ms,
                m.mean_tpot_ms,
                m.output_tokens_per_s,
                100.0 * m.quality.greedy_agreement,
                // A lower bound when some dropless token fell outside the top logprobs.
                if m.quality.num_bounded > 0 {
                    "≥ "
                } else {
                    ""
                },
                m.quality.mean_abs_delta_logprob
            ),
            None => "– | – | – | – | – | – | –".into(),
        };
        out += &match ran {
            true => format!(
                "| {alpha} | {} | {replayed} | {tokens} | {measured} |\n",
                row.policy
            ),
            false => format!("| {alpha} | {} | {replayed} | {tokens} |\n", row.policy),
        };
    }
    out
}
