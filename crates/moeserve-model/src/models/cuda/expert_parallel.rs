//! Expert parallelism of [`super::CudaMoeModel`] over GPUs `0..N` of one process
//! (`--expert-parallel-size N`): GPU 0 runs everything but the experts (attention, router, the
//! KV cache, lm_head) and its share of the experts; every GPU holds the experts the engine's
//! placement puts on it (one copy per expert however many of its slots replicate it).
//!
//! One MoE layer: the router's pairs go to physical slots as on the CPU (replicas take turns in
//! token order, `ExpertPlacement::slot_for`); GPU 0 permutes the rows into segments ordered by
//! (device, slot), so each device's rows are one contiguous run; one NCCL all-to-all-v
//! (grouped send / receive) carries each run to its GPU, which runs its segments' GEMMs and
//! SwiGLU; a second one brings the outputs back in the same order, and GPU 0 combines them with
//! the routing weights.
//!
//! A new placement (re-placement by the engine's rebalancer) is followed before the next step:
//! experts a GPU already holds stay, missing ones are copied device to device from a GPU that
//! holds them (the host arena only when none does, e.g. at start-up), unneeded ones are freed.

use std::collections::{BTreeMap, BTreeSet};

use moeserve_backend::cuda::gemm::{GemmShape, matmul_wt};
use moeserve_backend::cuda::nccl::NcclGroup;
use moeserve_backend::cuda::ops;
use moeserve_backend::cuda::{
    CudaBackend, CudaElement, CudaError, CudaSlice, CudaView, CudaViewMut, GpuMark,
};
use moeserve_core::{ExpertId, ExpertPlacement};

use super::weights::{host_values, stacked_w13};
use crate::moe::ExpertParallel;

/// A device's expert compute: marks on its stream before and after.
pub(super) type Span = (GpuMark, GpuMark);

/// Each span's GPU seconds (0 for a device that had nothing to compute); read after the
/// step's wait, so no extra one.
pub(super) fn span_seconds(spans: &[Option<Span>]) -> Result<Vec<f64>, CudaError> {
    spans
        .iter()
        .map(|s| s.as_ref().map_or(Ok(0.0), |(a, b)| a.seconds_until(b)))
        .collect()
}

/// Where one layer's permuted rows belong.
#[derive(Clone, Copy)]
pub(super) struct LayerRows<'a> {
    pub layer: usize,
    pub layout: &'a SegmentLayout,
    /// `[num_segments + 1]`: segment `s` is rows `offsets[s]..offsets[s + 1]`.
    pub offsets: &'a [usize],
}

/// One device's share of a layer: its backend and its rows' place among all rows.
#[derive(Clone, Copy)]
struct DevicePart<'a> {
    b: &'a CudaBackend,
    device: usize,
    /// Global row of the device's first row (its segments are contiguous from there).
    first_row: usize,
    rows: usize,
    hidden: usize,
    intermediate: usize,
}

/// One expert's weights on one GPU.
struct GpuExpert<T> {
    /// `[w1; w3]`: `[2 · intermediate, hidden]`.
    w13: CudaSlice<T>,
    /// `[hidden, intermediate]`.
    w2: CudaSlice<T>,
}

/// How one layer's physical slots map to the permuted rows: segment `s` is slot
/// `segments[s].slot` on `segments[s].device`; segments are ordered by (device, slot).
pub(super) struct SegmentLayout {
    /// `[num_physical]`: the segment of each slot.
    segment_of_slot: Vec<usize>,
    segments: Vec<PlacedSegment>,
}

#[derive(Clone, Copy)]
struct PlacedSegment {
    device: usize,
    expert: ExpertId,
}

impl SegmentLayout {
    pub(super) fn new(placement: &ExpertPlacement, layer: usize) -> Self {
        let devices = placement.physical_to_device(layer);
        let experts = placement.physical_to_logical(layer);
        let mut slots: Vec<usize> = (0..devices.len()).collect();
        slots.sort_by_key(|s| (devices[*s].0, *s));
        let mut segment_of_slot = vec![0; slots.len()];
        for (segment, slot) in slots.iter().enumerate() {
            segment_of_slot[*slot] = segment;
        }
        SegmentLayout {
            segment_of_slot,
            segments: slots
                .iter()
                .map(|s| PlacedSegment {
                    device: devices[*s].0 as usize,
                    expert: experts[*s],
                })
                .collect(),
        }
    }

    pub(super) fn num_segments(&self) -> usize {
        self.segments.len()
    }

    pub(super) fn segment_of_slot(&self, slot: usize) -> usize {
        self.segment_of_slot[slot]
    }
}

/// The expert GPUs, their NCCL communicators and the experts each holds.
pub(super) struct ExpertGpus<T> {
    /// GPUs `1..N` (GPU 0 is the model's own backend, passed to each call).
    others: Vec<CudaBackend>,
    nccl: NcclGroup,
    /// The placement `held` follows.
    placement: ExpertPlacement,
    /// `[device][layer]`: logical expert → its weights on that GPU.
    held: Vec<Vec<BTreeMap<u32, GpuExpert<T>>>>,
}

impl<T: CudaElement> ExpertGpus<T> {
    /// Opens GPUs `1..N` for `ep`'s `N` devices, connects all `N` with NCCL and uploads each
    /// one's experts.
    pub(super) fn new(gpu0: &CudaBackend, ep: &ExpertParallel) -> Result<Self, CudaError> {
        let n = ep.num_devices();
        let others = (1..n)
            .map(|d| {
                let b = CudaBackend::new(d)?;
                b.load_all_kernels()?;
                Ok(b)
            })
            .collect::<Result<Vec<_>, CudaError>>()?;
        let streams = std::iter::once(gpu0)
            .chain(&others)
            .map(|b| b.stream().clone())
            .collect();
        let mut gpus = ExpertGpus {
            nccl: NcclGroup::new(streams)?,
            others,
            placement: ep.placement().clone(),
            held: (0..n)
                .map(|_| {
                    (0..ep.placement().num_layers())
                        .map(|_| BTreeMap::new())
                        .collect()
                })
                .collect(),
        };
        gpus.sync_weights(gpu0, ep)?;
        Ok(gpus)
    }

    fn backend<'a>(&'a self, gpu0: &'a CudaBackend, device: usize) -> &'a CudaBackend {
        if device == 0 {
            gpu0
        } else {
            &self.others[device - 1]
        }
    }

    /// Follows a new placement of `ep` (a no-op when it has not changed).
    pub(super) fn follow(
        &mut self,
        gpu0: &CudaBackend,
        ep: &ExpertParallel,
    ) -> Result<(), CudaError> {
        if ep.num_devices() != self.held.len() {
            return Err(CudaError::InvalidArgument {
                op: "expert parallelism",
                message: format!(
                    "the placement has {} devices, the model was set up for {}",
                    ep.num_devices(),
                    self.held.len()
                ),
            });
        }
        if ep.placement() != &self.placement {
            self.placement = ep.placement().clone();
            self.sync_weights(gpu0, ep)?;
        }
        Ok(())
    }

    /// Makes every GPU hold exactly the experts `self.placement` puts on it: an expert a GPU
    /// lacks is copied device to device from a GPU that holds it (peer copy), else uploaded from
    /// the host arena the engine built for that device; then what is no longer placed is freed.
    fn sync_weights(&mut self, gpu0: &CudaBackend, ep: &ExpertParallel) -> Result<(), CudaError> {
        let n = self.held.len();
        for layer in 0..self.placement.num_layers() {
            let wanted: Vec<BTreeSet<u32>> = (0..n)
                .map(|device| {
                    self.placement
                        .physical_to_logical(layer)
                        .iter()
                        .zip(self.placement.physical_to_device(layer))
                        .filter(|(_, d)| d.0 as usize == device)
                        .map(|(e, _)| e.0)
                        .collect()
                })
                .collect();
            let mut added = Vec::new();
            for (device, experts) in wanted.iter().enumerate() {
                for &e in experts {
                    if self.held[device][layer].contains_key(&e) {
                        continue;
                    }
                    let b = self.backend(gpu0, device);
                    let source = (0..n).find_map(|d| Some((d, self.held[d][layer].get(&e)?)));
                    let expert = match source {
                        Some((from, source)) => {
                            // Event tracking is off: the source's own stream must have finished
                            // writing it before another device's stream reads it.
                            self.backend(gpu0, from).synchronize()?;
                            GpuExpert {
                                w13: peer_copy(b, &source.w13)?,
                                w2: peer_copy(b, &source.w2)?,
                            }
                        }
                        None => {
                            let host =
                                ep.held_expert(device, layer, ExpertId(e)).ok_or_else(|| {
                                    CudaError::InvalidArgument {
                                        op: "expert parallelism",
                                        message: format!(
                                            "device {device} has no host copy of expert {e}"
                                        ),
                                    }
                                })?;
                            GpuExpert {
                                w13: b.upload(&stacked_w13::<T>(host))?,
                                w2: b.upload(&host_values::<T>(&host.w2))?,
                            }
                        }
                    };
                    added.push((device, e, expert));
                }
            }
            // The copies read their sources until they finish: wait before freeing any.
            let receivers: BTreeSet<usize> = added.iter().map(|(d, ..)| *d).collect();
            for device in receivers {
                self.backend(gpu0, device).synchronize()?;
            }
            for (device, e, expert) in added {
                self.held[device][layer].insert(e, expert);
            }
            for (device, experts) in wanted.iter().enumerate() {
                self.held[device][layer].retain(|e, _| experts.contains(e));
            }
        }
        Ok(())
    }

    /// Bytes of expert weights each GPU holds.
    pub(super) fn held_bytes(&self) -> Vec<u64> {
        self.held
            .iter()
            .map(|layers| {
                let elements: usize = layers
                    .iter()
                    .flat_map(|held| held.values())
                    .map(|w| w.w13.len() + w.w2.len())
                    .sum();
                (elements * std::mem::size_of::<T>()) as u64
            })
            .collect()
    }

    pub(super) fn placement(&self) -> &ExpertPlacement {
        &self.placement
    }

    /// One layer's experts: `permuted` (GPU 0) holds the rows of segment `s` at
    /// `offsets[s]..offsets[s + 1]`; the outputs land in `expert_out` (GPU 0) row for row.
    /// Returns the rows each device computed and, when `timed`, each one's compute span
    /// (CUDA events on its stream, read at the step's end for the per-device expert seconds).
    pub(super) fn run(
        &self,
        gpu0: &CudaBackend,
        step: LayerRows<'_>,
        permuted: CudaView<'_, T>,
        expert_out: CudaViewMut<'_, T>,
        (hidden, intermediate): (usize, usize),
        timed: bool,
    ) -> Result<(Vec<u64>, Vec<Option<Span>>), CudaError> {
        let LayerRows {
            layer,
            layout,
            offsets,
        } = step;
        let n = self.held.len();
        let mut rows = vec![0usize; n];
        for (s, seg) in layout.segments.iter().enumerate() {
            rows[seg.device] += offsets[s + 1] - offsets[s];
        }
        // Dispatch: GPU 0 sends each device its contiguous run of rows; a device without rows
        // takes part in the exchange with no buffer.
        let mut inputs = (0..n)
            .map(|d| match rows[d] {
                0 => Ok(None),
                r => self.backend(gpu0, d).zeros::<T>(r * hidden).map(Some),
            })
            .collect::<Result<Vec<_>, CudaError>>()?;
        let mut counts = vec![vec![0usize; n]; n];
        counts[0] = rows.iter().map(|r| r * hidden).collect();
        let mut send: Vec<Option<CudaView<'_, T>>> = (0..n).map(|_| None).collect();
        send[0] = Some(permuted);
        let mut recv: Vec<Option<CudaViewMut<'_, T>>> = inputs
            .iter_mut()
            .map(|b| b.as_mut().map(|b| b.as_view_mut()))
            .collect();
        self.nccl.all_to_all_v(&send, &counts, &mut recv)?;
        // Each device's segments, then its outputs back to GPU 0 in the same order.
        let mut outputs = Vec::with_capacity(n);
        let mut spans = Vec::with_capacity(n);
        let mut first_row = 0;
        for (d, input) in inputs.iter().enumerate() {
            let part = DevicePart {
                b: self.backend(gpu0, d),
                device: d,
                first_row,
                rows: rows[d],
                hidden,
                intermediate,
            };
            let (output, span) = match input {
                Some(input) => {
                    let start = timed.then(|| part.b.mark()).transpose()?;
                    let out = self.device_experts(&part, layer, layout, offsets, input)?;
                    let span = match start {
                        Some(start) => Some((start, part.b.mark()?)),
                        None => None,
                    };
                    (Some(out), span)
                }
                None => (None, None),
            };
            outputs.push(output);
            spans.push(span);
            first_row += rows[d];
        }
        let mut counts = vec![vec![0usize; n]; n];
        for (d, c) in counts.iter_mut().enumerate() {
            c[0] = rows[d] * hidden;
        }
        let send: Vec<Option<CudaView<'_, T>>> = outputs
            .iter()
            .map(|b| b.as_ref().map(|b| b.as_view()))
            .collect();
        let mut recv: Vec<Option<CudaViewMut<'_, T>>> = std::iter::once(Some(expert_out))
            .chain((1..n).map(|_| None))
            .collect();
        self.nccl.all_to_all_v(&send, &counts, &mut recv)?;
        Ok((rows.into_iter().map(|r| r as u64).collect(), spans))
    }

    /// One device's segments of one layer over its received rows (at least one): `w1 | w3`
    /// GEMM, SwiGLU, `w2` GEMM per segment.
    fn device_experts(
        &self,
        part: &DevicePart<'_>,
        layer: usize,
        layout: &SegmentLayout,
        offsets: &[usize],
        input: &CudaSlice<T>,
    ) -> Result<CudaSlice<T>, CudaError> {
        let DevicePart {
            b,
            device,
            first_row,
            rows,
            hidden,
            intermediate: inter,
        } = *part;
        let mine: Vec<(usize, &PlacedSegment)> = layout
            .segments
            .iter()
            .enumerate()
            .filter(|(s, seg)| seg.device == device && offsets[s + 1] > offsets[*s])
            .collect();
        let held = &self.held[device][layer];
        let mut gate_up = b.zeros::<T>(rows * 2 * inter)?;
        let mut act = b.zeros::<T>(rows * inter)?;
        let mut out = b.zeros::<T>(rows * hidden)?;
        let local = |s: usize| offsets[s] - first_row;
        for (s, seg) in &mine {
            let (r0, m) = (local(*s), offsets[s + 1] - offsets[*s]);
            let w = &held[&seg.expert.0];
            matmul_wt(
                b,
                &input.slice(r0 * hidden..(r0 + m) * hidden),
                &w.w13.as_view(),
                &mut gate_up.slice_mut(r0 * 2 * inter..(r0 + m) * 2 * inter),
                GemmShape {
                    m,
                    n: 2 * inter,
                    k: hidden,
                },
            )?;
        }
        ops::silu_mul(b, gate_up.as_view(), act.as_view_mut(), inter)?;
        for (s, seg) in &mine {
            let (r0, m) = (local(*s), offsets[s + 1] - offsets[*s]);
            let w = &held[&seg.expert.0];
            matmul_wt(
                b,
                &act.slice(r0 * inter..(r0 + m) * inter),
                &w.w2.as_view(),
                &mut out.slice_mut(r0 * hidden..(r0 + m) * hidden),
                GemmShape {
                    m,
                    n: hidden,
                    k: inter,
                },
            )?;
        }
        Ok(out)
    }
}

/// A copy of `src` (on another GPU) on `b`'s device, by the driver's peer copy.
fn peer_copy<T: CudaElement>(
    b: &CudaBackend,
    src: &CudaSlice<T>,
) -> Result<CudaSlice<T>, CudaError> {
    // SAFETY: every element is written by the copy before anything reads it.
    let mut dst = unsafe { b.stream().alloc::<T>(src.len()) }?;
    b.copy_dtod(src, &mut dst)?;
    Ok(dst)
}

#[cfg(test)]
mod tests {
    use super::super::host_step::HostRouting;
    use super::*;
    use crate::moe::{RouterConfig, route};

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
}
