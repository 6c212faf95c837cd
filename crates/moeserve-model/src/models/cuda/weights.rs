//! Where a device model's weights come from: a loaded host model (serving, tests), or random
//! values generated on the device (the GPU benchmark: a 32-layer Mixtral-8x7B is ~93 GB and
//! needs no host copy).

use moeserve_backend::cuda::ops;
use moeserve_backend::cuda::{CudaBackend, CudaElement, CudaError, CudaSlice};
use moeserve_backend::{Weight, WeightData};
use rayon::prelude::*;

use super::super::decoder::MoeModel;
use crate::config::{ModelConfig, QkNorm};
use crate::models::decoder::FeedForward;
use crate::models::ops::LayerWeight;
use crate::moe::Expert;

/// One tensor of the device model, by its role (layer and expert indices where it has them).
#[derive(Clone, Copy, Debug)]
pub(super) enum Tensor {
    Embed,
    Norm,
    LmHead,
    InputNorm(usize),
    PostNorm(usize),
    /// An attention weight of a layer: projections, their biases, q/k norms (those the
    /// family's config has).
    Attention(usize, LayerWeight),
    Gate(usize),
    /// `[w1; w3]` of (layer, expert): `[2 · intermediate, hidden]`.
    W13(usize, usize),
    W2(usize, usize),
    /// The same of a layer's dense MLP, or of its shared expert.
    DenseW13(usize),
    DenseW2(usize),
    SharedW13(usize),
    SharedW2(usize),
    /// `[1, hidden]`: the shared expert's sigmoid gate (Qwen2-MoE).
    SharedGate(usize),
    /// Multi-head latent attention's pieces of `kv_b_proj`, every head's stacked:
    /// `W_uk[h]ᵀ` as `[heads, kv_lora_rank, qk_nope_head_dim]` and `W_uv[h]` as
    /// `[heads, v_head_dim, kv_lora_rank]`.
    AbsorbKey(usize),
    ExpandValue(usize),
}

pub(super) trait WeightSource<T> {
    fn tensor(&mut self, gpu: &CudaBackend, t: Tensor) -> Result<CudaSlice<T>, CudaError>;
    /// The router bias of `layer`, if any (added to its logits).
    fn router_bias(&self, layer: usize) -> Option<Vec<f32>>;
    /// `layer`'s `e_score_correction_bias`, if its router has one (sigmoid scoring).
    fn correction_bias(&self, layer: usize) -> Option<Vec<f32>>;
    /// `layer`'s sink logit per head, if its attention has them (GPT-OSS).
    fn sinks(&self, layer: usize) -> Option<Vec<f32>>;
    /// The experts' biases of `layer`, if they have them (GPT-OSS): `[E, 2 · intermediate]`
    /// (gate then up, as `[w1; w3]` stacks them) and `[E, hidden]` (down).
    fn expert_biases(&self, layer: usize) -> Option<(Vec<f32>, Vec<f32>)>;
}

/// A host weight's values as `T` (exact when the dtypes agree; converted once otherwise).
pub(super) fn host_values<T: CudaElement>(w: &Weight) -> Vec<T> {
    if w.is_prepacked() {
        return w.to_f32_vec().par_iter().map(|x| T::from_f32(*x)).collect();
    }
    match w.data() {
        WeightData::F32(v) => v.par_iter().map(|x| T::from_f32(*x)).collect(),
        WeightData::F16(v) => v.par_iter().map(|x| T::from_f32(x.to_f32())).collect(),
        WeightData::BF16(v) => v.par_iter().map(|x| T::from_f32(x.to_f32())).collect(),
        // FP8 block weights go up dequantised, in the compute dtype (no FP8 GEMM on the
        // device yet: twice the device memory of the FP8 bytes in bf16).
        WeightData::F8E4M3(v, blocks) => (0..v.len())
            .into_par_iter()
            .map(|i| T::from_f32(v[i].to_f32() * blocks.at(i / blocks.k, i % blocks.k)))
            .collect(),
        // MXFP4 and GPTQ / AWQ int4 likewise: dequantised once at upload (no 4-bit GEMM on
        // the device yet: 3.8× the device memory of the 4-bit bytes in bf16).
        WeightData::Mxfp4(_) | WeightData::Int4(_) => (0..w.numel())
            .into_par_iter()
            .map(|i| T::from_f32(w.get_f32(i)))
            .collect(),
    }
}

/// An expert's gate and up projections stacked, `[w1; w3]` (what one GEMM multiplies by).
pub(super) fn stacked_w13<T: CudaElement>(expert: &Expert) -> Vec<T> {
    let mut both = host_values::<T>(&expert.w1);
    both.extend(host_values::<T>(&expert.w3));
    both
}

/// Matrices of one shape, one after another.
fn stacked<T: CudaElement>(matrices: &[Weight]) -> Vec<T> {
    matrices.iter().flat_map(host_values::<T>).collect()
}

/// The weights of a loaded model, uploaded.
pub(super) struct HostWeights<'a>(pub &'a MoeModel);

impl<T: CudaElement> WeightSource<T> for HostWeights<'_> {
    fn tensor(&mut self, gpu: &CudaBackend, t: Tensor) -> Result<CudaSlice<T>, CudaError> {
        let m = self.0;
        let layer = |l: usize| &m.layers[l];
        // The device model asks only for what the config says a layer has.
        let moe = |l: usize| layer(l).moe().expect("the config says layer is sparse");
        let shared = |l: usize| {
            moe(l)
                .shared
                .as_ref()
                .expect("the config says the layer has a shared expert")
        };
        let latent = |l: usize| {
            layer(l)
                .self_attn
                .latent()
                .expect("the config says the layer has latent attention")
        };
        let dense = |l: usize| match &layer(l).mlp {
            FeedForward::Dense(mlp) => mlp,
            FeedForward::Sparse(_) => panic!("the config says layer {l} is dense"),
        };
        let w = match t {
            Tensor::Embed => &m.embed_tokens,
            Tensor::Norm => &m.norm,
            Tensor::LmHead => &m.lm_head,
            Tensor::InputNorm(l) => &layer(l).input_layernorm,
            Tensor::PostNorm(l) => &layer(l).post_attention_layernorm,
            Tensor::Attention(l, role) => layer(l)
                .self_attn
                .weight(role)
                .expect("the config says the layer has this weight"),
            Tensor::Gate(l) => &moe(l).gate,
            Tensor::W2(l, e) => &moe(l).experts[e].w2,
            Tensor::W13(l, e) => return gpu.upload(&stacked_w13::<T>(&moe(l).experts[e])),
            Tensor::DenseW13(l) => return gpu.upload(&stacked_w13::<T>(dense(l))),
            Tensor::DenseW2(l) => &dense(l).w2,
            Tensor::SharedW13(l) => return gpu.upload(&stacked_w13::<T>(&shared(l).mlp)),
            Tensor::SharedW2(l) => &shared(l).mlp.w2,
            Tensor::SharedGate(l) => shared(l)
                .gate
                .as_ref()
                .expect("the config says the shared expert is gated"),
            Tensor::AbsorbKey(l) => return gpu.upload(&stacked(latent(l).absorb_key())),
            Tensor::ExpandValue(l) => return gpu.upload(&stacked(latent(l).expand_value())),
        };
        gpu.upload(&host_values::<T>(w))
    }

    fn router_bias(&self, layer: usize) -> Option<Vec<f32>> {
        self.0.layers[layer].moe()?.router_bias.clone()
    }

    fn correction_bias(&self, layer: usize) -> Option<Vec<f32>> {
        self.0.layers[layer].moe()?.correction_bias.clone()
    }

    fn sinks(&self, layer: usize) -> Option<Vec<f32>> {
        let attention = self.0.layers[layer].self_attn.grouped()?;
        attention.sinks().map(<[f32]>::to_vec)
    }

    fn expert_biases(&self, layer: usize) -> Option<(Vec<f32>, Vec<f32>)> {
        let experts = &self.0.layers[layer].moe()?.experts;
        let (mut gate_up, mut down) = (Vec::new(), Vec::new());
        for expert in experts {
            let bias = expert.bias.as_ref()?;
            gate_up.extend_from_slice(&bias.gate);
            gate_up.extend_from_slice(&bias.up);
            down.extend_from_slice(&bias.down);
        }
        Some((gate_up, down))
    }
}

/// Seeded uniform weights made on the device: `U(-a, a)` with `a = sqrt(3 / fan_in)` keeps
/// activations of order 1 through the layers; norms are ones.
pub(super) struct RandomWeights {
    pub config: ModelConfig,
    pub seed: u64,
}

/// `(elements, fan-in)` of tensor `t` of a model of `c`; fan-in 0 marks a norm.
pub(super) fn tensor_shape(c: &ModelConfig, t: Tensor) -> (usize, usize) {
    let (h, kv, heads) = (c.hidden_size, c.kv_dim(), c.num_attention_heads);
    // The query's width and o_proj's input (MLA: heads of qk_head_dim, of v_head_dim).
    let (q, o_in) = match &c.mla {
        Some(m) => (heads * m.qk_head_dim(), heads * m.v_head_dim),
        None => (c.q_dim(), c.q_dim()),
    };
    // MLA's q LoRA rank, kv LoRA rank, latent row, nope and value widths.
    let (q_rank, r, latent, nope, v) = c.mla.as_ref().map_or((0, 0, 0, 0, 0), |m| {
        (
            m.q_lora_rank.unwrap_or(0),
            m.kv_lora_rank,
            m.latent_dim(),
            m.qk_nope_head_dim,
            m.v_head_dim,
        )
    });
    let (i, dense_i) = (c.moe_intermediate_size, c.intermediate_size);
    let shared_i = c.shared_expert.map_or(0, |s| s.intermediate_size);
    let (q_norm, k_norm) = match c.attention.qk_norm {
        QkNorm::Flat => (q, kv),
        QkNorm::PerHead | QkNorm::None => (c.head_dim, c.head_dim),
    };
    match t {
        Tensor::Embed => (c.vocab_size * h, 1),
        Tensor::LmHead => (c.vocab_size * h, h),
        Tensor::Norm | Tensor::InputNorm(_) | Tensor::PostNorm(_) => (h, 0),
        Tensor::Attention(_, role) => match role {
            LayerWeight::QProj => (q * h, h),
            LayerWeight::KProj | LayerWeight::VProj => (kv * h, h),
            LayerWeight::OProj => (h * o_in, o_in),
            LayerWeight::QBias => (q, h),
            LayerWeight::KBias | LayerWeight::VBias => (kv, h),
            LayerWeight::OBias => (h, o_in),
            LayerWeight::QNorm => (q_norm, 0),
            LayerWeight::KNorm => (k_norm, 0),
            LayerWeight::InputNorm | LayerWeight::PostNorm => (h, 0),
            LayerWeight::QAProj => (q_rank * h, h),
            LayerWeight::QABias => (q_rank, h),
            LayerWeight::QANorm => (q_rank, 0),
            LayerWeight::QBProj => (q * q_rank, q_rank),
            LayerWeight::KvAProj => (latent * h, h),
            LayerWeight::KvABias => (latent, h),
            LayerWeight::KvANorm => (r, 0),
        },
        Tensor::AbsorbKey(_) => (heads * r * nope, r),
        Tensor::ExpandValue(_) => (heads * v * r, r),
        Tensor::Gate(_) => (c.num_local_experts * h, h),
        Tensor::W13(..) => (2 * i * h, h),
        Tensor::W2(..) => (h * i, i),
        Tensor::DenseW13(_) => (2 * dense_i * h, h),
        Tensor::DenseW2(_) => (h * dense_i, dense_i),
        Tensor::SharedW13(_) => (2 * shared_i * h, h),
        Tensor::SharedW2(_) => (h * shared_i, shared_i),
        Tensor::SharedGate(_) => (h, h),
    }
}

impl<T: CudaElement> WeightSource<T> for RandomWeights {
    fn tensor(&mut self, gpu: &CudaBackend, t: Tensor) -> Result<CudaSlice<T>, CudaError> {
        let (len, fan_in) = tensor_shape(&self.config, t);
        if fan_in == 0 {
            return gpu.upload(&vec![T::from_f32(1.0); len]);
        }
        self.seed += 1;
        let mut w = gpu.zeros::<T>(len)?;
        let scale = (3.0 / fan_in as f32).sqrt();
        ops::fill_uniform(gpu, w.as_view_mut(), self.seed, scale)?;
        Ok(w)
    }

    fn router_bias(&self, _layer: usize) -> Option<Vec<f32>> {
        None
    }

    fn correction_bias(&self, _layer: usize) -> Option<Vec<f32>> {
        None
    }

    fn sinks(&self, _layer: usize) -> Option<Vec<f32>> {
        None
    }

    fn expert_biases(&self, _layer: usize) -> Option<(Vec<f32>, Vec<f32>)> {
        None
    }
}
