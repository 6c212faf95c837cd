//! `OlmoeForCausalLM` (transformers' `OlmoeConfig`): RMSNorm over the whole q and k projections
//! before the split into heads, q/k/v clamped to `clip_qkv`, every layer sparse with experts of
//! `intermediate_size` under `mlp.experts.N.{gate,up,down}_proj`, top-k weights renormalised
//! only with `norm_topk_prob`.

use super::{Architecture, Common};
use crate::Result;
use crate::config::{AttentionConfig, ConfigFields, ModelConfig, QkNorm, TensorNames};

pub(super) fn read_config(fields: &ConfigFields<'_>) -> Result<ModelConfig> {
    let c = Common::read(fields, 1e4, 1e-5, 4096)?;
    let intermediate_size = fields.usize("intermediate_size")?;
    let bias = fields.opt_bool("attention_bias")?.unwrap_or(false);
    Ok(ModelConfig {
        architecture: Architecture::Olmoe,
        vocab_size: c.vocab_size,
        hidden_size: c.hidden_size,
        intermediate_size,
        moe_intermediate_size: intermediate_size,
        num_hidden_layers: c.num_hidden_layers,
        num_attention_heads: c.num_attention_heads,
        num_key_value_heads: c.num_key_value_heads,
        head_dim: c.head_dim,
        num_local_experts: fields.usize("num_experts")?,
        num_experts_per_tok: fields.usize("num_experts_per_tok")?,
        norm_topk_prob: fields.opt_bool("norm_topk_prob")?.unwrap_or(false),
        shared_expert: None,
        sparse_layers: vec![true; c.num_hidden_layers],
        attention: AttentionConfig {
            qkv_bias: bias,
            o_bias: bias,
            qk_norm: QkNorm::Flat,
            clip_qkv: fields.opt_f64("clip_qkv")?.map(|v| v as f32),
        },
        names: TensorNames {
            moe_block: "mlp",
            expert_proj: ["gate_proj", "up_proj", "down_proj"],
        },
        rms_norm_eps: c.rms_norm_eps,
        rope_theta: c.rope_theta,
        sliding_window: None,
        max_position_embeddings: c.max_position_embeddings,
        tie_word_embeddings: c.tie_word_embeddings,
        dtype: c.dtype,
    })
}
