//! The MoE block of a CUDA step: the router (on the device, or on the host with the CPU's
//! router), permute, the experts (device-offset GEMM, cuBLAS per segment, or the expert GPUs),
//! combine, the shared expert; and each layer's routing summary, completed at the step's end.

use moeserve_backend::cuda::gemm::{GemmShape, GroupedGemm, grouped_expert_matmul, matmul_wt};
use moeserve_backend::cuda::ops::{self, DeviceRouting, ExpertTable};
use moeserve_backend::cuda::{CudaElement, CudaError, CudaSlice, CudaView, CudaViewMut};
use moeserve_core::ExpertId;

use super::super::expert_parallel::{LayerRows, SegmentLayout, Span, span_seconds};
use super::super::host_step::{
    HostRouting, device_router_scores, dropless_routing, experts_on_device_offsets,
    routes_on_device,
};
use super::super::workspace::ViewMut;
use super::super::{DeviceMlp, DeviceMoe};
use super::{CudaStep, Observed};
use crate::models::ops::Act;
use crate::moe::record::LayerRouting;
use crate::moe::{RouterConfig, route_with_bias};

/// A layer's routing summary before the step's end.
pub(super) struct PendingRecord {
    /// The host router's summary; `None` for a layer routed on the device, summarised from
    /// its routing as read back.
    summary: Option<LayerRouting>,
    moe_layer: usize,
    /// Rows each device computed (expert parallelism); one GPU computes every kept pair.
    device_pairs: Vec<u64>,
    /// Each device's expert compute, as two marks on its stream (`None`: it had no rows).
    spans: Vec<Option<Span>>,
    /// Tokens through the layer's shared expert (all of them; 0 without one), as the CPU
    /// counts them.
    shared_expert_tokens: u64,
}

/// Where a layer's rows sit in the step's routing record.
#[derive(Clone, Copy)]
pub(super) struct RecordShape {
    pub(super) pairs: usize,
    /// Offsets per layer (segments + 1).
    pub(super) width: usize,
    pub(super) top_k: usize,
}

impl PendingRecord {
    /// Whether the layer was routed on the device (its summary comes from the record).
    pub(super) fn routed_on_device(&self) -> bool {
        self.summary.is_none()
    }

    /// The layer's summary: the host router's, or one made from the routing record read back
    /// (`ids`, `offsets`: every layer's rows), with each device's pairs and expert seconds.
    pub(super) fn complete(
        self,
        ids: &[i32],
        offsets: &[i32],
        s: RecordShape,
    ) -> Result<LayerRouting, CudaError> {
        let layer = self.moe_layer;
        let mut summary = match self.summary {
            Some(summary) => summary,
            None => {
                let offsets: Vec<usize> = offsets[layer * s.width..(layer + 1) * s.width]
                    .iter()
                    .map(|o| *o as usize)
                    .collect();
                let chosen = ids[layer * s.pairs..(layer + 1) * s.pairs].to_vec();
                dropless_routing(&offsets, chosen, s.top_k)
            }
        };
        summary.device_pairs = match self.device_pairs.is_empty() {
            true => vec![summary.expert_load.iter().map(|l| u64::from(*l)).sum()],
            false => self.device_pairs,
        };
        summary.device_seconds = span_seconds(&self.spans)?;
        summary.counts.shared_expert_tokens = self.shared_expert_tokens;
        Ok(summary)
    }
}

impl<T: CudaElement> CudaStep<'_, T> {
    /// `Delta` = the routed experts of `block` on `Normed`: router GEMM → top-k (on the device
    /// when `routes_on_device`, else on the host) → permute → experts → unpermute.
    /// Device-routed layers of a small step (`experts_on_device_offsets`) run the experts on the
    /// device-offset GEMM and copy nothing back; larger steps read the offsets back for cuBLAS,
    /// one wait per layer, which their GEMMs dwarf.
    pub(super) fn routed_experts(
        &mut self,
        block: &DeviceMoe<T>,
        moe_layer: usize,
    ) -> std::result::Result<(), CudaError> {
        let (gpu, c, wants) = (self.m.gpu, self.m.config, self.wants);
        let (t, h) = (self.num_tokens(), c.hidden_size);
        let (e, k, inter) = (
            c.num_local_experts,
            c.num_experts_per_tok,
            c.moe_intermediate_size,
        );
        let on_device = routes_on_device(c, wants.capacity, wants.expert_parallel);
        let b = &mut self.moe;
        let (pairs, width) = (b.pairs, b.segments + 1);
        let normed = &self.acts[Act::Normed.index()];
        matmul_wt(
            gpu,
            &normed.as_view(),
            &block.gate.as_view(),
            &mut b.router_logits.as_view_mut(),
            GemmShape { m: t, n: e, k: h },
        )?;
        // This layer's rows of the step's routing record.
        let mut topk_ids = b
            .topk_ids
            .slice_mut(moe_layer * pairs..(moe_layer + 1) * pairs);
        let mut offsets = b
            .offsets
            .slice_mut(moe_layer * width..(moe_layer + 1) * width);
        // Set by host routing; completed at the step's end (with the devices' rows and times).
        let mut summary: Option<LayerRouting> = None;
        let mut layout: Option<SegmentLayout> = None;
        let host_offsets: Option<Vec<usize>> = if on_device {
            let mut offsets = offsets.slice_mut(..e + 1);
            ops::route_top_k(
                gpu,
                ops::RouteArgs {
                    logits: b.router_logits.as_view(),
                    bias: block.router_bias.as_ref().map(|b| b.as_view()),
                    topk_ids: topk_ids.as_view_mut(),
                    topk_weights: b.topk_w.as_view_mut(),
                    slots: b.topk_slots.as_view_mut(),
                    expert_counts: b.counts.as_view_mut(),
                    top_k: k,
                    capacity: None,
                    renormalize: c.norm_topk_prob,
                    scores: device_router_scores(
                        c.router_scoring,
                        block.correction.as_ref().map(|b| b.as_view()),
                    ),
                    scale: c.routed_scaling_factor,
                },
            )?;
            ops::moe_segment_offsets(gpu, b.counts.as_view(), offsets.as_view_mut(), None)?;
            if wants.trace {
                // What the router ranked: the logits plus the router bias, as the CPU traces.
                let mut logits: Vec<f32> = gpu
                    .download(&b.router_logits)?
                    .iter()
                    .map(|v| v.to_f32())
                    .collect();
                add_router_bias(&mut logits, block.router_bias_host.as_deref(), e);
                (self.observe)(Observed::RouterLogits(logits));
            }
            match &block.tables {
                Some(_) if experts_on_device_offsets(c, t) => None,
                _ => Some(
                    gpu.download(&offsets)?
                        .iter()
                        .map(|o| *o as usize)
                        .collect(),
                ),
            }
        } else {
            let mut logits: Vec<f32> = gpu
                .download(&b.router_logits)?
                .iter()
                .map(|v| v.to_f32())
                .collect();
            add_router_bias(&mut logits, block.router_bias_host.as_deref(), e);
            let layer_router = RouterConfig {
                top_k: k,
                capacity: wants.capacity,
                renormalize: c.norm_topk_prob,
                scoring: c.router_scoring,
                scale: c.routed_scaling_factor,
            };
            let bias = block.correction_bias.as_deref();
            let routed = route_with_bias(&logits, e, &layer_router, bias);
            let host = match self.m.experts {
                Some(gpus) => {
                    let placement = gpus.placement();
                    let segments = SegmentLayout::new(placement, moe_layer);
                    let host = HostRouting::with_segments(
                        &routed,
                        segments.num_segments(),
                        |expert, ordinal| {
                            let slot = placement.slot_for(moe_layer, ExpertId(expert), ordinal);
                            segments.segment_of_slot(slot)
                        },
                    );
                    layout = Some(segments);
                    host
                }
                None => HostRouting::new(&routed, e),
            };
            gpu.copy_htod(&host.topk_ids, &mut topk_ids)?;
            gpu.copy_htod(&host.weights, &mut b.topk_w)?;
            gpu.copy_htod(&host.slots, &mut b.topk_slots)?;
            let used = host.offsets.len();
            gpu.copy_htod(&host.offsets, &mut offsets.slice_mut(..used))?;
            if wants.routing {
                summary = Some(LayerRouting::from_routed(&routed, &wants.capacity));
            }
            if wants.trace {
                (self.observe)(Observed::RouterLogits(logits));
            }
            Some(host.offsets.iter().map(|o| *o as usize).collect())
        };
        // One offset per segment and the end: the experts', or the placement's slots'.
        let used = host_offsets.as_ref().map_or(e + 1, Vec::len);
        let routing = DeviceRouting {
            topk_ids: topk_ids.as_view(),
            topk_weights: b.topk_w.as_view(),
            slots: b.topk_slots.as_view(),
            offsets: offsets.slice(..used),
            top_k: k,
            ids_by_rank: on_device,
        };
        ops::moe_permute(
            gpu,
            normed.as_view(),
            &routing,
            b.permuted.as_view_mut(),
            b.pair_of_row.as_view_mut(),
        )?;
        let (device_pairs, spans) = match (self.m.experts, &layout, &host_offsets) {
            (Some(gpus), Some(layout), Some(host_offsets)) => {
                let rows = LayerRows {
                    layer: moe_layer,
                    layout,
                    offsets: host_offsets,
                };
                gpus.run(
                    gpu,
                    rows,
                    b.permuted.as_view(),
                    b.expert_out.as_view_mut(),
                    (h, inter),
                    wants.routing,
                )?
            }
            _ => {
                let gemm = |x: CudaView<'_, T>,
                            weights: &[CudaSlice<T>],
                            table: Option<&ExpertTable<T>>,
                            y: CudaViewMut<'_, T>,
                            (n, k): (usize, usize)| {
                    match (&host_offsets, table) {
                        (Some(offsets), _) => grouped_expert_matmul(
                            gpu,
                            GroupedGemm {
                                x,
                                weights,
                                y,
                                offsets,
                                n,
                                k,
                            },
                        ),
                        (None, Some(table)) => {
                            ops::moe_grouped_gemm(gpu, x, table, y, routing.offsets.slice(..))
                        }
                        (None, None) => unreachable!("device offsets only with expert tables"),
                    }
                };
                let tables = block.tables.as_ref();
                let start = wants.routing.then(|| gpu.mark()).transpose()?;
                gemm(
                    b.permuted.as_view(),
                    &block.w13,
                    tables.map(|t| &t.0),
                    b.gate_up.as_view_mut(),
                    (2 * inter, h),
                )?;
                if let Some((gate_up_bias, _)) = &block.expert_bias {
                    let bias = gate_up_bias.as_view();
                    let offsets = routing.offsets.slice(..);
                    ops::add_segment_bias(gpu, b.gate_up.as_view_mut(), bias, offsets, 2 * inter)?;
                }
                ops::gated_activation(
                    gpu,
                    b.gate_up.as_view(),
                    b.act.as_view_mut(),
                    inter,
                    c.experts.activation,
                )?;
                gemm(
                    b.act.as_view(),
                    &block.w2,
                    tables.map(|t| &t.1),
                    b.expert_out.as_view_mut(),
                    (h, inter),
                )?;
                if let Some((_, down_bias)) = &block.expert_bias {
                    let (bias, offsets) = (down_bias.as_view(), routing.offsets.slice(..));
                    ops::add_segment_bias(gpu, b.expert_out.as_view_mut(), bias, offsets, h)?;
                }
                let span = match start {
                    Some(start) => Some((start, gpu.mark()?)),
                    None => None,
                };
                (Vec::new(), vec![span])
            }
        };
        if wants.routing {
            self.records.push(PendingRecord {
                summary,
                moe_layer,
                device_pairs,
                spans,
                shared_expert_tokens: if block.shared.is_some() { t as u64 } else { 0 },
            });
        }
        let delta = &mut self.acts[Act::Delta.index()];
        ops::moe_unpermute(gpu, b.expert_out.as_view(), &routing, delta.as_view_mut())
    }

    /// `Delta += g · shared_mlp(Normed)`, `g = sigmoid(gate · Normed)` per token (or 1): every
    /// token, outside the capacity.
    pub(super) fn shared_expert(
        &mut self,
        mlp: &DeviceMlp<T>,
        gate: Option<&CudaSlice<T>>,
    ) -> std::result::Result<(), CudaError> {
        let (gpu, t, h) = (self.m.gpu, self.num_tokens(), self.m.config.hidden_size);
        self.mlp_into(mlp)?;
        if let Some(gate) = gate {
            matmul_wt(
                gpu,
                &self.acts[Act::Normed.index()].as_view(),
                &gate.as_view(),
                &mut self.mlp.gate_logit.as_view_mut(),
                GemmShape { m: t, n: 1, k: h },
            )?;
        }
        let delta = &mut self.acts[Act::Delta.index()];
        ops::add_gated(
            gpu,
            delta.as_view_mut(),
            self.mlp.out.as_view(),
            gate.map(|_| self.mlp.gate_logit.as_view()),
            h,
        )
    }
}

/// The router bias added to each row of `logits` (`[tokens, experts]`): what the router ranks.
fn add_router_bias(logits: &mut [f32], bias: Option<&[f32]>, experts: usize) {
    if let Some(bias) = bias {
        for row in logits.chunks_exact_mut(experts) {
            row.iter_mut().zip(bias).for_each(|(l, b)| *l += b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A device-routed layer's summary, made from the routing record read back at the step's
    /// end: each expert's pairs from the offsets, the choices, and the shared expert's tokens
    /// as the CPU counts them (every token of the step).
    #[test]
    fn a_device_routed_layers_summary_counts_pairs_and_shared_expert_tokens() {
        let shape = RecordShape {
            pairs: 4,
            width: 4,
            top_k: 2,
        };
        // Layer 1 of two: 2 tokens, top 2 of 3 experts.
        let ids = [0, 0, 0, 0, 2, 0, 2, 1];
        let offsets = [0, 0, 0, 0, 0, 1, 2, 4];
        let record = PendingRecord {
            summary: None,
            moe_layer: 1,
            device_pairs: Vec::new(),
            spans: Vec::new(),
            shared_expert_tokens: 2,
        };
        let summary = record.complete(&ids, &offsets, shape).unwrap();
        assert_eq!(summary.expert_load, [1, 1, 2]);
        assert_eq!(summary.chosen_experts, [2, 0, 2, 1]);
        assert_eq!(summary.counts.pairs, 4);
        assert_eq!(summary.counts.shared_expert_tokens, 2);
        assert_eq!(summary.device_pairs, [4]);
    }
}
