//! `moeserve generate`: one prompt through the engine, printed as text or as one JSON object.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use moeserve_core::SamplingParams;
use moeserve_engine::assets::ModelAssets;
use moeserve_engine::offline::generate_one;
use moeserve_engine::request::{GenerateOutput, GenerateRequest, Prompt};
use moeserve_model::chat_template::ChatMessage;
use serde::Serialize;

#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// Model directory in Hugging Face format.
    #[arg(long)]
    model: PathBuf,
    /// Prompt text (with --chat: the user message).
    #[arg(
        long,
        conflicts_with = "prompt_ids",
        required_unless_present = "prompt_ids"
    )]
    prompt: Option<String>,
    /// Prompt as comma-separated token ids.
    #[arg(long, value_delimiter = ',')]
    prompt_ids: Option<Vec<u32>>,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long, requires = "prompt")]
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
    /// Print one JSON object instead of the text.
    #[arg(long)]
    json: bool,
}

/// The `--json` output.
#[derive(Serialize)]
struct JsonOutput<'a> {
    prompt_ids: &'a [u32],
    token_ids: &'a [u32],
    text: &'a str,
    logprobs: &'a [f32],
    #[serde(skip_serializing_if = "Option::is_none")]
    top_logprobs: Option<&'a [Vec<(u32, f32)>]>,
    finish_reason: moeserve_engine::request::FinishReason,
}

pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    let start = Instant::now();
    let assets = std::sync::Arc::new(
        ModelAssets::load(&args.model)
            .with_context(|| format!("loading {}", args.model.display()))?,
    );
    eprintln!(
        "loaded {} in {:.2} s ({:.2} GB of weights, kernels: {})",
        args.model.display(),
        start.elapsed().as_secs_f64(),
        assets.model.weight_bytes() as f64 / 1e9,
        moeserve_backend::cpu::isa()
    );
    let prompt = match (args.prompt, args.prompt_ids) {
        (Some(text), _) if args.chat => Prompt::Chat(vec![ChatMessage::new("user", text)]),
        (Some(text), _) => Prompt::Text(text),
        (None, Some(ids)) => Prompt::TokenIds(ids),
        (None, None) => anyhow::bail!("give --prompt or --prompt-ids"),
    };
    let params = SamplingParams {
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        seed: args.seed,
        max_tokens: args.max_tokens,
        ignore_eos: args.ignore_eos,
        logprobs: args.logprobs,
        ..SamplingParams::default()
    };
    let start = Instant::now();
    let output = generate_one(assets.clone(), GenerateRequest { prompt, params })?;
    let secs = start.elapsed().as_secs_f64();
    eprintln!(
        "{} prompt + {} generated tokens in {secs:.2} s ({:.1} tokens/s), finish reason {:?}",
        output.prompt_ids.len(),
        output.token_ids.len(),
        output.token_ids.len() as f64 / secs,
        output.finish_reason
    );
    if args.json {
        println!(
            "{}",
            serde_json::to_string(&json_output(&output, args.logprobs.is_some()))?
        );
    } else {
        println!("{}", output.text);
    }
    Ok(())
}

fn json_output(output: &GenerateOutput, with_top: bool) -> JsonOutput<'_> {
    JsonOutput {
        prompt_ids: &output.prompt_ids,
        token_ids: &output.token_ids,
        text: &output.text,
        logprobs: &output.logprobs,
        top_logprobs: with_top.then_some(output.top_logprobs.as_slice()),
        finish_reason: output.finish_reason,
    }
}
