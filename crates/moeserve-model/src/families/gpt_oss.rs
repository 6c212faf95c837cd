//! `GptOssForCausalLM` (transformers' `GptOssConfig`: gpt-oss-20b, gpt-oss-120b): grouped-query
//! attention with biases on all four projections and a learned sink logit per head
//! (`self_attn.sinks`); `layer_types` alternating `sliding_attention` (a window of
//! `sliding_window`) and `full_attention`; YaRN RoPE by halves (the config class's default
//! when config.json sets none); every layer sparse: `mlp.router` (weight and bias) takes the
//! top-k of the raw logits and softmaxes over the k (the same weights as a softmax over all
//! experts renormalised over the top k); experts with biases whose gate and up projections are
//! interleaved in one `gate_up_proj [E, H, 2I]`, through GPT-OSS's clamped SwiGLU
//! (`swiglu_alpha`, `swiglu_limit`). The release's MXFP4 experts (`quantization_config:
//! {"quant_method": "mxfp4"}`, `*_blocks` / `*_scales`) load as 4-bit
//! (`Checkpoint::mxfp4_rows`).

use moeserve_backend::cpu::GatedActivation;

use super::{Architecture, Common, MLP_NAMES, MoeShape};
use crate::config::{
    AttentionConfig, ConfigFields, ExpertConfig, FusedExperts, ModelConfig, QkNorm, TensorNames,
};
use crate::layers::rope::{RopeScaling, Yarn};
use crate::{ModelError, Result};

/// `GptOssConfig`'s defaults.
const SLIDING_WINDOW: usize = 128;
const SWIGLU_ALPHA: f64 = 1.702;
const SWIGLU_LIMIT: f64 = 7.0;

pub(super) fn read_config(fields: &ConfigFields<'_>) -> Result<ModelConfig> {
    let quant = fields
        .json
        .get("quantization_config")
        .and_then(|q| q.get("quant_method"))
        .and_then(serde_json::Value::as_str);
    // `moeserve quantize`'s int8 checkpoints are read by the checkpoint, whatever the family.
    if let Some(method) = quant.filter(|m| !["mxfp4", crate::quantize::QUANT_METHOD].contains(m)) {
        return Err(ModelError::config(
            fields.path,
            format!(
                "`quantization_config.quant_method: {method:?}`: GPT-OSS checkpoints are read in \
                 bf16/f32 or with MXFP4 experts (\"mxfp4\", as released)"
            ),
        ));
    }
    let mut c = Common::read(fields, 150_000.0, 1e-5, 131_072)?;
    if !rope_scaling_given(fields) {
        c.rope_scaling = DEFAULT_YARN;
    }
    let num_layers = c.num_hidden_layers;
    let num_experts = match fields.opt_usize("num_local_experts")? {
        Some(n) => n,
        None => fields.opt_usize("num_experts")?.unwrap_or(128),
    };
    let intermediate_size = fields.opt_usize("intermediate_size")?.unwrap_or(2880);
    let moe = MoeShape {
        intermediate_size,
        moe_intermediate_size: intermediate_size,
        num_experts,
        num_experts_per_tok: fields.opt_usize("num_experts_per_tok")?.unwrap_or(4),
    };
    let bias = fields.opt_bool("attention_bias")?.unwrap_or(true);
    let attention = AttentionConfig {
        qkv_bias: bias,
        o_bias: bias,
        qk_norm: QkNorm::None,
        clip_qkv: None,
        sinks: true,
    };
    let window_layers = window_layers(fields, num_layers)?;
    let sliding_window = match fields.json.get("sliding_window") {
        None => Some(SLIDING_WINDOW),
        Some(_) => fields.opt_usize("sliding_window")?,
    };
    let limit = fields.opt_f64("swiglu_limit")?.unwrap_or(SWIGLU_LIMIT);
    let alpha = fields.opt_f64("swiglu_alpha")?.unwrap_or(SWIGLU_ALPHA);
    if !(limit.is_finite() && limit > 0.0 && alpha.is_finite()) {
        return Err(ModelError::config(
            fields.path,
            format!(
                "`swiglu_limit` must be above 0 and `swiglu_alpha` finite, got {limit}, {alpha}"
            ),
        ));
    }
    Ok(ModelConfig {
        // Top-k of the logits, then a softmax over the k chosen.
        norm_topk_prob: true,
        experts: ExpertConfig {
            bias: true,
            activation: GatedActivation::ClampedSwiglu {
                alpha: alpha as f32,
                limit: limit as f32,
            },
        },
        router_bias: true,
        attention,
        names: TensorNames {
            router: "router",
            fused_experts: FusedExperts::InterleavedInputMajor,
            ..MLP_NAMES
        },
        sliding_window,
        window_layers,
        ..c.config(Architecture::GptOss, moe)
    })
}

/// Per layer, whether it is a `sliding_attention` one; without `layer_types`, the config
/// class's pattern (even layers sliding, odd ones full).
fn window_layers(fields: &ConfigFields<'_>, num_layers: usize) -> Result<Vec<bool>> {
    let Some(types) = fields.json.get("layer_types").filter(|v| !v.is_null()) else {
        return Ok((0..num_layers).map(|l| l % 2 == 0).collect());
    };
    let bad = |msg: String| ModelError::config(fields.path, msg);
    let types = types
        .as_array()
        .ok_or_else(|| bad(format!("`layer_types` must be a list, got {types}")))?;
    if types.len() != num_layers {
        return Err(bad(format!(
            "`layer_types` lists {} layers, `num_hidden_layers` is {num_layers}",
            types.len()
        )));
    }
    types
        .iter()
        .map(|t| match t.as_str() {
            Some("sliding_attention") => Ok(true),
            Some("full_attention") => Ok(false),
            _ => Err(bad(format!(
                "`layer_types` entries must be \"sliding_attention\" or \"full_attention\", \
                 got {t}"
            ))),
        })
        .collect()
}

/// The config class's RoPE when config.json sets none: YaRN over 32× an original 4096
/// positions, `beta_fast` 32, `beta_slow` 1, not truncated.
const DEFAULT_YARN: RopeScaling = RopeScaling::Yarn(Yarn {
    factor: 32.0,
    original_max_position_embeddings: 4096,
    beta_fast: 32.0,
    beta_slow: 1.0,
    attention_factor: None,
    mscale: None,
    mscale_all_dim: None,
    truncate: false,
});

/// Whether config.json says `rope_parameters` or `rope_scaling` (else [`DEFAULT_YARN`]).
fn rope_scaling_given(fields: &ConfigFields<'_>) -> bool {
    ["rope_parameters", "rope_scaling"]
        .iter()
        .any(|k| fields.json.get(*k).is_some_and(|v| v.is_object()))
}
