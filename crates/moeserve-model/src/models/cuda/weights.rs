//! Where a device model's weights come from: a loaded host model (serving, tests), or random
//! values generated on the device (the GPU benchmark: a 32-layer Mixtral-8x7B is ~93 GB and
//! needs no host copy).

use moeserve_backend::cuda::ops;
use moeserve_backend::cuda::{CudaBackend, CudaElement, CudaError, CudaSlice};
use moeserve_backend::{Weight, WeightData};
use rayon::prelude::*;

use super::super::decoder::MoeModel;
use crate::config::ModelConfig;
use crate::moe::Expert;

/// One tensor of the device model, by its role (layer and expert indices where it has them).
#[derive(Clone, Copy, Debug)]
pub(super) enum Tensor {
    Embed,
    Norm,
    LmHead,
    InputNorm(usize),
    PostNorm(usize),
    Q(usize),
    K(usize),
    V(usize),
    O(usize),
    Gate(usize),
    /// `[w1; w3]` of (layer, expert): `[2 · intermediate, hidden]`.
    W13(usize, usize),
    W2(usize, usize),
}

pub(super) trait WeightSource<T> {
    fn tensor(&mut self, gpu: &CudaBackend, t: Tensor) -> Result<CudaSlice<T>, CudaError>;
    /// The router bias of `layer`, if any (added to its logits).
    fn router_bias(&self, layer: usize) -> Option<Vec<f32>>;
}

/// A host weight's values as `T` (exact when the dtypes agree; converted once otherwise).
pub(super) fn host_values<T: CudaElement>(w: &Weight) -> Vec<T> {
    match w.data() {
        WeightData::F32(v) => v.par_iter().map(|x| T::from_f32(*x)).collect(),
        WeightData::F16(v) => v.par_iter().map(|x| T::from_f32(x.to_f32())).collect(),
        WeightData::BF16(v) => v.par_iter().map(|x| T::from_f32(x.to_f32())).collect(),
    }
}

/// An expert's gate and up projections stacked, `[w1; w3]` (what one GEMM multiplies by).
pub(super) fn stacked_w13<T: CudaElement>(expert: &Expert) -> Vec<T> {
    let mut both = host_values::<T>(&expert.w1);
    both.extend(host_values::<T>(&expert.w3));
    both
}

/// The weights of a loaded model, uploaded.
pub(super) struct HostWeights<'a>(pub &'a MoeModel);

impl<T: CudaElement> WeightSource<T> for HostWeights<'_> {
    fn tensor(&mut self, gpu: &CudaBackend, t: Tensor) -> Result<CudaSlice<T>, CudaError> {
        let m = self.0;
        let layer = |l: usize| &m.layers[l];
        // `CudaMoeModel` takes Mixtral-shaped models only: every layer is sparse.
        let moe = |l: usize| {
            layer(l)
                .moe()
                .expect("a Mixtral-shaped model's layers are sparse")
        };
        let w = match t {
            Tensor::Embed => &m.embed_tokens,
            Tensor::Norm => &m.norm,
            Tensor::LmHead => &m.lm_head,
            Tensor::InputNorm(l) => &layer(l).input_layernorm,
            Tensor::PostNorm(l) => &layer(l).post_attention_layernorm,
            Tensor::Q(l) => layer(l).self_attn.weights()[0],
            Tensor::K(l) => layer(l).self_attn.weights()[1],
            Tensor::V(l) => layer(l).self_attn.weights()[2],
            Tensor::O(l) => layer(l).self_attn.weights()[3],
            Tensor::Gate(l) => &moe(l).gate,
            Tensor::W2(l, e) => &moe(l).experts[e].w2,
            Tensor::W13(l, e) => {
                return gpu.upload(&stacked_w13::<T>(&moe(l).experts[e]));
            }
        };
        gpu.upload(&host_values::<T>(w))
    }

    fn router_bias(&self, layer: usize) -> Option<Vec<f32>> {
        self.0.layers[layer].moe()?.router_bias.clone()
    }
}

/// Seeded uniform weights made on the device: `U(-a, a)` with `a = sqrt(3 / fan_in)` keeps
/// activations of order 1 through the layers; norms are ones.
pub(super) struct RandomWeights {
    pub config: ModelConfig,
    pub seed: u64,
}

impl<T: CudaElement> WeightSource<T> for RandomWeights {
    fn tensor(&mut self, gpu: &CudaBackend, t: Tensor) -> Result<CudaSlice<T>, CudaError> {
        let c = &self.config;
        let (h, i, q, kv) = (c.hidden_size, c.intermediate_size, c.q_dim(), c.kv_dim());
        // (elements, fan-in); fan-in 0 marks a norm (ones).
        let (len, fan_in) = match t {
            Tensor::Embed => (c.vocab_size * h, 1),
            Tensor::LmHead => (c.vocab_size * h, h),
            Tensor::Norm | Tensor::InputNorm(_) | Tensor::PostNorm(_) => (h, 0),
            Tensor::Q(_) => (q * h, h),
            Tensor::K(_) | Tensor::V(_) => (kv * h, h),
            Tensor::O(_) => (h * q, q),
            Tensor::Gate(_) => (c.num_local_experts * h, h),
            Tensor::W13(..) => (2 * i * h, h),
            Tensor::W2(..) => (h * i, i),
        };
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
}
