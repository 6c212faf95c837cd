//! `MixtralForCausalLM` (transformers' `ModelConfig`): plain grouped-query attention with an
//! optional sliding window, every layer sparse, softmax → top-k → renormalise, experts
//! `block_sparse_moe.experts.N.w{1,3,2}`.

use super::{Architecture, Common};
use crate::Result;
use crate::config::{AttentionConfig, ConfigFields, ModelConfig, TensorNames};

pub(super) fn read_config(fields: &ConfigFields<'_>) -> Result<ModelConfig> {
    let c = Common::read(fields, 1e6, 1e-5, 4096 * 32)?;
    let intermediate_size = fields.usize("intermediate_size")?;
    Ok(ModelConfig {
        architecture: Architecture::Mixtral,
        vocab_size: c.vocab_size,
        hidden_size: c.hidden_size,
        intermediate_size,
        moe_intermediate_size: intermediate_size,
        num_hidden_layers: c.num_hidden_layers,
        num_attention_heads: c.num_attention_heads,
        num_key_value_heads: c.num_key_value_heads,
        head_dim: c.head_dim,
        num_local_experts: fields.usize("num_local_experts")?,
        num_experts_per_tok: fields.usize("num_experts_per_tok")?,
        norm_topk_prob: true,
        shared_expert: None,
        sparse_layers: vec![true; c.num_hidden_layers],
        attention: AttentionConfig::PLAIN,
        names: TensorNames {
            moe_block: "block_sparse_moe",
            expert_proj: ["w1", "w3", "w2"],
        },
        rms_norm_eps: c.rms_norm_eps,
        rope_theta: c.rope_theta,
        sliding_window: fields.opt_usize("sliding_window")?,
        max_position_embeddings: c.max_position_embeddings,
        tie_word_embeddings: c.tie_word_embeddings,
        dtype: c.dtype,
    })
}
