//! [`MoeModel`]'s forward on one CUDA device (feature `cuda`): the decoder's operations
//! (`ops::DecoderOps`) on the kernels of `cuda/` and cuBLAS (`moeserve_backend::cuda`), so
//! every family runs here in the layer order `ops::decode` gives, as on the CPU. This file
//! holds no family logic: a layer's attention options (biases, q/k norms, clamp) and its
//! feed-forward block (sparse MoE with an optional shared expert, or a dense MLP) are what the
//! config and the uploaded weights say. This file holds the device model (weights per layer,
//! KV cache) and its entry points; `cuda/step.rs` one step's operations on it.
//!
//! Weights are uploaded once from the loaded host model, in the checkpoint's dtype (f32, f16 or
//! bf16). Activations between kernels are in that dtype; the residual stream and every
//! reduction are f32. So an f32 checkpoint follows the CPU forward to f32 rounding and a bf16 one
//! to bf16 tolerance; the GPU parity test (`tests/cuda_forward.rs`) checks every family's
//! fixtures against transformers. The KV cache lives on the device, `[num_slots, kv_dim]` per
//! layer in the weights' dtype, addressed by the slots of the engine's block tables, as on the
//! CPU.
//!
//! A step runs in a workspace sized once (`workspace.rs`, [`CudaMoeModel::reserve`]): no
//! device allocation per step. Its inputs go up in seven copies; its logits (greedy rows
//! reduced to their token on the device, `ForwardOptions::greedy`) and routing record come back
//! into pinned memory at the end, with one wait. `plan.rs` says what a step queues
//! ([`step_plan`]), and the GPU test checks the backend's counts against it.
//!
//! Routing: dropless steps route on the device (`moe_router.cu`: every family's softmax or
//! sigmoid scores, groups, correction bias and scale); a small step's experts then
//! run on the GEMM that reads the segment offsets on the device (`moe_gemm.cu`), so no layer
//! waits for the host. With a capacity factor the
//! router logits are copied back and routed on the host by the CPU's own `moe::route` (drop,
//! reroute and spill exactly as on the CPU, in token order; the router kernel's atomics would
//! hand out slots in arrival order), then the device permutes by that routing. A shared expert
//! runs on every token, outside the capacity.
//!
//! Expert parallelism (`--expert-parallel-size N`): GPUs `0..N` hold the experts of the
//! engine's placement (MoE layers numbered among the sparse layers, as on the CPU) and exchange
//! rows with NCCL (`expert_parallel.rs`); routing is then made on the host too, so pairs reach
//! the same slots as on the CPU.

mod expert_parallel;
mod host_step;
mod memory;
mod plan;
mod step;
mod weights;
mod workspace;

use half::{bf16, f16};
use moeserve_backend::BackendError;
use moeserve_backend::cuda::ops::ExpertTable;
use moeserve_backend::cuda::{CudaBackend, CudaElement, CudaError, CudaSlice, WorkCounts};
use moeserve_backend::device::CudaDeviceInfo;
use moeserve_core::DType;

use super::decoder::{ForwardOptions, LogitsFor, MoeModel};
use super::ops::{LayerWeight, decode};
use crate::batch::{BatchLimits, ForwardBatch};
use crate::config::{ModelConfig, QkNorm};
use crate::kv_cache::KvCacheLayout;
use crate::{ModelError, Result};
use expert_parallel::ExpertGpus;
use host_step::{AttentionLayout, attention_split, greedy_order, partial_floats, step_inputs};
use step::{CudaStep, Observed, RowOrder, StepMode, StepModel, StepRows};
use weights::{HostWeights, RandomWeights, Tensor, WeightSource};
use workspace::{StepDims, StepWorkspace};

pub use memory::weight_bytes_per_gpu;
pub use plan::{StepShape, step_plan};

/// A model of any family and its KV cache on one CUDA device.
pub struct CudaMoeModel {
    info: CudaDeviceInfo,
    dtype: DType,
    model: Typed,
}

/// Where a sparse layer's routed experts live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ExpertHome {
    /// In the device model, on its GPU.
    ThisGpu,
    /// On the expert GPUs of `--expert-parallel-size` (GPU 0 holds only its placement's share,
    /// uploaded with the others' at the first step).
    ExpertGpus,
}

/// The device model in the checkpoint's element type.
enum Typed {
    F32(DeviceModel<f32>),
    F16(DeviceModel<f16>),
    BF16(DeviceModel<bf16>),
}

impl CudaMoeModel {
    /// Opens device `ordinal`, compiles the kernels, uploads `model`'s weights and allocates a
    /// KV cache of `layout` on it.
    pub fn new(model: &MoeModel, layout: KvCacheLayout, ordinal: usize) -> Result<Self> {
        Self::with_dtype(model, layout, ordinal, model.embed_tokens.dtype())
    }

    /// As [`CudaMoeModel::new`], with weights, activations and KV cache in `dtype` whatever the
    /// checkpoint's (the GPU test runs the f32 fixtures in bf16 this way).
    pub fn with_dtype(
        model: &MoeModel,
        layout: KvCacheLayout,
        ordinal: usize,
        dtype: DType,
    ) -> Result<Self> {
        Self::build(model, layout, ordinal, dtype, ExpertHome::ThisGpu)
    }

    /// As [`CudaMoeModel::new`] for expert parallelism: GPU `ordinal` holds everything but the
    /// routed experts, which the first step's placement puts on the expert GPUs (this one's
    /// share included), so no GPU holds an expert its placement does not give it. Every
    /// forward must then pass that placement (`MoeOptions::experts`).
    pub fn expert_parallel(
        model: &MoeModel,
        layout: KvCacheLayout,
        ordinal: usize,
    ) -> Result<Self> {
        let dtype = model.embed_tokens.dtype();
        Self::build(model, layout, ordinal, dtype, ExpertHome::ExpertGpus)
    }

    fn build(
        model: &MoeModel,
        layout: KvCacheLayout,
        ordinal: usize,
        dtype: DType,
        experts_here: ExpertHome,
    ) -> Result<Self> {
        let gpu = CudaBackend::new(ordinal).map_err(backend)?;
        gpu.load_all_kernels().map_err(backend)?;
        let info = gpu.info().clone();
        let (c, mut host) = (model.config().clone(), HostWeights(model));
        let model = match dtype {
            DType::F32 => Typed::F32(DeviceModel::build(gpu, c, layout, &mut host, experts_here)?),
            DType::F16 => Typed::F16(DeviceModel::build(gpu, c, layout, &mut host, experts_here)?),
            DType::BF16 => {
                Typed::BF16(DeviceModel::build(gpu, c, layout, &mut host, experts_here)?)
            }
            DType::F8E4M3 | DType::Mxfp4 | DType::Int4 => {
                return Err(ModelError::InvalidInput {
                    message: format!("the device computes in f32, f16 or bf16, not {dtype}"),
                });
            }
        };
        Ok(CudaMoeModel { info, dtype, model })
    }

    /// A model of `config` with seeded random bf16 weights generated on the device (for the GPU
    /// benchmark: no checkpoint and no host copy, so a full Mixtral-8x7B fits one H200).
    pub fn synthetic(
        config: ModelConfig,
        layout: KvCacheLayout,
        ordinal: usize,
        seed: u64,
    ) -> Result<Self> {
        let gpu = CudaBackend::new(ordinal).map_err(backend)?;
        gpu.load_all_kernels().map_err(backend)?;
        let info = gpu.info().clone();
        let mut random = RandomWeights {
            config: config.clone(),
            seed,
        };
        let model = DeviceModel::build(gpu, config, layout, &mut random, ExpertHome::ThisGpu)?;
        Ok(CudaMoeModel {
            info,
            dtype: DType::BF16,
            model: Typed::BF16(model),
        })
    }

    pub fn device(&self) -> &CudaDeviceInfo {
        &self.info
    }

    /// The element type of weights, activations and the KV cache on the device.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// As [`MoeModel::forward`], with the KV cache on the device: writes the step tokens'
    /// keys and values and returns f32 logits (`[num_sequences or num_tokens, vocab]`).
    pub fn forward(
        &mut self,
        batch: &ForwardBatch<'_>,
        opts: ForwardOptions<'_>,
    ) -> Result<Vec<f32>> {
        match &mut self.model {
            Typed::F32(m) => m.forward(batch, opts),
            Typed::F16(m) => m.forward(batch, opts),
            Typed::BF16(m) => m.forward(batch, opts),
        }
    }

    /// Sizes the step's buffers for the engine's largest step once, so that steps allocate
    /// nothing on the device: `max_tokens` (`--max-num-batched-tokens`) tokens of up to
    /// `max_sequences` sequences with contexts up to `max_context` (`--max-model-len`) tokens,
    /// logits for each sequence's last token (a step asking for every token's logits grows
    /// the logits' buffers once).
    pub fn reserve(
        &mut self,
        max_tokens: usize,
        max_sequences: usize,
        max_context: usize,
    ) -> Result<()> {
        match &mut self.model {
            Typed::F32(m) => m.reserve(max_tokens, max_sequences, max_context),
            Typed::F16(m) => m.reserve(max_tokens, max_sequences, max_context),
            Typed::BF16(m) => m.reserve(max_tokens, max_sequences, max_context),
        }
    }

    /// Bytes of weights on each GPU: the checkpoint's tensors uploaded to this model's GPU plus
    /// the experts each expert GPU holds (once expert parallelism has run a step); the figures
    /// `weight_bytes_per_gpu` plans.
    pub fn weight_bytes_per_gpu(&self) -> Vec<u64> {
        match &self.model {
            Typed::F32(m) => m.weight_bytes_per_gpu(),
            Typed::F16(m) => m.weight_bytes_per_gpu(),
            Typed::BF16(m) => m.weight_bytes_per_gpu(),
        }
    }

    /// What the model's device has queued and waited for so far (see
    /// `StepPlan` for what a step should cost).
    pub fn work_counts(&self) -> WorkCounts {
        match &self.model {
            Typed::F32(m) => m.gpu.counts(),
            Typed::F16(m) => m.gpu.counts(),
            Typed::BF16(m) => m.gpu.counts(),
        }
    }

    /// Copies every layer's keys and values of block `src` into block `dst` (a forked
    /// sequence's own copy of a shared partial block); queued before the next step's kernels.
    pub fn copy_block(&mut self, src: usize, dst: usize) -> Result<()> {
        match &mut self.model {
            Typed::F32(m) => m.copy_block(src, dst),
            Typed::F16(m) => m.copy_block(src, dst),
            Typed::BF16(m) => m.copy_block(src, dst),
        }
    }
}

/// The widest dense MLP or shared expert of the model (0 when it has none).
fn widest_mlp<T>(weights: &DeviceWeights<T>) -> usize {
    weights
        .layers
        .iter()
        .filter_map(|l| match &l.mlp {
            DeviceFeedForward::Dense(mlp) => Some(mlp.intermediate),
            DeviceFeedForward::Sparse(moe) => moe.shared.as_ref().map(|s| s.0.intermediate),
        })
        .max()
        .unwrap_or(0)
}

fn backend(e: CudaError) -> ModelError {
    ModelError::Backend(BackendError::Cuda(e))
}

/// A layer's attention weights; biases and q/k norms where the family has them.
struct DeviceAttention<T> {
    /// `q_proj` (none under multi-head latent attention with a query LoRA), `k_proj` and
    /// `v_proj` (none under MLA), `o_proj`.
    q: Option<CudaSlice<T>>,
    k: Option<CudaSlice<T>>,
    v: Option<CudaSlice<T>>,
    o: CudaSlice<T>,
    /// `[q, k, v, o]` biases.
    biases: [Option<CudaSlice<T>>; 4],
    q_norm: Option<CudaSlice<T>>,
    k_norm: Option<CudaSlice<T>>,
    /// `[num_heads]` sink logits (GPT-OSS).
    sinks: Option<CudaSlice<f32>>,
    /// Multi-head latent attention's weights (DeepSeek-V2/V3).
    latent: Option<DeviceLatent<T>>,
}

/// One layer's multi-head latent attention weights beside `q_proj` and `o_proj`: the query
/// LoRA (`q_a_proj` + bias, `q_a_layernorm`, `q_b_proj`) when the config has one,
/// `kv_a_proj_with_mqa` (+ bias), `kv_a_layernorm`, and `kv_b_proj` cut per head as on the CPU
/// (`layers/mla.rs`): `W_uk[h]ᵀ` stacked `[heads, kv_lora_rank, qk_nope]` (absorbed into the
/// query) and `W_uv[h]` stacked `[heads, v_head_dim, kv_lora_rank]`.
struct DeviceLatent<T> {
    q_a: Option<CudaSlice<T>>,
    q_a_bias: Option<CudaSlice<T>>,
    q_a_norm: Option<CudaSlice<T>>,
    q_b: Option<CudaSlice<T>>,
    kv_a: CudaSlice<T>,
    kv_a_bias: Option<CudaSlice<T>>,
    kv_a_norm: CudaSlice<T>,
    absorb_key: CudaSlice<T>,
    expand_value: CudaSlice<T>,
}

/// A SwiGLU MLP: `[w1; w3]` stacked (`[2 · intermediate, hidden]`, one GEMM) and `w2`.
struct DeviceMlp<T> {
    w13: CudaSlice<T>,
    w2: CudaSlice<T>,
    intermediate: usize,
}

/// A sparse layer's router, experts and shared expert.
struct DeviceMoe<T> {
    gate: CudaSlice<T>,
    router_bias: Option<CudaSlice<f32>>,
    /// The same bias on the host, for routing there (capacity factor).
    router_bias_host: Option<Vec<f32>>,
    /// `gate.e_score_correction_bias` (sigmoid scoring) on the device, for the router kernel,
    /// and on the host, for routing there (capacity factor, expert parallelism).
    correction: Option<CudaSlice<f32>>,
    correction_bias: Option<Vec<f32>>,
    /// Per expert `[w1; w3]`: `[2 · intermediate, hidden]` (gate rows, then up rows).
    w13: Vec<CudaSlice<T>>,
    /// Per expert `[hidden, intermediate]`.
    w2: Vec<CudaSlice<T>>,
    /// Device pointers to `w13` and `w2`, for the GEMM that reads the segment offsets on the
    /// device (the vectors above are never changed after the tables are made).
    tables: Option<(ExpertTable<T>, ExpertTable<T>)>,
    /// The experts' biases (GPT-OSS): `[E, 2 · intermediate]` (gate, up) and `[E, hidden]`.
    expert_bias: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
    /// Always computed, outside the capacity; `gate: [1, hidden]` scales it by a sigmoid.
    shared: Option<(DeviceMlp<T>, Option<CudaSlice<T>>)>,
}

enum DeviceFeedForward<T> {
    Sparse(Box<DeviceMoe<T>>),
    Dense(DeviceMlp<T>),
}

struct DeviceLayer<T> {
    input_norm: CudaSlice<T>,
    attention: DeviceAttention<T>,
    post_norm: CudaSlice<T>,
    mlp: DeviceFeedForward<T>,
}

/// One layer's KV cache, `[num_slots, key_dim]` and `[num_slots, value_dim]` (MLA: the latent
/// rows, and no values).
struct LayerCache<T> {
    k: CudaSlice<T>,
    v: CudaSlice<T>,
}

/// Every weight of the model on the device (read only during a step).
struct DeviceWeights<T> {
    embed: CudaSlice<T>,
    layers: Vec<DeviceLayer<T>>,
    norm: CudaSlice<T>,
    lm_head: CudaSlice<T>,
    inv_freq: CudaSlice<f32>,
    /// YaRN's cos/sin factor (1 for plain RoPE).
    rope_scaling: f32,
}

impl<T> DeviceLayer<T> {
    fn weight(&self, role: LayerWeight) -> Option<&CudaSlice<T>> {
        let a = &self.attention;
        match role {
            LayerWeight::InputNorm => Some(&self.input_norm),
            LayerWeight::PostNorm => Some(&self.post_norm),
            LayerWeight::QProj => a.q.as_ref(),
            LayerWeight::KProj => a.k.as_ref(),
            LayerWeight::VProj => a.v.as_ref(),
            LayerWeight::OProj => Some(&a.o),
            LayerWeight::QBias => a.biases[0].as_ref(),
            LayerWeight::KBias => a.biases[1].as_ref(),
            LayerWeight::VBias => a.biases[2].as_ref(),
            LayerWeight::OBias => a.biases[3].as_ref(),
            LayerWeight::QNorm => a.q_norm.as_ref(),
            LayerWeight::KNorm => a.k_norm.as_ref(),
            LayerWeight::QAProj => a.latent.as_ref()?.q_a.as_ref(),
            LayerWeight::QABias => a.latent.as_ref()?.q_a_bias.as_ref(),
            LayerWeight::QANorm => a.latent.as_ref()?.q_a_norm.as_ref(),
            LayerWeight::QBProj => a.latent.as_ref()?.q_b.as_ref(),
            LayerWeight::KvAProj => a.latent.as_ref().map(|m| &m.kv_a),
            LayerWeight::KvABias => a.latent.as_ref()?.kv_a_bias.as_ref(),
            LayerWeight::KvANorm => a.latent.as_ref().map(|m| &m.kv_a_norm),
        }
    }
}

struct DeviceModel<T> {
    gpu: CudaBackend,
    config: ModelConfig,
    layout: KvCacheLayout,
    weights: DeviceWeights<T>,
    kv: Vec<LayerCache<T>>,
    /// The step's buffers, sized by [`CudaMoeModel::reserve`] (else grown by the steps).
    workspace: StepWorkspace<T>,
    experts_here: ExpertHome,
    /// Bytes of the checkpoint's tensors uploaded to this GPU.
    weight_bytes: u64,
    /// Set up at the first step with expert parallelism.
    experts: Option<ExpertGpus<T>>,
}

impl<T: CudaElement> DeviceModel<T> {
    /// The model of `config` with its weights from `source` and a KV cache of `layout`.
    fn build(
        gpu: CudaBackend,
        config: ModelConfig,
        layout: KvCacheLayout,
        source: &mut dyn WeightSource<T>,
        experts_here: ExpertHome,
    ) -> Result<Self> {
        let c = config;
        let (key_slots, value_slots) = (
            layout.num_slots() * layout.key_dim,
            layout.num_slots() * layout.value_dim,
        );
        let corrections: Vec<_> = (0..c.num_hidden_layers)
            .map(|l| source.correction_bias(l))
            .collect();
        let sinks: Vec<_> = (0..c.num_hidden_layers).map(|l| source.sinks(l)).collect();
        let expert_biases: Vec<_> = (0..c.num_hidden_layers)
            .map(|l| source.expert_biases(l))
            .collect();
        if c.experts.bias && expert_biases.iter().flatten().next().is_none() {
            return Err(ModelError::InvalidInput {
                message: format!(
                    "{}: the config says the experts have biases, and the weights have none",
                    c.architecture
                ),
            });
        }
        // Bytes of the tensors uploaded, for `weight_bytes` (checked against memory.rs).
        let mut uploaded = 0u64;
        let mut get = |t: Tensor| {
            let w = source.tensor(&gpu, t).map_err(backend)?;
            uploaded += (w.len() * std::mem::size_of::<T>()) as u64;
            Ok::<_, ModelError>(w)
        };
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        let mut kv = Vec::with_capacity(c.num_hidden_layers);
        let per_layer = corrections.into_iter().zip(sinks).zip(expert_biases);
        for (l, ((correction_bias, sinks), expert_bias)) in per_layer.enumerate() {
            let a = &c.attention;
            let kv_b = match c.mla {
                Some(_) => Some((get(Tensor::AbsorbKey(l))?, get(Tensor::ExpandValue(l))?)),
                None => None,
            };
            let mut attn = |role| get(Tensor::Attention(l, role));
            // The weight of `role` when `on` (the config says the layer has it).
            let some = |on: bool, role, attn: &mut dyn FnMut(_) -> Result<_>| {
                on.then(|| attn(role)).transpose()
            };
            let sinks = sinks.map(|s| gpu.upload(&s)).transpose().map_err(backend)?;
            let attention = match (&c.mla, kv_b) {
                (Some(m), Some((absorb_key, expand_value))) => {
                    let low_rank = m.q_lora_rank.is_some();
                    DeviceAttention {
                        q: some(!low_rank, LayerWeight::QProj, &mut attn)?,
                        k: None,
                        v: None,
                        o: attn(LayerWeight::OProj)?,
                        biases: [
                            None,
                            None,
                            None,
                            some(m.bias, LayerWeight::OBias, &mut attn)?,
                        ],
                        q_norm: None,
                        k_norm: None,
                        sinks,
                        latent: Some(DeviceLatent {
                            q_a: some(low_rank, LayerWeight::QAProj, &mut attn)?,
                            q_a_bias: some(low_rank && m.bias, LayerWeight::QABias, &mut attn)?,
                            q_a_norm: some(low_rank, LayerWeight::QANorm, &mut attn)?,
                            q_b: some(low_rank, LayerWeight::QBProj, &mut attn)?,
                            kv_a: attn(LayerWeight::KvAProj)?,
                            kv_a_bias: some(m.bias, LayerWeight::KvABias, &mut attn)?,
                            kv_a_norm: attn(LayerWeight::KvANorm)?,
                            absorb_key,
                            expand_value,
                        }),
                    }
                }
                _ => {
                    let has_norm = a.qk_norm != QkNorm::None;
                    DeviceAttention {
                        q: Some(attn(LayerWeight::QProj)?),
                        k: Some(attn(LayerWeight::KProj)?),
                        v: Some(attn(LayerWeight::VProj)?),
                        o: attn(LayerWeight::OProj)?,
                        biases: [
                            some(a.qkv_bias, LayerWeight::QBias, &mut attn)?,
                            some(a.qkv_bias, LayerWeight::KBias, &mut attn)?,
                            some(a.qkv_bias, LayerWeight::VBias, &mut attn)?,
                            some(a.o_bias, LayerWeight::OBias, &mut attn)?,
                        ],
                        q_norm: some(has_norm, LayerWeight::QNorm, &mut attn)?,
                        k_norm: some(has_norm, LayerWeight::KNorm, &mut attn)?,
                        sinks,
                        latent: None,
                    }
                }
            };
            let mlp = if c.sparse_layers[l] {
                let experts = 0..c.num_local_experts;
                let shared = match c.shared_expert {
                    Some(s) => Some((
                        DeviceMlp {
                            w13: get(Tensor::SharedW13(l))?,
                            w2: get(Tensor::SharedW2(l))?,
                            intermediate: s.intermediate_size,
                        },
                        s.gated.then(|| get(Tensor::SharedGate(l))).transpose()?,
                    )),
                    None => None,
                };
                // Under expert parallelism the experts live on the expert GPUs (GPU 0's share
                // among them), uploaded from the engine's placement at the first step.
                let experts = match experts_here {
                    ExpertHome::ThisGpu => experts,
                    ExpertHome::ExpertGpus => 0..0,
                };
                let w13: Vec<_> = experts
                    .clone()
                    .map(|e| get(Tensor::W13(l, e)))
                    .collect::<Result<_>>()?;
                let w2: Vec<_> = experts
                    .map(|e| get(Tensor::W2(l, e)))
                    .collect::<Result<_>>()?;
                let (h, inter) = (c.hidden_size, c.moe_intermediate_size);
                // SAFETY: the tables live beside `w13` and `w2` in the layer, which never
                // change them.
                let tables = match experts_here {
                    ExpertHome::ThisGpu => Some(unsafe {
                        (
                            ExpertTable::new(&gpu, &w13, 2 * inter, h).map_err(backend)?,
                            ExpertTable::new(&gpu, &w2, h, inter).map_err(backend)?,
                        )
                    }),
                    ExpertHome::ExpertGpus => None,
                };
                DeviceFeedForward::Sparse(Box::new(DeviceMoe {
                    gate: get(Tensor::Gate(l))?,
                    router_bias: None,
                    router_bias_host: None,
                    correction: correction_bias
                        .as_deref()
                        .map(|b| gpu.upload(b))
                        .transpose()
                        .map_err(backend)?,
                    correction_bias,
                    w13,
                    w2,
                    tables,
                    expert_bias: match expert_bias {
                        Some((gate_up, down)) => Some((
                            gpu.upload(&gate_up).map_err(backend)?,
                            gpu.upload(&down).map_err(backend)?,
                        )),
                        None => None,
                    },
                    shared,
                }))
            } else {
                DeviceFeedForward::Dense(DeviceMlp {
                    w13: get(Tensor::DenseW13(l))?,
                    w2: get(Tensor::DenseW2(l))?,
                    intermediate: c.intermediate_size,
                })
            };
            layers.push(DeviceLayer {
                input_norm: get(Tensor::InputNorm(l))?,
                attention,
                post_norm: get(Tensor::PostNorm(l))?,
                mlp,
            });
            kv.push(LayerCache {
                k: gpu.zeros(key_slots).map_err(backend)?,
                // One element where there are no values (MLA): no empty allocation.
                v: gpu.zeros(value_slots.max(1)).map_err(backend)?,
            });
        }
        let (embed, norm, lm_head) = (
            get(Tensor::Embed)?,
            get(Tensor::Norm)?,
            get(Tensor::LmHead)?,
        );
        for (l, layer) in layers.iter_mut().enumerate() {
            if let (Some(bias), DeviceFeedForward::Sparse(moe)) =
                (source.router_bias(l), &mut layer.mlp)
            {
                moe.router_bias = Some(gpu.upload(&bias).map_err(backend)?);
                moe.router_bias_host = Some(bias);
            }
        }
        let rope = c.rope_frequencies();
        let weights = DeviceWeights {
            embed,
            layers,
            norm,
            lm_head,
            inv_freq: gpu.upload(&rope.inv_freq).map_err(backend)?,
            rope_scaling: rope.attention_scaling,
        };
        let first = StepDims {
            tokens: 1,
            table_entries: 1,
            logit_rows: 1,
            segments: c.num_local_experts,
            partial_floats: 0,
        };
        let workspace =
            StepWorkspace::new(&gpu, &c, widest_mlp(&weights), first).map_err(backend)?;
        Ok(DeviceModel {
            weights,
            kv,
            config: c,
            layout,
            gpu,
            workspace,
            experts_here,
            weight_bytes: uploaded,
            experts: None,
        })
    }

    fn weight_bytes_per_gpu(&self) -> Vec<u64> {
        let mut bytes = match &self.experts {
            Some(gpus) => gpus.held_bytes(),
            None => vec![0],
        };
        bytes[0] += self.weight_bytes;
        bytes
    }

    fn reserve(
        &mut self,
        max_tokens: usize,
        max_sequences: usize,
        max_context: usize,
    ) -> Result<()> {
        let blocks = max_context.div_ceil(self.layout.block_size).max(1);
        // The largest split: a decode step of every sequence at the longest context.
        let split = attention_split(&self.config, max_sequences, max_context);
        let dims = StepDims {
            tokens: max_tokens.max(1),
            table_entries: max_sequences.max(1) * blocks,
            logit_rows: max_sequences.max(1),
            segments: self.segments(),
            partial_floats: partial_floats(&self.config, split, max_sequences),
        };
        self.workspace.fit(&self.gpu, dims).map_err(backend)
    }

    /// The most segments an MoE layer's rows fall into: one per expert, or per physical slot
    /// of the expert-parallel placement.
    fn segments(&self) -> usize {
        let placed = self.experts.as_ref().map(|g| {
            let p = g.placement();
            (0..p.num_layers())
                .map(|l| p.num_physical(l))
                .max()
                .unwrap_or(0)
        });
        placed.unwrap_or(0).max(self.config.num_local_experts)
    }

    fn copy_block(&mut self, src: usize, dst: usize) -> Result<()> {
        let (bs, n) = (self.layout.block_size, self.layout.num_blocks);
        if src >= n || dst >= n {
            return Err(ModelError::InvalidInput {
                message: format!("KV block copy {src} → {dst} outside the cache's {n} blocks"),
            });
        }
        let (key_row, value_row) = (self.layout.key_dim * bs, self.layout.value_dim * bs);
        for cache in &mut self.kv {
            for (rows, row) in [(&mut cache.k, key_row), (&mut cache.v, value_row)] {
                self.gpu
                    .copy_within(rows, src * row, dst * row, row)
                    .map_err(backend)?;
            }
        }
        Ok(())
    }

    fn forward(&mut self, batch: &ForwardBatch<'_>, opts: ForwardOptions<'_>) -> Result<Vec<f32>> {
        opts.moe.check(&self.config)?;
        let c = &self.config;
        let mut x = step_inputs(
            batch,
            &BatchLimits {
                vocab_size: c.vocab_size,
                max_position_embeddings: c.max_position_embeddings,
                block_size: self.layout.block_size,
                num_blocks: self.layout.num_blocks,
            },
            opts.logits,
        )?;
        // Rows that want only their greedy token go last, to be reduced on the device.
        let greedy = opts.greedy.filter(|g| {
            opts.logits == LogitsFor::LastTokens && g.wanted.len() == x.logit_rows.len()
        });
        let (order, sampled) = match &greedy {
            Some(g) => greedy_order(&g.wanted),
            None => ((0..x.logit_rows.len()).collect(), x.logit_rows.len()),
        };
        x.logit_rows = order.iter().map(|r| x.logit_rows[*r]).collect();
        let mut trace = opts.trace;
        let mut record = opts.moe.record;
        // The engine refuses this at start-up; the model guards its own callers too.
        if opts.moe.experts.is_some() && c.experts.bias {
            return Err(ModelError::InvalidInput {
                message: format!(
                    "{}: experts with biases (GPT-OSS) run on one GPU on CUDA so far; expert \
                     parallelism for them is on the CPU backend (--device cpu)",
                    c.architecture
                ),
            });
        }
        if opts.moe.experts.is_none() && self.experts_here == ExpertHome::ExpertGpus {
            return Err(ModelError::InvalidInput {
                message: "this CUDA model was built for expert parallelism: its experts live on \
                          the expert GPUs, so every forward needs the placement"
                    .into(),
            });
        }
        let expert_parallel = match opts.moe.experts {
            Some(ep) => {
                match &mut self.experts {
                    Some(gpus) => gpus.follow(&self.gpu, ep),
                    None => ExpertGpus::new(&self.gpu, ep).map(|g| self.experts = Some(g)),
                }
                .map_err(backend)?;
                true
            }
            None => false,
        };
        let wants = StepMode {
            trace: trace.is_some(),
            routing: record.is_some(),
            capacity: opts.moe.capacity,
            expert_parallel,
        };
        let mut observe = |event| match event {
            Observed::LayerOutput(v) => {
                if let Some(t) = trace.as_deref_mut() {
                    t.layer_outputs.push(v);
                }
            }
            Observed::RouterLogits(v) => {
                if let Some(t) = trace.as_deref_mut() {
                    t.router_logits.push(v);
                }
            }
            Observed::Routing(r) => {
                if let Some(rec) = record.as_deref_mut() {
                    rec.layers.push(r);
                }
            }
        };
        let attention = AttentionLayout::new(c, &x);
        let dims = StepDims {
            tokens: x.ids.len(),
            table_entries: x.block_tables.len(),
            logit_rows: x.logit_rows.len(),
            segments: self.segments(),
            partial_floats: partial_floats(c, attention.split, x.ids.len()),
        };
        self.workspace.fit(&self.gpu, dims).map_err(backend)?;
        let DeviceModel {
            gpu,
            config,
            layout,
            weights,
            kv,
            workspace,
            experts,
            ..
        } = self;
        let mut step = CudaStep::new(
            StepModel {
                gpu,
                config,
                block_size: layout.block_size,
                weights,
                experts: experts.as_ref().filter(|_| wants.expert_parallel),
            },
            workspace,
            kv,
            StepRows {
                x: &x,
                attention: &attention,
                dims,
                rows: RowOrder {
                    order: &order,
                    sampled,
                },
            },
            wants,
            &mut observe,
        )
        .map_err(backend)?;
        decode(config, &mut step).map_err(backend)?;
        if let Some(g) = greedy {
            g.reduced = std::mem::take(&mut step.greedy);
        }
        Ok(step.logits)
    }
}
