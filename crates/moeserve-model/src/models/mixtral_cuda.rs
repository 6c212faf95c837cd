//! [`MixtralModel`]'s forward on one CUDA device (feature `cuda`): the layer order of
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
mod weights;

use half::{bf16, f16};
use moeserve_backend::cuda::gemm::{GemmShape, GroupedGemm, grouped_expert_matmul, matmul_wt};
use moeserve_backend::cuda::ops::{self, AttentionShape, DeviceRouting, RmsNormArgs};
use moeserve_backend::cuda::{CudaBackend, CudaElement, CudaError, CudaSlice};
use moeserve_backend::device::CudaDeviceInfo;
use moeserve_backend::{BackendError, cpu};
use moeserve_core::{DType, ExpertId};

use super::mixtral::{ForwardOptions, LogitsFor, MixtralModel};
use crate::batch::{BatchLimits, ForwardBatch};
use crate::config::MixtralConfig;
use crate::kv_cache::{KvCacheLayout, slot_of};
use crate::moe::record::LayerRouting;
use crate::moe::{Capacity, RoutedStep, RouterConfig, RoutingCounts, route};
use crate::{ModelError, Result};
use expert_parallel::{ExpertGpus, LayerRows, SegmentLayout};
use weights::{HostWeights, RandomWeights, Tensor, WeightSource, host_values, stacked_w13};

/// A Mixtral model and its KV cache on one CUDA device.
pub struct CudaMixtral {
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

impl CudaMixtral {
    /// Opens device `ordinal`, compiles the kernels, uploads `model`'s weights and allocates a
    /// KV cache of `layout` on it.
    pub fn new(model: &MixtralModel, layout: KvCacheLayout, ordinal: usize) -> Result<Self> {
        Self::with_dtype(model, layout, ordinal, model.embed_tokens.dtype())
    }

    /// As [`CudaMixtral::new`], with weights, activations and KV cache in `dtype` whatever the
    /// checkpoint's (the GPU test runs the f32 fixtures in bf16 this way).
    pub fn with_dtype(
        model: &MixtralModel,
        layout: KvCacheLayout,
        ordinal: usize,
        dtype: DType,
    ) -> Result<Self> {
        let gpu = CudaBackend::new(ordinal).map_err(backend)?;
        gpu.load_all_kernels().map_err(backend)?;
        let info = gpu.info().clone();
        let (c, mut host) = (model.config().clone(), HostWeights(model));
        let model = match dtype {
            DType::F32 => Typed::F32(DeviceModel::build(gpu, c, layout, &mut host)?),
            DType::F16 => Typed::F16(DeviceModel::build(gpu, c, layout, &mut host)?),
            DType::BF16 => Typed::BF16(DeviceModel::build(gpu, c, layout, &mut host)?),
        };
        Ok(CudaMixtral { info, dtype, model })
    }

    /// A model of `config` with seeded random bf16 weights generated on the device (for the GPU
    /// benchmark: no checkpoint and no host copy, so a full Mixtral-8x7B fits one H200).
    pub fn synthetic(
        config: MixtralConfig,
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
        let model = DeviceModel::build(gpu, config, layout, &mut random)?;
        Ok(CudaMixtral {
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

    /// As [`MixtralModel::forward`], with the KV cache on the device: writes the step tokens'
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
    config: MixtralConfig,
    layout: KvCacheLayout,
    embed: CudaSlice<T>,
    layers: Vec<DeviceLayer<T>>,
    norm: CudaSlice<T>,
    lm_head: CudaSlice<T>,
    inv_freq: CudaSlice<f32>,
    /// Set up at the first step with expert parallelism.
    experts: Option<ExpertGpus<T>>,
}

/// The host-side layout of one step: what the kernels index by.
struct StepInputs {
    ids: Vec<u32>,
    positions: Vec<i32>,
    /// Per token: its sequence (row of the block tables).
    token_seq: Vec<i32>,
    slots: Vec<i64>,
    /// `[num_sequences, max_blocks]`, padded with 0 (never read past a sequence's length).
    block_tables: Vec<i32>,
    max_blocks: usize,
    /// The tokens that get logits.
    logit_rows: Vec<i32>,
}

fn step_inputs(
    batch: &ForwardBatch<'_>,
    limits: &BatchLimits,
    logits: LogitsFor,
) -> Result<StepInputs> {
    let places = batch.places(limits)?;
    let seqs = batch.sequences;
    let max_blocks = seqs
        .iter()
        .map(|s| s.block_table.len())
        .max()
        .unwrap_or(0)
        .max(1);
    let mut block_tables = vec![0i32; seqs.len() * max_blocks];
    for (row, s) in block_tables.chunks_exact_mut(max_blocks).zip(seqs) {
        for (dst, b) in row.iter_mut().zip(s.block_table) {
            *dst = *b as i32;
        }
    }
    let slot = |p: &crate::batch::TokenPlace| {
        slot_of(seqs[p.sequence].block_table, limits.block_size, p.position) as i64
    };
    let logit_rows = match logits {
        LogitsFor::AllTokens => (0..places.len() as i32).collect(),
        LogitsFor::LastTokens => seqs
            .iter()
            .map(|s| (s.query_start + s.query_len - 1) as i32)
            .collect(),
    };
    Ok(StepInputs {
        ids: batch.token_ids.to_vec(),
        positions: places.iter().map(|p| p.position as i32).collect(),
        token_seq: places.iter().map(|p| p.sequence as i32).collect(),
        slots: places.iter().map(slot).collect(),
        block_tables,
        max_blocks,
        logit_rows,
    })
}

impl<T: CudaElement> DeviceModel<T> {
    /// The model of `config` with its weights from `source` and a KV cache of `layout`.
    fn build(
        gpu: CudaBackend,
        config: MixtralConfig,
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
        let wants = Readback {
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
        wants: Readback,
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

/// Which values to read back during a step (each read is a copy and a wait for the stream).
#[derive(Clone, Copy)]
struct Readback {
    /// Layer outputs and router logits, for a [`super::mixtral::ForwardTrace`].
    trace: bool,
    /// Each layer's routing summary, for the engine's per-expert load.
    routing: bool,
    /// Anything but dropless routes on the host (router logits read back every layer).
    capacity: Capacity,
    /// The experts run on the expert GPUs (routing on the host, to place pairs on slots).
    expert_parallel: bool,
}

/// A routing made on the host in the device kernels' layout (see `moe_permute.cu`): per
/// (token, rank) pair its expert, weight and row within the expert's segment (`-1`: no pair
/// there, e.g. dropped), and the segments' offsets.
struct HostRouting {
    /// `[num_tokens * top_k]`
    topk_ids: Vec<i32>,
    weights: Vec<f32>,
    slots: Vec<i32>,
    /// `[num_experts + 1]`
    offsets: Vec<i32>,
}

impl HostRouting {
    /// One segment per expert.
    fn new(routed: &RoutedStep, num_experts: usize) -> Self {
        Self::with_segments(routed, num_experts, |expert, _| expert as usize)
    }

    /// `segment(expert, ordinal)`: the segment of the `ordinal`-th pair routed to `expert` this
    /// step (e.g. the physical slot of a placement). A token's computed pairs fill its first
    /// ranks, in the routing's order; segment rows are handed out in token order, every pass of
    /// an expert in one segment (spilled pairs compute the same values as in a later pass).
    fn with_segments(
        routed: &RoutedStep,
        num_segments: usize,
        mut segment: impl FnMut(u32, usize) -> usize,
    ) -> Self {
        let k = routed.top_k;
        let n = routed.num_tokens * k;
        let mut h = HostRouting {
            topk_ids: vec![0; n],
            weights: vec![0.0; n],
            slots: vec![-1; n],
            offsets: vec![0; num_segments + 1],
        };
        let mut next_row = vec![0i32; num_segments];
        let mut ordinal = vec![0usize; routed.num_experts()];
        for t in 0..routed.num_tokens {
            for (j, pair) in routed.token_pairs(t).iter().enumerate() {
                let nth = &mut ordinal[pair.expert as usize];
                let s = segment(pair.expert, *nth);
                *nth += 1;
                h.topk_ids[t * k + j] = s as i32;
                h.weights[t * k + j] = pair.weight;
                h.slots[t * k + j] = next_row[s];
                next_row[s] += 1;
            }
        }
        for (e, rows) in next_row.iter().enumerate() {
            h.offsets[e + 1] = h.offsets[e] + rows;
        }
        h
    }
}

/// A dropless layer's routing summary from the segment offsets and the router's choices.
fn dropless_routing(offsets: &[usize], topk_ids: Vec<i32>, top_k: usize) -> LayerRouting {
    let expert_load: Vec<u32> = offsets.windows(2).map(|w| (w[1] - w[0]) as u32).collect();
    LayerRouting {
        counts: RoutingCounts {
            pairs: topk_ids.len() as u64,
            ..RoutingCounts::default()
        },
        expert_load,
        top_k,
        chosen_experts: topk_ids.into_iter().map(|e| e as u32).collect(),
        ..LayerRouting::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::SequenceSlice;

    #[test]
    fn step_inputs_index_tokens_by_sequence_position_and_slot() {
        // A 3-token prefill (blocks 4, 5 of size 2) and a decode at position 4 (blocks 0, 2, 7).
        let seqs = [
            SequenceSlice {
                query_start: 0,
                query_len: 3,
                context_len: 3,
                block_table: &[4, 5],
            },
            SequenceSlice {
                query_start: 3,
                query_len: 1,
                context_len: 5,
                block_table: &[0, 2, 7],
            },
        ];
        let batch = ForwardBatch {
            token_ids: &[10, 11, 12, 13],
            sequences: &seqs,
        };
        let limits = BatchLimits {
            vocab_size: 100,
            max_position_embeddings: 64,
            block_size: 2,
            num_blocks: 8,
        };
        let x = step_inputs(&batch, &limits, LogitsFor::LastTokens).unwrap();
        assert_eq!(x.positions, [0, 1, 2, 4]);
        assert_eq!(x.token_seq, [0, 0, 0, 1]);
        assert_eq!(x.slots, [8, 9, 10, 14]);
        assert_eq!(x.max_blocks, 3);
        assert_eq!(x.block_tables, [4, 5, 0, 0, 2, 7]);
        assert_eq!(x.logit_rows, [2, 3]);
        let all = step_inputs(&batch, &limits, LogitsFor::AllTokens).unwrap();
        assert_eq!(all.logit_rows, [0, 1, 2, 3]);
        // A block outside the cache is refused before anything reaches the device.
        let limits = BatchLimits {
            num_blocks: 7,
            ..limits
        };
        assert!(step_inputs(&batch, &limits, LogitsFor::LastTokens).is_err());
    }

    #[test]
    fn host_routing_lays_out_every_computed_pair_once_in_its_experts_segment() {
        use crate::moe::OverflowPolicy;
        // 40 tokens over 6 experts, skewed towards expert 0, top-2, capacity factor 1.
        let logits: Vec<f32> = (0..40 * 6)
            .map(|i| ((i * 7919) % 13) as f32 * 0.3 - if i % 6 == 0 { 0.0 } else { 1.0 })
            .collect();
        for overflow in [
            OverflowPolicy::Drop,
            OverflowPolicy::Reroute,
            OverflowPolicy::Spill,
        ] {
            let config = RouterConfig {
                top_k: 2,
                capacity: Capacity::Factor {
                    alpha: 1.0,
                    overflow,
                },
            };
            let routed = route(&logits, 6, &config);
            let h = HostRouting::new(&routed, 6);
            assert_eq!(h.offsets[6] as usize, routed.pairs.len(), "{overflow}");
            let mut seen = vec![Vec::new(); 6];
            for t in 0..routed.num_tokens {
                let pairs = routed.token_pairs(t);
                for j in 0..2 {
                    let at = t * 2 + j;
                    match pairs.get(j) {
                        Some(p) => {
                            assert_eq!(h.topk_ids[at], p.expert as i32);
                            assert_eq!(h.weights[at], p.weight);
                            seen[p.expert as usize].push(h.slots[at]);
                        }
                        None => assert_eq!(h.slots[at], -1, "{overflow}: token {t} rank {j}"),
                    }
                }
            }
            for (e, rows) in seen.iter().enumerate() {
                let want: Vec<i32> = (0..rows.len() as i32).collect();
                assert_eq!(*rows, want, "{overflow}: expert {e}'s rows in token order");
                assert_eq!(h.offsets[e + 1] - h.offsets[e], rows.len() as i32);
                assert_eq!(routed.expert_load[e] as usize, rows.len(), "{overflow}");
            }
            if overflow == OverflowPolicy::Drop {
                assert!(routed.counts.dropped > 0, "the case must drop something");
            }
        }
    }

    #[test]
    fn placed_segments_run_by_device_and_replicas_take_turns() {
        use moeserve_core::ExpertPlacement;
        // 1 layer, 4 experts on 2 devices, 2 replicated slots (6 physical slots).
        let placement = ExpertPlacement::round_robin(1, 4, 2, 2).unwrap();
        let layout = SegmentLayout::new(&placement, 0);
        assert_eq!(layout.num_segments(), placement.num_physical(0));
        let devices = placement.physical_to_device(0);
        let device_of_segment: Vec<u32> = {
            let mut d = vec![0; layout.num_segments()];
            for (slot, dev) in devices.iter().enumerate() {
                d[layout.segment_of_slot(slot)] = dev.0;
            }
            d
        };
        assert!(device_of_segment.is_sorted(), "{device_of_segment:?}");
        // 12 tokens all routed to experts 0 and 1 (top-2), dropless.
        let logits: Vec<f32> = (0..12 * 4).map(|i| [3.0, 2.0, 0.0, -1.0][i % 4]).collect();
        let routed = route(&logits, 4, &RouterConfig::dropless(2));
        let h = HostRouting::with_segments(&routed, layout.num_segments(), |e, nth| {
            layout.segment_of_slot(placement.slot_for(0, ExpertId(e), nth))
        });
        assert_eq!(h.offsets[layout.num_segments()], 24);
        assert!(
            [0u32, 1]
                .iter()
                .any(|e| placement.num_replicas(0, ExpertId(*e)) > 1),
            "the case needs a replicated expert among the routed ones"
        );
        for e in [0u32, 1] {
            // Each replica of a replicated expert takes some of its 12 pairs.
            let slots = placement.logical_to_physical(0, ExpertId(e));
            let rows: Vec<i32> = slots
                .iter()
                .map(|s| {
                    let seg = layout.segment_of_slot(*s);
                    h.offsets[seg + 1] - h.offsets[seg]
                })
                .collect();
            assert_eq!(rows.iter().sum::<i32>(), 12, "expert {e}: {rows:?}");
            if slots.len() > 1 {
                assert!(
                    rows.iter().all(|r| *r > 0),
                    "expert {e}'s replicas: {rows:?}"
                );
            }
        }
    }

    #[test]
    fn dropless_routing_counts_each_experts_pairs() {
        let r = dropless_routing(&[0, 2, 2, 5], vec![0, 2, 2, 0, 2], 1);
        assert_eq!(r.expert_load, [2, 0, 3]);
        assert_eq!(r.counts.pairs, 5);
        assert_eq!(r.counts.dropped, 0);
        assert_eq!(r.chosen_experts, [0, 2, 2, 0, 2]);
    }
}
