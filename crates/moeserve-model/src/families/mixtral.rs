//! `MixtralForCausalLM` (transformers' `MixtralConfig`): plain grouped-query attention with an
//! optional sliding window, every layer sparse, softmax → top-k → renormalise, experts
//! `block_sparse_moe.experts.N.w{1,3,2}` — the defaults of [`Common::config`].

use super::{Architecture, Common, MoeShape};
use crate::Result;
use crate::config::{ConfigFields, ModelConfig};

pub(super) fn read_config(fields: &ConfigFields<'_>) -> Result<ModelConfig> {
    let c = Common::read(fields, 1e6, 1e-5, 4096 * 32)?;
    let intermediate_size = fields.usize("intermediate_size")?;
    let moe = MoeShape {
        intermediate_size,
        moe_intermediate_size: intermediate_size,
        num_experts: fields.usize("num_local_experts")?,
        num_experts_per_tok: fields.usize("num_experts_per_tok")?,
    };
    Ok(ModelConfig {
        sliding_window: fields.opt_usize("sliding_window")?,
        ..c.config(Architecture::Mixtral, moe)
    })
}
