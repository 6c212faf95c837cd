//! `moeserve quantize`: an int8 checkpoint made with GPTQ (calibrated on text sampled from the
//! model itself), which `--quantization int8` then loads instead of rounding at load; or with
//! `--bits 4` a GPTQ int4 checkpoint in the format transformers and vLLM load.

use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use moeserve_model::quantize::{GptqOptions, QuantFormat, QuantizeOptions, quantize_checkpoint};

#[derive(Debug, Args)]
pub struct QuantizeArgs {
    /// The model directory (a Hugging Face checkpoint of a supported family in bf16, f16 or
    /// f32).
    #[arg(long)]
    model: PathBuf,
    /// Output directory: the source's files (hard-linked where possible), the int8 tensors and
    /// `quantization_config` in config.json; with `--bits 4`, a GPTQ checkpoint.
    #[arg(long)]
    out: PathBuf,
    /// Bits per weight: 8 (moeserve's int8 rows beside the source's tensors, a scale and offset
    /// per 64 inputs) or 4 (a GPTQ int4 checkpoint: act-order, static asymmetric groups).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u8).range(4..=8))]
    bits: u8,
    /// Inputs per scale and zero point with `--bits 4` (a multiple of 8).
    #[arg(long, default_value_t = 128)]
    group_size: usize,
    /// The 4-bit checkpoint's format (`--bits 4`): GPTQ's, as AutoGPTQ, GPTQModel and
    /// optimum write it.
    #[arg(long, value_parser = ["gptq"])]
    format: Option<String>,
    /// Calibration sequences sampled from the model.
    #[arg(long, default_value_t = 32)]
    calibration_samples: usize,
    /// Tokens per calibration sequence.
    #[arg(long, default_value_t = 256)]
    calibration_len: usize,
    /// Seed of the calibration samples.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// GPTQ's damping: this fraction of the mean Hessian diagonal is added to it.
    #[arg(long, default_value_t = 0.01)]
    damp: f32,
    /// Most memory for the calibration Hessians (4·k² bytes per matrix input): the layers are
    /// calibrated and quantized in groups that fit, one pass over the calibration text each.
    #[arg(long, default_value = "8GiB", value_parser = super::engine_args::parse_size)]
    max_hessian_memory: u64,
    /// Threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
}

pub fn run(args: QuantizeArgs) -> anyhow::Result<()> {
    let threads = moeserve_backend::cpu::init_threads(args.threads).map_err(anyhow::Error::msg)?;
    let start = Instant::now();
    let opts = QuantizeOptions {
        samples: args.calibration_samples,
        sample_len: args.calibration_len,
        seed: args.seed,
        gptq: GptqOptions {
            damp: args.damp,
            ..GptqOptions::default()
        },
        max_hessian_bytes: args.max_hessian_memory,
        format: match args.bits {
            4 => QuantFormat::GptqInt4 {
                group_size: args.group_size,
            },
            8 if args.format.is_some() => {
                anyhow::bail!("--format gptq is the 4-bit checkpoint's format: add --bits 4")
            }
            8 => QuantFormat::Int8,
            other => anyhow::bail!("--bits {other}: 4 (GPTQ int4) or 8 (int8)"),
        },
    };
    tracing::info!(
        "quantizing {} to int{} with GPTQ ({threads} threads)",
        args.model.display(),
        args.bits
    );
    let mut progress =
        |what: &str| tracing::info!("[{:6.1} s] {what}", start.elapsed().as_secs_f64());
    let report = quantize_checkpoint(&args.model, &args.out, &opts, &mut progress)?;
    for (matrix, why) in &report.round_to_nearest {
        tracing::info!("rounded to nearest: {matrix}: {why}");
    }
    for matrix in &report.kept_in_float {
        tracing::warn!(
            "kept in float (GPTQ packs 8 values per word and takes whole groups of \
             --group-size {} inputs): {matrix}",
            args.group_size
        );
    }
    tracing::info!(
        "wrote {}: {} matrices, {} calibration tokens, {} calibration pass(es); sampling {:.1} s, \
         calibration {:.1} s, GPTQ {:.1} s ({} rounded to nearest)",
        args.out.display(),
        report.matrices,
        report.calibration_tokens,
        report.passes,
        report.sample_seconds,
        report.calibrate_seconds,
        report.gptq_seconds,
        report.round_to_nearest.len()
    );
    Ok(())
}
