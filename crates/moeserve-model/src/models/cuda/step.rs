//! One step of [`CudaMoeModel`](super::CudaMoeModel) on the device: the decoder's operations
//! (`ops::DecoderOps`) over the step's buffers, the weights of `cuda.rs` and the kernels of
//! `cuda/`. Routing is made on the device when dropless on one GPU (every family's scoring: see
//! `cuda/moe_router.cu`), else on the host with the CPU's router; a shared expert is added after the routed ones. Multi-head
//! latent attention runs as on the CPU (`layers/mla.rs`): the key up-projection absorbed into
//! the query, attention over the cached latent rows, the value up-projection after it; the
//! per-head products are one strided batched cuBLAS call each. The MoE block is in
//! `step/experts.rs`.

mod experts;

use moeserve_backend::cuda::gemm::{GemmShape, StridedBatch, matmul_wt, strided_batched_matmul_wt};
use moeserve_backend::cuda::ops::{self, AttentionShape, LatentShape, RmsNormArgs, Split};
use moeserve_backend::cuda::{CudaBackend, CudaElement, CudaError, CudaSlice, CudaViewMut};

use super::expert_parallel::ExpertGpus;
use super::host_step::{AttentionLayout, StepInputs};
use super::workspace::{
    InputViews, MlpViews, MoeViews, OutputViews, StepDims, StepViews, StepWorkspace, ViewMut,
};
use super::{DeviceFeedForward, DeviceLatent, DeviceMlp, DeviceWeights, LayerCache};
use crate::config::{MlaConfig, ModelConfig};
use crate::models::decoder::Greedy;
use crate::models::ops::{Act, DecoderOps, LayerWeight, Point, read_write, read_write_mut};
use crate::moe::Capacity;
use crate::moe::record::LayerRouting;
use experts::{PendingRecord, RecordShape};

/// Values read back from the device during a step.
pub(super) enum Observed {
    /// The residual stream after a layer, `[num_tokens, hidden]`.
    LayerOutput(Vec<f32>),
    /// A layer's router logits, `[num_tokens, num_experts]`.
    RouterLogits(Vec<f32>),
    Routing(LayerRouting),
}

/// How a step runs: which values it reads back (each read is a copy and a wait for the
/// stream) and where it routes.
#[derive(Clone, Copy)]
pub(super) struct StepMode {
    /// Layer outputs and router logits, for a [`super::decoder::ForwardTrace`].
    pub(super) trace: bool,
    /// Each layer's routing summary, for the engine's per-expert load.
    pub(super) routing: bool,
    /// Anything but dropless routes on the host (router logits read back every layer).
    pub(super) capacity: Capacity,
    /// The experts run on the expert GPUs (routing on the host, to place pairs on slots).
    pub(super) expert_parallel: bool,
}

/// What a step reads of the device model.
pub(super) struct StepModel<'m, T> {
    pub(super) gpu: &'m CudaBackend,
    pub(super) config: &'m ModelConfig,
    pub(super) block_size: usize,
    pub(super) weights: &'m DeviceWeights<T>,
    /// The expert GPUs when this step runs its experts there.
    pub(super) experts: Option<&'m ExpertGpus<T>>,
}

/// One step on the device: the decoder's operations over the step's views of the workspace.
pub(super) struct CudaStep<'m, T> {
    m: StepModel<'m, T>,
    /// The layers' KV caches, written by the step.
    kv: &'m mut [LayerCache<T>],
    x: &'m StepInputs,
    inputs: InputViews<'m>,
    wants: StepMode,
    observe: &'m mut dyn FnMut(Observed),
    residual: CudaViewMut<'m, f32>,
    acts: [CudaViewMut<'m, T>; Act::COUNT],
    /// Entries of `inputs.tiles` in use, and how attention splits long contexts.
    tile_entries: usize,
    split: Split,
    partials: CudaViewMut<'m, f32>,
    moe: MoeViews<'m, T>,
    mlp: MlpViews<'m, T>,
    out: OutputViews<'m, T>,
    /// The MoE layers' routing summaries, completed at the end of the step (the device-routed
    /// layers' routing and every layer's expert timings are read then, after the one wait).
    records: Vec<PendingRecord>,
    /// The original logits row of each device row, and how many rows (the first) come back
    /// whole; the others are reduced to their greedy token on the device.
    row_order: &'m [usize],
    sampled_rows: usize,
    /// The step's logits, once `logits` ran (`[rows, vocab]` in the original order; greedy
    /// rows left zero).
    pub(super) logits: Vec<f32>,
    /// Per original row: its greedy outcome (`Greedy::Logits` for sampled rows).
    pub(super) greedy: Vec<Greedy>,
}

/// A step's tokens on the host, its sizes, and the order of its logits rows.
pub(super) struct StepRows<'a> {
    pub(super) x: &'a StepInputs,
    pub(super) attention: &'a AttentionLayout,
    pub(super) dims: StepDims,
    pub(super) rows: RowOrder<'a>,
}

/// How a step returns its logits rows.
pub(super) struct RowOrder<'a> {
    /// The original row of each device row (the order of `StepInputs::logit_rows`).
    pub(super) order: &'a [usize],
    /// The first `sampled` device rows come back whole; the rest as greedy tokens.
    pub(super) sampled: usize,
}

impl<'m, T: CudaElement> CudaStep<'m, T> {
    /// A step over `x` in `ws` (fitted to `dims` already): copies the index arrays in.
    pub(super) fn new(
        m: StepModel<'m, T>,
        ws: &'m mut StepWorkspace<T>,
        kv: &'m mut [LayerCache<T>],
        StepRows {
            x,
            attention,
            dims,
            rows,
        }: StepRows<'m>,
        wants: StepMode,
        observe: &'m mut dyn FnMut(Observed),
    ) -> std::result::Result<Self, CudaError> {
        let gpu = m.gpu;
        let StepViews {
            mut inputs,
            partials,
            residual,
            acts,
            moe,
            mlp,
            out,
        } = ws.views(dims);
        gpu.copy_htod(&x.ids, &mut inputs.ids)?;
        gpu.copy_htod(&x.positions, &mut inputs.positions)?;
        gpu.copy_htod(&x.token_seq, &mut inputs.token_seq)?;
        gpu.copy_htod(&x.slots, &mut inputs.slots)?;
        gpu.copy_htod(&x.block_tables, &mut inputs.tables)?;
        gpu.copy_htod(&x.logit_rows, &mut inputs.logit_rows)?;
        let mut tiles = inputs.tiles.slice_mut(..attention.tiles.len());
        gpu.copy_htod(&attention.tiles, &mut tiles)?;
        Ok(CudaStep {
            m,
            kv,
            x,
            inputs,
            wants,
            observe,
            residual,
            acts,
            tile_entries: attention.tiles.len(),
            split: attention.split,
            partials,
            moe,
            mlp,
            out,
            records: Vec::new(),
            row_order: rows.order,
            sampled_rows: rows.sampled,
            logits: Vec::new(),
            greedy: Vec::new(),
        })
    }

    fn num_tokens(&self) -> usize {
        self.x.ids.len()
    }

    fn layer_weight(&self, layer: usize, role: LayerWeight) -> &'m CudaSlice<T> {
        let weights: &'m DeviceWeights<T> = self.m.weights;
        weights.layers[layer]
            .weight(role)
            .unwrap_or_else(|| panic!("layer {layer} has no {role:?} (the config says it has)"))
    }

    fn mla(&self) -> &'m MlaConfig {
        let config: &'m ModelConfig = self.m.config;
        config.mla.as_ref().expect("an MLA config")
    }

    fn latent_shape(&self) -> LatentShape {
        let m = self.mla();
        LatentShape {
            num_heads: self.m.config.num_attention_heads,
            nope: m.qk_nope_head_dim,
            rope: m.qk_rope_head_dim,
            rank: m.kv_lora_rank,
        }
    }

    fn latent_weights(&self, layer: usize) -> &'m DeviceLatent<T> {
        let weights: &'m DeviceWeights<T> = self.m.weights;
        weights.layers[layer]
            .attention
            .latent
            .as_ref()
            .unwrap_or_else(|| {
                panic!("layer {layer} has no latent attention (the config says it has)")
            })
    }

    /// `out = mlp(Normed)` for a dense MLP or a shared expert: `[w1; w3]` GEMM → SwiGLU → `w2`.
    fn mlp_into(&mut self, mlp: &DeviceMlp<T>) -> std::result::Result<(), CudaError> {
        let (gpu, t, h) = (self.m.gpu, self.num_tokens(), self.m.config.hidden_size);
        let i = mlp.intermediate;
        let normed = &self.acts[Act::Normed.index()];
        let b = &mut self.mlp;
        matmul_wt(
            gpu,
            &normed.as_view(),
            &mlp.w13.as_view(),
            &mut b.gate_up.slice_mut(..t * 2 * i),
            GemmShape {
                m: t,
                n: 2 * i,
                k: h,
            },
        )?;
        ops::silu_mul(
            gpu,
            b.gate_up.slice(..t * 2 * i),
            b.act.slice_mut(..t * i),
            i,
        )?;
        matmul_wt(
            gpu,
            &b.act.slice(..t * i),
            &mlp.w2.as_view(),
            &mut b.out.as_view_mut(),
            GemmShape { m: t, n: h, k: i },
        )
    }
}

impl<T: CudaElement> DecoderOps for CudaStep<'_, T> {
    type Error = CudaError;

    fn embed(&mut self) -> std::result::Result<(), CudaError> {
        ops::embedding(
            self.m.gpu,
            ops::EmbeddingArgs {
                table: self.m.weights.embed.as_view(),
                ids: self.inputs.ids.as_view(),
                out: self.residual.as_view_mut(),
                hidden: self.m.config.hidden_size,
            },
        )
    }

    fn add_rms_norm(
        &mut self,
        layer: usize,
        w: LayerWeight,
        add: bool,
    ) -> std::result::Result<(), CudaError> {
        let weight = self.layer_weight(layer, w);
        let (delta, normed) = read_write(&mut self.acts, Act::Delta, Act::Normed);
        ops::rms_norm_residual(
            self.m.gpu,
            RmsNormArgs {
                residual: self.residual.as_view_mut(),
                delta: add.then(|| delta.as_view()),
                weight: weight.as_view(),
                out: normed.as_view_mut(),
                eps: self.m.config.rms_norm_eps,
            },
        )
    }

    fn linear(
        &mut self,
        layer: usize,
        x: Act,
        w: LayerWeight,
        bias: Option<LayerWeight>,
        y: Act,
    ) -> std::result::Result<(), CudaError> {
        let t = self.num_tokens();
        let w = self.layer_weight(layer, w);
        let bias = bias.map(|b| self.layer_weight(layer, b));
        let (x, y) = read_write(&mut self.acts, x, y);
        let (m, n) = (t, y.len() / t.max(1));
        let k = w.len() / n.max(1);
        matmul_wt(
            self.m.gpu,
            &x.as_view(),
            &w.as_view(),
            &mut y.as_view_mut(),
            GemmShape { m, n, k },
        )?;
        match bias {
            Some(b) => ops::add_bias(self.m.gpu, y.as_view_mut(), b.as_view()),
            None => Ok(()),
        }
    }

    fn rms_norm_rows(
        &mut self,
        layer: usize,
        x: Act,
        w: LayerWeight,
    ) -> std::result::Result<(), CudaError> {
        let weight = self.layer_weight(layer, w);
        let eps = self.m.config.rms_norm_eps;
        let x = &mut self.acts[x.index()];
        ops::rms_norm_rows(self.m.gpu, x.as_view_mut(), weight.as_view(), eps)
    }

    fn mla_norm_query(&mut self, layer: usize) -> std::result::Result<(), CudaError> {
        let weight = self.layer_weight(layer, LayerWeight::QANorm);
        let x = &mut self.acts[Act::QLowRank.index()];
        let eps = MlaConfig::LATENT_NORM_EPS;
        ops::rms_norm_rows(self.m.gpu, x.as_view_mut(), weight.as_view(), eps)
    }

    fn mla_norm_latent(&mut self, layer: usize) -> std::result::Result<(), CudaError> {
        let weight = self.layer_weight(layer, LayerWeight::KvANorm);
        let width = self.mla().latent_dim();
        let x = &mut self.acts[Act::Latent.index()];
        let eps = MlaConfig::LATENT_NORM_EPS;
        ops::rms_norm_row_prefixes(self.m.gpu, x.as_view_mut(), weight.as_view(), width, eps)
    }

    fn mla_rope(&mut self, _layer: usize) -> std::result::Result<(), CudaError> {
        let (shape, interleave) = (self.latent_shape(), self.mla().rope_interleave);
        let (q, latent) = read_write_mut(&mut self.acts, Act::Q, Act::Latent);
        ops::mla_rope(
            self.m.gpu,
            ops::LatentRopeArgs {
                q: q.as_view_mut(),
                latent: latent.as_view_mut(),
                positions: self.inputs.positions.as_view(),
                inv_freq: self.m.weights.inv_freq.as_view(),
                shape,
                interleave,
                scaling: self.m.weights.rope_scaling,
            },
        )
    }

    fn mla_absorb_query(&mut self, layer: usize) -> std::result::Result<(), CudaError> {
        let (gpu, s, t) = (self.m.gpu, self.latent_shape(), self.num_tokens());
        let (qk, latent) = (s.nope + s.rope, s.rank + s.rope);
        let w = &self.latent_weights(layer).absorb_key;
        let (q, latent_q) = read_write(&mut self.acts, Act::Q, Act::LatentQ);
        ops::mla_copy_rope(gpu, q.as_view(), latent_q.as_view_mut(), s)?;
        // Per head h and token: latent_q[.., h, ..rank] = W_uk[h]ᵀ · q[.., h, ..nope] (W_uk[h]ᵀ
        // stored `[rank, nope]`: the `[n, k]` weight of `x · wᵀ`).
        strided_batched_matmul_wt(
            gpu,
            &q.as_view(),
            &w.as_view(),
            &mut latent_q.as_view_mut(),
            StridedBatch {
                batch: s.num_heads,
                shape: GemmShape {
                    m: t,
                    n: s.rank,
                    k: s.nope,
                },
                x_row: s.num_heads * qk,
                x_batch: qk,
                y_row: s.num_heads * latent,
                y_batch: latent,
            },
        )
    }

    fn mla_write_latent(&mut self, layer: usize) -> std::result::Result<(), CudaError> {
        let width = self.mla().latent_dim();
        let cache = &mut self.kv[layer];
        ops::write_latent(
            self.m.gpu,
            self.acts[Act::Latent.index()].as_view(),
            cache.k.as_view_mut(),
            self.inputs.slots.as_view(),
            width,
        )
    }

    fn mla_attention(&mut self, layer: usize) -> std::result::Result<(), CudaError> {
        let (s, scale) = (self.latent_shape(), self.mla().softmax_scale);
        let cache = &self.kv[layer];
        let (q, out) = read_write(&mut self.acts, Act::LatentQ, Act::LatentAttn);
        ops::latent_attention(
            self.m.gpu,
            ops::LatentAttentionArgs {
                out: out.as_view_mut(),
                q: q.as_view(),
                cache: cache.k.as_view(),
                at: ops::AttentionTiles {
                    block_tables: self.inputs.tables.as_view(),
                    token_seq: self.inputs.token_seq.as_view(),
                    positions: self.inputs.positions.as_view(),
                    tiles: self.inputs.tiles.slice(..self.tile_entries),
                    split: self.split,
                    partials: self.partials.as_view_mut(),
                },
                num_heads: s.num_heads,
                latent_dim: s.rank + s.rope,
                value_dim: s.rank,
                block_size: self.m.block_size,
                max_blocks_per_seq: self.x.max_blocks,
                scale,
            },
        )
    }

    fn mla_expand_values(&mut self, layer: usize) -> std::result::Result<(), CudaError> {
        let (gpu, s, t) = (self.m.gpu, self.latent_shape(), self.num_tokens());
        let v = self.mla().v_head_dim;
        let w = &self.latent_weights(layer).expand_value;
        let (x, out) = read_write(&mut self.acts, Act::LatentAttn, Act::Attn);
        // Per head h: attn[:, h, ..] = latent_attn[:, h, ..] · W_uv[h]ᵀ (W_uv[h]: `[v, rank]`).
        strided_batched_matmul_wt(
            gpu,
            &x.as_view(),
            &w.as_view(),
            &mut out.as_view_mut(),
            StridedBatch {
                batch: s.num_heads,
                shape: GemmShape {
                    m: t,
                    n: v,
                    k: s.rank,
                },
                x_row: s.num_heads * s.rank,
                x_batch: s.rank,
                y_row: s.num_heads * v,
                y_batch: v,
            },
        )
    }

    fn clamp(&mut self, x: Act, limit: f32) -> std::result::Result<(), CudaError> {
        ops::clamp(self.m.gpu, self.acts[x.index()].as_view_mut(), limit)
    }

    fn rope(&mut self, _layer: usize) -> std::result::Result<(), CudaError> {
        let c = self.m.config;
        let [_, q, k, ..] = &mut self.acts;
        ops::rope(
            self.m.gpu,
            ops::RopeArgs {
                q: q.as_view_mut(),
                k: k.as_view_mut(),
                positions: self.inputs.positions.as_view(),
                inv_freq: self.m.weights.inv_freq.as_view(),
                num_heads: c.num_attention_heads,
                num_kv_heads: c.num_key_value_heads,
                head_dim: c.head_dim,
                rotary_dim: c.rotary_dim,
                scaling: self.m.weights.rope_scaling,
            },
        )
    }

    fn write_kv(&mut self, layer: usize) -> std::result::Result<(), CudaError> {
        let cache = &mut self.kv[layer];
        ops::write_kv(
            self.m.gpu,
            ops::WriteKvArgs {
                k: self.acts[Act::K.index()].as_view(),
                v: self.acts[Act::V.index()].as_view(),
                k_cache: cache.k.as_view_mut(),
                v_cache: cache.v.as_view_mut(),
                slot_mapping: self.inputs.slots.as_view(),
                kv_dim: self.m.config.kv_dim(),
            },
        )
    }

    fn paged_attention(&mut self, layer: usize) -> std::result::Result<(), CudaError> {
        let c = self.m.config;
        let cache = &self.kv[layer];
        let (q, out) = read_write(&mut self.acts, Act::Q, Act::Attn);
        ops::paged_attention(
            self.m.gpu,
            ops::PagedAttentionArgs {
                out: out.as_view_mut(),
                q: q.as_view(),
                k_cache: cache.k.as_view(),
                v_cache: cache.v.as_view(),
                at: ops::AttentionTiles {
                    block_tables: self.inputs.tables.as_view(),
                    token_seq: self.inputs.token_seq.as_view(),
                    positions: self.inputs.positions.as_view(),
                    tiles: self.inputs.tiles.slice(..self.tile_entries),
                    split: self.split,
                    partials: self.partials.as_view_mut(),
                },
                sinks: self.m.weights.layers[layer]
                    .attention
                    .sinks
                    .as_ref()
                    .map(|s| s.as_view()),
                shape: AttentionShape {
                    num_heads: c.num_attention_heads,
                    num_kv_heads: c.num_key_value_heads,
                    head_dim: c.head_dim,
                    block_size: self.m.block_size,
                    max_blocks_per_seq: self.x.max_blocks,
                    sliding_window: c.layer_window(layer),
                },
            },
        )
    }

    fn sparse_moe(&mut self, layer: usize, moe_layer: usize) -> std::result::Result<(), CudaError> {
        let weights: &DeviceWeights<T> = self.m.weights;
        let DeviceFeedForward::Sparse(block) = &weights.layers[layer].mlp else {
            panic!("layer {layer} has no MoE block (the config says it has)");
        };
        self.routed_experts(block, moe_layer)?;
        if let Some((mlp, gate)) = &block.shared {
            self.shared_expert(mlp, gate.as_ref())?;
        }
        Ok(())
    }

    fn dense_mlp(&mut self, layer: usize) -> std::result::Result<(), CudaError> {
        let weights: &DeviceWeights<T> = self.m.weights;
        let DeviceFeedForward::Dense(mlp) = &weights.layers[layer].mlp else {
            panic!("layer {layer} has no dense MLP (the config says it has)");
        };
        self.mlp_into(mlp)?;
        let delta = &mut self.acts[Act::Delta.index()];
        self.m.gpu.copy_dtod(&self.mlp.out, delta)
    }

    fn add_last_delta(&mut self) -> std::result::Result<(), CudaError> {
        // The norm's output over all tokens is unused: only the logits rows go through the
        // final norm (in `logits`).
        let layers = self.m.config.num_hidden_layers;
        let (delta, normed) = read_write(&mut self.acts, Act::Delta, Act::Normed);
        ops::rms_norm_residual(
            self.m.gpu,
            RmsNormArgs {
                residual: self.residual.as_view_mut(),
                delta: (layers > 0).then(|| delta.as_view()),
                weight: self.m.weights.norm.as_view(),
                out: normed.as_view_mut(),
                eps: self.m.config.rms_norm_eps,
            },
        )
    }

    fn logits(&mut self) -> std::result::Result<(), CudaError> {
        let (gpu, c) = (self.m.gpu, self.m.config);
        let (h, rows) = (c.hidden_size, self.x.logit_rows.len());
        let o = &mut self.out;
        ops::gather_rows(
            gpu,
            ops::GatherRowsArgs {
                src: self.residual.as_view(),
                rows: self.inputs.logit_rows.as_view(),
                dst: o.last.as_view_mut(),
                hidden: h,
            },
        )?;
        ops::rms_norm_residual(
            gpu,
            RmsNormArgs {
                residual: o.last.as_view_mut(),
                delta: None,
                weight: self.m.weights.norm.as_view(),
                out: o.last_normed.as_view_mut(),
                eps: c.rms_norm_eps,
            },
        )?;
        matmul_wt(
            gpu,
            &o.last_normed.as_view(),
            &self.m.weights.lm_head.as_view(),
            &mut o.logits.as_view_mut(),
            GemmShape {
                m: rows,
                n: c.vocab_size,
                k: h,
            },
        )?;
        // Greedy rows (the last ones) reduced here: two numbers each come back, not a row.
        let (vocab, sampled) = (c.vocab_size, self.sampled_rows);
        if sampled < rows {
            ops::argmax_logprob(
                gpu,
                o.logits.slice(sampled * vocab..),
                o.greedy_ids.slice_mut(sampled..),
                o.greedy_logprobs.slice_mut(sampled..),
            )?;
            gpu.copy_dtoh_pinned(&o.greedy_ids.slice(sampled..), o.greedy_ids_host)?;
            gpu.copy_dtoh_pinned(&o.greedy_logprobs.slice(sampled..), o.greedy_logprobs_host)?;
        }
        // The step's results come back together: the sampled rows' logits and, for layers
        // routed on the device, their routing; one wait for all.
        if sampled > 0 {
            gpu.copy_dtoh_pinned(&o.logits.slice(..sampled * vocab), o.logits_host)?;
        }
        let record = self.records.iter().any(PendingRecord::routed_on_device);
        if record {
            gpu.copy_dtoh_pinned(&self.moe.topk_ids, o.topk_ids_host)?;
            gpu.copy_dtoh_pinned(&self.moe.offsets, o.offsets_host)?;
        }
        gpu.synchronize()?;
        // Zeroed by the allocator (untouched pages for greedy rows), each sampled row put back
        // at its original place.
        self.logits = vec![0.0; rows * vocab];
        self.greedy = vec![Greedy::Logits; rows];
        let host = gpu.pinned_contents(o.logits_host)?;
        for (device_row, &row) in self.row_order[..sampled].iter().enumerate() {
            let src = &host[device_row * vocab..(device_row + 1) * vocab];
            let dst = &mut self.logits[row * vocab..(row + 1) * vocab];
            dst.iter_mut().zip(src).for_each(|(d, s)| *d = s.to_f32());
        }
        if sampled < rows {
            let ids = gpu.pinned_contents(o.greedy_ids_host)?;
            let logprobs = gpu.pinned_contents(o.greedy_logprobs_host)?;
            for (i, &row) in self.row_order[sampled..].iter().enumerate() {
                self.greedy[row] = match u32::try_from(ids[i]) {
                    Ok(id) => Greedy::Token {
                        id,
                        logprob: logprobs[i],
                    },
                    Err(_) => Greedy::NotFinite,
                };
            }
        }
        let (ids, offsets) = match record {
            true => (
                gpu.pinned_contents(o.topk_ids_host)?,
                gpu.pinned_contents(o.offsets_host)?,
            ),
            false => (&[][..], &[][..]),
        };
        let shape = RecordShape {
            pairs: self.moe.pairs,
            width: self.moe.segments + 1,
            top_k: c.num_experts_per_tok,
        };
        for pending in self.records.drain(..) {
            let summary = pending.complete(ids, offsets, shape)?;
            (self.observe)(Observed::Routing(summary));
        }
        Ok(())
    }

    fn observe(&mut self, at: Point) -> std::result::Result<(), CudaError> {
        if at == Point::LayerOutput && self.wants.trace {
            let residual = self.m.gpu.download(&self.residual)?;
            (self.observe)(Observed::LayerOutput(residual));
        }
        Ok(())
    }
}
