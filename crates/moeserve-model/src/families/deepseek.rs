//! `DeepseekV2ForCausalLM` and `DeepseekV3ForCausalLM` (transformers' `DeepseekV2Config` /
//! `DeepseekV3Config`: DeepSeek-V2, V2-Lite, V2.5, V3, R1, and Kimi-K2, which ships as V3).
//!
//! Attention is multi-head latent attention ([`MlaConfig`]): `q_lora_rank` (null: `q_proj`),
//! `kv_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`; RoPE over the rotary
//! slice only, on interleaved pairs (V2's complex product, V3's `rope_interleave`, default
//! true) or on halves; the scores scaled by `qk_head_dim^-0.5`, times YaRN's
//! `mscale(factor, mscale_all_dim)²` when `mscale_all_dim` is set. `attention_bias` puts biases
//! on `q_a_proj`, `kv_a_proj_with_mqa` and `o_proj`.
//!
//! The first `first_k_dense_replace` layers are dense (an MLP of `intermediate_size`), the
//! others sparse: `n_routed_experts` experts of `moe_intermediate_size` plus
//! `n_shared_experts · moe_intermediate_size` of shared experts (`mlp.shared_experts`, no gate).
//! The routers:
//! - V2 (`topk_method`): `greedy`, the top-k of the softmax over all experts, or
//!   `group_limited_greedy`, the same within the `topk_group` of `n_group` groups whose best
//!   probability is highest; the weights are never renormalised (transformers' V2 ignores
//!   `norm_topk_prob`), then multiplied by `routed_scaling_factor`.
//! - V3: `noaux_tc`, DeepSeek-V3's sigmoid router with `e_score_correction_bias` and groups
//!   (see `moe::router`), renormalised with `norm_topk_prob` (default true), then scaled.
//!
//! V3's MTP layers (`model.layers.{num_hidden_layers}.*`, `num_nextn_predict_layers`) are not
//! loaded, as transformers ignores them.

use super::{Architecture, Common, MLP_NAMES, MoeShape};
use crate::config::{ConfigFields, MlaConfig, ModelConfig, SharedExpertConfig};
use crate::layers::rope::RopeScaling;
use crate::moe::{GroupLimit, Scoring};
use crate::{ModelError, Result};

pub(super) fn read_config(
    architecture: Architecture,
    fields: &ConfigFields<'_>,
) -> Result<ModelConfig> {
    let v3 = architecture == Architecture::DeepseekV3;
    let c = Common::read(fields, 1e4, 1e-6, if v3 { 4096 } else { 2048 })?;
    let num_experts = match fields.opt_usize("n_routed_experts")? {
        Some(n) => n,
        None => fields
            .opt_usize("num_local_experts")?
            .unwrap_or(if v3 { 256 } else { 64 }),
    };
    let first_dense = fields
        .opt_usize("first_k_dense_replace")?
        .unwrap_or(if v3 { 3 } else { 0 });
    let sparse_layers = (0..c.num_hidden_layers).map(|l| l >= first_dense).collect();
    let moe_intermediate_size =
        fields
            .opt_usize("moe_intermediate_size")?
            .unwrap_or(if v3 { 2048 } else { 1407 });
    let shared_expert =
        match fields
            .opt_usize("n_shared_experts")?
            .unwrap_or(if v3 { 1 } else { 2 })
        {
            0 => None,
            n => Some(SharedExpertConfig {
                intermediate_size: n * moe_intermediate_size,
                gated: false,
            }),
        };
    let groups = fields
        .opt_usize("n_group")?
        .unwrap_or(if v3 { 8 } else { 1 });
    let keep = fields
        .opt_usize("topk_group")?
        .unwrap_or(if v3 { 4 } else { 1 });
    let group_limit = (groups > 1).then_some(GroupLimit { groups, keep });
    let router_scoring = match v3 {
        true => Scoring::Sigmoid { group_limit },
        false => v2_scoring(fields, group_limit)?,
    };
    let mla = mla_config(fields, v3, &c)?;
    let moe = MoeShape {
        intermediate_size: fields.opt_usize("intermediate_size")?.unwrap_or(if v3 {
            18432
        } else {
            12288
        }),
        moe_intermediate_size,
        num_experts,
        num_experts_per_tok: fields.opt_usize("num_experts_per_tok")?.unwrap_or(if v3 {
            8
        } else {
            6
        }),
    };
    let (head_dim, rotary_dim) = (mla.qk_rope_head_dim, mla.qk_rope_head_dim);
    Ok(ModelConfig {
        // transformers' V2 router never renormalises; V3's follows `norm_topk_prob`.
        norm_topk_prob: v3 && fields.opt_bool("norm_topk_prob")?.unwrap_or(true),
        router_scoring,
        score_correction_bias: v3,
        routed_scaling_factor: fields.opt_f64("routed_scaling_factor")?.unwrap_or(if v3 {
            2.5
        } else {
            1.0
        }) as f32,
        shared_expert,
        sparse_layers,
        mla: Some(mla),
        names: crate::config::TensorNames {
            shared_expert: "shared_experts",
            ..MLP_NAMES
        },
        // Every head reads the one latent: the query heads are the only heads.
        num_key_value_heads: c.num_attention_heads,
        head_dim,
        rotary_dim,
        ..c.config(architecture, moe)
    })
}

/// DeepSeek-V2's `topk_method`: `greedy` (default) or `group_limited_greedy`.
fn v2_scoring(fields: &ConfigFields<'_>, group_limit: Option<GroupLimit>) -> Result<Scoring> {
    let method = fields
        .json
        .get("topk_method")
        .and_then(serde_json::Value::as_str)
        .unwrap_or("greedy");
    match (method, group_limit) {
        ("greedy", _) => Ok(Scoring::Softmax),
        ("group_limited_greedy", Some(group_limit)) => Ok(Scoring::SoftmaxGrouped { group_limit }),
        // One group keeps every expert: plain greedy.
        ("group_limited_greedy", None) => Ok(Scoring::Softmax),
        (other, _) => Err(ModelError::config(
            fields.path,
            format!(
                "`topk_method` {other:?} is not supported by DeepseekV2ForCausalLM (only \"greedy\" \
                 and \"group_limited_greedy\", as transformers)"
            ),
        )),
    }
}

fn mla_config(fields: &ConfigFields<'_>, v3: bool, c: &Common) -> Result<MlaConfig> {
    let q_lora_rank = match fields.json.get("q_lora_rank") {
        Some(serde_json::Value::Null) => None,
        Some(_) => fields.opt_usize("q_lora_rank")?,
        None => Some(1536),
    };
    let mla = MlaConfig {
        q_lora_rank,
        kv_lora_rank: fields.opt_usize("kv_lora_rank")?.unwrap_or(512),
        qk_nope_head_dim: fields.opt_usize("qk_nope_head_dim")?.unwrap_or(128),
        qk_rope_head_dim: fields.opt_usize("qk_rope_head_dim")?.unwrap_or(64),
        v_head_dim: fields.opt_usize("v_head_dim")?.unwrap_or(128),
        rope_interleave: !v3 || fields.opt_bool("rope_interleave")?.unwrap_or(true),
        bias: fields.opt_bool("attention_bias")?.unwrap_or(false),
        softmax_scale: 0.0,
    };
    for (name, v) in [
        ("kv_lora_rank", mla.kv_lora_rank),
        ("qk_rope_head_dim", mla.qk_rope_head_dim),
        ("v_head_dim", mla.v_head_dim),
        ("q_lora_rank", q_lora_rank.unwrap_or(1)),
    ] {
        if v == 0 {
            return Err(ModelError::config(
                fields.path,
                format!("`{name}` must be at least 1"),
            ));
        }
    }
    if !mla.qk_rope_head_dim.is_multiple_of(2) {
        return Err(ModelError::config(
            fields.path,
            format!(
                "`qk_rope_head_dim` ({}) must be even for rotary embeddings",
                mla.qk_rope_head_dim
            ),
        ));
    }
    let mut scale = (mla.qk_head_dim() as f64).powf(-0.5);
    if let RopeScaling::Yarn(yarn) = c.rope_scaling
        && let Some(all) = yarn.mscale_all_dim.filter(|m| *m != 0.0)
        && yarn.factor > 1.0
    {
        let mscale = 0.1 * all * yarn.factor.ln() + 1.0;
        scale *= mscale * mscale;
    }
    Ok(MlaConfig {
        softmax_scale: scale as f32,
        ..mla
    })
}
