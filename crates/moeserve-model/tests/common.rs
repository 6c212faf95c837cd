//! Helpers shared by the model's integration tests: fixture paths, reference files, and a
//! single-sequence greedy loop over the paged cache.

#![allow(dead_code)] // Each test binary uses a different subset.

use std::path::{Path, PathBuf};

use moeserve_model::batch::{ForwardBatch, SequenceSlice};
use moeserve_model::kv_cache::{KvDtype, PagedKvCache};
use moeserve_model::models::{ForwardOptions, ForwardTrace, LogitsFor, MoeModel};
use serde::Deserialize;

/// The transformers fixtures of tiny random Mixtral checkpoints.
pub const MIXTRAL_CASES: [&str; 4] = [
    "mixtral-swa",
    "mixtral-tied",
    "mixtral-gqa",
    "mixtral-sharded",
];

/// The transformers fixtures of the other families (tests/reference/moe_family_cases.py):
/// q/k norms per head and `head_dim` ≠ hidden/heads, dense layers among sparse ones, fused
/// expert tensors, q/k/v biases and a gated shared expert, flat q/k norms and `clip_qkv`,
/// YaRN, DeepSeek-V3's sigmoid router on GQA (GLM-4.5), multi-head latent attention with
/// DeepSeek-V2's and V3's routers, V3 as an FP8 block checkpoint, and GPT-OSS (attention
/// sinks, alternating sliding and full layers, biased router and clamped, biased experts), in
/// bf16 and with the release's MXFP4 experts, and int4 checkpoints: Qwen3-MoE in GPTQ's format
/// (act-order, asymmetric) and Qwen2-MoE in AWQ's.
pub const FAMILY_CASES: [&str; 14] = [
    "qwen3-moe",
    "qwen3-moe-fused",
    "qwen3-moe-yarn",
    "qwen2-moe",
    "olmoe",
    "glm4-moe",
    "deepseek-v2-lite",
    "deepseek-v2",
    "deepseek-v3",
    "deepseek-v3-fp8",
    "gpt-oss",
    "gpt-oss-mxfp4",
    "qwen3-moe-gptq",
    "qwen2-moe-awq",
];

/// Every transformers fixture of a sparse model.
pub fn all_cases() -> impl Iterator<Item = &'static str> {
    MIXTRAL_CASES.into_iter().chain(FAMILY_CASES)
}

/// `tests/fixtures` of this checkout, or `$MOESERVE_FIXTURES` (test binaries copied to another
/// machine, e.g. by bench/gpu_check.sh, where the build's path does not exist).
pub fn fixtures_dir() -> PathBuf {
    match std::env::var_os("MOESERVE_FIXTURES") {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures"),
    }
}

#[derive(Debug, Deserialize)]
pub struct ReferencePrompt {
    pub prompt_ids: Vec<u32>,
    pub greedy_ids: Vec<u32>,
    pub greedy_logprobs: Vec<f32>,
    #[serde(default)]
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
}

#[derive(Debug, Deserialize)]
pub struct Reference {
    pub prompts: Vec<ReferencePrompt>,
}

pub fn read_reference(dir: &Path) -> Reference {
    let path = dir.join("reference.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// f32 tensors of `expected.safetensors` by name.
pub fn read_expected(dir: &Path) -> std::collections::HashMap<String, (Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(dir.join("expected.safetensors")).expect("expected.safetensors");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("valid expected.safetensors");
    st.tensors()
        .into_iter()
        .map(|(name, view)| {
            assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
            let values = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            (name, (view.shape().to_vec(), values))
        })
        .collect()
}

pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = max
        + logits
            .iter()
            .map(|l| ((l - max) as f64).exp())
            .sum::<f64>()
            .ln() as f32;
    logits.iter().map(|l| l - lse).collect()
}

pub fn argmax(xs: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in xs.iter().enumerate() {
        if *x > xs[best] {
            best = i;
        }
    }
    best as u32
}

/// One greedy step's outcome.
pub struct Step {
    pub token: u32,
    pub logprobs: Vec<f32>,
}

/// A single sequence decoding over a private paged cache (block ids in order).
pub struct SoloSequence<'m> {
    pub model: &'m MoeModel,
    pub cache: PagedKvCache,
    pub block_size: usize,
    pub tokens: Vec<u32>,
    pub computed: usize,
}

impl<'m> SoloSequence<'m> {
    pub fn new(model: &'m MoeModel, max_len: usize, block_size: usize) -> Self {
        Self::with_kv_dtype(model, max_len, block_size, KvDtype::F32)
    }

    /// A sequence over a cache of `dtype` rows.
    pub fn with_kv_dtype(
        model: &'m MoeModel,
        max_len: usize,
        block_size: usize,
        dtype: KvDtype,
    ) -> Self {
        let layout = model.kv_layout(max_len.div_ceil(block_size), block_size);
        let cache = PagedKvCache::with_dtype(layout, dtype);
        SoloSequence {
            model,
            cache,
            block_size,
            tokens: Vec::new(),
            computed: 0,
        }
    }

    /// Appends `new` and runs them through the model; returns the logits of the last one.
    pub fn feed(&mut self, new: &[u32]) -> Vec<f32> {
        self.tokens.extend_from_slice(new);
        let table: Vec<u32> = (0..self.tokens.len().div_ceil(self.block_size) as u32).collect();
        let seqs = [SequenceSlice {
            query_start: 0,
            query_len: new.len(),
            context_len: self.tokens.len(),
            block_table: &table,
        }];
        let batch = ForwardBatch {
            token_ids: new,
            sequences: &seqs,
        };
        let logits = self
            .model
            .forward(
                &batch,
                &mut self.cache,
                ForwardOptions {
                    logits: LogitsFor::LastTokens,
                    ..Default::default()
                },
            )
            .expect("forward");
        self.computed = self.tokens.len();
        logits
    }

    /// Greedy decoding of `n` tokens after `prompt`.
    pub fn greedy(&mut self, prompt: &[u32], n: usize) -> Vec<Step> {
        let mut logits = self.feed(prompt);
        let mut steps = Vec::new();
        for i in 0..n {
            let token = argmax(&logits);
            steps.push(Step {
                token,
                logprobs: log_softmax(&logits),
            });
            if i + 1 < n {
                logits = self.feed(&[token]);
            }
        }
        steps
    }
}

/// Logits of every position of `prompt` in one prefill step (block size 16), optionally tracing
/// per-layer values.
pub fn prefill_all_logits(
    model: &MoeModel,
    prompt: &[u32],
    trace: Option<&mut ForwardTrace>,
) -> Vec<f32> {
    let opts = ForwardOptions {
        logits: LogitsFor::AllTokens,
        trace,
        ..Default::default()
    };
    prefill(model, prompt, opts)
}

/// Blocks of the single-sequence prefills below.
pub const PREFILL_BLOCK_SIZE: usize = 16;

/// `prompt` as the only sequence of a step, all of it new, in blocks `0..` of `table`.
pub fn whole_prompt<'a>(prompt: &[u32], table: &'a [u32]) -> [SequenceSlice<'a>; 1] {
    [SequenceSlice {
        query_start: 0,
        query_len: prompt.len(),
        context_len: prompt.len(),
        block_table: table,
    }]
}

/// Blocks `0..n` covering `prompt`.
pub fn prefill_table(prompt: &[u32]) -> Vec<u32> {
    (0..prompt.len().div_ceil(PREFILL_BLOCK_SIZE) as u32).collect()
}

/// `prompt` in one prefill step (block size 16) under `opts`.
pub fn prefill(model: &MoeModel, prompt: &[u32], opts: ForwardOptions<'_>) -> Vec<f32> {
    let table = prefill_table(prompt);
    let mut cache = PagedKvCache::new(model.kv_layout(table.len(), PREFILL_BLOCK_SIZE));
    let seqs = whole_prompt(prompt, &table);
    let batch = ForwardBatch {
        token_ids: prompt,
        sequences: &seqs,
    };
    model.forward(&batch, &mut cache, opts).expect("forward")
}

/// Largest |Δ| between `got` and `want`, relative to `want`'s largest magnitude.
pub fn max_rel_diff(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
    got.iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max)
        / scale
}

/// Compares a traced prefill with `expected.safetensors` layer by layer (router logits, layer
/// outputs), then the final logits, so a failure names the first bad layer.
pub fn check_trace(
    case: &str,
    trace: &ForwardTrace,
    logits: &[f32],
    expected: &std::collections::HashMap<String, (Vec<usize>, Vec<f32>)>,
    tolerance: f32,
) {
    for (l, output) in trace.layer_outputs.iter().enumerate() {
        let d = max_rel_diff(output, &expected[&format!("layer_output.{l}")].1);
        assert!(d < tolerance, "{case}: output of layer {l} differs by {d}");
    }
    let layers = expected
        .keys()
        .filter(|k| k.starts_with("layer_output."))
        .count();
    assert_eq!(trace.layer_outputs.len(), layers, "{case}: traced layers");
    // Router logits exist for the sparse layers only, in layer order.
    let mut sparse: Vec<usize> = expected
        .keys()
        .filter_map(|k| k.strip_prefix("router_logits.")?.parse().ok())
        .collect();
    sparse.sort_unstable();
    assert_eq!(
        trace.router_logits.len(),
        sparse.len(),
        "{case}: sparse layers"
    );
    for (router, l) in trace.router_logits.iter().zip(sparse) {
        let d = max_rel_diff(router, &expected[&format!("router_logits.{l}")].1);
        assert!(
            d < tolerance,
            "{case}: router logits of layer {l} differ by {d}"
        );
    }
    let d = max_rel_diff(logits, &expected["logits"].1);
    assert!(d < tolerance, "{case}: final logits differ by {d}");
}

/// Chooses `--quantization int8` for this test process; false (and says why) where the CPU
/// kernels cannot run it (`MOESERVE_ISA=scalar`).
pub fn run_int8() -> bool {
    use moeserve_backend::cpu::{self, WeightQuantization};
    if !cpu::isa().packs_weights() {
        eprintln!("int8 needs the AVX-512 or AVX2 kernels; MOESERVE_ISA=scalar is set");
        return false;
    }
    cpu::set_weight_quantization(WeightQuantization::Int8).unwrap();
    true
}

/// Teacher-forced accuracy of `model` on the transformers references in `reference`: their
/// greedy tokens are fed one by one and, at each position, the model's logprob of the
/// reference token is compared with the reference's. (mean |Δlogprob|, greedy agreement,
/// positions).
pub fn teacher_forced(model: &MoeModel, reference: &Path) -> (f64, f64, usize) {
    let reference = read_reference(reference);
    let (mut delta, mut agree, mut positions) = (0.0f64, 0usize, 0usize);
    for want in &reference.prompts {
        let n = want.greedy_ids.len();
        let mut seq = SoloSequence::new(model, want.prompt_ids.len() + n, 16);
        let mut logits = seq.feed(&want.prompt_ids);
        for (i, &token) in want.greedy_ids.iter().enumerate() {
            let lp = log_softmax(&logits);
            delta += f64::from((lp[token as usize] - want.greedy_logprobs[i]).abs());
            agree += usize::from(argmax(&logits) == token);
            positions += 1;
            logits = seq.feed(&[token]);
        }
    }
    (
        delta / positions as f64,
        agree as f64 / positions as f64,
        positions,
    )
}

/// The demo model (made by `models/smolmoe-8x135m.sh`), or `$MOESERVE_DEMO_MODEL`.
pub fn demo_model_dir() -> PathBuf {
    std::env::var_os("MOESERVE_DEMO_MODEL").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/smolmoe-8x135m"),
        PathBuf::from,
    )
}

pub fn load_demo(dir: &Path) -> MoeModel {
    MoeModel::load(dir)
        .unwrap_or_else(|e| panic!("{}: {e} (run models/smolmoe-8x135m.sh)", dir.display()))
}
