//! `Glm4MoeForCausalLM` (transformers' `Glm4MoeConfig`: GLM-4.5, GLM-4.5-Air): grouped-query
//! attention with q/k/v biases (`attention_bias`; never on `o_proj`), RMSNorm per head on q and
//! k with `use_qk_norm`, RoPE over the leading `partial_rotary_factor` of each head (default
//! 0.5); the first `first_k_dense_replace` layers dense (an MLP of `intermediate_size`), the
//! others sparse: `n_routed_experts` experts of `moe_intermediate_size` chosen by DeepSeek-V3's
//! sigmoid router (`e_score_correction_bias`, `n_group` groups of which `topk_group` are kept,
//! `norm_topk_prob`, `routed_scaling_factor`), plus `n_shared_experts` shared experts computed
//! as one MLP of `n_shared_experts · moe_intermediate_size` (`mlp.shared_experts`, no gate).
//! The MTP layers after the last decoder layer (`num_nextn_predict_layers`) are not loaded, as
//! transformers ignores them.

use super::{Architecture, Common, DeepseekMoe, DeepseekMoeDefaults, MLP_NAMES};
use crate::config::{AttentionConfig, ConfigFields, ModelConfig, QkNorm};
use crate::moe::Scoring;
use crate::{ModelError, Result};

/// `Glm4MoeConfig`'s defaults.
const DEFAULTS: DeepseekMoeDefaults = DeepseekMoeDefaults {
    n_routed_experts: 128,
    num_experts_per_tok: 8,
    first_k_dense_replace: 1,
    intermediate_size: 10944,
    moe_intermediate_size: 1408,
    n_shared_experts: 1,
    n_group: 1,
    topk_group: 1,
    routed_scaling_factor: 1.0,
};

pub(super) fn read_config(fields: &ConfigFields<'_>) -> Result<ModelConfig> {
    let c = Common::read(fields, 1e4, 1e-5, 131072)?;
    let moe = DeepseekMoe::read(fields, &DEFAULTS, c.num_hidden_layers)?;
    let bias = fields.opt_bool("attention_bias")?.unwrap_or(false);
    let attention = AttentionConfig {
        qkv_bias: bias,
        o_bias: false,
        qk_norm: match fields.opt_bool("use_qk_norm")?.unwrap_or(false) {
            true => QkNorm::PerHead,
            false => QkNorm::None,
        },
        clip_qkv: None,
        sinks: false,
    };
    let rotary_dim = (c.head_dim as f64 * partial_rotary_factor(fields)?) as usize;
    Ok(ModelConfig {
        norm_topk_prob: fields.opt_bool("norm_topk_prob")?.unwrap_or(true),
        router_scoring: Scoring::Sigmoid {
            group_limit: moe.group_limit,
        },
        score_correction_bias: true,
        routed_scaling_factor: moe.routed_scaling_factor,
        shared_expert: moe.shared_expert,
        sparse_layers: moe.sparse_layers,
        attention,
        names: crate::config::TensorNames {
            shared_expert: "shared_experts",
            ..MLP_NAMES
        },
        rotary_dim,
        ..c.config(Architecture::Glm4Moe, moe.shape)
    })
}

/// `partial_rotary_factor`, top level (as the hub's configs say it) or in `rope_parameters`
/// (as transformers ≥ 5 writes it); the config class's default is 0.5.
fn partial_rotary_factor(fields: &ConfigFields<'_>) -> Result<f64> {
    let nested = fields
        .json
        .get("rope_parameters")
        .and_then(|p| p.get("partial_rotary_factor"))
        .and_then(serde_json::Value::as_f64);
    let factor = fields
        .opt_f64("partial_rotary_factor")?
        .or(nested)
        .unwrap_or(0.5);
    if !(factor > 0.0 && factor <= 1.0) {
        return Err(ModelError::config(
            fields.path,
            format!("`partial_rotary_factor` must be in (0, 1], got {factor}"),
        ));
    }
    Ok(factor)
}
