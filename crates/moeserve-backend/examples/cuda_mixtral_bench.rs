//! Synthetic Mixtral on one GPU, for `bench/gpu_check.sh`: random bf16 weights generated on the
//! device (a 32-layer Mixtral-8x7B is ~93 GB and fits one H200), a paged KV cache, and the
//! decoder layer built from the kernels of `cuda/` and cuBLAS exactly as a CUDA forward would
//! run it: embedding → per layer (RMSNorm → q/k/v GEMMs → RoPE → KV write → paged attention →
//! o GEMM → RMSNorm + residual → router GEMM → router → permute → grouped w1|w3 GEMM → SwiGLU →
//! grouped w2 GEMM → unpermute) → final norm → lm_head → greedy argmax.
//!
//! It measures prefill tokens/s (every sequence's prompt in one step), decode tokens/s (one
//! token per sequence per step, the host reading the sampled ids back each step, as an engine
//! does), the bytes a decode step must read (attention weights, the experts the router hit, the
//! KV cache, lm_head) over its time, and the device-to-device copy bandwidth of the same run.
//! One JSON object per line on stdout.
//!
//! NOTE: weights are random, so this measures speed, not quality; the model is not the
//! `moeserve` forward (that still runs on the CPU), but the same kernels in the same order.
//!
//! ```sh
//! cargo build --release --features cuda -p moeserve-backend --example cuda_mixtral_bench
//! cuda_mixtral_bench --layers 32 --batch 1,16,64 --prompt-len 256 --decode-steps 32
//! ```

use std::time::Instant;

use half::bf16;
use moeserve_backend::cpu;
use moeserve_backend::cuda::gemm::{GemmShape, GroupedGemm, grouped_expert_matmul, matmul_wt};
use moeserve_backend::cuda::ops::{self, AttentionShape, DeviceRouting, RmsNormArgs};
use moeserve_backend::cuda::{CudaBackend, CudaError, CudaSlice};

type T = bf16;

/// Mixtral-8x7B's shape (HF `config.json`), with a configurable number of layers.
#[derive(Clone, Copy, Debug)]
struct Shape {
    layers: usize,
    hidden: usize,
    inter: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    experts: usize,
    top_k: usize,
    vocab: usize,
}

const MIXTRAL_8X7B: Shape = Shape {
    layers: 32,
    hidden: 4096,
    inter: 14336,
    heads: 32,
    kv_heads: 8,
    head_dim: 128,
    experts: 8,
    top_k: 2,
    vocab: 32000,
};

const BLOCK_SIZE: usize = 16;

struct Layer {
    input_norm: CudaSlice<T>,
    q: CudaSlice<T>,
    k: CudaSlice<T>,
    v: CudaSlice<T>,
    o: CudaSlice<T>,
    post_norm: CudaSlice<T>,
    gate: CudaSlice<T>,
    /// Per expert `[w1; w3]`: `[2 * inter, hidden]`.
    w13: Vec<CudaSlice<T>>,
    /// Per expert `[hidden, inter]`.
    w2: Vec<CudaSlice<T>>,
    k_cache: CudaSlice<T>,
    v_cache: CudaSlice<T>,
}

struct Model {
    s: Shape,
    embed: CudaSlice<T>,
    layers: Vec<Layer>,
    norm: CudaSlice<T>,
    lm_head: CudaSlice<T>,
    inv_freq: CudaSlice<f32>,
}

fn random(gpu: &CudaBackend, len: usize, seed: u64, scale: f32) -> Result<CudaSlice<T>, CudaError> {
    let mut w = gpu.zeros::<T>(len)?;
    ops::fill_uniform(gpu, w.as_view_mut(), seed, scale)?;
    Ok(w)
}

fn ones(gpu: &CudaBackend, len: usize) -> Result<CudaSlice<T>, CudaError> {
    gpu.upload(&vec![bf16::ONE; len])
}

impl Model {
    fn new(gpu: &CudaBackend, s: Shape, num_slots: usize) -> Result<Self, CudaError> {
        let (h, q, kv) = (s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim);
        // Uniform(-a, a) with a = sqrt(3 / fan_in) keeps activations O(1) through the layers.
        let scale = |fan_in: usize| (3.0 / fan_in as f32).sqrt();
        let mut seed = 0u64;
        let mut next = |len: usize, fan_in: usize| {
            seed += 1;
            random(gpu, len, seed, scale(fan_in))
        };
        let layers = (0..s.layers)
            .map(|_| {
                Ok(Layer {
                    input_norm: ones(gpu, h)?,
                    q: next(q * h, h)?,
                    k: next(kv * h, h)?,
                    v: next(kv * h, h)?,
                    o: next(h * q, q)?,
                    post_norm: ones(gpu, h)?,
                    gate: next(s.experts * h, h)?,
                    w13: (0..s.experts)
                        .map(|_| next(2 * s.inter * h, h))
                        .collect::<Result<_, _>>()?,
                    w2: (0..s.experts)
                        .map(|_| next(h * s.inter, s.inter))
                        .collect::<Result<_, _>>()?,
                    k_cache: gpu.zeros(num_slots * kv)?,
                    v_cache: gpu.zeros(num_slots * kv)?,
                })
            })
            .collect::<Result<Vec<_>, CudaError>>()?;
        Ok(Model {
            s,
            embed: next(s.vocab * h, 1)?,
            layers,
            norm: ones(gpu, h)?,
            lm_head: next(s.vocab * h, h)?,
            inv_freq: gpu.upload(&cpu::rope_inv_freq(s.head_dim, 1e6))?,
        })
    }

    fn weight_bytes(&self) -> (usize, usize) {
        let s = self.s;
        let expert = 3 * s.inter * s.hidden * 2;
        let attention = (2 * s.heads + 2 * s.kv_heads) * s.head_dim * s.hidden * 2;
        let total = s.layers * (attention + s.experts * expert) + 2 * s.vocab * s.hidden * 2;
        (total, expert)
    }
}

/// One step's token layout (one sequence per entry of `ids`) on the host, uploaded before the step.
struct StepInputs {
    ids: Vec<u32>,
    positions: Vec<i32>,
    token_seq: Vec<i32>,
    slots: Vec<i64>,
    /// Index of each sequence's last token in the step.
    last_rows: Vec<i32>,
}

fn step_inputs(start: usize, len: usize, max_blocks: usize, ids: &[u32]) -> StepInputs {
    let mut x = StepInputs {
        ids: Vec::new(),
        positions: Vec::new(),
        token_seq: Vec::new(),
        slots: Vec::new(),
        last_rows: Vec::new(),
    };
    for (seq, id) in ids.iter().enumerate() {
        for p in start..start + len {
            // Sequence `seq` owns blocks seq * max_blocks.. (its block table row).
            let block = seq * max_blocks + p / BLOCK_SIZE;
            x.ids.push(*id);
            x.positions.push(p as i32);
            x.token_seq.push(seq as i32);
            x.slots.push((block * BLOCK_SIZE + p % BLOCK_SIZE) as i64);
        }
        x.last_rows.push((x.ids.len() - 1) as i32);
    }
    x
}

/// What one forward step read from memory, for the bandwidth figure.
#[derive(Default)]
struct StepStats {
    experts_hit: usize,
}

/// One forward step; returns the greedy token of each sequence.
fn forward(
    gpu: &CudaBackend,
    m: &mut Model,
    x: &StepInputs,
    tables: &CudaSlice<i32>,
    stats: &mut StepStats,
) -> Result<Vec<i32>, CudaError> {
    let s = m.s;
    let (t, h, qd, kvd, e) = (
        x.ids.len(),
        s.hidden,
        s.heads * s.head_dim,
        s.kv_heads * s.head_dim,
        s.experts,
    );
    let pairs = t * s.top_k;
    let ids = gpu.upload(&x.ids)?;
    let positions = gpu.upload(&x.positions)?;
    let token_seq = gpu.upload(&x.token_seq)?;
    let slots = gpu.upload(&x.slots)?;
    let last_rows = gpu.upload(&x.last_rows)?;
    let mut residual = gpu.zeros::<f32>(t * h)?;
    let mut normed = gpu.zeros::<T>(t * h)?;
    let mut delta = gpu.zeros::<T>(t * h)?;
    let (mut q, mut k, mut v) = (
        gpu.zeros::<T>(t * qd)?,
        gpu.zeros::<T>(t * kvd)?,
        gpu.zeros::<T>(t * kvd)?,
    );
    let mut attn = gpu.zeros::<T>(t * qd)?;
    let mut logits = gpu.zeros::<T>(t * e)?;
    let (mut topk_ids, mut topk_w, mut topk_slots) = (
        gpu.zeros::<i32>(pairs)?,
        gpu.zeros::<f32>(pairs)?,
        gpu.zeros::<i32>(pairs)?,
    );
    let (mut counts, mut offsets_d) = (gpu.zeros::<i32>(e)?, gpu.zeros::<i32>(e + 1)?);
    let (mut permuted, mut pair_of_row) = (gpu.zeros::<T>(pairs * h)?, gpu.zeros::<i32>(pairs)?);
    let mut gate_up = gpu.zeros::<T>(pairs * 2 * s.inter)?;
    let mut act = gpu.zeros::<T>(pairs * s.inter)?;
    let mut expert_out = gpu.zeros::<T>(pairs * h)?;
    let shape = AttentionShape {
        num_heads: s.heads,
        num_kv_heads: s.kv_heads,
        head_dim: s.head_dim,
        block_size: BLOCK_SIZE,
        max_blocks_per_seq: tables.len() / (x.last_rows.len()),
        sliding_window: None,
    };
    ops::embedding(
        gpu,
        ops::EmbeddingArgs {
            table: m.embed.as_view(),
            ids: ids.as_view(),
            out: residual.as_view_mut(),
            hidden: h,
        },
    )?;
    for (l, layer) in m.layers.iter_mut().enumerate() {
        let first = l == 0;
        ops::rms_norm_residual(
            gpu,
            RmsNormArgs {
                residual: residual.as_view_mut(),
                delta: (!first).then(|| delta.as_view()),
                weight: layer.input_norm.as_view(),
                out: normed.as_view_mut(),
                eps: 1e-5,
            },
        )?;
        matmul_wt(
            gpu,
            &normed.as_view(),
            &layer.q.as_view(),
            &mut q.as_view_mut(),
            GemmShape { m: t, n: qd, k: h },
        )?;
        matmul_wt(
            gpu,
            &normed.as_view(),
            &layer.k.as_view(),
            &mut k.as_view_mut(),
            GemmShape { m: t, n: kvd, k: h },
        )?;
        matmul_wt(
            gpu,
            &normed.as_view(),
            &layer.v.as_view(),
            &mut v.as_view_mut(),
            GemmShape { m: t, n: kvd, k: h },
        )?;
        ops::rope(
            gpu,
            ops::RopeArgs {
                q: q.as_view_mut(),
                k: k.as_view_mut(),
                positions: positions.as_view(),
                inv_freq: m.inv_freq.as_view(),
                num_heads: s.heads,
                num_kv_heads: s.kv_heads,
                head_dim: s.head_dim,
            },
        )?;
        ops::write_kv(
            gpu,
            ops::WriteKvArgs {
                k: k.as_view(),
                v: v.as_view(),
                k_cache: layer.k_cache.as_view_mut(),
                v_cache: layer.v_cache.as_view_mut(),
                slot_mapping: slots.as_view(),
                kv_dim: kvd,
            },
        )?;
        ops::paged_attention(
            gpu,
            ops::PagedAttentionArgs {
                out: attn.as_view_mut(),
                q: q.as_view(),
                k_cache: layer.k_cache.as_view(),
                v_cache: layer.v_cache.as_view(),
                block_tables: tables.as_view(),
                token_seq: token_seq.as_view(),
                positions: positions.as_view(),
                shape,
            },
        )?;
        matmul_wt(
            gpu,
            &attn.as_view(),
            &layer.o.as_view(),
            &mut delta.as_view_mut(),
            GemmShape { m: t, n: h, k: qd },
        )?;
        ops::rms_norm_residual(
            gpu,
            RmsNormArgs {
                residual: residual.as_view_mut(),
                delta: Some(delta.as_view()),
                weight: layer.post_norm.as_view(),
                out: normed.as_view_mut(),
                eps: 1e-5,
            },
        )?;
        matmul_wt(
            gpu,
            &normed.as_view(),
            &layer.gate.as_view(),
            &mut logits.as_view_mut(),
            GemmShape { m: t, n: e, k: h },
        )?;
        ops::route_top_k(
            gpu,
            ops::RouteArgs {
                logits: logits.as_view(),
                bias: None,
                topk_ids: topk_ids.as_view_mut(),
                topk_weights: topk_w.as_view_mut(),
                slots: topk_slots.as_view_mut(),
                expert_counts: counts.as_view_mut(),
                top_k: s.top_k,
                capacity: None,
            },
        )?;
        ops::moe_segment_offsets(gpu, counts.as_view(), offsets_d.as_view_mut(), None)?;
        // The per-segment GEMMs need the segment sizes on the host: one small copy per layer.
        let offsets: Vec<usize> = gpu
            .download(&offsets_d)?
            .iter()
            .map(|o| *o as usize)
            .collect();
        stats.experts_hit += offsets.windows(2).filter(|w| w[1] > w[0]).count();
        let routing = DeviceRouting {
            topk_ids: topk_ids.as_view(),
            topk_weights: topk_w.as_view(),
            slots: topk_slots.as_view(),
            offsets: offsets_d.as_view(),
            top_k: s.top_k,
        };
        ops::moe_permute(
            gpu,
            normed.as_view(),
            &routing,
            permuted.as_view_mut(),
            pair_of_row.as_view_mut(),
        )?;
        grouped_expert_matmul(
            gpu,
            GroupedGemm {
                x: permuted.as_view(),
                weights: &layer.w13,
                y: gate_up.as_view_mut(),
                offsets: &offsets,
                n: 2 * s.inter,
                k: h,
            },
        )?;
        ops::silu_mul(gpu, gate_up.as_view(), act.as_view_mut(), s.inter)?;
        grouped_expert_matmul(
            gpu,
            GroupedGemm {
                x: act.as_view(),
                weights: &layer.w2,
                y: expert_out.as_view_mut(),
                offsets: &offsets,
                n: h,
                k: s.inter,
            },
        )?;
        ops::moe_unpermute(gpu, expert_out.as_view(), &routing, delta.as_view_mut())?;
    }
    // Finish the residual, keep each sequence's last token, norm it, lm_head, argmax.
    let b = x.last_rows.len();
    ops::rms_norm_residual(
        gpu,
        RmsNormArgs {
            residual: residual.as_view_mut(),
            delta: Some(delta.as_view()),
            weight: m.norm.as_view(),
            out: normed.as_view_mut(),
            eps: 1e-5,
        },
    )?;
    let mut last = gpu.zeros::<f32>(b * h)?;
    ops::gather_rows(
        gpu,
        ops::GatherRowsArgs {
            src: residual.as_view(),
            rows: last_rows.as_view(),
            dst: last.as_view_mut(),
            hidden: h,
        },
    )?;
    let mut last_normed = gpu.zeros::<T>(b * h)?;
    ops::rms_norm_residual(
        gpu,
        RmsNormArgs {
            residual: last.as_view_mut(),
            delta: None,
            weight: m.norm.as_view(),
            out: last_normed.as_view_mut(),
            eps: 1e-5,
        },
    )?;
    let mut vocab_logits = gpu.zeros::<T>(b * s.vocab)?;
    matmul_wt(
        gpu,
        &last_normed.as_view(),
        &m.lm_head.as_view(),
        &mut vocab_logits.as_view_mut(),
        GemmShape {
            m: b,
            n: s.vocab,
            k: h,
        },
    )?;
    let (mut next, mut logprobs) = (gpu.zeros::<i32>(b)?, gpu.zeros::<f32>(b)?);
    ops::argmax_logprob(
        gpu,
        vocab_logits.as_view(),
        next.as_view_mut(),
        logprobs.as_view_mut(),
    )?;
    gpu.download(&next)
}

/// Device-to-device copy bandwidth: (read + write bytes) / time of a 4 GiB copy, best of 5.
fn copy_bandwidth(gpu: &CudaBackend) -> Result<f64, CudaError> {
    let len = 1usize << 31; // 2^31 bf16 = 4 GiB
    let src = gpu.zeros::<T>(len)?;
    let mut dst = gpu.zeros::<T>(len)?;
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

fn run(args: Args) -> Result<(), CudaError> {
    let gpu = CudaBackend::new(0)?;
    let start = Instant::now();
    gpu.load_all_kernels()?;
    eprintln!(
        "{}: kernels compiled in {:.2} s",
        gpu.info(),
        start.elapsed().as_secs_f64()
    );
    let copy_bw = copy_bandwidth(&gpu)?;
    println!(
        "{{\"metric\":\"d2d_copy_bandwidth_gbs\",\"value\":{:.1}}}",
        copy_bw / 1e9
    );
    let s = Shape {
        layers: args.layers,
        ..MIXTRAL_8X7B
    };
    let max_batch = *args.batches.iter().max().expect("a batch size");
    let max_blocks = (args.prompt_len + args.decode_steps).div_ceil(BLOCK_SIZE);
    let start = Instant::now();
    let mut model = Model::new(&gpu, s, max_batch * max_blocks * BLOCK_SIZE)?;
    gpu.synchronize()?;
    let (weight_bytes, expert_bytes) = model.weight_bytes();
    eprintln!(
        "{} layers, {:.1} GB of bf16 weights generated in {:.1} s",
        s.layers,
        weight_bytes as f64 / 1e9,
        start.elapsed().as_secs_f64()
    );
    let kv_token_bytes = s.layers * 2 * s.kv_heads * s.head_dim * 2;
    let attention_bytes = s.layers * (2 * s.heads + 2 * s.kv_heads) * s.head_dim * s.hidden * 2;
    for &batch in &args.batches {
        // Block table: sequence i owns blocks i * max_blocks.. (tables are per sequence rows).
        let table: Vec<i32> = (0..batch * max_blocks).map(|b| b as i32).collect();
        let tables = gpu.upload(&table)?;
        let mut ids: Vec<u32> = (0..batch)
            .map(|i| (1 + i * 7) as u32 % s.vocab as u32)
            .collect();
        let mut stats = StepStats::default();
        let prefill = step_inputs(0, args.prompt_len, max_blocks, &ids);
        forward(&gpu, &mut model, &prefill, &tables, &mut stats)?; // warm-up (cuBLAS heuristics, allocator)
        let start = Instant::now();
        let next = forward(&gpu, &mut model, &prefill, &tables, &mut stats)?;
        let prefill_s = start.elapsed().as_secs_f64();
        ids = next.iter().map(|t| *t as u32).collect();
        let mut stats = StepStats::default();
        let start = Instant::now();
        for step in 0..args.decode_steps {
            let x = step_inputs(args.prompt_len + step, 1, max_blocks, &ids);
            ids = forward(&gpu, &mut model, &x, &tables, &mut stats)?
                .iter()
                .map(|t| *t as u32)
                .collect();
        }
        let decode_s = start.elapsed().as_secs_f64();
        let steps = args.decode_steps as f64;
        let mean_context = (args.prompt_len as f64 + steps / 2.0) * batch as f64;
        let bytes_per_step = attention_bytes as f64
            + stats.experts_hit as f64 / steps * expert_bytes as f64
            + mean_context * kv_token_bytes as f64
            + (s.vocab * s.hidden * 2) as f64;
        let step_s = decode_s / steps;
        println!(
            "{{\"layers\":{},\"batch\":{batch},\"prompt_len\":{},\"prefill_tokens_per_s\":{:.1},\"decode_tokens_per_s\":{:.1},\"decode_step_ms\":{:.3},\"decode_bytes_per_step_gb\":{:.3},\"decode_hbm_gbs\":{:.1},\"d2d_copy_gbs\":{:.1},\"experts_hit_per_step\":{:.1}}}",
            s.layers,
            args.prompt_len,
            (batch * args.prompt_len) as f64 / prefill_s,
            batch as f64 * steps / decode_s,
            step_s * 1e3,
            bytes_per_step / 1e9,
            bytes_per_step / step_s / 1e9,
            copy_bw / 1e9,
            stats.experts_hit as f64 / steps,
        );
    }
    Ok(())
}
