//! `moeserve make-model`: random preset checkpoints, or a dense GGUF upcycled into experts.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use moeserve_core::DType;
use moeserve_formats::convert::{UpcycleOptions, upcycle_gguf};
use moeserve_formats::presets::{MakeModelOptions, Preset, make_model};

#[derive(Debug, Args)]
pub struct MakeModelArgs {
    /// A random preset (mixtral-tiny, mixtral-bench-1b, mixtral-8x7b-2l, mixtral-wide,
    /// qwen3-moe-30b-a3b-2l, qwen3-moe-tiny, deepseek-v2-lite-2l, deepseek-v3-2l, deepseek-v3-tiny,
    /// gpt-oss-20b-2l, gpt-oss-20b-2l-bf16, gpt-oss-tiny, gpt-oss-tiny-bf16).
    #[arg(
        long,
        conflicts_with = "from_gguf",
        required_unless_present = "from_gguf"
    )]
    preset: Option<String>,
    /// A dense llama-architecture GGUF to upcycle (every expert a copy of its MLP).
    #[arg(long)]
    from_gguf: Option<PathBuf>,
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Experts per layer when upcycling.
    #[arg(long, default_value_t = 8)]
    num_experts: usize,
    /// Experts per token when upcycling.
    #[arg(long, default_value_t = 2)]
    top_k: usize,
    /// Relative seeded noise per expert when upcycling (0 keeps the experts identical).
    #[arg(long, default_value_t = 0.0)]
    expert_jitter: f32,
    /// Stored dtype when upcycling: bf16, f16 or f32.
    #[arg(long, default_value = "bf16")]
    dtype: String,
}

pub fn run(args: MakeModelArgs) -> anyhow::Result<()> {
    let start = Instant::now();
    if let Some(gguf) = args.from_gguf {
        let dtype = DType::parse(&args.dtype)
            .with_context(|| format!("unknown --dtype {:?}", args.dtype))?;
        let report = upcycle_gguf(&UpcycleOptions {
            gguf,
            out: args.out.clone(),
            num_experts: args.num_experts,
            top_k: args.top_k,
            seed: args.seed,
            expert_jitter: args.expert_jitter,
            dtype,
        })?;
        tracing::info!("{report}");
    } else if let Some(name) = args.preset {
        let preset = Preset::from_name(&name)
            .with_context(|| format!("unknown preset {name:?} (presets: {})", Preset::names()))?;
        let made = make_model(&MakeModelOptions {
            preset,
            out: args.out.clone(),
            seed: args.seed,
        })?;
        tracing::info!("{made}");
    }
    tracing::info!("done in {:.1} s", start.elapsed().as_secs_f64());
    Ok(())
}
