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

use super::{Architecture, Common, MLP_NAMES, MoeShape};
use crate::config::{AttentionConfig, ConfigFields, ModelConfig, QkNorm, SharedExpertConfig};
use crate::moe::{GroupLimit, Scoring};
use crate::{ModelError, Result};

pub(super) fn read_config(fields: &ConfigFields<'_>) -> Result<ModelConfig> {
    let c = Common::read(fields, 1e4, 1e-5, 131072)?;
    let num_experts = match fields.opt_usize("n_routed_experts")? {
        Some(n) => n,
        None => fields.opt_usize("num_local_experts")?.unwrap_or(128),
    };
    let first_dense = fields.opt_usize("first_k_dense_replace")?.unwrap_or(1);
    let sparse_layers = (0..c.num_hidden_layers).map(|l| l >= first_dense).collect();
    let bias = fields.opt_bool("attention_bias")?.unwrap_or(false);
    let attention = AttentionConfig {
        qkv_bias: bias,
        o_bias: false,
        qk_norm: match fields.opt_bool("use_qk_norm")?.unwrap_or(false) {
            true => QkNorm::PerHead,
            false => QkNorm::None,
        },
        clip_qkv: None,
    };
    let rotary_dim = (c.head_dim as f64 * partial_rotary_factor(fields)?) as usize;
    let moe_intermediate_size = fields.opt_usize("moe_intermediate_size")?.unwrap_or(1408);
    let shared_expert = match fields.opt_usize("n_shared_experts")?.unwrap_or(1) {
        0 => None,
        n => Some(SharedExpertConfig {
            intermediate_size: n * moe_intermediate_size,
            gated: false,
        }),
    };
    let groups = fields.opt_usize("n_group")?.unwrap_or(1);
    let keep = fields.opt_usize("topk_group")?.unwrap_or(1);
    let moe = MoeShape {
        intermediate_size: fields.opt_usize("intermediate_size")?.unwrap_or(10944),
        moe_intermediate_size,
        num_experts,
        num_experts_per_tok: fields.opt_usize("num_experts_per_tok")?.unwrap_or(8),
    };
    let scale = fields.opt_f64("routed_scaling_factor")?.unwrap_or(1.0) as f32;
    Ok(ModelConfig {
        norm_topk_prob: fields.opt_bool("norm_topk_prob")?.unwrap_or(true),
        router_scoring: Scoring::Sigmoid {
            // One group keeps every expert: the same as no limit, which is cheaper.
            group_limit: (groups > 1).then_some(GroupLimit { groups, keep }),
        },
        score_correction_bias: true,
        routed_scaling_factor: scale,
        shared_expert,
        sparse_layers,
        attention,
        names: crate::config::TensorNames {
            shared_expert: "shared_experts",
            ..MLP_NAMES
        },
        rotary_dim,
        ..c.config(Architecture::Glm4Moe, moe)
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
