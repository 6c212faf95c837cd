//! The buffers of a forward pass, owned by whoever runs steps (the engine keeps one) and reused
//! from step to step: once a workspace has seen a step as large, a CPU forward without expert
//! parallelism or tracing makes no heap allocation (`tests/alloc_free.rs` counts them).

use moeserve_backend::cpu;

use crate::batch::TokenPlace;
use crate::layers::mla::MlaScratch;
use crate::models::ops::Act;
use crate::moe::experts::MoeWorkspace;

#[derive(Default)]
pub struct ForwardWorkspace {
    pub(crate) places: Vec<TokenPlace>,
    /// `[num_tokens, hidden]`: the residual stream.
    pub(crate) hidden: Vec<f32>,
    /// The step's activations by [`Act`] (normed input, queries, keys, values, attention
    /// outputs, the last block's output).
    pub(crate) acts: [Vec<f32>; Act::COUNT],
    /// The rotary angles at the position of the token being rotated.
    pub(crate) angles: cpu::RopeAngles,
    /// The activations of the step's dense products in tile order.
    pub(crate) tiled: Vec<f32>,
    /// `[num_tokens, num_experts]`
    pub(crate) router_logits: Vec<f32>,
    pub(crate) moe: MoeWorkspace,
    /// Multi-head latent attention's per-head gathers and products.
    pub(crate) mla: MlaScratch,
    /// Rows of the residual stream that get logits.
    pub(crate) logit_rows: Vec<usize>,
    /// `[logit rows, hidden]`: those rows, then normed.
    pub(crate) selected: Vec<f32>,
    pub(crate) final_normed: Vec<f32>,
    /// `[logit rows, vocab]`: what the last forward returned.
    pub(crate) logits: Vec<f32>,
}

impl ForwardWorkspace {
    /// Hands the last forward's logits to the caller in exchange for `logits`, whose buffer
    /// the next forward reuses (no copy, no allocation).
    pub fn swap_logits(&mut self, logits: &mut Vec<f32>) {
        std::mem::swap(&mut self.logits, logits);
    }
}

/// `buf` as `len` zeros, in its own allocation when that is large enough.
pub(crate) fn zeroed(buf: &mut Vec<f32>, len: usize) {
    buf.clear();
    buf.resize(len, 0.0);
}
