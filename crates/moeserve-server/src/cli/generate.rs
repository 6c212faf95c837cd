//! `moeserve generate`: one prompt, or a JSONL file of prompts run together through the engine
//! (the offline batch API); printed as text or as one JSON object per prompt, in input order.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use moeserve_core::SamplingParams;
use moeserve_engine::assets::ModelAssets;
use moeserve_engine::moe::MoeRequestCounts;
use moeserve_engine::offline::LlmEngine;
use moeserve_engine::request::{
    FinishReason, GenerateOutput, GenerateRequest, Prompt, RequestTimings,
};
use moeserve_text::chat_template::ChatMessage;
use serde::{Deserialize, Serialize};

use super::engine_args::EngineArgs;

#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// Model directory in Hugging Face format, or a hub id (`org/name`) in the Hugging Face
    /// cache or downloaded into it (as `serve --model`).
    #[arg(long)]
    model: PathBuf,
    /// The branch, tag or commit of a hub model.
    #[arg(long, default_value = "main")]
    revision: String,
    /// The Hugging Face cache to look in and download to (default: as huggingface_hub finds it).
    #[arg(long)]
    download_dir: Option<PathBuf>,
    /// Prompt text (with --chat: the user message).
    #[arg(long, group = "input")]
    prompt: Option<String>,
    /// Prompt as comma-separated token ids.
    #[arg(long, value_delimiter = ',', group = "input")]
    prompt_ids: Option<Vec<u32>>,
    /// A JSONL file, one request per line: {"prompt": "..."} or {"prompt_ids": [...]}, optionally
    /// with max_tokens, temperature, top_p, top_k, seed, ignore_eos, logprobs.
    #[arg(long, group = "input")]
    prompts_file: Option<PathBuf>,
    /// Wrap text prompts as a user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// 0 is greedy (the default here, so a plain run is reproducible).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// 0 keeps all tokens.
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long)]
    seed: Option<u64>,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Report the top K alternatives of every generated token.
    #[arg(long)]
    logprobs: Option<usize>,
    /// Print one JSON object per prompt instead of the text.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    engine: EngineArgs,
}

/// One line of `--prompts-file`; absent fields take the command-line values.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PromptLine {
    prompt: Option<String>,
    prompt_ids: Option<Vec<u32>>,
    max_tokens: Option<usize>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<usize>,
    seed: Option<u64>,
    ignore_eos: Option<bool>,
    logprobs: Option<usize>,
}

/// The `--json` output of one request.
#[derive(Serialize)]
struct JsonOutput<'a> {
    prompt_ids: &'a [u32],
    token_ids: &'a [u32],
    text: &'a str,
    logprobs: &'a [f32],
    #[serde(skip_serializing_if = "Option::is_none")]
    top_logprobs: Option<&'a [Vec<(u32, f32)>]>,
    finish_reason: FinishReason,
    timings: RequestTimings,
    /// The request's (token, expert) pairs and what capacity did to them (with a capacity
    /// factor only).
    #[serde(skip_serializing_if = "Option::is_none")]
    moe: Option<MoeRequestCounts>,
}

pub fn run(mut args: GenerateArgs) -> anyhow::Result<()> {
    let device = super::device::select(args.engine.device)?;
    args.model =
        super::model_source::resolve(&args.model, &args.revision, args.download_dir.as_deref())?
            .dir;
    args.engine.init_kernels(&args.model)?;
    let start = Instant::now();
    let assets = ModelAssets::load_for(&args.model, &device)
        .with_context(|| format!("loading {}", args.model.display()))?;
    tracing::info!(
        "loaded {} in {:.2} s ({:.2} GB of weights, kernels: {}, quantization: {})",
        args.model.display(),
        start.elapsed().as_secs_f64(),
        assets.model.weight_bytes() as f64 / 1e9,
        super::device::kernels_name(&device),
        assets.model.quantization_summary()
    );
    let requests = requests(&args)?;
    let mut engine = LlmEngine::new(Arc::new(assets), &args.engine.to_config(device))?;
    let stats = engine.core().stats();
    let tokens = (stats.num_kv_blocks * args.engine.block_size).max(1) as u64;
    tracing::info!(
        "KV cache: {} blocks of {} tokens ({:.2} GB; {} bytes per token: {} in {}), max concurrency \
         at {} tokens: {:.1}",
        stats.num_kv_blocks,
        args.engine.block_size,
        stats.kv_cache_bytes as f64 / 1e9,
        stats.kv_cache_bytes / tokens,
        engine.core().assets().model.config().kv_cache_row_summary(),
        stats.kv_cache_dtype,
        stats.max_model_len,
        stats.max_concurrency_at_max_len
    );
    let progress = indicatif::ProgressBar::new(requests.len() as u64);
    if requests.len() == 1 {
        progress.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let start = Instant::now();
    let results = engine.generate(requests, |done, _| progress.set_position(done as u64));
    progress.finish_and_clear();
    let secs = start.elapsed().as_secs_f64();
    let generated: usize = results.iter().flatten().map(|o| o.token_ids.len()).sum();
    tracing::info!(
        "{} requests, {generated} generated tokens in {secs:.2} s ({:.1} tokens/s)",
        results.len(),
        generated as f64 / secs
    );
    report_moe(&engine.core().moe_stats());
    let mut failed = 0;
    for (i, result) in results.iter().enumerate() {
        match result {
            Ok(output) => print_output(output, &args, i, results.len())?,
            Err(e) => {
                failed += 1;
                if args.json {
                    println!("{}", serde_json::json!({ "error": e.to_string() }));
                } else {
                    tracing::error!("request {i}: {e}");
                }
            }
        }
    }
    anyhow::ensure!(failed == 0, "{failed} of {} requests failed", results.len());
    Ok(())
}

fn print_output(
    output: &GenerateOutput,
    args: &GenerateArgs,
    index: usize,
    total: usize,
) -> anyhow::Result<()> {
    if args.json {
        let json = JsonOutput {
            prompt_ids: &output.prompt_ids,
            token_ids: &output.token_ids,
            text: &output.text,
            logprobs: &output.logprobs,
            top_logprobs: args.logprobs.map(|_| output.top_logprobs.as_slice()),
            finish_reason: output.finish_reason,
            timings: output.timings,
            moe: output.moe,
        };
        println!("{}", serde_json::to_string(&json)?);
    } else if total == 1 {
        println!("{}", output.text);
    } else {
        println!("--- {index} ---\n{}", output.text);
    }
    Ok(())
}

fn default_params(args: &GenerateArgs) -> SamplingParams {
    SamplingParams {
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        seed: args.seed,
        max_tokens: args.max_tokens,
        ignore_eos: args.ignore_eos,
        logprobs: args.logprobs,
        ..SamplingParams::default()
    }
}

fn text_prompt(text: String, chat: bool) -> Prompt {
    match chat {
        true => Prompt::chat(vec![ChatMessage::new("user", text)]),
        false => Prompt::Text(text),
    }
}

fn requests(args: &GenerateArgs) -> anyhow::Result<Vec<GenerateRequest>> {
    let params = default_params(args);
    if let Some(path) = &args.prompts_file {
        return read_prompts_file(path, &params, args.chat);
    }
    let prompt = match (&args.prompt, &args.prompt_ids) {
        (Some(text), _) => text_prompt(text.clone(), args.chat),
        (None, Some(ids)) => Prompt::TokenIds(ids.clone()),
        (None, None) => anyhow::bail!("give --prompt, --prompt-ids or --prompts-file"),
    };
    Ok(vec![GenerateRequest {
        prompt,
        params,
        grammar: None,
        routed_experts: Default::default(),
    }])
}

pub(super) fn read_prompts_file(
    path: &Path,
    defaults: &SamplingParams,
    chat: bool,
) -> anyhow::Result<Vec<GenerateRequest>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut requests = Vec::new();
    for (n, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let at = || format!("{}:{}", path.display(), n + 1);
        let line: PromptLine = serde_json::from_str(line).with_context(at)?;
        let prompt = match (line.prompt, line.prompt_ids) {
            (Some(text), None) => text_prompt(text, chat),
            (None, Some(ids)) => Prompt::TokenIds(ids),
            _ => anyhow::bail!("{}: give exactly one of \"prompt\" or \"prompt_ids\"", at()),
        };
        let d = defaults;
        let params = SamplingParams {
            max_tokens: line.max_tokens.unwrap_or(d.max_tokens),
            temperature: line.temperature.unwrap_or(d.temperature),
            top_p: line.top_p.unwrap_or(d.top_p),
            top_k: line.top_k.unwrap_or(d.top_k),
            seed: line.seed.or(d.seed),
            ignore_eos: line.ignore_eos.unwrap_or(d.ignore_eos),
            logprobs: line.logprobs.or(d.logprobs),
            ..d.clone()
        };
        requests.push(GenerateRequest {
            prompt,
            params,
            grammar: None,
            routed_experts: Default::default(),
        });
    }
    anyhow::ensure!(!requests.is_empty(), "{} holds no requests", path.display());
    Ok(requests)
}

/// One stderr line about routing when capacity or expert parallelism is in play.
fn report_moe(moe: &moeserve_engine::moe::MoeStats) {
    if moe.capacity_factor.is_none() && moe.expert_parallel_size <= 1 {
        return;
    }
    let (pairs, dropped, rerouted) = moe.layers.iter().fold((0, 0, 0), |(p, d, r), l| {
        (p + l.pairs, d + l.dropped, r + l.rerouted)
    });
    let rebalances: Vec<String> = moe
        .rebalances
        .iter()
        .map(|r| {
            let realised = r
                .realised_imbalance
                .map_or("?".to_string(), |v| format!("{v:.3}"));
            format!(
                "step {}: {:.3} -> predicted {:.3}, realised {realised}",
                r.step, r.imbalance_before, r.predicted_imbalance
            )
        })
        .collect();
    tracing::info!(
        "moe: {pairs} pairs, {dropped} dropped, {rerouted} rerouted; windowed step imbalance {:.3}; {} rebalances [{}]",
        moe.step_imbalance,
        moe.num_rebalances,
        rebalances.join("; ")
    );
}
