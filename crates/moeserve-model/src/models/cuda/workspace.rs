//! The buffers of a step on the device, allocated once for the largest step
//! ([`CudaMoeModel::reserve`](super::CudaMoeModel::reserve), from the engine's
//! `--max-num-batched-tokens`, `--max-num-seqs` and `--max-model-len`) and viewed at each step's
//! own size, as the CPU's `ForwardWorkspace`. A step larger than the reservation grows the
//! buffers it outgrows (counted as allocations; none after the first such step).

use moeserve_backend::cuda::{
    CudaBackend, CudaElement, CudaError, CudaSlice, CudaViewMut, DeviceRepr, PinnedHostSlice,
    ValidAsZeroBits,
};

use crate::config::ModelConfig;
use crate::models::ops::Act;

/// The sizes of one step (or of the largest one, to reserve).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct StepDims {
    pub(crate) tokens: usize,
    /// Block-table entries: sequences × the longest table.
    pub(crate) table_entries: usize,
    /// Rows that get logits.
    pub(crate) logit_rows: usize,
    /// Segments of an MoE layer's permuted rows (experts, or a placement's slots).
    pub(crate) segments: usize,
    /// Floats of split attention's partial results.
    pub(crate) partial_floats: usize,
}

/// Every activation's width in [`Act`] order; `None` for those the family does not use.
pub(crate) fn act_widths(c: &ModelConfig) -> [Option<usize>; Act::COUNT] {
    let h = c.hidden_size;
    match &c.mla {
        None => [
            Some(h),
            Some(c.q_dim()),
            Some(c.kv_dim()),
            Some(c.kv_dim()),
            Some(c.q_dim()),
            Some(h),
            None,
            None,
            None,
            None,
        ],
        Some(m) => {
            let heads = c.num_attention_heads;
            [
                Some(h),
                Some(heads * m.qk_head_dim()),
                None,
                None,
                Some(heads * m.v_head_dim),
                Some(h),
                m.q_lora_rank,
                Some(m.latent_dim()),
                Some(heads * m.latent_dim()),
                Some(heads * m.kv_lora_rank),
            ]
        }
    }
}

/// The step's buffers (capacity ≥ any step run so far).
pub(crate) struct StepWorkspace<T> {
    ids: CudaSlice<u32>,
    positions: CudaSlice<i32>,
    token_seq: CudaSlice<i32>,
    slots: CudaSlice<i64>,
    tables: CudaSlice<i32>,
    logit_rows: CudaSlice<i32>,
    /// The attention kernel's token tiles, `[tiles, 2]`.
    tiles: CudaSlice<i32>,
    partials: CudaSlice<f32>,
    residual: CudaSlice<f32>,
    acts: [CudaSlice<T>; Act::COUNT],
    router_logits: CudaSlice<T>,
    /// `[moe_layers, pairs]`: each MoE layer's router choices, kept for the step's record.
    topk_ids: CudaSlice<i32>,
    topk_w: CudaSlice<f32>,
    topk_slots: CudaSlice<i32>,
    counts: CudaSlice<i32>,
    /// `[moe_layers, segments + 1]`: each MoE layer's segment offsets, kept likewise.
    offsets: CudaSlice<i32>,
    permuted: CudaSlice<T>,
    pair_of_row: CudaSlice<i32>,
    gate_up: CudaSlice<T>,
    act: CudaSlice<T>,
    expert_out: CudaSlice<T>,
    mlp_gate_up: CudaSlice<T>,
    mlp_act: CudaSlice<T>,
    mlp_out: CudaSlice<T>,
    mlp_gate_logit: CudaSlice<T>,
    last: CudaSlice<f32>,
    last_normed: CudaSlice<T>,
    logits: CudaSlice<T>,
    /// Greedy rows' tokens and log-probabilities, reduced on the device.
    greedy_ids: CudaSlice<i32>,
    greedy_logprobs: CudaSlice<f32>,
    /// Where the step's results come back: logits, greedy tokens, and the routing record.
    logits_host: PinnedHostSlice<T>,
    greedy_ids_host: PinnedHostSlice<i32>,
    greedy_logprobs_host: PinnedHostSlice<f32>,
    topk_ids_host: PinnedHostSlice<i32>,
    offsets_host: PinnedHostSlice<i32>,
    shape: Shape,
}

/// What the buffers' sizes derive from besides a step's [`StepDims`].
#[derive(Clone, Copy)]
struct Shape {
    widths: [Option<usize>; Act::COUNT],
    hidden: usize,
    vocab: usize,
    experts: usize,
    top_k: usize,
    moe_intermediate: usize,
    /// The widest dense MLP or shared expert.
    mlp_intermediate: usize,
    moe_layers: usize,
}

/// The step's buffers viewed at its size.
pub(crate) struct StepViews<'w, T> {
    pub(crate) inputs: InputViews<'w>,
    pub(crate) partials: CudaViewMut<'w, f32>,
    pub(crate) residual: CudaViewMut<'w, f32>,
    pub(crate) acts: [CudaViewMut<'w, T>; Act::COUNT],
    pub(crate) moe: MoeViews<'w, T>,
    pub(crate) mlp: MlpViews<'w, T>,
    pub(crate) out: OutputViews<'w, T>,
}

/// The step's index arrays on the device.
pub(crate) struct InputViews<'w> {
    pub(crate) ids: CudaViewMut<'w, u32>,
    pub(crate) positions: CudaViewMut<'w, i32>,
    pub(crate) token_seq: CudaViewMut<'w, i32>,
    pub(crate) slots: CudaViewMut<'w, i64>,
    pub(crate) tables: CudaViewMut<'w, i32>,
    pub(crate) logit_rows: CudaViewMut<'w, i32>,
    /// The attention kernel's token tiles (room for one per token; the step uses its own).
    pub(crate) tiles: CudaViewMut<'w, i32>,
}

/// The logits' buffers and where the step's results come back to.
pub(crate) struct OutputViews<'w, T> {
    pub(crate) last: CudaViewMut<'w, f32>,
    pub(crate) last_normed: CudaViewMut<'w, T>,
    pub(crate) logits: CudaViewMut<'w, T>,
    pub(crate) greedy_ids: CudaViewMut<'w, i32>,
    pub(crate) greedy_logprobs: CudaViewMut<'w, f32>,
    pub(crate) logits_host: &'w mut PinnedHostSlice<T>,
    pub(crate) greedy_ids_host: &'w mut PinnedHostSlice<i32>,
    pub(crate) greedy_logprobs_host: &'w mut PinnedHostSlice<f32>,
    pub(crate) topk_ids_host: &'w mut PinnedHostSlice<i32>,
    pub(crate) offsets_host: &'w mut PinnedHostSlice<i32>,
}

/// The MoE block's views: `pairs = tokens · top_k` rows.
pub(crate) struct MoeViews<'w, T> {
    pub(crate) router_logits: CudaViewMut<'w, T>,
    /// `[moe_layers, pairs]`; a layer uses its row.
    pub(crate) topk_ids: CudaViewMut<'w, i32>,
    pub(crate) topk_w: CudaViewMut<'w, f32>,
    pub(crate) topk_slots: CudaViewMut<'w, i32>,
    pub(crate) counts: CudaViewMut<'w, i32>,
    /// `[moe_layers, segments + 1]`; a layer uses its row.
    pub(crate) offsets: CudaViewMut<'w, i32>,
    pub(crate) permuted: CudaViewMut<'w, T>,
    pub(crate) pair_of_row: CudaViewMut<'w, i32>,
    pub(crate) gate_up: CudaViewMut<'w, T>,
    pub(crate) act: CudaViewMut<'w, T>,
    pub(crate) expert_out: CudaViewMut<'w, T>,
    pub(crate) pairs: usize,
    pub(crate) segments: usize,
}

/// A dense MLP's or a shared expert's views (`[tokens, …]`, sized for the widest).
pub(crate) struct MlpViews<'w, T> {
    pub(crate) gate_up: CudaViewMut<'w, T>,
    pub(crate) act: CudaViewMut<'w, T>,
    pub(crate) out: CudaViewMut<'w, T>,
    pub(crate) gate_logit: CudaViewMut<'w, T>,
}

/// Grows `buf` to hold `len` elements (at least one); its contents are not kept.
fn fit<T: DeviceRepr + ValidAsZeroBits>(
    gpu: &CudaBackend,
    buf: &mut CudaSlice<T>,
    len: usize,
) -> Result<(), CudaError> {
    if buf.len() < len.max(1) {
        *buf = gpu.zeros(len.max(1))?;
    }
    Ok(())
}

fn fit_pinned<T: DeviceRepr + ValidAsZeroBits>(
    gpu: &CudaBackend,
    buf: &mut PinnedHostSlice<T>,
    len: usize,
) -> Result<(), CudaError> {
    if buf.len() < len.max(1) {
        *buf = gpu.pinned(len.max(1))?;
    }
    Ok(())
}

impl<T: CudaElement> StepWorkspace<T> {
    /// Buffers for steps up to `dims` of a model of `c` (`mlp_intermediate`: its widest dense
    /// MLP or shared expert).
    pub(crate) fn new(
        gpu: &CudaBackend,
        c: &ModelConfig,
        mlp_intermediate: usize,
        dims: StepDims,
    ) -> Result<Self, CudaError> {
        let shape = Shape {
            widths: act_widths(c),
            hidden: c.hidden_size,
            vocab: c.vocab_size,
            experts: c.num_local_experts,
            top_k: c.num_experts_per_tok,
            moe_intermediate: c.moe_intermediate_size,
            mlp_intermediate,
            moe_layers: c.sparse_layers.iter().filter(|s| **s).count(),
        };
        let mut acts = Vec::with_capacity(Act::COUNT);
        for _ in 0..Act::COUNT {
            acts.push(gpu.zeros::<T>(1)?);
        }
        let Ok(acts) = <[CudaSlice<T>; Act::COUNT]>::try_from(acts) else {
            unreachable!("one buffer per activation")
        };
        let mut ws = StepWorkspace {
            ids: gpu.zeros(1)?,
            positions: gpu.zeros(1)?,
            token_seq: gpu.zeros(1)?,
            slots: gpu.zeros(1)?,
            tables: gpu.zeros(1)?,
            logit_rows: gpu.zeros(1)?,
            tiles: gpu.zeros(1)?,
            partials: gpu.zeros(1)?,
            residual: gpu.zeros(1)?,
            acts,
            router_logits: gpu.zeros(1)?,
            topk_ids: gpu.zeros(1)?,
            topk_w: gpu.zeros(1)?,
            topk_slots: gpu.zeros(1)?,
            counts: gpu.zeros(1)?,
            offsets: gpu.zeros(1)?,
            permuted: gpu.zeros(1)?,
            pair_of_row: gpu.zeros(1)?,
            gate_up: gpu.zeros(1)?,
            act: gpu.zeros(1)?,
            expert_out: gpu.zeros(1)?,
            mlp_gate_up: gpu.zeros(1)?,
            mlp_act: gpu.zeros(1)?,
            mlp_out: gpu.zeros(1)?,
            mlp_gate_logit: gpu.zeros(1)?,
            last: gpu.zeros(1)?,
            last_normed: gpu.zeros(1)?,
            logits: gpu.zeros(1)?,
            greedy_ids: gpu.zeros(1)?,
            greedy_logprobs: gpu.zeros(1)?,
            logits_host: gpu.pinned(1)?,
            greedy_ids_host: gpu.pinned(1)?,
            greedy_logprobs_host: gpu.pinned(1)?,
            topk_ids_host: gpu.pinned(1)?,
            offsets_host: gpu.pinned(1)?,
            shape,
        };
        ws.fit(gpu, dims)?;
        Ok(ws)
    }

    /// Grows whatever a step of `dims` outgrows.
    pub(crate) fn fit(&mut self, gpu: &CudaBackend, d: StepDims) -> Result<(), CudaError> {
        let s = self.shape;
        let (t, h, r) = (d.tokens, s.hidden, d.logit_rows);
        let pairs = t * s.top_k;
        let layers = s.moe_layers.max(1);
        fit(gpu, &mut self.ids, t)?;
        fit(gpu, &mut self.positions, t)?;
        fit(gpu, &mut self.token_seq, t)?;
        fit(gpu, &mut self.slots, t)?;
        fit(gpu, &mut self.tables, d.table_entries)?;
        fit(gpu, &mut self.logit_rows, r)?;
        fit(gpu, &mut self.tiles, 2 * t)?;
        fit(gpu, &mut self.partials, d.partial_floats)?;
        fit(gpu, &mut self.residual, t * h)?;
        for (buf, width) in self.acts.iter_mut().zip(s.widths) {
            fit(gpu, buf, width.map_or(1, |w| t * w))?;
        }
        fit(gpu, &mut self.router_logits, t * s.experts)?;
        fit(gpu, &mut self.topk_ids, layers * pairs)?;
        fit(gpu, &mut self.topk_w, pairs)?;
        fit(gpu, &mut self.topk_slots, pairs)?;
        fit(gpu, &mut self.counts, s.experts)?;
        fit(gpu, &mut self.offsets, layers * (d.segments + 1))?;
        fit(gpu, &mut self.permuted, pairs * h)?;
        fit(gpu, &mut self.pair_of_row, pairs)?;
        fit(gpu, &mut self.gate_up, pairs * 2 * s.moe_intermediate)?;
        fit(gpu, &mut self.act, pairs * s.moe_intermediate)?;
        fit(gpu, &mut self.expert_out, pairs * h)?;
        fit(gpu, &mut self.mlp_gate_up, t * 2 * s.mlp_intermediate)?;
        fit(gpu, &mut self.mlp_act, t * s.mlp_intermediate)?;
        fit(gpu, &mut self.mlp_out, t * h)?;
        fit(gpu, &mut self.mlp_gate_logit, t)?;
        fit(gpu, &mut self.last, r * h)?;
        fit(gpu, &mut self.last_normed, r * h)?;
        fit(gpu, &mut self.logits, r * s.vocab)?;
        fit(gpu, &mut self.greedy_ids, r)?;
        fit(gpu, &mut self.greedy_logprobs, r)?;
        fit_pinned(gpu, &mut self.logits_host, r * s.vocab)?;
        fit_pinned(gpu, &mut self.greedy_ids_host, r)?;
        fit_pinned(gpu, &mut self.greedy_logprobs_host, r)?;
        fit_pinned(gpu, &mut self.topk_ids_host, layers * pairs)?;
        fit_pinned(gpu, &mut self.offsets_host, layers * (d.segments + 1))?;
        Ok(())
    }

    /// The buffers viewed at a step of `d` (after [`StepWorkspace::fit`]).
    pub(crate) fn views(&mut self, d: StepDims) -> StepViews<'_, T> {
        let s = self.shape;
        let (t, h, r) = (d.tokens, s.hidden, d.logit_rows);
        let pairs = t * s.top_k;
        let layers = s.moe_layers.max(1);
        let mut widths = s.widths.iter();
        let acts = self.acts.each_mut().map(|buf| {
            let width = widths.next().copied().flatten();
            buf.slice_mut(..width.map_or(1, |w| t * w))
        });
        StepViews {
            inputs: InputViews {
                ids: self.ids.slice_mut(..t),
                positions: self.positions.slice_mut(..t),
                token_seq: self.token_seq.slice_mut(..t),
                slots: self.slots.slice_mut(..t),
                tables: self.tables.slice_mut(..d.table_entries),
                logit_rows: self.logit_rows.slice_mut(..r),
                tiles: self.tiles.slice_mut(..2 * t),
            },
            partials: self.partials.slice_mut(..d.partial_floats.max(1)),
            residual: self.residual.slice_mut(..t * h),
            acts,
            moe: MoeViews {
                router_logits: self.router_logits.slice_mut(..t * s.experts),
                topk_ids: self.topk_ids.slice_mut(..layers * pairs),
                topk_w: self.topk_w.slice_mut(..pairs),
                topk_slots: self.topk_slots.slice_mut(..pairs),
                counts: self.counts.slice_mut(..s.experts),
                offsets: self.offsets.slice_mut(..layers * (d.segments + 1)),
                permuted: self.permuted.slice_mut(..pairs * h),
                pair_of_row: self.pair_of_row.slice_mut(..pairs),
                gate_up: self.gate_up.slice_mut(..pairs * 2 * s.moe_intermediate),
                act: self.act.slice_mut(..pairs * s.moe_intermediate),
                expert_out: self.expert_out.slice_mut(..pairs * h),
                pairs,
                segments: d.segments,
            },
            mlp: MlpViews {
                gate_up: self.mlp_gate_up.slice_mut(..t * 2 * s.mlp_intermediate),
                act: self.mlp_act.slice_mut(..t * s.mlp_intermediate),
                out: self.mlp_out.slice_mut(..t * h),
                gate_logit: self.mlp_gate_logit.slice_mut(..t),
            },
            out: OutputViews {
                last: self.last.slice_mut(..r * h),
                last_normed: self.last_normed.slice_mut(..r * h),
                logits: self.logits.slice_mut(..r * s.vocab),
                greedy_ids: self.greedy_ids.slice_mut(..r),
                greedy_logprobs: self.greedy_logprobs.slice_mut(..r),
                logits_host: &mut self.logits_host,
                greedy_ids_host: &mut self.greedy_ids_host,
                greedy_logprobs_host: &mut self.greedy_logprobs_host,
                topk_ids_host: &mut self.topk_ids_host,
                offsets_host: &mut self.offsets_host,
            },
        }
    }
}

/// `as_view_mut` on a view, as on a slice: the step's code reads the same either way.
pub(crate) trait ViewMut<T> {
    fn as_view_mut(&mut self) -> CudaViewMut<'_, T>;
}

impl<T> ViewMut<T> for CudaViewMut<'_, T> {
    fn as_view_mut(&mut self) -> CudaViewMut<'_, T> {
        self.slice_mut(..)
    }
}
