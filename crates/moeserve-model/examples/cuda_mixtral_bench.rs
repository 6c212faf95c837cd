//! Synthetic Mixtral-8x7B on one GPU, for `bench/gpu_check.sh`: the engine's CUDA forward
//! (`CudaMoeModel`) with seeded random bf16 weights generated on the device
//! (`CudaMoeModel::synthetic`; a 32-layer Mixtral-8x7B is ~93 GB and fits one H200), the shape of
//! the `mixtral-8x7b-2l` preset with `--layers` layers.
//!
//! It measures prefill tokens/s (every sequence's prompt in one step), decode tokens/s (one
//! token per sequence per step, greedy on the copied-back logits, as the engine samples), the
//! bytes a decode step must read (attention weights, the experts the router hit, the KV cache,
//! lm_head) over its time, and the device-to-device copy bandwidth of the same run. One JSON
//! object per line on stdout.
//!
//! NOTE: weights are random, so this measures speed, not quality.
//!
//! ```sh
//! cargo build --release --features cuda -p moeserve-model --example cuda_mixtral_bench
//! cuda_mixtral_bench --layers 32 --batch 1,16,64 --prompt-len 256 --decode-steps 32
//! ```

use std::path::Path;
use std::time::Instant;

use half::bf16;
use moeserve_backend::cuda::{CudaBackend, CudaError};
use moeserve_formats::presets::Preset;
use moeserve_model::batch::{ForwardBatch, SequenceSlice};
use moeserve_model::config::ModelConfig;
use moeserve_model::kv_cache::KvCacheLayout;
use moeserve_model::models::{CudaMoeModel, ForwardOptions, Greedy, GreedyRows};
use moeserve_model::moe::{MoeOptions, MoeStepRecord};

const BLOCK_SIZE: usize = 16;

/// Device-to-device copy bandwidth: (read + write bytes) / time of a 4 GiB copy, best of 5.
fn copy_bandwidth(gpu: &CudaBackend) -> Result<f64, CudaError> {
    let len = 1usize << 31; // 2^31 bf16 = 4 GiB
    let src = gpu.zeros::<bf16>(len)?;
    let mut dst = gpu.zeros::<bf16>(len)?;
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        gpu.synchronize()?;
        let start = Instant::now();
        gpu.stream().memcpy_dtod(&src, &mut dst)?;
        gpu.synchronize()?;
        best = best.min(start.elapsed().as_secs_f64());
    }
    Ok(2.0 * (len * 2) as f64 / best)
}

struct Args {
    layers: usize,
    batches: Vec<usize>,
    prompt_len: usize,
    decode_steps: usize,
}

fn parse_args() -> Args {
    let mut a = Args {
        layers: 32,
        batches: vec![1, 16, 64],
        prompt_len: 256,
        decode_steps: 32,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    for pair in argv.chunks(2) {
        let value = pair
            .get(1)
            .unwrap_or_else(|| panic!("{} needs a value", pair[0]));
        match pair[0].as_str() {
            "--layers" => a.layers = value.parse().expect("--layers N"),
            "--batch" => {
                a.batches = value
                    .split(',')
                    .map(|b| b.parse().expect("--batch 1,16,64"))
                    .collect()
            }
            "--prompt-len" => a.prompt_len = value.parse().expect("--prompt-len N"),
            "--decode-steps" => a.decode_steps = value.parse().expect("--decode-steps N"),
            other => {
                panic!("unknown flag {other} (--layers, --batch, --prompt-len, --decode-steps)")
            }
        }
    }
    a
}

fn main() -> std::process::ExitCode {
    match run(parse_args()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Mixtral-8x7B's shape (the `mixtral-8x7b-2l` preset's config) with `layers` layers.
fn mixtral_8x7b(layers: usize) -> Result<ModelConfig, Box<dyn std::error::Error>> {
    let mut spec = Preset::Mixtral8x7b2l.spec();
    spec.num_hidden_layers = layers;
    let json = spec.config_json().to_string();
    Ok(ModelConfig::from_json_str(
        &json,
        Path::new("mixtral-8x7b (synthetic)"),
    )?)
}

/// The greedy token of each logits row.
fn greedy(logits: &[f32], vocab: usize) -> Vec<u32> {
    logits
        .chunks_exact(vocab)
        .map(|row| {
            let best = row
                .iter()
                .enumerate()
                .fold(0, |b, (i, v)| if *v > row[b] { i } else { b });
            best as u32
        })
        .collect()
}

/// Runs one step of `ids[s]` for each sequence `s` (its own blocks from `s * max_blocks`),
/// positions from `start`; returns the greedy tokens and the experts hit.
fn step(
    model: &mut CudaMoeModel,
    vocab: usize,
    ids: &[Vec<u32>],
    start: usize,
    max_blocks: usize,
) -> Result<(Vec<u32>, usize), Box<dyn std::error::Error>> {
    let tables: Vec<Vec<u32>> = (0..ids.len())
        .map(|s| {
            let first = (s * max_blocks) as u32;
            (first..first + max_blocks as u32).collect()
        })
        .collect();
    let mut token_ids = Vec::new();
    let mut seqs = Vec::new();
    for (s, new) in ids.iter().enumerate() {
        let len = start + new.len();
        seqs.push(SequenceSlice {
            query_start: token_ids.len(),
            query_len: new.len(),
            context_len: len,
            block_table: &tables[s][..len.div_ceil(BLOCK_SIZE)],
        });
        token_ids.extend_from_slice(new);
    }
    let mut record = MoeStepRecord::default();
    // Greedy on the device, as the engine asks for greedy requests: two numbers per sequence
    // come back, not a vocabulary of logits.
    let mut greedy_rows = GreedyRows {
        wanted: vec![true; ids.len()],
        ..Default::default()
    };
    let logits = model.forward(
        &ForwardBatch {
            token_ids: &token_ids,
            sequences: &seqs,
        },
        ForwardOptions {
            moe: MoeOptions {
                record: Some(&mut record),
                ..Default::default()
            },
            greedy: Some(&mut greedy_rows),
            ..Default::default()
        },
    )?;
    let tokens = match greedy_rows.reduced.is_empty() {
        true => greedy(&logits, vocab),
        false => greedy_rows
            .reduced
            .iter()
            .map(|g| match g {
                Greedy::Token { id, .. } => Ok(*id),
                other => Err(format!("greedy row: {other:?}")),
            })
            .collect::<Result<_, _>>()?,
    };
    let hit = record
        .layers
        .iter()
        .map(|l| l.expert_load.iter().filter(|n| **n > 0).count())
        .sum();
    Ok((tokens, hit))
}

fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let gpu = CudaBackend::new(0)?;
    let copy_bw = copy_bandwidth(&gpu)?;
    drop(gpu);
    println!(
        "{{\"metric\":\"d2d_copy_bandwidth_gbs\",\"value\":{:.1}}}",
        copy_bw / 1e9
    );
    let c = mixtral_8x7b(args.layers)?;
    let max_batch = *args.batches.iter().max().expect("a batch size");
    let max_blocks = (args.prompt_len + args.decode_steps + 1).div_ceil(BLOCK_SIZE);
    let layout = KvCacheLayout::for_model(&c, max_batch * max_blocks, BLOCK_SIZE);
    let start = Instant::now();
    let mut model = CudaMoeModel::synthetic(c.clone(), layout, 0, 0)?;
    // The step's buffers once, for the largest prefill, as the engine does at start-up.
    let max_context = args.prompt_len + args.decode_steps + 1;
    model.reserve(max_batch * args.prompt_len, max_batch, max_context)?;
    let (h, i, v) = (c.hidden_size, c.intermediate_size, c.vocab_size);
    let expert_bytes = 3 * i * h * 2;
    let attention_bytes = c.num_hidden_layers * 2 * (c.q_dim() + c.kv_dim()) * h * 2;
    let weight_bytes =
        attention_bytes + c.num_hidden_layers * c.num_local_experts * expert_bytes + 2 * v * h * 2;
    eprintln!(
        "{}: {} layers, {:.1} GB of bf16 weights generated in {:.1} s",
        model.device(),
        c.num_hidden_layers,
        weight_bytes as f64 / 1e9,
        start.elapsed().as_secs_f64()
    );
    let kv_token_bytes = c.num_hidden_layers * 2 * c.kv_dim() * 2;
    for &batch in &args.batches {
        let prompts: Vec<Vec<u32>> = (0..batch)
            .map(|s| {
                (0..args.prompt_len)
                    .map(|p| ((1 + s * 7 + p * 13) % v) as u32)
                    .collect()
            })
            .collect();
        // Warm-up (cuBLAS heuristics, the allocator), then the timed prefill over the same
        // blocks (the cache rows are overwritten).
        step(&mut model, v, &prompts, 0, max_blocks)?;
        let start = Instant::now();
        let (mut next, _) = step(&mut model, v, &prompts, 0, max_blocks)?;
        let prefill_s = start.elapsed().as_secs_f64();
        let mut experts_hit = 0;
        let start = Instant::now();
        for d in 0..args.decode_steps {
            let ids: Vec<Vec<u32>> = next.iter().map(|t| vec![*t]).collect();
            let (tokens, hit) = step(&mut model, v, &ids, args.prompt_len + d, max_blocks)?;
            next = tokens;
            experts_hit += hit;
        }
        let decode_s = start.elapsed().as_secs_f64();
        let steps = args.decode_steps as f64;
        let mean_context = (args.prompt_len as f64 + steps / 2.0) * batch as f64;
        let bytes_per_step = attention_bytes as f64
            + experts_hit as f64 / steps * expert_bytes as f64
            + mean_context * kv_token_bytes as f64
            + (v * h * 2) as f64;
        let step_s = decode_s / steps;
        println!(
            "{{\"layers\":{},\"batch\":{batch},\"prompt_len\":{},\"prefill_tokens_per_s\":{:.1},\"decode_tokens_per_s\":{:.1},\"decode_step_ms\":{:.3},\"decode_bytes_per_step_gb\":{:.3},\"decode_hbm_gbs\":{:.1},\"d2d_copy_gbs\":{:.1},\"experts_hit_per_step\":{:.1}}}",
            c.num_hidden_layers,
            args.prompt_len,
            (batch * args.prompt_len) as f64 / prefill_s,
            batch as f64 * steps / decode_s,
            step_s * 1e3,
            bytes_per_step / 1e9,
            bytes_per_step / step_s / 1e9,
            copy_bw / 1e9,
            experts_hit as f64 / steps,
        );
    }
    Ok(())
}
