//! `OlmoeForCausalLM` (transformers' `OlmoeConfig`): RMSNorm over the whole q and k projections
//! before the split into heads, q/k/v clamped to `clip_qkv`, every layer sparse with experts of
//! `intermediate_size` under `mlp.experts.N.{gate,up,down}_proj`, top-k weights renormalised
//! only with `norm_topk_prob`.

use super::{Architecture, Common, MLP_NAMES, MoeShape};
use crate::Result;
use crate::config::{AttentionConfig, ConfigFields, ModelConfig, QkNorm};

pub(super) fn read_config(fields: &ConfigFields<'_>) -> Result<ModelConfig> {
    let c = Common::read(fields, 1e4, 1e-5, 4096)?;
    let intermediate_size = fields.usize("intermediate_size")?;
    let bias = fields.opt_bool("attention_bias")?.unwrap_or(false);
    let moe = MoeShape {
        intermediate_size,
        moe_intermediate_size: intermediate_size,
        num_experts: fields.usize("num_experts")?,
        num_experts_per_tok: fields.usize("num_experts_per_tok")?,
    };
    Ok(ModelConfig {
        norm_topk_prob: fields.opt_bool("norm_topk_prob")?.unwrap_or(false),
        attention: AttentionConfig {
            qkv_bias: bias,
            o_bias: bias,
            qk_norm: QkNorm::Flat,
            clip_qkv: fields.opt_f64("clip_qkv")?.map(|v| v as f32),
            sinks: false,
        },
        names: MLP_NAMES,
        ..c.config(Architecture::Olmoe, moe)
    })
}
