//! `Qwen3MoeForCausalLM` and `Qwen2MoeForCausalLM` (transformers' `Qwen3MoeConfig`,
//! `Qwen2MoeConfig`). Both: a layer is sparse unless listed in `mlp_only_layers`, and only every
//! `decoder_sparse_step`-th one is (`(layer + 1) % step == 0`); experts of
//! `moe_intermediate_size` under `mlp.experts.N.{gate,up,down}_proj`, dense layers an MLP of
//! `intermediate_size`; top-k weights renormalised only with `norm_topk_prob`.
//! - Qwen3-MoE: RMSNorm per head on q and k (`q_norm`, `k_norm`) before RoPE; biases on all
//!   four projections only with `attention_bias`.
//! - Qwen2-MoE: q/k/v biases; a shared expert of `shared_expert_intermediate_size` scaled by
//!   `sigmoid(shared_expert_gate · x)`.

use super::{Architecture, Common, MLP_NAMES, MoeShape};
use crate::config::{AttentionConfig, ConfigFields, ModelConfig, QkNorm, SharedExpertConfig};
use crate::{ModelError, Result};

pub(super) fn read_config(
    architecture: Architecture,
    fields: &ConfigFields<'_>,
) -> Result<ModelConfig> {
    let qwen3 = architecture == Architecture::Qwen3Moe;
    let c = Common::read(fields, 1e4, 1e-6, 32768)?;
    if fields.opt_bool("use_sliding_window")?.unwrap_or(false) {
        // Qwen's windows apply to a subset of layers (`max_window_layers`, `layer_types`).
        return Err(ModelError::config(
            fields.path,
            "`use_sliding_window: true` is not supported for this family yet",
        ));
    }
    // Hub configs say `num_experts`; transformers ≥ 5 writes `num_local_experts` (its
    // attribute map) when it saves one.
    let num_experts = match fields.opt_usize("num_experts")? {
        Some(n) => n,
        None => fields.usize("num_local_experts")?,
    };
    let step = fields.opt_usize("decoder_sparse_step")?.unwrap_or(1);
    if step == 0 {
        return Err(ModelError::config(
            fields.path,
            "`decoder_sparse_step` must be at least 1",
        ));
    }
    let mlp_only = fields.usize_list("mlp_only_layers")?;
    let sparse_layers = (0..c.num_hidden_layers)
        .map(|l| !mlp_only.contains(&l) && num_experts > 0 && (l + 1).is_multiple_of(step))
        .collect();
    let attention = if qwen3 {
        let bias = fields.opt_bool("attention_bias")?.unwrap_or(false);
        AttentionConfig {
            qkv_bias: bias,
            o_bias: bias,
            qk_norm: QkNorm::PerHead,
            clip_qkv: None,
            sinks: false,
        }
    } else {
        AttentionConfig {
            qkv_bias: fields.opt_bool("qkv_bias")?.unwrap_or(true),
            o_bias: false,
            qk_norm: QkNorm::None,
            clip_qkv: None,
            sinks: false,
        }
    };
    let shared_expert = match fields.opt_usize("shared_expert_intermediate_size")? {
        Some(size) if !qwen3 && size > 0 => Some(SharedExpertConfig {
            intermediate_size: size,
            gated: true,
        }),
        _ => None,
    };
    let moe = MoeShape {
        intermediate_size: fields.usize("intermediate_size")?,
        moe_intermediate_size: fields.usize("moe_intermediate_size")?,
        num_experts,
        num_experts_per_tok: fields.usize("num_experts_per_tok")?,
    };
    Ok(ModelConfig {
        norm_topk_prob: fields.opt_bool("norm_topk_prob")?.unwrap_or(false),
        shared_expert,
        sparse_layers,
        attention,
        names: MLP_NAMES,
        ..c.config(architecture, moe)
    })
}
