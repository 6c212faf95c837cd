//! `moeserve quantize`: an int8 checkpoint made with GPTQ, as vLLM users get one from
//! llm-compressor or AutoGPTQ. The stored format is `--quantization int8`'s (a scale and offset
//! per row and 64 positions); only the integers are chosen by GPTQ instead of rounding to
//! nearest, which cuts the demo model's mean |Δlogprob| (bench/RESULTS.md).
//!
//! 1. Calibration text is sampled from the model itself (temperature 1 from BOS, seeded), so
//!    no dataset is needed and it follows the model's own distribution.
//! 2. A forward pass over it in the stored precision records every matrix's Hessian
//!    ([`calibrate`]).
//! 3. GPTQ per matrix ([`gptq`]), the matrices in parallel.
//! 4. The output directory holds the source's files unchanged (shards hard-linked where the
//!    file system allows), `model-int8-*.safetensors` with `{matrix}.qweight` (i8 `[n, k]`),
//!    `{matrix}.scales` and `{matrix}.offsets` (f32 `[n, k / 64]`), an index naming all, and
//!    `quantization_config` in `config.json`. Loading it runs int8 with these integers unless
//!    `--quantization none` asks for the stored weights.
//!
//! With `--bits 4` ([`QuantFormat::GptqInt4`]) the integers go on GPTQ's 4-bit grid in groups
//! of `group_size` inputs ([`int4`]) and the output is a GPTQ checkpoint as AutoGPTQ, GPTQModel
//! and optimum write one (`quant_method: "gptq"`, `checkpoint_format: "gptq"`): each quantized
//! layer's `{matrix}.qweight`, `.qzeros`, `.scales` and `.g_idx` in `model-gptq-*.safetensors`
//! instead of its `.weight`, the source's shards rewritten without those, everything else
//! linked. lm_head stays in float there, as GPTQ releases keep it, and so do matrices whose
//! sides are not multiples of 8 (the format packs 8 per word) or whose inputs are not whole
//! groups (vLLM's GPTQ kernels refuse a partial group).
//!
//! Steps 2–4 run for a group of layers at a time, as many as `max_hessian_bytes` of Hessians
//! allow (4·k² bytes per matrix input; 2.6 GB for the whole demo model, ≈ 6.6 GB per layer of
//! Mixtral-8x7B), each group its own calibration pass and int8 file.

pub mod calibrate;
pub mod gptq;
pub mod int4;

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use moeserve_backend::Weight;
use moeserve_backend::cpu::quant::{GROUP, Int8Rows, quantize_rows_int8};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use serde_json::{Value, json};

pub use calibrate::{Hessian, Hessians, LayerHessians};
pub use gptq::{Fallback, GptqOptions, gptq_int4, gptq_int8};
pub use int4::Int4Rows;

use crate::batch::{ForwardBatch, SequenceSlice};
use crate::kv_cache::PagedKvCache;
use crate::models::MoeModel;
use crate::models::decoder::{FeedForward, SelfAttention};
use crate::models::decoder::{ForwardOptions, LogitsFor};
use crate::models::workspace::ForwardWorkspace;
use crate::moe::Expert;
use crate::{ModelError, Result};
use moeserve_formats::writer::StagedDir;
use moeserve_text::generation_config::GenerationConfig;

/// `quantization_config.quant_method` of a checkpoint this module wrote.
pub const QUANT_METHOD: &str = "moeserve-int8";
/// The field of a quantized checkpoint's `quantization_config` that keeps the source's own
/// (an FP8 checkpoint's, whose tensors the int8 checkpoint keeps as stored).
pub const SOURCE_QUANTIZATION: &str = "source_quantization_config";
/// The start of the int8 files' names ([`int8_file`]).
pub const INT8_PREFIX: &str = "model-int8";
/// The start of a GPTQ int4 checkpoint's quantized files' names.
pub const GPTQ_PREFIX: &str = "model-gptq";

/// What `moeserve quantize` writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum QuantFormat {
    /// int8 rows beside the source's tensors, in `--quantization int8`'s format.
    #[default]
    Int8,
    /// A GPTQ int4 checkpoint, groups of `group_size` inputs.
    GptqInt4 { group_size: usize },
}

/// What `moeserve quantize` does.
#[derive(Clone, Debug)]
pub struct QuantizeOptions {
    /// Calibration sequences sampled from the model.
    pub samples: usize,
    /// Tokens per calibration sequence (BOS included).
    pub sample_len: usize,
    pub seed: u64,
    pub gptq: GptqOptions,
    /// Most bytes of Hessians held at once: the layers are calibrated and quantized in groups
    /// that fit (one calibration pass each).
    pub max_hessian_bytes: u64,
    pub format: QuantFormat,
}

impl Default for QuantizeOptions {
    fn default() -> Self {
        QuantizeOptions {
            samples: 32,
            sample_len: 256,
            seed: 0,
            gptq: GptqOptions::default(),
            max_hessian_bytes: 8 << 30,
            format: QuantFormat::Int8,
        }
    }
}

/// What a quantization run did.
#[derive(Debug, Default)]
pub struct QuantizeReport {
    pub matrices: usize,
    pub calibration_tokens: usize,
    /// Calibration passes (layer groups within `max_hessian_bytes`).
    pub passes: usize,
    /// Matrices rounded to nearest instead, with the reason (no calibration input reached
    /// them, or their Hessian could not be factored).
    pub round_to_nearest: Vec<(String, String)>,
    /// Matrices a GPTQ int4 checkpoint keeps in float (sides not multiples of 8, or inputs not
    /// whole groups).
    pub kept_in_float: Vec<String>,
    pub sample_seconds: f64,
    pub calibrate_seconds: f64,
    pub gptq_seconds: f64,
}

/// A quantizable matrix of the model: its checkpoint prefix (`{prefix}.weight`), weight and
/// Hessian.
struct Job<'a> {
    prefix: String,
    weight: &'a Weight,
    hessian: &'a Hessian,
}

/// Quantizes the model in `src` with GPTQ and writes the int8 checkpoint to `dst` (created; it
/// must not be `src`). `progress` hears what is being done.
pub fn quantize_checkpoint(
    src: &Path,
    dst: &Path,
    opts: &QuantizeOptions,
    progress: &mut dyn FnMut(&str),
) -> Result<QuantizeReport> {
    if opts.samples == 0 || opts.sample_len < 2 {
        return Err(ModelError::InvalidInput {
            message: "calibration needs at least one sample of at least 2 tokens".into(),
        });
    }
    if dst.exists() && same_dir(src, dst) {
        return Err(ModelError::config(
            dst,
            "the output directory is the model directory",
        ));
    }
    if let QuantFormat::GptqInt4 { group_size } = opts.format {
        gptq_int4_source_check(src, group_size)?;
    }
    let model = MoeModel::load_as_stored(src)?;
    let generation = GenerationConfig::from_dir(src)?;
    let bos = generation.bos_token_id.unwrap_or(0);
    let mut report = QuantizeReport::default();
    // The output directory first: an unwritable one fails before minutes of calibration. It is
    // written under a temporary name and put in place only when complete.
    let staged = StagedDir::new(dst)?;
    let out = staged.path();
    let mut weight_map = link_source_files(src, out)?;

    let clock = std::time::Instant::now();
    progress(&format!(
        "sampling {} calibration sequences of {} tokens from the model (seed {})",
        opts.samples, opts.sample_len, opts.seed
    ));
    let sequences = sample_sequences(&model, opts, bos, &generation.eos_token_ids)?;
    report.sample_seconds = clock.elapsed().as_secs_f64();
    report.calibration_tokens = sequences.iter().map(Vec::len).sum();

    let groups = layer_groups(&model, opts.max_hessian_bytes);
    report.passes = groups.len();
    let c = model.config();
    for (i, layers) in groups.iter().enumerate() {
        let last = i + 1 == groups.len();
        let clock = std::time::Instant::now();
        progress(&format!(
            "layers {}..{} of {}: recording their matrices' inputs",
            layers.start, layers.end, c.num_hidden_layers
        ));
        // lm_head's inputs only where it is quantized (int8; GPTQ keeps it in float).
        let lm_head = last && opts.format == QuantFormat::Int8;
        let mut hessians =
            Hessians::new(layers.clone(), c.num_local_experts, c.hidden_size, lm_head);
        calibrate(&model, &sequences, &mut hessians)?;
        report.calibrate_seconds += clock.elapsed().as_secs_f64();

        let clock = std::time::Instant::now();
        let int4 = match opts.format {
            QuantFormat::GptqInt4 { group_size } => Some(group_size),
            QuantFormat::Int8 => None,
        };
        // GPTQ releases keep lm_head in float; the format packs 8 values per word, and vLLM's
        // GPTQ kernels take whole groups only.
        let fits = |job: &Job<'_>| match (int4, job.weight.shape()) {
            (Some(group), &[n, k]) => n % 8 == 0 && k % 8 == 0 && k % group == 0,
            _ => true,
        };
        let (jobs, float): (Vec<_>, Vec<_>) =
            jobs(&model, &hessians, lm_head).into_iter().partition(fits);
        report
            .kept_in_float
            .extend(float.into_iter().map(|job| job.prefix));
        progress(&format!("GPTQ on {} matrices", jobs.len()));
        let results: Vec<(Quantized, Option<String>)> = jobs
            .par_iter()
            .map(|job| quantize_one(job, opts.gptq, int4))
            .collect();
        report.gptq_seconds += clock.elapsed().as_secs_f64();
        report.matrices += jobs.len();
        for (job, (_, why)) in jobs.iter().zip(&results) {
            if let Some(why) = why {
                report
                    .round_to_nearest
                    .push((job.prefix.clone(), why.clone()));
            }
        }
        let tensors = jobs.iter().zip(&results).map(|(job, (q, _))| {
            let s = job.weight.shape();
            (job.prefix.as_str(), q, [s[0], s[1]])
        });
        let path = out.join(match int4 {
            None => int8_file(i + 1, groups.len()),
            Some(_) => gptq_file(i + 1, groups.len()),
        });
        write_quantized_tensors(&path, tensors, &mut weight_map)?;
    }
    if matches!(opts.format, QuantFormat::GptqInt4 { .. }) {
        progress("writing the source's other tensors");
        drop_quantized_weights(src, out, &mut weight_map)?;
    }
    progress(&format!("writing {}", dst.display()));
    write_index_and_config(src, out, weight_map, opts, &report)?;
    staged.commit()?;
    Ok(report)
}

/// `model-int8-00001-of-00003.safetensors`: the int8 tensors of the `i`-th of `n` layer groups.
pub fn int8_file(i: usize, n: usize) -> String {
    format!("{INT8_PREFIX}-{i:05}-of-{n:05}.safetensors")
}

/// `model-gptq-00001-of-00003.safetensors`: the GPTQ tensors of the `i`-th of `n` layer groups.
fn gptq_file(i: usize, n: usize) -> String {
    format!("{GPTQ_PREFIX}-{i:05}-of-{n:05}.safetensors")
}

/// A GPTQ int4 checkpoint replaces per-matrix `.weight` tensors: refused for sources that
/// store their experts fused ([E, …] tensors, GPT-OSS's MXFP4 blocks), for FP8 and already
/// quantized sources, and for group sizes the format cannot hold.
fn gptq_int4_source_check(src: &Path, group_size: usize) -> Result<()> {
    if group_size == 0 || !group_size.is_multiple_of(8) {
        return Err(ModelError::InvalidInput {
            message: format!("--group-size {group_size}: GPTQ groups are a positive multiple of 8"),
        });
    }
    let source = crate::checkpoint::Checkpoint::open(src)?;
    let fused = source.tensor_names().find(|n| {
        n.ends_with("experts.gate_up_proj")
            || n.ends_with("experts.down_proj")
            || n.ends_with("_blocks")
    });
    if let Some(name) = fused {
        return Err(ModelError::config(
            src,
            format!(
                "`{name}`: a GPTQ checkpoint stores each expert's matrices apart, and this one \
                 fuses them (--bits 8 quantizes it)"
            ),
        ));
    }
    let path = src.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
    let config: Value =
        serde_json::from_str(&text).map_err(|e| ModelError::config(&path, e.to_string()))?;
    if let Some(method) = config
        .get("quantization_config")
        .and_then(|q| q.get("quant_method"))
        .and_then(Value::as_str)
    {
        return Err(ModelError::config(
            &path,
            format!(
                "the source is already quantized (`quant_method: {method:?}`); --bits 4 starts \
                 from bf16, f16 or f32 weights"
            ),
        ));
    }
    Ok(())
}

/// Consecutive layers whose Hessians (with lm_head's in the last group) fit in `budget` bytes
/// together; a layer larger than the budget is a group of its own.
fn layer_groups(model: &MoeModel, budget: u64) -> Vec<Range<usize>> {
    let c = model.config();
    let square = |k: usize| 4 * (k * k) as u64;
    let per_layer = square(c.hidden_size)
        + square(c.num_attention_heads * c.head_dim)
        + c.num_local_experts as u64 * (square(c.hidden_size) + square(c.moe_intermediate_size))
        + square(c.hidden_size)
        + square(
            c.intermediate_size
                .max(c.shared_expert.map_or(0, |s| s.intermediate_size)),
        );
    let mut groups: Vec<Range<usize>> = Vec::new();
    let mut bytes = 0u64;
    for l in 0..c.num_hidden_layers {
        match groups.last_mut() {
            Some(g) if bytes + per_layer <= budget => {
                g.end = l + 1;
                bytes += per_layer;
            }
            _ => {
                groups.push(l..l + 1);
                bytes = per_layer;
            }
        }
    }
    if groups.is_empty() {
        groups.push(0..0);
    }
    groups
}

fn same_dir(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

/// A matrix on the int8 or the 4-bit grid.
enum Quantized {
    Int8(Int8Rows),
    Int4(Int4Rows),
}

/// GPTQ for one matrix (onto 4-bit groups of `int4` inputs, else int8); round-to-nearest (and
/// why) when no calibration row reached it or its Hessian cannot be factored.
fn quantize_one(
    job: &Job<'_>,
    opts: GptqOptions,
    int4: Option<usize>,
) -> (Quantized, Option<String>) {
    let (n, k) = (job.weight.shape()[0], job.weight.shape()[1]);
    let w = job.weight.to_f32_vec();
    if job.hessian.rows == 0 {
        let rows = match int4 {
            Some(group) => Quantized::Int4(Int4Rows::round_to_nearest(&w, (n, k), group)),
            None => Quantized::Int8(quantize_rows_int8(
                moeserve_backend::WeightData::F32(&w),
                n,
                k,
            )),
        };
        return (rows, Some("no calibration token reached it".into()));
    }
    let h = job.hessian.sum.clone();
    let (rows, fallback) = match int4 {
        Some(group) => {
            let (rows, fallback) = gptq_int4(&w, (n, k), group, h, opts);
            (Quantized::Int4(rows), fallback)
        }
        None => {
            let (rows, fallback) = gptq_int8(&w, n, k, h, opts);
            (Quantized::Int8(rows), fallback)
        }
    };
    let why = fallback.map(|Fallback::NotPositiveDefinite { column }| {
        format!("its damped Hessian is not positive definite (column {column})")
    });
    (rows, why)
}

/// The matrices `--quantization int8` quantizes (routers stay as stored) in the layers
/// `hessians` recorded, and lm_head with `lm_head`, each with its Hessian.
fn jobs<'a>(model: &'a MoeModel, hessians: &'a Hessians, lm_head: bool) -> Vec<Job<'a>> {
    let mut jobs = Vec::new();
    let first = hessians.first_layer();
    let layers = model.layers.iter().enumerate().skip(first);
    for ((l, layer), hs) in layers.zip(&hessians.layers) {
        for (name, weight, hessian) in attention_jobs(&layer.self_attn, hs) {
            let prefix = format!("model.layers.{l}.self_attn.{name}");
            jobs.push(Job {
                prefix,
                weight,
                hessian,
            });
        }
        let c = model.config();
        let mut mlp = |prefix: &str, mlp: &'a Expert, names: [&str; 3], inp, hidden| {
            let [gate, up, down] = names;
            for (name, weight, hessian) in [
                (gate, &mlp.w1, inp),
                (down, &mlp.w2, hidden),
                (up, &mlp.w3, inp),
            ] {
                jobs.push(Job {
                    prefix: format!("{prefix}.{name}"),
                    weight,
                    hessian,
                });
            }
        };
        const MLP: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];
        let block = format!("model.layers.{l}.{}", c.names.moe_block);
        match &layer.mlp {
            FeedForward::Sparse(moe) => {
                for (e, expert) in moe.experts.iter().enumerate() {
                    let (inp, hidden) = (&hs.expert_in[e], &hs.expert_hidden[e]);
                    let prefix = format!("{block}.experts.{e}");
                    mlp(&prefix, expert, c.names.expert_proj, inp, hidden);
                }
                if let Some(shared) = &moe.shared {
                    let prefix = format!("{block}.{}", c.names.shared_expert);
                    mlp(&prefix, &shared.mlp, MLP, &hs.mlp_in, &hs.mlp_hidden);
                }
            }
            FeedForward::Dense(dense) => {
                let prefix = format!("model.layers.{l}.mlp");
                mlp(&prefix, dense, MLP, &hs.mlp_in, &hs.mlp_hidden);
            }
        }
    }
    if lm_head {
        jobs.push(Job {
            prefix: "lm_head".into(),
            weight: &model.lm_head,
            hessian: &hessians.lm_head,
        });
    }
    jobs
}

/// A layer's attention matrices by hub name, with their inputs' Hessians. Multi-head latent
/// attention's `kv_b_proj` is not among them: it is cut per head at load (absorbed into the
/// query and applied to the output) and those pieces stay as stored.
fn attention_jobs<'a>(
    attention: &'a SelfAttention,
    hs: &'a LayerHessians,
) -> Vec<(&'static str, &'a Weight, &'a Hessian)> {
    use crate::models::ops::LayerWeight as W;
    let roles: &[(&str, W, &Hessian)] = match attention {
        SelfAttention::Grouped(_) => &[
            ("q_proj", W::QProj, &hs.attention_in),
            ("k_proj", W::KProj, &hs.attention_in),
            ("v_proj", W::VProj, &hs.attention_in),
            ("o_proj", W::OProj, &hs.attention_out),
        ],
        SelfAttention::Latent(_) => &[
            ("q_proj", W::QProj, &hs.attention_in),
            ("q_a_proj", W::QAProj, &hs.attention_in),
            ("q_b_proj", W::QBProj, &hs.query_low_rank_in),
            ("kv_a_proj_with_mqa", W::KvAProj, &hs.attention_in),
            ("o_proj", W::OProj, &hs.attention_out),
        ],
    };
    roles
        .iter()
        .filter_map(|&(name, role, hessian)| Some((name, attention.weight(role)?, hessian)))
        .collect()
}

/// `opts.samples` sequences of `opts.sample_len` tokens: BOS, then tokens drawn from the
/// model's distribution at temperature 1 with end-of-sequence tokens masked (as transformers'
/// `min_new_tokens`), all sequences decoded together.
fn sample_sequences(
    model: &MoeModel,
    opts: &QuantizeOptions,
    bos: u32,
    eos: &[u32],
) -> Result<Vec<Vec<u32>>> {
    const BLOCK: usize = 16;
    let (count, len) = (opts.samples, opts.sample_len);
    let blocks_per_seq = len.div_ceil(BLOCK);
    let mut kv = PagedKvCache::new(model.kv_layout(count * blocks_per_seq, BLOCK));
    let tables: Vec<Vec<u32>> = (0..count)
        .map(|s| ((s * blocks_per_seq) as u32..((s + 1) * blocks_per_seq) as u32).collect())
        .collect();
    let mut rng = ChaCha8Rng::seed_from_u64(opts.seed);
    let mut sequences = vec![vec![bos]; count];
    let vocab = model.config().vocab_size;
    let mut probs = vec![0.0f32; vocab];
    let mut ws = ForwardWorkspace::default();
    for pos in 1..len {
        let step_ids: Vec<u32> = sequences.iter().map(|s| s[pos - 1]).collect();
        let slices: Vec<SequenceSlice<'_>> = tables
            .iter()
            .enumerate()
            .map(|(s, table)| SequenceSlice {
                query_start: s,
                query_len: 1,
                context_len: pos,
                block_table: table,
            })
            .collect();
        let batch = ForwardBatch {
            token_ids: &step_ids,
            sequences: &slices,
        };
        let opts = ForwardOptions {
            logits: LogitsFor::LastTokens,
            ..Default::default()
        };
        let logits = model.forward_in(&batch, &mut kv, opts, &mut ws)?;
        for (seq, row) in sequences.iter_mut().zip(logits.chunks_exact(vocab)) {
            probs.copy_from_slice(row);
            for &e in eos {
                if let Some(p) = probs.get_mut(e as usize) {
                    *p = f32::NEG_INFINITY;
                }
            }
            moeserve_backend::cpu::softmax_in_place(&mut probs);
            seq.push(draw(&probs, &mut rng));
        }
    }
    Ok(sequences)
}

/// A token drawn from `probs` (summing to 1).
fn draw(probs: &[f32], rng: &mut ChaCha8Rng) -> u32 {
    let target = rng.random::<f64>() * probs.iter().map(|p| f64::from(*p)).sum::<f64>();
    let mut acc = 0.0f64;
    for (i, p) in probs.iter().enumerate() {
        acc += f64::from(*p);
        if acc > target {
            return i as u32;
        }
    }
    probs.iter().rposition(|p| *p > 0.0).unwrap_or(0) as u32
}

/// Runs the sequences through the model a few at a time (whole-sequence prefills), recording
/// every matrix's inputs.
fn calibrate(model: &MoeModel, sequences: &[Vec<u32>], hessians: &mut Hessians) -> Result<()> {
    const BLOCK: usize = 16;
    const TOKENS_PER_PASS: usize = 1024;
    let len = sequences.iter().map(Vec::len).max().unwrap_or(0);
    let per_pass = (TOKENS_PER_PASS / len.max(1)).max(1);
    let blocks_per_seq = len.div_ceil(BLOCK);
    let mut kv = PagedKvCache::new(model.kv_layout(per_pass * blocks_per_seq, BLOCK));
    let tables: Vec<Vec<u32>> = (0..per_pass)
        .map(|s| ((s * blocks_per_seq) as u32..((s + 1) * blocks_per_seq) as u32).collect())
        .collect();
    for chunk in sequences.chunks(per_pass) {
        let token_ids: Vec<u32> = chunk.concat();
        let mut start = 0;
        let slices: Vec<SequenceSlice<'_>> = chunk
            .iter()
            .zip(&tables)
            .map(|(s, table)| {
                let slice = SequenceSlice {
                    query_start: start,
                    query_len: s.len(),
                    context_len: s.len(),
                    block_table: table,
                };
                start += s.len();
                slice
            })
            .collect();
        let batch = ForwardBatch {
            token_ids: &token_ids,
            sequences: &slices,
        };
        model.forward_calibrating(&batch, &mut kv, hessians)?;
    }
    Ok(())
}

/// Creates `dst` with the source's files but its config and index (large files hard-linked
/// where the file system allows) and returns the source's tensor → file map.
fn link_source_files(src: &Path, dst: &Path) -> Result<BTreeMap<String, Value>> {
    std::fs::create_dir_all(dst).map_err(|e| ModelError::io(dst, e))?;
    let is_int8 = |file: &str| file.starts_with(INT8_PREFIX);
    let mut weight_map = BTreeMap::new();
    let source = crate::checkpoint::Checkpoint::open(src)?;
    for (name, file) in source.tensor_files().filter(|(_, f)| !is_int8(f)) {
        weight_map.insert(name.to_string(), Value::String(file.to_string()));
    }
    // Never write through a hard link into another checkpoint: earlier int8 files go first.
    for entry in std::fs::read_dir(dst).map_err(|e| ModelError::io(dst, e))? {
        let path = entry.map_err(|e| ModelError::io(dst, e))?.path();
        if path
            .file_name()
            .and_then(|f| f.to_str())
            .is_some_and(is_int8)
        {
            std::fs::remove_file(&path).map_err(|e| ModelError::io(&path, e))?;
        }
    }
    for entry in std::fs::read_dir(src).map_err(|e| ModelError::io(src, e))? {
        let entry = entry.map_err(|e| ModelError::io(src, e))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let (from, to) = (entry.path(), dst.join(&*name));
        let replaced = ["config.json", "model.safetensors.index.json"];
        if !from.is_file() || replaced.contains(&&*name) || is_int8(&name) {
            continue;
        }
        if to.exists() {
            std::fs::remove_file(&to).map_err(|e| ModelError::io(&to, e))?;
        }
        if std::fs::hard_link(&from, &to).is_err() {
            std::fs::copy(&from, &to).map_err(|e| ModelError::io(&to, e))?;
        }
    }
    Ok(weight_map)
}

/// A tensor to write: name, dtype, shape and bytes (borrowed or made for the file).
type NamedTensor<'a> = (String, Dtype, Vec<usize>, Cow<'a, [u8]>);

/// Writes every matrix's quantized tensors to `path` and names the file in `weight_map`: int8
/// rows as `{prefix}.qweight` (i8 `[n, k]`), `.scales` and `.offsets` (f32 `[n, k / 64]`);
/// 4-bit ones as GPTQ's `qweight`, `qzeros`, `scales` and `g_idx` ([`Int4Rows::gptq_tensors`]).
fn write_quantized_tensors<'a>(
    path: &Path,
    tensors: impl Iterator<Item = (&'a str, &'a Quantized, [usize; 2])>,
    weight_map: &mut BTreeMap<String, Value>,
) -> Result<()> {
    // The int8 rows are written from views of themselves: no second copy of the model's int8
    // form; the GPTQ words are packed per matrix.
    let mut named: Vec<NamedTensor<'a>> = Vec::new();
    for (prefix, quantized, [n, k]) in tensors {
        match quantized {
            Quantized::Int8(rows) => {
                let groups = vec![n, k.div_ceil(GROUP)];
                named.extend(
                    [
                        (
                            "qweight",
                            Dtype::I8,
                            vec![n, k],
                            bytemuck::cast_slice(&rows.q),
                        ),
                        (
                            "scales",
                            Dtype::F32,
                            groups.clone(),
                            bytemuck::cast_slice(&rows.scales),
                        ),
                        (
                            "offsets",
                            Dtype::F32,
                            groups,
                            bytemuck::cast_slice(&rows.offsets),
                        ),
                    ]
                    .map(|(suffix, dtype, shape, data)| {
                        (
                            format!("{prefix}.{suffix}"),
                            dtype,
                            shape,
                            Cow::Borrowed(data),
                        )
                    }),
                );
            }
            Quantized::Int4(rows) => {
                for (suffix, shape, data) in rows.gptq_tensors() {
                    let dtype = if suffix == "scales" {
                        Dtype::F16
                    } else {
                        Dtype::I32
                    };
                    named.push((format!("{prefix}.{suffix}"), dtype, shape, Cow::Owned(data)));
                }
            }
        }
    }
    let file = path
        .file_name()
        .and_then(|f| f.to_str())
        .unwrap_or_default();
    for (name, ..) in &named {
        weight_map.insert(name.clone(), Value::String(file.into()));
    }
    write_safetensors(
        path,
        named
            .iter()
            .map(|(n, d, s, b)| (n.as_str(), *d, s.clone(), &b[..])),
    )
}

/// Writes tensors `(name, dtype, shape, bytes)` to the safetensors file `path`, readable like
/// the source's files, with the `format: pt` metadata transformers' loader expects.
fn write_safetensors<'a>(
    path: &Path,
    tensors: impl Iterator<Item = (&'a str, Dtype, Vec<usize>, &'a [u8])>,
) -> Result<()> {
    let bad = |e: safetensors::SafeTensorError| ModelError::Safetensors {
        path: path.to_path_buf(),
        message: e.to_string(),
    };
    let mut views = Vec::new();
    for (name, dtype, shape, data) in tensors {
        views.push((
            name.to_string(),
            TensorView::new(dtype, shape, data).map_err(bad)?,
        ));
    }
    let metadata = Some(std::collections::HashMap::from([(
        "format".to_string(),
        "pt".to_string(),
    )]));
    safetensors::serialize_to_file(views, metadata, path).map_err(bad)?;
    // Readable like the other files (the safetensors crate creates it owner-only).
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let readable = std::fs::Permissions::from_mode(0o644);
        std::fs::set_permissions(path, readable).map_err(|e| ModelError::io(path, e))?;
    }
    Ok(())
}

/// A GPTQ checkpoint has no `.weight` for its quantized layers: each source shard in `dst` that
/// holds one of them (a `{prefix}.qweight` is in `weight_map`) is written anew without them,
/// and they leave `weight_map`.
fn drop_quantized_weights(
    src: &Path,
    dst: &Path,
    weight_map: &mut BTreeMap<String, Value>,
) -> Result<()> {
    let quantized = |name: &str| {
        name.strip_suffix(".weight")
            .is_some_and(|prefix| weight_map.contains_key(&format!("{prefix}.qweight")))
    };
    let mut shards: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (name, file) in weight_map.iter() {
        if let Some(file) = file.as_str().filter(|f| !f.starts_with(GPTQ_PREFIX)) {
            shards
                .entry(file.to_string())
                .or_default()
                .push(name.clone());
        }
    }
    let mut dropped = Vec::new();
    for (file, names) in shards {
        if !names.iter().any(|n| quantized(n)) {
            continue;
        }
        let from = src.join(&file);
        let bytes = std::fs::read(&from).map_err(|e| ModelError::io(&from, e))?;
        let parsed = SafeTensors::deserialize(&bytes).map_err(|e| ModelError::Safetensors {
            path: from.clone(),
            message: e.to_string(),
        })?;
        let kept: Vec<_> = parsed
            .tensors()
            .into_iter()
            .filter(|(n, _)| !quantized(n))
            .collect();
        dropped.extend(names.into_iter().filter(|n| quantized(n)));
        // `dst`'s copy may be a hard link to the source: unlink it before writing.
        let to = dst.join(&file);
        std::fs::remove_file(&to).map_err(|e| ModelError::io(&to, e))?;
        let views = kept
            .iter()
            .map(|(n, v)| (n.as_str(), v.dtype(), v.shape().to_vec(), v.data()));
        write_safetensors(&to, views)?;
    }
    for name in dropped {
        weight_map.remove(&name);
    }
    Ok(())
}

/// Writes the index naming every tensor's file and config.json with `quantization_config`.
fn write_index_and_config(
    src: &Path,
    dst: &Path,
    weight_map: BTreeMap<String, Value>,
    opts: &QuantizeOptions,
    report: &QuantizeReport,
) -> Result<()> {
    let index = json!({ "metadata": {}, "weight_map": weight_map });
    write_json(&dst.join("model.safetensors.index.json"), &index)?;
    let config_path = src.join("config.json");
    let text =
        std::fs::read_to_string(&config_path).map_err(|e| ModelError::io(&config_path, e))?;
    let mut config: Value =
        serde_json::from_str(&text).map_err(|e| ModelError::config(&config_path, e.to_string()))?;
    let calibration = json!({
        "source": "sampled from the model, temperature 1, from BOS",
        "samples": opts.samples,
        "tokens_per_sample": opts.sample_len,
        "seed": opts.seed,
        "tokens": report.calibration_tokens,
    });
    let round_to_nearest: Vec<_> = report.round_to_nearest.iter().map(|(m, _)| m).collect();
    if let QuantFormat::GptqInt4 { group_size } = opts.format {
        // As AutoGPTQ / GPTQModel write it for act-order with static groups (whose g_idx is
        // the plain runs); what else moeserve knows goes under `meta`, which readers ignore.
        config["quantization_config"] = json!({
            "quant_method": "gptq",
            "checkpoint_format": "gptq",
            "bits": 4,
            "group_size": group_size,
            "desc_act": true,
            "static_groups": true,
            "sym": false,
            "true_sequential": false,
            "lm_head": false,
            "damp_percent": opts.gptq.damp,
            "meta": {
                "quantizer": [format!("moeserve:{}", env!("CARGO_PKG_VERSION"))],
                "block_size": opts.gptq.block,
                "calibration": calibration,
                "round_to_nearest": round_to_nearest,
                "kept_in_float": report.kept_in_float,
            },
        });
        return write_json(&dst.join("config.json"), &config);
    }
    // The source's tensors stay beside the int8 ones, as stored: an FP8 checkpoint's storage
    // (its block size) must still be said for them to load.
    let source = config.get("quantization_config").cloned();
    config["quantization_config"] = json!({
        "quant_method": QUANT_METHOD,
        "bits": 8,
        "group_size": GROUP,
        "format": "w = q * scale + offset per row and group, q in [-128, 127]",
        "method": "gptq",
        "desc_act": true,
        "static_groups": true,
        "damp_percent": opts.gptq.damp,
        "block_size": opts.gptq.block,
        "calibration": calibration,
        "round_to_nearest": round_to_nearest,
    });
    if let Some(source) = source {
        config["quantization_config"][SOURCE_QUANTIZATION] = source;
    }
    write_json(&dst.join("config.json"), &config)
}

fn write_json(path: &Path, value: &Value) -> Result<()> {
    let text = serde_json::to_string_pretty(value).expect("JSON values serialize");
    std::fs::write(path, text + "\n").map_err(|e| ModelError::io(path, e))
}

/// Whether `dir/config.json` says its checkpoint holds this module's int8 tensors.
pub fn stored_int8(dir: &Path) -> Result<bool> {
    let path: PathBuf = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
    let config: Value =
        serde_json::from_str(&text).map_err(|e| ModelError::config(&path, e.to_string()))?;
    match config.get("quantization_config") {
        None => Ok(false),
        Some(q) => match q.get("quant_method").and_then(Value::as_str) {
            Some(QUANT_METHOD) => Ok(true),
            // FP8 block checkpoints run their FP8 weights (`checkpoint`), int8 only if asked;
            // GPT-OSS's MXFP4 experts stay 4-bit.
            // GPTQ / AWQ int4 checkpoints run their int4 weights.
            Some("fp8" | "mxfp4" | "gptq" | "awq") => Ok(false),
            other => Err(ModelError::config(
                &path,
                format!(
                    "quantization_config.quant_method {other:?} is not supported (only \
                     {QUANT_METHOD:?}, written by `moeserve quantize`, \"fp8\" block \
                     checkpoints, GPT-OSS's \"mxfp4\", and 4-bit \"gptq\" and \"awq\")"
                ),
            )),
        },
    }
}
