//! Dense → MoE conversion: sparse upcycling of a dense llama GGUF into a Mixtral checkpoint
//! in Hugging Face format (safetensors, `config.json`, tokenizer files).
//!
//! Follows "Sparse Upcycling" (Komatsuzaki et al., 2022): every expert starts as a copy of the
//! dense MLP (`w1` = `ffn_gate`, `w3` = `ffn_up`, `w2` = `ffn_down`); attention, norms and
//! embeddings are copied; only the router is new.
//!
//! - Router `block_sparse_moe.gate.weight` `[E, H]`: seeded normal with
//!   `std = 1 / (sqrt(H) · rms(g))`, `g` the layer's `post_attention_layernorm` weight. The
//!   router sees the normed hidden state `x = g ⊙ n` with `rms(n) = 1`, so its logits have a
//!   standard deviation of about 1: routing is neither uniform nor one-hot.
//! - `expert_jitter = s > 0` multiplies every weight of every expert by `1 + s · z`,
//!   `z ~ N(0, 1)` seeded per (seed, tensor): relative noise that keeps each weight's sign and
//!   scale and makes experts differ (`s = 0` keeps them identical, so the MoE output equals the
//!   dense output whatever the router picks, since Mixtral renormalises the top-k weights).
//! - llama.cpp stores `attn_q`/`attn_k` rows permuted for its rotary layout; they are
//!   un-permuted back to the HF layout.
//!
//! `num_experts = 1, top_k = 1` gives the dense model itself in Mixtral form.

mod llama;
mod random;
mod spec;
pub mod tokenizer;

use std::path::PathBuf;
use std::sync::Arc;

use moeserve_core::DType;

pub use llama::{DenseLlama, unpermute_rope_rows};
pub use random::TensorRng;
pub use spec::{
    CheckpointSpec, DeepseekPart, DeepseekSpec, GptOssPart, GptOssSpec, SpecFamily, SpecTensor,
};

use crate::gguf::GgufFile;
use crate::writer::{
    CheckpointWriter, ShardLayout, StagedDir, TensorSource, human_bytes, human_count,
};
use crate::{FormatError, Result};

/// Shards are cut at this size, as transformers' `max_shard_size="5GB"`.
pub const MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// What to upcycle, into what.
#[derive(Clone, Debug, PartialEq)]
pub struct UpcycleOptions {
    /// A dense llama-architecture GGUF.
    pub gguf: PathBuf,
    /// The checkpoint directory to write (created if missing, files replaced).
    pub out: PathBuf,
    pub num_experts: usize,
    pub top_k: usize,
    pub seed: u64,
    /// Relative noise per expert weight (0 = identical experts); see the module doc.
    pub expert_jitter: f32,
    /// Element type of the written tensors.
    pub dtype: DType,
}

/// What [`upcycle_gguf`] wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct UpcycleReport {
    pub out: PathBuf,
    pub spec: CheckpointSpec,
    /// The safetensors files, in shard order.
    pub files: Vec<PathBuf>,
    pub num_parameters: u64,
    pub total_bytes: u64,
}

impl std::fmt::Display for UpcycleReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "wrote {}: Mixtral with {} layers × {} experts (top-{}), {} parameters, {} {} in \
             {} file(s)",
            self.out.display(),
            self.spec.num_hidden_layers,
            self.spec.num_local_experts,
            self.spec.num_experts_per_tok,
            human_count(self.num_parameters),
            human_bytes(self.total_bytes),
            self.spec.dtype,
            self.files.len()
        )
    }
}

/// Converts a dense llama GGUF into an upcycled Mixtral checkpoint directory.
pub fn upcycle_gguf(options: &UpcycleOptions) -> Result<UpcycleReport> {
    validate(options)?;
    let gguf = Arc::new(GgufFile::open(&options.gguf)?);
    let dense = DenseLlama::from_gguf(&gguf)?;
    let tokenizer = tokenizer::tokenizer_from_gguf(&gguf, dense.context_length)?;
    let spec = CheckpointSpec {
        family: SpecFamily::Mixtral,
        vocab_size: dense.vocab_size,
        hidden_size: dense.hidden_size,
        intermediate_size: dense.intermediate_size,
        num_hidden_layers: dense.num_layers,
        num_attention_heads: dense.num_heads,
        num_key_value_heads: dense.num_kv_heads,
        head_dim: dense.head_dim,
        num_local_experts: options.num_experts,
        num_experts_per_tok: options.top_k,
        rms_norm_eps: dense.rms_norm_eps,
        rope_theta: dense.rope_theta,
        max_position_embeddings: dense.context_length,
        tie_word_embeddings: dense.tied_embeddings,
        bos_token_id: tokenizer.bos_token_id,
        eos_token_id: tokenizer.eos_token_id,
        pad_token_id: tokenizer.pad_token_id,
        dtype: options.dtype,
    };
    let sources = spec
        .tensors()
        .into_iter()
        .map(|tensor| tensor_source(&gguf, &spec, tensor, options))
        .collect::<Result<Vec<_>>>()?;

    let staged = StagedDir::new(&options.out)?;
    let writer = CheckpointWriter::create(staged.path())?;
    let written = writer.write_tensors(sources, ShardLayout::MaxShardBytes(MAX_SHARD_BYTES))?;
    writer.write_config(&spec.config_json())?;
    writer.write_json("generation_config.json", &spec.generation_config_json())?;
    writer.write_json("tokenizer.json", &tokenizer.tokenizer_json)?;
    writer.write_json("tokenizer_config.json", &tokenizer.tokenizer_config)?;
    if let Some(template) = &tokenizer.chat_template {
        writer.write_text("chat_template.jinja", template)?;
    }
    let files = written.files.iter().map(|f| staged.final_path(f)).collect();
    staged.commit()?;
    Ok(UpcycleReport {
        out: options.out.clone(),
        spec,
        files,
        num_parameters: written.num_parameters,
        total_bytes: written.total_bytes,
    })
}

fn validate(options: &UpcycleOptions) -> Result<()> {
    let problem = if options.num_experts == 0 {
        Some("num_experts must be at least 1".to_string())
    } else if options.top_k == 0 || options.top_k > options.num_experts {
        Some(format!(
            "top_k must be between 1 and num_experts ({}), got {}",
            options.num_experts, options.top_k
        ))
    } else if !(options.expert_jitter.is_finite() && options.expert_jitter >= 0.0) {
        Some(format!(
            "expert_jitter must be a finite number ≥ 0, got {}",
            options.expert_jitter
        ))
    } else {
        None
    };
    match problem {
        Some(message) => Err(FormatError::config(
            &options.gguf,
            format!("invalid upcycling options: {message}"),
        )),
        None => Ok(()),
    }
}

/// How one Mixtral tensor is made from the GGUF.
fn tensor_source(
    gguf: &Arc<GgufFile>,
    spec: &CheckpointSpec,
    tensor: SpecTensor,
    options: &UpcycleOptions,
) -> Result<TensorSource> {
    use SpecTensor::*;
    let name = spec.name(tensor);
    let shape = spec.shape(tensor);
    let blk = |l: usize, what: &str| format!("blk.{l}.{what}.weight");
    let (source_name, rope_heads) = match tensor {
        EmbedTokens => ("token_embd.weight".to_string(), None),
        FinalNorm => ("output_norm.weight".to_string(), None),
        LmHead => ("output.weight".to_string(), None),
        InputNorm { layer } => (blk(layer, "attn_norm"), None),
        PostAttentionNorm { layer } => (blk(layer, "ffn_norm"), None),
        QProj { layer } => (blk(layer, "attn_q"), Some(spec.num_attention_heads)),
        KProj { layer } => (blk(layer, "attn_k"), Some(spec.num_key_value_heads)),
        VProj { layer } => (blk(layer, "attn_v"), None),
        OProj { layer } => (blk(layer, "attn_output"), None),
        QNorm { .. } | KNorm { .. } => unreachable!("the upcycled Mixtral has no q/k norms"),
        Deepseek { .. } | GptOss { .. } => unreachable!("the upcycled model is a Mixtral"),
        W1 { layer, .. } => (blk(layer, "ffn_gate"), None),
        W2 { layer, .. } => (blk(layer, "ffn_down"), None),
        W3 { layer, .. } => (blk(layer, "ffn_up"), None),
        Router { layer } => {
            let norm = gguf.tensor_f32(&blk(layer, "ffn_norm"))?;
            let rms = (norm
                .iter()
                .map(|&g| f64::from(g) * f64::from(g))
                .sum::<f64>()
                / norm.len().max(1) as f64)
                .sqrt();
            let std = (1.0 / ((spec.hidden_size as f64).sqrt() * rms.max(1e-3))) as f32;
            let rng = TensorRng::new(options.seed, &name);
            return Ok(TensorSource::new(name, options.dtype, shape, move |out| {
                rng.fill_normal(out, std);
                Ok(())
            }));
        }
    };
    let jitter = match tensor {
        W1 { .. } | W2 { .. } | W3 { .. } if options.expert_jitter > 0.0 => {
            Some((TensorRng::new(options.seed, &name), options.expert_jitter))
        }
        _ => None,
    };
    let cols = shape.last().copied().unwrap_or(1);
    let gguf = Arc::clone(gguf);
    Ok(TensorSource::new(name, options.dtype, shape, move |out| {
        gguf.tensor_f32_into(&source_name, out)?;
        if let Some(n_head) = rope_heads {
            unpermute_rope_rows(out, n_head, cols, gguf.path())?;
        }
        if let Some((rng, scale)) = &jitter {
            rng.jitter_multiplicative(out, *scale);
        }
        Ok(())
    }))
}
