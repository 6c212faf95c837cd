//! [`MoeModel`]'s forward on one CUDA device (feature `cuda`): the layer order of
//! `mixtral.rs` on the kernels of `cuda/` and cuBLAS (`moeserve_backend::cuda`):
//! embedding → per layer (RMSNorm + residual → q/k/v GEMMs → RoPE → KV write → paged attention
//! → o GEMM → RMSNorm + residual → router GEMM → top-k → permute → grouped `w1 | w3` GEMM →
//! SwiGLU → grouped `w2` GEMM → unpermute) → final norm → lm_head.
//!
//! Weights are uploaded once from the loaded host model, in the checkpoint's dtype (f32, f16 or
//! bf16). Activations between kernels are in that dtype; the residual stream and every
//! reduction are f32. So an f32 checkpoint follows the CPU forward to f32 rounding and a bf16 one
//! to bf16 tolerance; the GPU parity test (`tests/cuda_forward.rs`) checks both against the
//! transformers fixtures. The KV cache lives on the device, `[num_slots, kv_dim]` per layer in
//! the weights' dtype, addressed by the slots of the engine's block tables, as on the CPU.
//!
//! Routing: dropless steps route on the device (`moe_router.cu`). With a capacity factor the
//! router logits are copied back and routed on the host by the CPU's own `moe::route` (drop,
//! reroute and spill exactly as on the CPU, in token order; the router kernel's atomics would
//! hand out slots in arrival order), then the device permutes by that routing.
//!
//! Expert parallelism (`--expert-parallel-size N`): GPUs `0..N` hold the experts of the
//! engine's placement and exchange rows with NCCL (`expert_parallel.rs`); routing is then made
//! on the host too, so pairs reach the same slots as on the CPU.

mod expert_parallel;
mod host_step;
mod weights;

use half::{bf16, f16};
use moeserve_backend::cuda::gemm::{GemmShape, GroupedGemm, grouped_expert_matmul, matmul_wt};
use moeserve_backend::cuda::ops::{self, AttentionShape, DeviceRouting, RmsNormArgs};
use moeserve_backend::cuda::{CudaBackend, CudaElement, CudaError, CudaSlice};
use moeserve_backend::device::CudaDeviceInfo;
use moeserve_backend::{BackendError, cpu};
use moeserve_core::{DType, ExpertId};

use super::decoder::{ForwardOptions, MoeModel};
use crate::batch::{BatchLimits, ForwardBatch};
use crate::config::ModelConfig;
use crate::kv_cache::KvCacheLayout;
use crate::moe::record::LayerRouting;
use crate::moe::{Capacity, RouterConfig, route};
use crate::{ModelError, Result};
use expert_parallel::{ExpertGpus, LayerRows, SegmentLayout};
use host_step::{HostRouting, StepInputs, dropless_routing, step_inputs};
use weights::{HostWeights, RandomWeights, Tensor, WeightSource, host_values, stacked_w13};

/// A Mixtral model and its KV cache on one CUDA device.
pub struct CudaMoeModel {
    info: CudaDeviceInfo,
    dtype: DType,
    model: Typed,
}

/// The device model in the checkpoint's element type.
enum Typed {
    F32(DeviceModel<f32>),
    F16(DeviceModel<f16>),
    BF16(DeviceModel<bf16>),
}

/// The CUDA forward implements the Mixtral shape only so far (no attention options, dense
/// layers or shared experts): anything else is refused here, by name, not computed wrongly.
fn check_mixtral_shaped(c: &ModelConfig) -> Result<()> {
    if c.is_mixtral_shaped() {
        return Ok(());
    }
    Err(ModelError::InvalidInput {
        message: format!(
            "the CUDA backend runs Mixtral-shaped models only so far; {} needs its attention \
             options, dense layers or shared experts (run it with --device cpu)",
            c.architecture
        ),
    })
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
        check_mixtral_shaped(model.config())?;
        let gpu = CudaBackend::new(ordinal).map_err(backend)?;
        gpu.load_all_kernels().map_err(backend)?;
        let info = gpu.info().clone();
        let (c, mut host) = (model.config().clone(), HostWeights(model));
        let model = match dtype {
            DType::F32 => Typed::F32(DeviceModel::build(gpu, c, layout, &mut host)?),
            DType::F16 => Typed::F16(DeviceModel::build(gpu, c, layout, &mut host)?),
            DType::BF16 => Typed::BF16(DeviceModel::build(gpu, c, layout, &mut host)?),
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
        check_mixtral_shaped(&config)?;
        let gpu = CudaBackend::new(ordinal).map_err(backend)?;
        gpu.load_all_kernels().map_err(backend)?;
        let info = gpu.info().clone();
        let mut random = RandomWeights {
            config: config.clone(),
            seed,
        };
        let model = DeviceModel::build(gpu, config, layout, &mut random)?;
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
}

fn backend(e: CudaError) -> ModelError {
    ModelError::Backend(BackendError::Cuda(e))
}

struct DeviceLayer<T> {
    input_norm: CudaSlice<T>,
    q: CudaSlice<T>,
    k: CudaSlice<T>,
    v: CudaSlice<T>,
    o: CudaSlice<T>,
    post_norm: CudaSlice<T>,
    gate: CudaSlice<T>,
    router_bias: Option<CudaSlice<f32>>,
    /// The same bias on the host, for routing there (capacity factor).
    router_bias_host: Option<Vec<f32>>,
    /// Per expert `[w1; w3]`: `[2 · intermediate, hidden]` (gate rows, then up rows).
    w13: Vec<CudaSlice<T>>,
    /// Per expert `[hidden, intermediate]`.
    w2: Vec<CudaSlice<T>>,
    k_cache: CudaSlice<T>,
    v_cache: CudaSlice<T>,
}

struct DeviceModel<T> {
    gpu: CudaBackend,
    config: ModelConfig,
    layout: KvCacheLayout,
    embed: CudaSlice<T>,
    layers: Vec<DeviceLayer<T>>,
    norm: CudaSlice<T>,
    lm_head: CudaSlice<T>,
    inv_freq: CudaSlice<f32>,
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
    ) -> Result<Self> {
        let c = config;
        let slots = layout.num_slots() * layout.kv_dim;
        let mut get = |t: Tensor| source.tensor(&gpu, t).map_err(backend);
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for l in 0..c.num_hidden_layers {
            let experts = 0..c.num_local_experts;
            layers.push(DeviceLayer {
                input_norm: get(Tensor::InputNorm(l))?,
                q: get(Tensor::Q(l))?,
                k: get(Tensor::K(l))?,
                v: get(Tensor::V(l))?,
                o: get(Tensor::O(l))?,
                post_norm: get(Tensor::PostNorm(l))?,
                gate: get(Tensor::Gate(l))?,
                router_bias: None,
                router_bias_host: None,
                w13: experts
                    .clone()
                    .map(|e| get(Tensor::W13(l, e)))
                    .collect::<Result<_>>()?,
                w2: experts
                    .map(|e| get(Tensor::W2(l, e)))
                    .collect::<Result<_>>()?,
                k_cache: gpu.zeros(slots).map_err(backend)?,
                v_cache: gpu.zeros(slots).map_err(backend)?,
            });
        }
        let (embed, norm, lm_head) = (
            get(Tensor::Embed)?,
            get(Tensor::Norm)?,
            get(Tensor::LmHead)?,
        );
        for (l, layer) in layers.iter_mut().enumerate() {
            if let Some(bias) = source.router_bias(l) {
                layer.router_bias = Some(gpu.upload(&bias).map_err(backend)?);
                layer.router_bias_host = Some(bias);
            }
        }
        Ok(DeviceModel {
            embed,
            layers,
            norm,
            lm_head,
            inv_freq: gpu
                .upload(&cpu::rope_inv_freq(c.head_dim, c.rope_theta))
                .map_err(backend)?,
            config: c,
            layout,
            gpu,
            experts: None,
        })
    }

    fn check_options(&self, opts: &ForwardOptions<'_>) -> Result<()> {
        if let Some(ep) = opts.moe.experts {
            let p = ep.placement();
            let c = &self.config;
            if p.num_layers() != c.num_hidden_layers || p.num_experts() != c.num_local_experts {
                return Err(ModelError::ExpertParallel {
                    message: format!(
                        "the expert placement is for {} layers of {} experts, the model has {} of {}",
                        p.num_layers(),
                        p.num_experts(),
                        c.num_hidden_layers,
                        c.num_local_experts
                    ),
                });
            }
        }
        opts.moe
            .capacity
            .validate()
            .map_err(|e| ModelError::InvalidInput {
                message: e.to_string(),
            })
    }

    fn forward(&mut self, batch: &ForwardBatch<'_>, opts: ForwardOptions<'_>) -> Result<Vec<f32>> {
        self.check_options(&opts)?;
        let c = &self.config;
        let x = step_inputs(
            batch,
            &BatchLimits {
                vocab_size: c.vocab_size,
                max_position_embeddings: c.max_position_embeddings,
                block_size: self.layout.block_size,
                num_blocks: self.layout.num_blocks,
            },
            opts.logits,
        )?;
        let mut trace = opts.trace;
        let mut record = opts.moe.record;
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
        self.run(&x, wants, &mut |event| match event {
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
        })
        .map_err(backend)
    }

    /// The step on the device; `observe` receives the values a trace or routing record holds.
    fn run(
        &mut self,
        x: &StepInputs,
        wants: StepMode,
        observe: &mut dyn FnMut(Observed),
    ) -> std::result::Result<Vec<f32>, CudaError> {
        let gpu = &self.gpu;
        let c = &self.config;
        let (t, h) = (x.ids.len(), c.hidden_size);
        let (qd, kvd, e, k) = (
            c.q_dim(),
            c.kv_dim(),
            c.num_local_experts,
            c.num_experts_per_tok,
        );
        let (inter, pairs, eps) = (c.intermediate_size, t * k, c.rms_norm_eps);
        let ids = gpu.upload(&x.ids)?;
        let positions = gpu.upload(&x.positions)?;
        let token_seq = gpu.upload(&x.token_seq)?;
        let slots = gpu.upload(&x.slots)?;
        let tables = gpu.upload(&x.block_tables)?;
        let logit_rows = gpu.upload(&x.logit_rows)?;
        let mut residual = gpu.zeros::<f32>(t * h)?;
        let mut normed = gpu.zeros::<T>(t * h)?;
        let mut delta = gpu.zeros::<T>(t * h)?;
        let mut q = gpu.zeros::<T>(t * qd)?;
        let mut kk = gpu.zeros::<T>(t * kvd)?;
        let mut v = gpu.zeros::<T>(t * kvd)?;
        let mut attn = gpu.zeros::<T>(t * qd)?;
        let mut router_logits = gpu.zeros::<T>(t * e)?;
        let mut topk_ids = gpu.zeros::<i32>(pairs)?;
        let mut topk_w = gpu.zeros::<f32>(pairs)?;
        let mut topk_slots = gpu.zeros::<i32>(pairs)?;
        let mut counts = gpu.zeros::<i32>(e)?;
        let mut offsets_d = gpu.zeros::<i32>(e + 1)?;
        let mut permuted = gpu.zeros::<T>(pairs * h)?;
        let mut pair_of_row = gpu.zeros::<i32>(pairs)?;
        let mut gate_up = gpu.zeros::<T>(pairs * 2 * inter)?;
        let mut act = gpu.zeros::<T>(pairs * inter)?;
        let mut expert_out = gpu.zeros::<T>(pairs * h)?;
        let shape = AttentionShape {
            num_heads: c.num_attention_heads,
            num_kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            block_size: self.layout.block_size,
            max_blocks_per_seq: x.max_blocks,
            sliding_window: c.sliding_window,
        };
        ops::embedding(
            gpu,
            ops::EmbeddingArgs {
                table: self.embed.as_view(),
                ids: ids.as_view(),
                out: residual.as_view_mut(),
                hidden: h,
            },
        )?;
        for (l, layer) in self.layers.iter_mut().enumerate() {
            // The previous layer's MoE output is added to the residual by this norm.
            ops::rms_norm_residual(
                gpu,
                RmsNormArgs {
                    residual: residual.as_view_mut(),
                    delta: (l > 0).then(|| delta.as_view()),
                    weight: layer.input_norm.as_view(),
                    out: normed.as_view_mut(),
                    eps,
                },
            )?;
            if l > 0 && wants.trace {
                observe(Observed::LayerOutput(gpu.download(&residual)?));
            }
            let proj = |w: &CudaSlice<T>, y: &mut CudaSlice<T>, n: usize| {
                matmul_wt(
                    gpu,
                    &normed.as_view(),
                    &w.as_view(),
                    &mut y.as_view_mut(),
                    GemmShape { m: t, n, k: h },
                )
            };
            proj(&layer.q, &mut q, qd)?;
            proj(&layer.k, &mut kk, kvd)?;
            proj(&layer.v, &mut v, kvd)?;
            ops::rope(
                gpu,
                ops::RopeArgs {
                    q: q.as_view_mut(),
                    k: kk.as_view_mut(),
                    positions: positions.as_view(),
                    inv_freq: self.inv_freq.as_view(),
                    num_heads: c.num_attention_heads,
                    num_kv_heads: c.num_key_value_heads,
                    head_dim: c.head_dim,
                },
            )?;
            ops::write_kv(
                gpu,
                ops::WriteKvArgs {
                    k: kk.as_view(),
                    v: v.as_view(),
                    k_cache: layer.k_cache.as_view_mut(),
                    v_cache: layer.v_cache.as_view_mut(),
                    slot_mapping: slots.as_view(),
                    kv_dim: kvd,
                },
            )?;
            ops::paged_attention(
                gpu,
                ops::PagedAttentionArgs {
                    out: attn.as_view_mut(),
                    q: q.as_view(),
                    k_cache: layer.k_cache.as_view(),
                    v_cache: layer.v_cache.as_view(),
                    block_tables: tables.as_view(),
                    token_seq: token_seq.as_view(),
                    positions: positions.as_view(),
                    shape,
                },
            )?;
            matmul_wt(
                gpu,
                &attn.as_view(),
                &layer.o.as_view(),
                &mut delta.as_view_mut(),
                GemmShape { m: t, n: h, k: qd },
            )?;
            ops::rms_norm_residual(
                gpu,
                RmsNormArgs {
                    residual: residual.as_view_mut(),
                    delta: Some(delta.as_view()),
                    weight: layer.post_norm.as_view(),
                    out: normed.as_view_mut(),
                    eps,
                },
            )?;
            matmul_wt(
                gpu,
                &normed.as_view(),
                &layer.gate.as_view(),
                &mut router_logits.as_view_mut(),
                GemmShape { m: t, n: e, k: h },
            )?;
            // Set by host routing; sent once the experts ran (with their devices' rows).
            let mut pending: Option<LayerRouting> = None;
            let mut layout: Option<SegmentLayout> = None;
            let offsets = if wants.capacity == Capacity::Dropless && !wants.expert_parallel {
                ops::route_top_k(
                    gpu,
                    ops::RouteArgs {
                        logits: router_logits.as_view(),
                        bias: layer.router_bias.as_ref().map(|b| b.as_view()),
                        topk_ids: topk_ids.as_view_mut(),
                        topk_weights: topk_w.as_view_mut(),
                        slots: topk_slots.as_view_mut(),
                        expert_counts: counts.as_view_mut(),
                        top_k: k,
                        capacity: None,
                    },
                )?;
                ops::moe_segment_offsets(gpu, counts.as_view(), offsets_d.as_view_mut(), None)?;
                // The per-expert GEMMs need the segment sizes on the host: one small copy per
                // layer (the grouped kernel that would avoid it is future work, see gemm.rs).
                let offsets: Vec<usize> = gpu
                    .download(&offsets_d)?
                    .iter()
                    .map(|o| *o as usize)
                    .collect();
                if wants.trace {
                    let logits = gpu.download(&router_logits)?;
                    observe(Observed::RouterLogits(
                        logits.iter().map(|v| v.to_f32()).collect(),
                    ));
                }
                if wants.routing {
                    let chosen = gpu.download(&topk_ids)?;
                    observe(Observed::Routing(dropless_routing(&offsets, chosen, k)));
                }
                offsets
            } else {
                let mut logits: Vec<f32> = gpu
                    .download(&router_logits)?
                    .iter()
                    .map(|v| v.to_f32())
                    .collect();
                if let Some(bias) = &layer.router_bias_host {
                    for row in logits.chunks_exact_mut(e) {
                        row.iter_mut().zip(bias).for_each(|(l, b)| *l += b);
                    }
                }
                let config = RouterConfig {
                    top_k: k,
                    capacity: wants.capacity,
                    renormalize: true,
                };
                let routed = route(&logits, e, &config);
                let host = match self.experts.as_ref().filter(|_| wants.expert_parallel) {
                    Some(gpus) => {
                        let placement = gpus.placement();
                        let segments = SegmentLayout::new(placement, l);
                        let host = HostRouting::with_segments(
                            &routed,
                            segments.num_segments(),
                            |expert, ordinal| {
                                let slot = placement.slot_for(l, ExpertId(expert), ordinal);
                                segments.segment_of_slot(slot)
                            },
                        );
                        layout = Some(segments);
                        host
                    }
                    None => HostRouting::new(&routed, e),
                };
                topk_ids = gpu.upload(&host.topk_ids)?;
                topk_w = gpu.upload(&host.weights)?;
                topk_slots = gpu.upload(&host.slots)?;
                offsets_d = gpu.upload(&host.offsets)?;
                if wants.routing {
                    pending = Some(LayerRouting::from_routed(&routed, &wants.capacity));
                }
                if wants.trace {
                    observe(Observed::RouterLogits(logits));
                }
                host.offsets.iter().map(|o| *o as usize).collect()
            };
            let routing = DeviceRouting {
                topk_ids: topk_ids.as_view(),
                topk_weights: topk_w.as_view(),
                slots: topk_slots.as_view(),
                offsets: offsets_d.as_view(),
                top_k: k,
            };
            ops::moe_permute(
                gpu,
                normed.as_view(),
                &routing,
                permuted.as_view_mut(),
                pair_of_row.as_view_mut(),
            )?;
            let device_pairs = match (&self.experts, &layout) {
                (Some(gpus), Some(layout)) => {
                    let rows = LayerRows {
                        layer: l,
                        layout,
                        offsets: &offsets,
                    };
                    gpus.run(gpu, rows, &permuted, &mut expert_out, h, inter)?
                }
                _ => {
                    grouped_expert_matmul(
                        gpu,
                        GroupedGemm {
                            x: permuted.as_view(),
                            weights: &layer.w13,
                            y: gate_up.as_view_mut(),
                            offsets: &offsets,
                            n: 2 * inter,
                            k: h,
                        },
                    )?;
                    ops::silu_mul(gpu, gate_up.as_view(), act.as_view_mut(), inter)?;
                    grouped_expert_matmul(
                        gpu,
                        GroupedGemm {
                            x: act.as_view(),
                            weights: &layer.w2,
                            y: expert_out.as_view_mut(),
                            offsets: &offsets,
                            n: h,
                            k: inter,
                        },
                    )?;
                    Vec::new()
                }
            };
            if let Some(mut summary) = pending {
                summary.device_pairs = device_pairs;
                observe(Observed::Routing(summary));
            }
            ops::moe_unpermute(gpu, expert_out.as_view(), &routing, delta.as_view_mut())?;
        }
        // The last MoE output joins the residual (the norm's output over all tokens is unused:
        // only the logits rows go through the final norm below).
        ops::rms_norm_residual(
            gpu,
            RmsNormArgs {
                residual: residual.as_view_mut(),
                delta: (!self.layers.is_empty()).then(|| delta.as_view()),
                weight: self.norm.as_view(),
                out: normed.as_view_mut(),
                eps,
            },
        )?;
        if !self.layers.is_empty() && wants.trace {
            observe(Observed::LayerOutput(gpu.download(&residual)?));
        }
        let rows = x.logit_rows.len();
        let mut last = gpu.zeros::<f32>(rows * h)?;
        ops::gather_rows(
            gpu,
            ops::GatherRowsArgs {
                src: residual.as_view(),
                rows: logit_rows.as_view(),
                dst: last.as_view_mut(),
                hidden: h,
            },
        )?;
        let mut last_normed = gpu.zeros::<T>(rows * h)?;
        ops::rms_norm_residual(
            gpu,
            RmsNormArgs {
                residual: last.as_view_mut(),
                delta: None,
                weight: self.norm.as_view(),
                out: last_normed.as_view_mut(),
                eps,
            },
        )?;
        let mut logits = gpu.zeros::<T>(rows * c.vocab_size)?;
        matmul_wt(
            gpu,
            &last_normed.as_view(),
            &self.lm_head.as_view(),
            &mut logits.as_view_mut(),
            GemmShape {
                m: rows,
                n: c.vocab_size,
                k: h,
            },
        )?;
        Ok(gpu.download(&logits)?.iter().map(|v| v.to_f32()).collect())
    }
}

/// Values read back from the device during a step.
enum Observed {
    /// The residual stream after a layer, `[num_tokens, hidden]`.
    LayerOutput(Vec<f32>),
    /// A layer's router logits, `[num_tokens, num_experts]`.
    RouterLogits(Vec<f32>),
    Routing(LayerRouting),
}

/// How a step runs: which values it reads back (each read is a copy and a wait for the
/// stream) and where it routes.
#[derive(Clone, Copy)]
struct StepMode {
    /// Layer outputs and router logits, for a [`super::decoder::ForwardTrace`].
    trace: bool,
    /// Each layer's routing summary, for the engine's per-expert load.
    routing: bool,
    /// Anything but dropless routes on the host (router logits read back every layer).
    capacity: Capacity,
    /// The experts run on the expert GPUs (routing on the host, to place pairs on slots).
    expert_parallel: bool,
}
