//! The operations the decoder is written over ([`DecoderOps`]), and the one definition of the
//! decoder's layer order on them ([`decode`]).
//!
//! A backend runs a step by implementing these operations on its own buffers (host vectors on
//! the CPU, device slices on CUDA) and weights; it holds no family logic. Which operations run,
//! in which order and with which options (projection biases, q/k norms, clamping, dense or
//! sparse feed-forward) is decided here from the [`ModelConfig`], once for every backend.

use crate::config::{ModelConfig, QkNorm};

/// The step's activations an operation reads or writes, `[num_tokens, width]` each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Act {
    /// The normed input of the next attention or feed-forward block (`hidden`).
    Normed,
    /// Queries, keys and values (`q_dim`, `kv_dim`, `kv_dim`).
    Q,
    K,
    V,
    /// Attention outputs before `o_proj` (`q_dim`).
    Attn,
    /// The last block's output, not yet added to the residual stream (`hidden`).
    Delta,
    /// Multi-head latent attention's low-rank query (`q_lora_rank`).
    QLowRank,
    /// MLA's per-token cache row, `[kv_lora_rank | qk_rope_head_dim]`.
    Latent,
    /// MLA's queries in the latent space, `[heads, kv_lora_rank + qk_rope_head_dim]`.
    LatentQ,
    /// MLA's attention outputs in the latent space, `[heads, kv_lora_rank]`.
    LatentAttn,
}

impl Act {
    pub(crate) const COUNT: usize = 10;

    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

/// `x` to read and `y` to write: two different activations of a backend's `[A; Act::COUNT]`.
pub(crate) fn read_write<A>(acts: &mut [A; Act::COUNT], x: Act, y: Act) -> (&A, &mut A) {
    let (x, y) = read_write_mut(acts, x, y);
    (x, y)
}

/// Two different activations of a backend's `[A; Act::COUNT]`, both to write.
pub(crate) fn read_write_mut<A>(acts: &mut [A; Act::COUNT], x: Act, y: Act) -> (&mut A, &mut A) {
    match acts.get_disjoint_mut([x.index(), y.index()]) {
        Ok([x, y]) => (x, y),
        Err(_) => panic!("an operation reads and writes the same activation ({x:?})"),
    }
}

/// A weight of one decoder layer's attention half, by role.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LayerWeight {
    InputNorm,
    PostNorm,
    QProj,
    KProj,
    VProj,
    OProj,
    QBias,
    KBias,
    VBias,
    OBias,
    /// `[head_dim]` (per head) or `[q_dim]` / `[kv_dim]` (over the whole projection).
    QNorm,
    KNorm,
    /// Multi-head latent attention's: `q_a_proj` (+ bias), `q_a_layernorm`, `q_b_proj`,
    /// `kv_a_proj_with_mqa` (+ bias), `kv_a_layernorm`.
    QAProj,
    QABias,
    QANorm,
    QBProj,
    KvAProj,
    KvABias,
    /// Read by the CUDA step (the CPU's `MlaAttention` norms with its own field).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    KvANorm,
}

/// Where a step's values may be read by a trace or a calibration pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Point {
    /// The residual stream after a layer (all layers done but the last's feed-forward
    /// residual, which [`DecoderOps::add_last_delta`] adds before the last one).
    LayerOutput,
    /// `Act::Normed` as layer `l`'s attention reads it.
    AttentionInput(usize),
    /// `Act::Attn` as layer `l`'s `o_proj` reads it.
    AttentionOutput(usize),
    /// `Act::QLowRank` as layer `l`'s `q_b_proj` reads it (multi-head latent attention).
    QueryLowRank(usize),
}

/// One step's operations on a backend.
pub(crate) trait DecoderOps {
    type Error;

    /// The residual stream `hidden` = the step tokens' embedding rows.
    fn embed(&mut self) -> Result<(), Self::Error>;
    /// `hidden += Delta` (not for the first layer's input norm), then
    /// `Normed = rms_norm(hidden) · w`.
    fn add_rms_norm(&mut self, layer: usize, w: LayerWeight, add: bool) -> Result<(), Self::Error>;
    /// `y = x · wᵀ (+ bias)`.
    fn linear(
        &mut self,
        layer: usize,
        x: Act,
        w: LayerWeight,
        bias: Option<LayerWeight>,
        y: Act,
    ) -> Result<(), Self::Error>;
    /// Several [`Self::linear`]s of the same input `x` (a layer's q, k and v projections),
    /// each `(w, bias, y)`; a backend may run them as one job.
    fn linears<const N: usize>(
        &mut self,
        layer: usize,
        x: Act,
        products: [(LayerWeight, Option<LayerWeight>, Act); N],
    ) -> Result<(), Self::Error> {
        for (w, bias, y) in products {
            self.linear(layer, x, w, bias, y)?;
        }
        Ok(())
    }
    /// RMSNorm of `x` in place, over rows as wide as `w`.
    fn rms_norm_rows(&mut self, layer: usize, x: Act, w: LayerWeight) -> Result<(), Self::Error>;
    /// MLA: `q_a_layernorm` of `QLowRank` in place (RMSNorm's default epsilon).
    fn mla_norm_query(&mut self, layer: usize) -> Result<(), Self::Error>;
    /// MLA: `kv_a_layernorm` over the latent part of each `Latent` row, in place.
    fn mla_norm_latent(&mut self, layer: usize) -> Result<(), Self::Error>;
    /// MLA: rotary embeddings on the rotary slice of each query head (`Q`) and on the shared
    /// rotary key of each `Latent` row, interleaved or by halves as the config says.
    fn mla_rope(&mut self, layer: usize) -> Result<(), Self::Error>;
    /// MLA: `LatentQ` = each head's query in the latent space, `[W_uk[h]ᵀ · q_nope | q_rope]`.
    fn mla_absorb_query(&mut self, layer: usize) -> Result<(), Self::Error>;
    /// MLA: the `Latent` rows into layer `layer`'s KV cache at the step tokens' slots.
    fn mla_write_latent(&mut self, layer: usize) -> Result<(), Self::Error>;
    /// MLA: `LatentAttn` = causal attention of `LatentQ` over the cached latent rows of each
    /// token's sequence (keys the whole rows, values their latent part).
    fn mla_attention(&mut self, layer: usize) -> Result<(), Self::Error>;
    /// MLA: `Attn` = each head's value, `W_uv[h] · LatentAttn[h]`.
    fn mla_expand_values(&mut self, layer: usize) -> Result<(), Self::Error>;
    /// `x = clamp(x, -limit, limit)`.
    fn clamp(&mut self, x: Act, limit: f32) -> Result<(), Self::Error>;
    /// Rotary embeddings on `Q` and `K` at the step tokens' positions.
    fn rope(&mut self, layer: usize) -> Result<(), Self::Error>;
    /// `K` and `V` into layer `layer`'s KV cache at the step tokens' slots.
    fn write_kv(&mut self, layer: usize) -> Result<(), Self::Error>;
    /// `Attn` = causal (optionally sliding-window) attention of `Q` over the cached keys and
    /// values of each token's sequence.
    fn paged_attention(&mut self, layer: usize) -> Result<(), Self::Error>;
    /// `Delta` = the sparse MoE block of `layer` (MoE layer `moe_layer`) on `Normed`: router,
    /// routing under the step's capacity, routed experts (on this device or across the
    /// expert-parallel group), shared expert.
    fn sparse_moe(&mut self, layer: usize, moe_layer: usize) -> Result<(), Self::Error>;
    /// `Delta` = the dense MLP of `layer` on `Normed`.
    fn dense_mlp(&mut self, layer: usize) -> Result<(), Self::Error>;
    /// `hidden += Delta`: the last layer's feed-forward output joins the residual stream.
    fn add_last_delta(&mut self) -> Result<(), Self::Error>;
    /// The logits of the rows the step asks for: final norm, then lm_head.
    fn logits(&mut self) -> Result<(), Self::Error>;
    /// A trace or a calibration pass reads values at `at`; nothing by default.
    fn observe(&mut self, _at: Point) -> Result<(), Self::Error> {
        Ok(())
    }
}

/// The decoder, once for every backend: embedding → per layer (RMSNorm → attention → residual
/// → RMSNorm → sparse MoE or dense MLP → residual) → RMSNorm → lm_head. The residual add of
/// each block is fused with the next norm.
pub(crate) fn decode<O: DecoderOps>(c: &ModelConfig, ops: &mut O) -> Result<(), O::Error> {
    ops.embed()?;
    let mut moe_layer = 0;
    for layer in 0..c.num_hidden_layers {
        ops.add_rms_norm(layer, LayerWeight::InputNorm, layer > 0)?;
        if layer > 0 {
            ops.observe(Point::LayerOutput)?;
        }
        ops.observe(Point::AttentionInput(layer))?;
        match c.mla {
            Some(_) => latent_attention(c, ops, layer)?,
            None => attention(c, ops, layer)?,
        }
        ops.add_rms_norm(layer, LayerWeight::PostNorm, true)?;
        if c.sparse_layers[layer] {
            ops.sparse_moe(layer, moe_layer)?;
            moe_layer += 1;
        } else {
            ops.dense_mlp(layer)?;
        }
    }
    ops.add_last_delta()?;
    if c.num_hidden_layers > 0 {
        ops.observe(Point::LayerOutput)?;
    }
    ops.logits()
}

/// Self-attention with the family's options: q/k/v (+ bias) → q/k RMSNorm (per head or over
/// the projection) → clamp → RoPE → KV write → paged attention → o_proj (+ bias) into `Delta`.
fn attention<O: DecoderOps>(c: &ModelConfig, ops: &mut O, layer: usize) -> Result<(), O::Error> {
    use LayerWeight as W;
    let a = &c.attention;
    let bias = |b| a.qkv_bias.then_some(b);
    ops.linears(
        layer,
        Act::Normed,
        [
            (W::QProj, bias(W::QBias), Act::Q),
            (W::KProj, bias(W::KBias), Act::K),
            (W::VProj, bias(W::VBias), Act::V),
        ],
    )?;
    if a.qk_norm != QkNorm::None {
        // The norm weights' widths (head_dim, or the projections') set the rows.
        ops.rms_norm_rows(layer, Act::Q, W::QNorm)?;
        ops.rms_norm_rows(layer, Act::K, W::KNorm)?;
    }
    if let Some(limit) = a.clip_qkv {
        for x in [Act::Q, Act::K, Act::V] {
            ops.clamp(x, limit)?;
        }
    }
    ops.rope(layer)?;
    ops.write_kv(layer)?;
    ops.paged_attention(layer)?;
    ops.observe(Point::AttentionOutput(layer))?;
    ops.linear(
        layer,
        Act::Attn,
        W::OProj,
        a.o_bias.then_some(W::OBias),
        Act::Delta,
    )
}

/// Multi-head latent attention (DeepSeek-V2/V3): the query through `q_proj` or `q_a_proj →
/// q_a_layernorm → q_b_proj`; `kv_a_proj_with_mqa` → `kv_a_layernorm` on the latent; RoPE on
/// the rotary slices; the latent row into the KV cache; attention in the latent space (the
/// key up-projection absorbed into the query, the value one applied to the output); `o_proj`
/// (+ bias) into `Delta`.
fn latent_attention<O: DecoderOps>(
    c: &ModelConfig,
    ops: &mut O,
    layer: usize,
) -> Result<(), O::Error> {
    use LayerWeight as W;
    let mla = c.mla.as_ref().expect("an MLA config");
    let bias = |b| mla.bias.then_some(b);
    match mla.q_lora_rank {
        None => ops.linear(layer, Act::Normed, W::QProj, None, Act::Q)?,
        Some(_) => {
            ops.linear(
                layer,
                Act::Normed,
                W::QAProj,
                bias(W::QABias),
                Act::QLowRank,
            )?;
            ops.mla_norm_query(layer)?;
            ops.observe(Point::QueryLowRank(layer))?;
            ops.linear(layer, Act::QLowRank, W::QBProj, None, Act::Q)?;
        }
    }
    ops.linear(
        layer,
        Act::Normed,
        W::KvAProj,
        bias(W::KvABias),
        Act::Latent,
    )?;
    ops.mla_norm_latent(layer)?;
    ops.mla_rope(layer)?;
    ops.mla_absorb_query(layer)?;
    ops.mla_write_latent(layer)?;
    ops.mla_attention(layer)?;
    ops.mla_expand_values(layer)?;
    ops.observe(Point::AttentionOutput(layer))?;
    ops.linear(layer, Act::Attn, W::OProj, bias(W::OBias), Act::Delta)
}
