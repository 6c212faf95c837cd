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

use super::{Architecture, Common, DeepseekMoe, DeepseekMoeDefaults, MLP_NAMES};
use crate::config::{ConfigFields, MlaConfig, ModelConfig};
use crate::layers::rope::RopeScaling;
use crate::moe::{GroupLimit, Scoring};
use crate::{ModelError, Result};

/// `DeepseekV2Config`'s and `DeepseekV3Config`'s defaults (they differ) with their context.
const V2_DEFAULTS: (usize, DeepseekMoeDefaults) = (
    2048,
    DeepseekMoeDefaults {
        n_routed_experts: 64,
        num_experts_per_tok: 6,
        first_k_dense_replace: 0,
        intermediate_size: 12288,
        moe_intermediate_size: 1407,
        n_shared_experts: 2,
        n_group: 1,
        topk_group: 1,
        routed_scaling_factor: 1.0,
    },
);

const V3_DEFAULTS: (usize, DeepseekMoeDefaults) = (
    4096,
    DeepseekMoeDefaults {
        n_routed_experts: 256,
        num_experts_per_tok: 8,
        first_k_dense_replace: 3,
        intermediate_size: 18432,
        moe_intermediate_size: 2048,
        n_shared_experts: 1,
        n_group: 8,
        topk_group: 4,
        routed_scaling_factor: 2.5,
    },
);

pub(super) fn read_config(
    architecture: Architecture,
    fields: &ConfigFields<'_>,
) -> Result<ModelConfig> {
    let v3 = architecture == Architecture::DeepseekV3;
    let (max_positions, defaults) = if v3 { V3_DEFAULTS } else { V2_DEFAULTS };
    let c = Common::read(fields, 1e4, 1e-6, max_positions)?;
    let moe = DeepseekMoe::read(fields, &defaults, c.num_hidden_layers)?;
    let router_scoring = match v3 {
        true => Scoring::Sigmoid {
            group_limit: moe.group_limit,
        },
        false => v2_scoring(fields, moe.group_limit)?,
    };
    let mla = mla_config(fields, v3, &c)?;
    Ok(ModelConfig {
        // transformers' V2 router never renormalises; V3's follows `norm_topk_prob`.
        norm_topk_prob: v3 && fields.opt_bool("norm_topk_prob")?.unwrap_or(true),
        router_scoring,
        score_correction_bias: v3,
        routed_scaling_factor: moe.routed_scaling_factor,
        shared_expert: moe.shared_expert,
        sparse_layers: moe.sparse_layers,
        mla: Some(mla),
        names: crate::config::TensorNames {
            shared_expert: "shared_experts",
            ..MLP_NAMES
        },
        // Every head reads the one latent: the query heads are the only heads.
        num_key_value_heads: c.num_attention_heads,
        // As transformers' config: `head_dim` is the rotary slice, all of which RoPE turns.
        head_dim: mla.qk_rope_head_dim,
        rotary_dim: mla.qk_rope_head_dim,
        ..c.config(architecture, moe.shape)
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
    let qk_nope_head_dim = fields.opt_usize("qk_nope_head_dim")?.unwrap_or(128);
    let qk_rope_head_dim = fields.opt_usize("qk_rope_head_dim")?.unwrap_or(64);
    let kv_lora_rank = fields.opt_usize("kv_lora_rank")?.unwrap_or(512);
    let v_head_dim = fields.opt_usize("v_head_dim")?.unwrap_or(128);
    let bad = |message: String| Err(ModelError::config(fields.path, message));
    for (name, v) in [
        ("kv_lora_rank", kv_lora_rank),
        ("qk_rope_head_dim", qk_rope_head_dim),
        ("v_head_dim", v_head_dim),
        ("q_lora_rank", q_lora_rank.unwrap_or(1)),
    ] {
        if v == 0 {
            return bad(format!("`{name}` must be at least 1"));
        }
    }
    if !qk_rope_head_dim.is_multiple_of(2) {
        return bad(format!(
            "`qk_rope_head_dim` ({qk_rope_head_dim}) must be even for rotary embeddings"
        ));
    }
    let mut softmax_scale = ((qk_nope_head_dim + qk_rope_head_dim) as f64).powf(-0.5);
    if let RopeScaling::Yarn(yarn) = c.rope_scaling
        && let Some(all) = yarn.mscale_all_dim.filter(|m| *m != 0.0)
        && yarn.factor > 1.0
    {
        let mscale = 0.1 * all * yarn.factor.ln() + 1.0;
        softmax_scale *= mscale * mscale;
    }
    Ok(MlaConfig {
        q_lora_rank,
        kv_lora_rank,
        qk_nope_head_dim,
        qk_rope_head_dim,
        v_head_dim,
        rope_interleave: !v3 || fields.opt_bool("rope_interleave")?.unwrap_or(true),
        bias: fields.opt_bool("attention_bias")?.unwrap_or(false),
        softmax_scale: softmax_scale as f32,
    })
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::config::ModelConfig;
    use crate::moe::{GroupLimit, Scoring};

    /// DeepSeek-V2-Lite's config.json as the hub has it (the fields the model reads).
    const V2_LITE: &str = r#"{"architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 102400,
        "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
        "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
        "n_shared_experts": 2, "n_routed_experts": 64, "num_experts_per_tok": 6,
        "first_k_dense_replace": 1, "kv_lora_rank": 512, "q_lora_rank": null,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "topk_method": "greedy", "n_group": 1, "topk_group": 1, "norm_topk_prob": false,
        "routed_scaling_factor": 1.0, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
        "rope_theta": 10000, "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32,
        "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096}, "torch_dtype": "bfloat16"}"#;

    fn parse(text: &str) -> crate::Result<ModelConfig> {
        ModelConfig::from_json_str(text, Path::new("config.json"))
    }

    #[test]
    fn v2_lite_reads_as_latent_attention_with_yarns_softmax_scale() {
        let c = parse(V2_LITE).unwrap();
        let mla = c.mla.unwrap();
        assert_eq!(
            (
                mla.q_lora_rank,
                mla.kv_lora_rank,
                mla.qk_head_dim(),
                mla.latent_dim()
            ),
            (None, 512, 192, 576)
        );
        assert!(mla.rope_interleave, "V2 turns interleaved pairs");
        // 192^-0.5 · (0.1 · 0.707 · ln 40 + 1)²
        let want = 192f64.powf(-0.5) * (0.1 * 0.707 * 40f64.ln() + 1.0).powi(2);
        assert!((f64::from(mla.softmax_scale) - want).abs() < 1e-7);
        assert_eq!((c.head_dim, c.rotary_dim), (64, 64));
        assert_eq!(c.kv_cache_row(), (576, 0));
        assert_eq!(c.router_scoring, Scoring::Softmax);
        assert!(!c.norm_topk_prob && !c.score_correction_bias);
        assert_eq!(c.shared_expert.unwrap().intermediate_size, 2 * 1408);
        assert_eq!(&c.sparse_layers[..2], [false, true]);
    }

    #[test]
    fn v2_group_limited_greedy_and_v3_groups_read_as_grouped_routers() {
        let grouped = V2_LITE
            .replace(
                r#""topk_method": "greedy""#,
                r#""topk_method": "group_limited_greedy""#,
            )
            .replace(r#""n_group": 1"#, r#""n_group": 8"#)
            .replace(r#""topk_group": 1"#, r#""topk_group": 3"#);
        let limit = GroupLimit { groups: 8, keep: 3 };
        let c = parse(&grouped).unwrap();
        assert_eq!(
            c.router_scoring,
            Scoring::SoftmaxGrouped { group_limit: limit }
        );
        let v3 = grouped.replace("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM");
        let c = parse(&v3).unwrap();
        let sigmoid = Scoring::Sigmoid {
            group_limit: Some(limit),
        };
        assert_eq!(c.router_scoring, sigmoid);
        // V3 follows `norm_topk_prob` (false here), V2 never renormalises.
        assert!(!c.norm_topk_prob && c.score_correction_bias);
        let renormalised = v3.replace(r#""norm_topk_prob": false"#, r#""norm_topk_prob": true"#);
        assert!(parse(&renormalised).unwrap().norm_topk_prob);
        let bad = V2_LITE.replace(r#""topk_method": "greedy""#, r#""topk_method": "noaux""#);
        let msg = parse(&bad).unwrap_err().to_string();
        assert!(
            msg.contains(r#"`topk_method` "noaux" is not supported"#),
            "{msg}"
        );
        let bad = V2_LITE.replace(r#""qk_rope_head_dim": 64"#, r#""qk_rope_head_dim": 63"#);
        assert!(
            parse(&bad)
                .unwrap_err()
                .to_string()
                .contains("must be even")
        );
    }
}
