//! HF `config.json` of the MoE families this crate serves, read into one family-agnostic
//! [`ModelConfig`]: the shapes every family shares plus the per-layer options that tell the
//! families apart (attention variant, which layers are sparse, the router's weighting, shared
//! experts, tensor names). Each family's own reading lives in `crate::families`.
//!
//! Shared conventions follow transformers: `rope_theta` may sit at the top level or, as in
//! transformers ≥ 5, inside `rope_parameters`; `head_dim` defaults to `hidden_size / heads`;
//! `dtype` or the older `torch_dtype`.

use std::path::Path;

use moeserve_core::DType;
use serde_json::Value;

pub use crate::families::{Architecture, SUPPORTED_ARCHITECTURES};
use crate::layers::rope::{RopeFrequencies, RopeScaling, Yarn};
use crate::moe::Scoring;
use crate::{ModelError, Result};

/// How an attention layer normalises its queries and keys before RoPE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QkNorm {
    /// No normalisation (Mixtral, Qwen2-MoE).
    None,
    /// RMSNorm over each head's `head_dim` values (Qwen3-MoE's `q_norm` / `k_norm`).
    PerHead,
    /// RMSNorm over the whole projection, before the split into heads (OLMoE).
    Flat,
}

/// The attention variant of a family (every layer the same).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionConfig {
    /// Biases on the q, k and v projections.
    pub qkv_bias: bool,
    /// A bias on the output projection.
    pub o_bias: bool,
    pub qk_norm: QkNorm,
    /// q, k and v clamped to `[-clip, clip]` (OLMoE's `clip_qkv`, after the q/k norms).
    pub clip_qkv: Option<f32>,
    /// A learned sink logit per head (`self_attn.sinks`, GPT-OSS) joins each softmax's
    /// denominator.
    pub sinks: bool,
}

impl AttentionConfig {
    /// Plain grouped-query attention: no biases, no norms, no clipping (Mixtral).
    pub const PLAIN: AttentionConfig = AttentionConfig {
        qkv_bias: false,
        o_bias: false,
        qk_norm: QkNorm::None,
        clip_qkv: None,
        sinks: false,
    };
}

/// DeepSeek-V2/V3's multi-head latent attention. Per token, the query comes from `q_proj`
/// (no `q_lora_rank`) or `q_a_proj → q_a_layernorm → q_b_proj`, `qk_nope_head_dim +
/// qk_rope_head_dim` per head; `kv_a_proj_with_mqa` gives the latent `kv_lora_rank` values
/// (normed by `kv_a_layernorm`) and one shared rotary key of `qk_rope_head_dim`; `kv_b_proj`
/// expands the latent into each head's `qk_nope_head_dim` key and `v_head_dim` value. What the
/// KV cache stores is the latent and the rotary key, not the expanded heads.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MlaConfig {
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// RoPE turns interleaved pairs (V2 always; V3's `rope_interleave`), else halves.
    pub rope_interleave: bool,
    /// Biases on `q_a_proj`, `kv_a_proj_with_mqa` and `o_proj` (`attention_bias`).
    pub bias: bool,
    /// The attention scores' scale: `qk_head_dim^-0.5`, times YaRN's `mscale(factor,
    /// mscale_all_dim)²` when the config sets `mscale_all_dim`.
    pub softmax_scale: f32,
}

impl MlaConfig {
    /// `q_a_layernorm` and `kv_a_layernorm` keep RMSNorm's default epsilon, whatever
    /// `rms_norm_eps` says (HF builds them without it).
    pub const LATENT_NORM_EPS: f32 = 1e-6;

    /// A query head's width: `qk_nope_head_dim + qk_rope_head_dim`.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// One token's cached row in one layer: the latent and the rotary key.
    pub fn latent_dim(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim
    }
}

/// A shared expert every token goes through beside its routed ones (Qwen2-MoE).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedExpertConfig {
    pub intermediate_size: usize,
    /// Its output is scaled by `sigmoid(shared_expert_gate · x)`, one scalar per token.
    pub gated: bool,
}

/// How a checkpoint may fuse a layer's experts into two 3-D tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FusedExperts {
    /// `experts.gate_up_proj [E, 2I, H]` (each expert's gate rows, then its up rows) and
    /// `experts.down_proj [E, H, I]`, as transformers ≥ 5 writes the Mixtral-like families.
    GateThenUp,
    /// GPT-OSS's `experts.gate_up_proj [E, H, 2I]` (input-major; even columns gate, odd up)
    /// and `experts.down_proj [E, I, H]`, with `_bias` tensors beside them.
    InterleavedInputMajor,
}

/// What the experts of a sparse block compute beyond a SwiGLU MLP.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ExpertConfig {
    /// Biases on the gate, up and down projections (GPT-OSS).
    pub bias: bool,
    pub activation: moeserve_backend::cpu::GatedActivation,
}

impl ExpertConfig {
    /// SwiGLU without biases.
    pub const SWIGLU: ExpertConfig = ExpertConfig {
        bias: false,
        activation: moeserve_backend::cpu::GatedActivation::Silu,
    };
}

/// Where a family keeps its tensors, below `model.layers.L.`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorNames {
    /// The feed-forward block: `block_sparse_moe` (Mixtral) or `mlp`.
    pub moe_block: &'static str,
    /// The router below it: `gate` (`[E, H]`), or GPT-OSS's `router` (with a bias).
    pub router: &'static str,
    /// How fused expert tensors are laid out, when the checkpoint has them.
    pub fused_experts: FusedExperts,
    /// An expert's gate, up and down projections: `w1, w3, w2` or `gate_proj, up_proj, down_proj`.
    pub expert_proj: [&'static str; 3],
    /// The shared expert under the block: `shared_expert` (Qwen2-MoE) or `shared_experts`
    /// (GLM-4.5, DeepSeek).
    pub shared_expert: &'static str,
}

/// The model hyper-parameters the forward pass needs, whatever the family.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// The dense MLP's width, in the layers that have one (`mlp_only_layers`, …).
    pub intermediate_size: usize,
    /// A routed expert's width (`moe_intermediate_size`; Mixtral's `intermediate_size`).
    pub moe_intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    /// Routed experts per sparse layer (`num_local_experts` / `num_experts`).
    pub num_local_experts: usize,
    pub num_experts_per_tok: usize,
    /// Whether the top-k weights are renormalised to sum to 1 (`norm_topk_prob`; Mixtral: yes).
    pub norm_topk_prob: bool,
    /// How the router scores experts: softmax, or sigmoid with groups (GLM-4.5, DeepSeek-V3).
    pub router_scoring: Scoring,
    /// Each sparse layer's router has `gate.e_score_correction_bias` (sigmoid scoring).
    pub score_correction_bias: bool,
    /// `routed_scaling_factor`: the routed experts' weights are multiplied by it.
    pub routed_scaling_factor: f32,
    pub shared_expert: Option<SharedExpertConfig>,
    /// The routed experts' biases and activation.
    pub experts: ExpertConfig,
    /// The router has a bias (`router.bias`, GPT-OSS).
    pub router_bias: bool,
    /// Per decoder layer: whether its feed-forward block is the sparse MoE block (else a dense
    /// MLP of `intermediate_size`).
    pub sparse_layers: Vec<bool>,
    pub attention: AttentionConfig,
    /// Multi-head latent attention instead of grouped-query attention (DeepSeek-V2/V3);
    /// `head_dim` and `rotary_dim` are then its `qk_rope_head_dim`.
    pub mla: Option<MlaConfig>,
    pub names: TensorNames,
    pub rms_norm_eps: f32,
    pub rope_theta: f64,
    /// Plain RoPE or YaRN.
    pub rope_scaling: RopeScaling,
    /// The leading part of each head that RoPE rotates (`head_dim · partial_rotary_factor`;
    /// `head_dim` for most families).
    pub rotary_dim: usize,
    /// Attend to at most this many most recent positions (the query's own included), in the
    /// layers `window_layers` marks.
    pub sliding_window: Option<usize>,
    /// Per decoder layer: whether `sliding_window` applies to it (every layer, but GPT-OSS's
    /// `full_attention` ones in `layer_types`).
    pub window_layers: Vec<bool>,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// `torch_dtype` / `dtype` as declared; the tensors' own dtypes are what is used.
    pub dtype: Option<DType>,
}

impl ModelConfig {
    /// Reads and validates `dir/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
        Self::from_json_str(&text, &path)
    }

    /// Parses config JSON; `path` is only used in error messages. `architectures` (or, without
    /// it, `model_type`) picks the family.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self> {
        let json: Value = serde_json::from_str(text)
            .map_err(|e| ModelError::config(path, format!("invalid JSON: {e}")))?;
        let fields = ConfigFields { json: &json, path };
        let architecture = fields.architecture()?;
        let config = crate::families::read_config(architecture, &fields)?;
        config.validate(path)?;
        Ok(config)
    }

    fn validate(&self, path: &Path) -> Result<()> {
        let bad = |msg: String| Err(ModelError::config(path, msg));
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("num_experts", self.num_local_experts),
            ("num_experts_per_tok", self.num_experts_per_tok),
        ] {
            if v == 0 {
                return bad(format!("`{name}` must be at least 1"));
            }
        }
        if self.sparse_layers.iter().any(|s| *s) && self.moe_intermediate_size == 0 {
            return bad("the experts' intermediate size must be at least 1".to_string());
        }
        if self.sparse_layers.iter().any(|s| !*s) && self.intermediate_size == 0 {
            return bad("`intermediate_size` must be at least 1 for dense layers".to_string());
        }
        if self.shared_expert.is_some_and(|s| s.intermediate_size == 0) {
            return bad("`shared_expert_intermediate_size` must be at least 1".to_string());
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return bad(format!(
                "`num_attention_heads` ({}) must be a multiple of `num_key_value_heads` ({})",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!(
                "`head_dim` ({}) must be even for rotary embeddings",
                self.head_dim
            ));
        }
        if self.rotary_dim == 0
            || self.rotary_dim > self.head_dim
            || !self.rotary_dim.is_multiple_of(2)
        {
            return bad(format!(
                "the rotary part of a head ({}, `head_dim · partial_rotary_factor`) must be even \
                 and in 2..={}",
                self.rotary_dim, self.head_dim
            ));
        }
        let router = crate::moe::RouterConfig {
            renormalize: self.norm_topk_prob,
            scoring: self.router_scoring,
            scale: self.routed_scaling_factor,
            ..crate::moe::RouterConfig::dropless(self.num_experts_per_tok)
        };
        if self.num_moe_layers() > 0
            && let Err(e) = router.validate(self.num_local_experts)
        {
            return bad(format!("`{}` {}", e.field, e.message));
        }
        if self.num_experts_per_tok > self.num_local_experts {
            return bad(format!(
                "`num_experts_per_tok` ({}) exceeds the number of experts ({})",
                self.num_experts_per_tok, self.num_local_experts
            ));
        }
        if self.sliding_window == Some(0) {
            return bad("`sliding_window` must be at least 1 or null".to_string());
        }
        if let Some(clip) = self.attention.clip_qkv
            && !(clip.is_finite() && clip > 0.0)
        {
            return bad(format!("`clip_qkv` must be a number above 0, got {clip}"));
        }
        Ok(())
    }

    /// The sliding window of decoder layer `layer`, if it has one.
    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        self.sliding_window.filter(|_| self.window_layers[layer])
    }

    /// The rotary frequencies of the rotated part of a head, and the cos/sin scaling.
    pub fn rope_frequencies(&self) -> RopeFrequencies {
        RopeFrequencies::new(self.rotary_dim, self.rope_theta, self.rope_scaling)
    }

    /// The widths of one token's key and value rows in one layer's KV cache: grouped-query
    /// attention's `kv_dim()` twice, or MLA's latent row and no value row.
    pub fn kv_cache_row(&self) -> (usize, usize) {
        match &self.mla {
            Some(mla) => (mla.latent_dim(), 0),
            None => (self.kv_dim(), self.kv_dim()),
        }
    }

    /// The heads a KV cache row is made of: `num_key_value_heads`, or one latent row (MLA).
    pub fn kv_cache_heads(&self) -> usize {
        match &self.mla {
            Some(_) => 1,
            None => self.num_key_value_heads,
        }
    }

    /// What one token's KV cache row of one layer holds, for logs: `latent 512 + rope 64` (MLA)
    /// or `keys and values 2 × 8 heads × 128`.
    pub fn kv_cache_row_summary(&self) -> String {
        match &self.mla {
            Some(m) => format!(
                "latent {} + rope {} values per layer",
                m.kv_lora_rank, m.qk_rope_head_dim
            ),
            None => format!(
                "keys and values 2 × {} heads × {} values per layer",
                self.num_key_value_heads, self.head_dim
            ),
        }
    }

    /// Key/value width of one token in one layer: `num_key_value_heads * head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// Query width: `num_attention_heads * head_dim`.
    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    /// The decoder layers whose feed-forward block is the sparse MoE block, in order: the
    /// MoE layer `m` of placement, load tracking and metrics is decoder layer `moe_layers()[m]`.
    pub fn moe_layers(&self) -> Vec<usize> {
        (0..self.num_hidden_layers)
            .filter(|l| self.sparse_layers[*l])
            .collect()
    }

    /// Number of sparse MoE layers.
    pub fn num_moe_layers(&self) -> usize {
        self.sparse_layers.iter().filter(|s| **s).count()
    }

    /// Whether this is the plain Mixtral shape: no attention extras, every layer sparse, no
    /// shared expert, renormalised softmax top-k, full rotary embeddings.
    pub fn is_mixtral_shaped(&self) -> bool {
        self.attention == AttentionConfig::PLAIN
            && self.sparse_layers.iter().all(|s| *s)
            && self.shared_expert.is_none()
            && self.norm_topk_prob
            && self.router_scoring == Scoring::Softmax
            && self.routed_scaling_factor == 1.0
            && self.rotary_dim == self.head_dim
            && self.mla.is_none()
            && self.experts == ExpertConfig::SWIGLU
            && !self.router_bias
    }
}

/// Typed access to config fields with errors that name the field.
pub(crate) struct ConfigFields<'a> {
    pub(crate) json: &'a Value,
    pub(crate) path: &'a Path,
}

impl ConfigFields<'_> {
    pub(crate) fn err(&self, msg: String) -> ModelError {
        ModelError::config(self.path, msg)
    }

    /// The family `architectures` names (the first one this crate serves), or, without
    /// `architectures`, the one `model_type` names.
    pub(crate) fn architecture(&self) -> Result<Architecture> {
        let archs = self.json.get("architectures").and_then(Value::as_array);
        let model_type = self.json.get("model_type").and_then(Value::as_str);
        let found: Vec<&str> = archs
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let known = if found.is_empty() {
            model_type.and_then(Architecture::from_model_type)
        } else {
            found.iter().find_map(|a| Architecture::from_name(a))
        };
        known.ok_or_else(|| {
            let found = if found.is_empty() {
                format!("model_type {}", model_type.unwrap_or("<missing>"))
            } else {
                found.join(", ")
            };
            ModelError::UnsupportedArchitecture {
                path: self.path.to_path_buf(),
                found,
                supported: SUPPORTED_ARCHITECTURES,
            }
        })
    }

    /// `head_dim` as config.json gives it (not a declared field of every config class, but
    /// read when present), else `hidden_size / num_attention_heads`.
    pub(crate) fn head_dim(&self, hidden_size: usize, heads: usize) -> Result<usize> {
        Ok(self
            .opt_usize("head_dim")?
            .unwrap_or(hidden_size / heads.max(1)))
    }

    /// A list of layer indices (`mlp_only_layers`); empty when absent.
    pub(crate) fn usize_list(&self, key: &str) -> Result<Vec<usize>> {
        match self.json.get(key) {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_u64().map(|n| n as usize).ok_or_else(|| {
                        self.err(format!("`{key}` must list non-negative integers, got {v}"))
                    })
                })
                .collect(),
            Some(v) => Err(self.err(format!("`{key}` must be a list of integers, got {v}"))),
        }
    }

    pub(crate) fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.json.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_u64().map(|n| Some(n as usize)).ok_or_else(|| {
                self.err(format!(
                    "field `{key}` must be a non-negative integer, got {v}"
                ))
            }),
        }
    }

    pub(crate) fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?
            .ok_or_else(|| self.err(format!("missing field `{key}`")))
    }

    pub(crate) fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.json.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.err(format!("field `{key}` must be a number, got {v}"))),
        }
    }

    pub(crate) fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.json.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.err(format!("field `{key}` must be true or false, got {v}"))),
        }
    }

    /// `rope_theta`, or `rope_parameters.rope_theta` (transformers ≥ 5); `default` (the family
    /// config class's) when neither is given.
    pub(crate) fn rope_theta(&self, default: f64) -> Result<f64> {
        if let Some(t) = self.opt_f64("rope_theta")? {
            return Ok(t);
        }
        if let Some(params) = self.json.get("rope_parameters").filter(|v| !v.is_null()) {
            return params
                .get("rope_theta")
                .and_then(Value::as_f64)
                .ok_or_else(|| {
                    self.err("field `rope_parameters.rope_theta` must be a number".to_string())
                });
        }
        Ok(default)
    }

    /// The RoPE type and its parameters: `rope_parameters` (transformers ≥ 5) or the older
    /// `rope_scaling`; plain RoPE without either. Types other than `default` and `yarn` are
    /// refused by name.
    pub(crate) fn rope_scaling(&self, max_position_embeddings: usize) -> Result<RopeScaling> {
        let found = ["rope_parameters", "rope_scaling"]
            .into_iter()
            .find_map(|key| Some((key, self.json.get(key).filter(|v| v.is_object())?)));
        let Some((key, params)) = found else {
            return Ok(RopeScaling::None);
        };
        let kind = params
            .get("rope_type")
            .or_else(|| params.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("default");
        let number = |name: &str| -> Result<Option<f64>> {
            match params.get(name) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => v.as_f64().map(Some).ok_or_else(|| {
                    self.err(format!("field `{key}.{name}` must be a number, got {v}"))
                }),
            }
        };
        match kind {
            "default" => Ok(RopeScaling::None),
            "yarn" => {
                let original = match number("original_max_position_embeddings")? {
                    Some(n) => n as usize,
                    None => self
                        .opt_usize("original_max_position_embeddings")?
                        .unwrap_or(max_position_embeddings),
                };
                let factor = match number("factor")? {
                    Some(f) => f,
                    None => max_position_embeddings as f64 / original.max(1) as f64,
                };
                if !(factor.is_finite() && factor > 0.0) || original == 0 {
                    return Err(self.err(format!(
                        "`{key}`: YaRN needs a factor above 0 and an original context, got \
                         factor {factor} and original_max_position_embeddings {original}"
                    )));
                }
                Ok(RopeScaling::Yarn(Yarn {
                    factor,
                    original_max_position_embeddings: original,
                    // transformers: `get("beta_fast") or 32`, so 0 means the default too.
                    beta_fast: number("beta_fast")?.filter(|b| *b != 0.0).unwrap_or(32.0),
                    beta_slow: number("beta_slow")?.filter(|b| *b != 0.0).unwrap_or(1.0),
                    attention_factor: number("attention_factor")?,
                    mscale: number("mscale")?,
                    mscale_all_dim: number("mscale_all_dim")?,
                    truncate: params
                        .get("truncate")
                        .and_then(Value::as_bool)
                        .unwrap_or(true),
                }))
            }
            other => Err(self.err(format!(
                "`{key}.rope_type` {other:?} is not supported (only \"default\" and \"yarn\")"
            ))),
        }
    }

    pub(crate) fn dtype(&self) -> Option<DType> {
        ["torch_dtype", "dtype"].iter().find_map(|k| {
            self.json
                .get(*k)
                .and_then(Value::as_str)
                .and_then(DType::parse)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#"{"architectures":["MixtralForCausalLM"],"vocab_size":32,"hidden_size":16,
        "intermediate_size":32,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,
        "num_local_experts":4,"num_experts_per_tok":2,"rms_norm_eps":1e-5,"rope_theta":10000.0,
        "sliding_window":null,"tie_word_embeddings":false,"torch_dtype":"bfloat16"}"#;

    fn parse(text: &str) -> Result<ModelConfig> {
        ModelConfig::from_json_str(text, Path::new("dir/config.json"))
    }

    #[test]
    fn parses_mixtral_fields_with_defaults() {
        let c = parse(BASE).unwrap();
        assert_eq!(c.head_dim, 4);
        assert_eq!(c.kv_dim(), 8);
        assert_eq!(c.sliding_window, None);
        assert_eq!(c.dtype, Some(DType::BF16));
    }

    #[test]
    fn reads_rope_theta_from_rope_parameters() {
        let text = BASE.replace(
            r#""rope_theta":10000.0,"#,
            r#""rope_parameters":{"rope_theta":5e5,"rope_type":"default"},"#,
        );
        assert_eq!(parse(&text).unwrap().rope_theta, 5e5);
    }

    #[test]
    fn missing_field_is_named_with_path() {
        let text = BASE.replace(r#""hidden_size":16,"#, "");
        let msg = parse(&text).unwrap_err().to_string();
        assert!(
            msg.contains("dir/config.json") && msg.contains("missing field `hidden_size`"),
            "{msg}"
        );
    }

    #[test]
    fn other_architecture_is_refused_naming_it_and_the_supported_list() {
        let text = BASE.replace("MixtralForCausalLM", "BertModel");
        let msg = parse(&text).unwrap_err().to_string();
        assert!(
            msg.contains("BertModel") && msg.contains("not supported"),
            "{msg}"
        );
        for arch in Architecture::ALL {
            assert!(msg.contains(arch.name()), "{msg}");
        }
    }

    const QWEN3: &str = r#"{"architectures":["Qwen3MoeForCausalLM"],"model_type":"qwen3_moe",
        "vocab_size":32,"hidden_size":16,"intermediate_size":48,"moe_intermediate_size":8,
        "num_hidden_layers":4,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":6,
        "num_experts":8,"num_experts_per_tok":2,"norm_topk_prob":true,"decoder_sparse_step":2,
        "mlp_only_layers":[3],"rope_theta":1e6,"tie_word_embeddings":false,"dtype":"bfloat16"}"#;

    #[test]
    fn qwen3_moe_reads_head_dim_norms_and_which_layers_are_sparse() {
        let c = parse(QWEN3).unwrap();
        assert_eq!(c.architecture, Architecture::Qwen3Moe);
        // head_dim as given, though 16 / 4 = 4.
        assert_eq!((c.head_dim, c.q_dim(), c.kv_dim()), (6, 24, 12));
        assert_eq!((c.intermediate_size, c.moe_intermediate_size), (48, 8));
        assert!(c.norm_topk_prob);
        assert_eq!(c.attention.qk_norm, QkNorm::PerHead);
        assert!(!c.attention.qkv_bias);
        // (l + 1) % 2 == 0 and not in mlp_only_layers: only layer 1.
        assert_eq!(c.sparse_layers, vec![false, true, false, false]);
        assert_eq!((c.moe_layers(), c.num_moe_layers()), (vec![1], 1));
        assert_eq!(c.names.expert_proj, ["gate_proj", "up_proj", "down_proj"]);
        assert!(!c.is_mixtral_shaped());
        // The model_type alone picks the family too.
        let text = QWEN3.replace(r#""architectures":["Qwen3MoeForCausalLM"],"#, "");
        assert_eq!(parse(&text).unwrap().architecture, Architecture::Qwen3Moe);
        let windowed = QWEN3.replace(r#""dtype""#, r#""use_sliding_window":true,"dtype""#);
        let msg = parse(&windowed).unwrap_err().to_string();
        assert!(msg.contains("use_sliding_window"), "{msg}");
    }

    #[test]
    fn qwen2_moe_has_qkv_bias_a_gated_shared_expert_and_no_renormalisation() {
        let text = QWEN3
            .replace("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")
            .replace("qwen3_moe", "qwen2_moe")
            .replace(
                r#""norm_topk_prob":true,"#,
                r#""shared_expert_intermediate_size":20,"#,
            );
        let c = parse(&text).unwrap();
        assert_eq!(c.architecture, Architecture::Qwen2Moe);
        assert!(c.attention.qkv_bias && !c.attention.o_bias);
        assert_eq!(c.attention.qk_norm, QkNorm::None);
        assert!(!c.norm_topk_prob);
        assert_eq!(
            c.shared_expert,
            Some(SharedExpertConfig {
                intermediate_size: 20,
                gated: true
            })
        );
    }

    #[test]
    fn olmoe_normalises_flat_q_and_k_and_clips() {
        let text = r#"{"architectures":["OlmoeForCausalLM"],"vocab_size":32,"hidden_size":16,
            "intermediate_size":8,"num_hidden_layers":2,"num_attention_heads":4,
            "num_experts":8,"num_experts_per_tok":2,"clip_qkv":2.5}"#;
        let c = parse(text).unwrap();
        assert_eq!(c.attention.qk_norm, QkNorm::Flat);
        assert_eq!(c.attention.clip_qkv, Some(2.5));
        assert_eq!((c.moe_intermediate_size, c.num_local_experts), (8, 8));
        assert_eq!(c.sparse_layers, vec![true, true]);
        assert!(!c.norm_topk_prob);
        assert_eq!(c.rope_theta, 1e4);
        let msg = parse(&text.replace("2.5", "-1")).unwrap_err().to_string();
        assert!(msg.contains("`clip_qkv` must be a number above 0"), "{msg}");
    }

    #[test]
    fn glm4_moe_has_the_sigmoid_router_shared_experts_and_partial_rotary() {
        let text = r#"{"architectures":["Glm4MoeForCausalLM"],"vocab_size":32,"hidden_size":16,
            "intermediate_size":40,"moe_intermediate_size":8,"num_hidden_layers":3,
            "num_attention_heads":4,"num_key_value_heads":2,"head_dim":8,"n_routed_experts":8,
            "num_experts_per_tok":2,"n_shared_experts":2,"first_k_dense_replace":1,"n_group":4,
            "topk_group":2,"routed_scaling_factor":2.5,"use_qk_norm":true,"attention_bias":true,
            "rope_theta":1e6,"partial_rotary_factor":0.5}"#;
        let c = parse(text).unwrap();
        assert_eq!(c.architecture, Architecture::Glm4Moe);
        assert_eq!(c.sparse_layers, vec![false, true, true]);
        assert_eq!((c.head_dim, c.rotary_dim), (8, 4));
        assert_eq!(
            c.router_scoring,
            Scoring::Sigmoid {
                group_limit: Some(crate::moe::GroupLimit { groups: 4, keep: 2 })
            }
        );
        assert!(c.score_correction_bias && c.norm_topk_prob);
        assert_eq!(c.routed_scaling_factor, 2.5);
        assert_eq!(
            c.shared_expert,
            Some(SharedExpertConfig {
                intermediate_size: 16,
                gated: false
            })
        );
        assert_eq!(c.names.shared_expert, "shared_experts");
        assert!(c.attention.qkv_bias && !c.attention.o_bias);
        assert_eq!(c.attention.qk_norm, QkNorm::PerHead);
        assert!(!c.is_mixtral_shaped());
        // transformers ≥ 5 writes the factor into rope_parameters; its default is 0.5.
        let nested = text.replace(
            r#""rope_theta":1e6,"partial_rotary_factor":0.5"#,
            r#""rope_parameters":{"rope_type":"default","rope_theta":1e6,"partial_rotary_factor":0.25}"#,
        );
        assert_eq!(parse(&nested).unwrap().rotary_dim, 2);
        let default = text.replace(r#","partial_rotary_factor":0.5"#, "");
        assert_eq!(parse(&default).unwrap().rotary_dim, 4);
        // Groups that cannot hold the top-k are refused at load, naming the field.
        let msg = parse(&text.replace(r#""topk_group":2"#, r#""topk_group":5"#))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("n_group"), "{msg}");
        let msg = parse(&text.replace("0.5}", "1.5}"))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("partial_rotary_factor"), "{msg}");
    }

    #[test]
    fn yarn_is_read_from_rope_parameters_or_rope_scaling_and_other_types_are_refused() {
        let yarn = r#""rope_parameters":{"rope_type":"yarn","rope_theta":1e6,"factor":4.0,
            "original_max_position_embeddings":8192,"beta_fast":16},"#;
        let c = parse(&QWEN3.replace(r#""dtype""#, &format!(r#"{yarn}"dtype""#))).unwrap();
        let RopeScaling::Yarn(y) = c.rope_scaling else {
            panic!("{:?}", c.rope_scaling)
        };
        assert_eq!((y.factor, y.original_max_position_embeddings), (4.0, 8192));
        assert_eq!((y.beta_fast, y.beta_slow, y.truncate), (16.0, 1.0, true));
        assert_eq!(c.rope_theta, 1e6);
        let f = c.rope_frequencies();
        assert_eq!(f.inv_freq.len(), c.head_dim / 2);
        assert!(f.attention_scaling > 1.0);
        // The older key, with `type`.
        let legacy = r#""rope_scaling":{"type":"yarn","factor":2.0,
            "original_max_position_embeddings":4096},"#;
        let c = parse(&QWEN3.replace(r#""dtype""#, &format!(r#"{legacy}"dtype""#))).unwrap();
        assert!(matches!(c.rope_scaling, RopeScaling::Yarn(y) if y.factor == 2.0));
        let linear = r#""rope_scaling":{"type":"linear","factor":2.0},"#;
        let msg = parse(&QWEN3.replace(r#""dtype""#, &format!(r#"{linear}"dtype""#)))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("\"linear\" is not supported"), "{msg}");
    }

    #[test]
    fn gpt_oss_has_sinks_alternating_windows_and_biased_clamped_experts() {
        use moeserve_backend::cpu::GatedActivation;
        // gpt-oss-20b's config.json, its layers cut to 4.
        let text = r#"{"architectures":["GptOssForCausalLM"],"attention_bias":true,
            "head_dim":64,"hidden_size":2880,"intermediate_size":2880,"layer_types":
            ["sliding_attention","full_attention","sliding_attention","full_attention"],
            "max_position_embeddings":131072,"model_type":"gpt_oss","num_attention_heads":64,
            "num_experts_per_tok":4,"num_hidden_layers":4,"num_key_value_heads":8,
            "num_local_experts":32,"rms_norm_eps":1e-05,"rope_scaling":{"beta_fast":32.0,
            "beta_slow":1.0,"factor":32.0,"original_max_position_embeddings":4096,
            "rope_type":"yarn","truncate":false},"rope_theta":150000,"sliding_window":128,
            "swiglu_limit":7.0,"tie_word_embeddings":false,"vocab_size":201088}"#;
        let c = parse(text).unwrap();
        assert_eq!(c.architecture, Architecture::GptOss);
        assert_eq!((c.q_dim(), c.hidden_size, c.kv_dim()), (4096, 2880, 512));
        assert_eq!(c.window_layers, vec![true, false, true, false]);
        assert_eq!(
            (0..4).map(|l| c.layer_window(l)).collect::<Vec<_>>(),
            vec![Some(128), None, Some(128), None]
        );
        assert!(c.attention.sinks && c.attention.qkv_bias && c.attention.o_bias);
        assert!(c.router_bias && c.norm_topk_prob && c.sparse_layers.iter().all(|s| *s));
        assert_eq!(c.names.router, "router");
        assert_eq!(c.names.fused_experts, FusedExperts::InterleavedInputMajor);
        assert_eq!(
            c.experts,
            ExpertConfig {
                bias: true,
                activation: GatedActivation::ClampedSwiglu {
                    alpha: 1.702,
                    limit: 7.0
                }
            }
        );
        let RopeScaling::Yarn(y) = c.rope_scaling else {
            panic!("{:?}", c.rope_scaling)
        };
        assert_eq!(
            (y.factor, y.truncate, c.rope_theta),
            (32.0, false, 150000.0)
        );
        assert!(!c.is_mixtral_shaped());
        // The config class's defaults: YaRN, window 128, even layers sliding.
        let bare = text
            .replace(
                r#""rope_scaling":{"beta_fast":32.0,
            "beta_slow":1.0,"factor":32.0,"original_max_position_embeddings":4096,
            "rope_type":"yarn","truncate":false},"#,
                "",
            )
            .replace(r#""sliding_window":128,"#, "")
            .replace(
                r#""layer_types":
            ["sliding_attention","full_attention","sliding_attention","full_attention"],"#,
                "",
            );
        let d = parse(&bare).unwrap();
        assert_eq!(d.rope_scaling, c.rope_scaling);
        assert_eq!(
            (d.sliding_window, &d.window_layers),
            (Some(128), &c.window_layers)
        );
        // A layer_types entry the family does not have, or the wrong count, is refused.
        let msg = parse(&text.replace(r#""full_attention"]"#, r#""chunked_attention"]"#))
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("layer_types") && msg.contains("chunked"),
            "{msg}"
        );
        let msg = parse(&text.replace(r#""num_hidden_layers":4"#, r#""num_hidden_layers":3"#))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("lists 4 layers"), "{msg}");
        // The MXFP4 release reads as the same model; another quantization method is refused.
        let quantized = |method: &str| {
            text.replace(
                r#""vocab_size":201088"#,
                &format!(
                    r#""vocab_size":201088,"quantization_config":{{"quant_method":"{method}"}}"#
                ),
            )
        };
        assert_eq!(parse(&quantized("mxfp4")).unwrap().experts, c.experts);
        let msg = parse(&quantized("awq")).unwrap_err().to_string();
        assert!(msg.contains("\"awq\"") && msg.contains("MXFP4"), "{msg}");
    }

    #[test]
    fn mixtral_is_the_plain_shape() {
        let c = parse(BASE).unwrap();
        assert!(c.is_mixtral_shaped());
        assert_eq!(c.moe_intermediate_size, c.intermediate_size);
        assert_eq!(c.names.moe_block, "block_sparse_moe");
    }

    #[test]
    fn wrong_type_and_inconsistent_heads_are_refused() {
        let msg = parse(&BASE.replace(r#""vocab_size":32"#, r#""vocab_size":"big""#))
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("`vocab_size` must be a non-negative integer"),
            "{msg}"
        );
        let msg = parse(&BASE.replace(r#""num_key_value_heads":2"#, r#""num_key_value_heads":3"#))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("multiple of `num_key_value_heads`"), "{msg}");
    }
}
