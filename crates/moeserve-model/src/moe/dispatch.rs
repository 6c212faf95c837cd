//! Dispatch and combine of one MoE layer's step. Dispatch permutes the computed pairs into
//! per-device work: each pair goes to a physical slot (replicas of an expert take turns in
//! token order, `ExpertPlacement::slot_for`), and the rows of one (slot, spill pass) form one
//! contiguous segment, computed as one GEMM. Combine adds the expert outputs back into token
//! order, weighted, each token's pairs in ascending expert order as HF's `index_add_` loop
//! over experts does, so the sum is the same however the pairs were spread.

use moeserve_core::{ExpertId, ExpertPlacement};

use super::parallel::{DeviceOutput, DeviceWork, Segment};
use super::router::RoutedStep;

/// Where the pairs of a layer are computed.
#[derive(Clone, Copy)]
pub(crate) enum SlotMap<'a> {
    /// The layer's own experts on one device: slot = expert.
    Local,
    /// Slots and devices of `layer` in `placement`.
    Placed {
        placement: &'a ExpertPlacement,
        layer: usize,
    },
}

impl SlotMap<'_> {
    fn num_devices(&self) -> usize {
        match self {
            SlotMap::Local => 1,
            SlotMap::Placed { placement, .. } => placement.num_devices(),
        }
    }

    /// `(slot, device)` of the `ordinal`-th pair routed to `expert` this step.
    fn locate(&self, expert: u32, ordinal: usize) -> (usize, usize) {
        match *self {
            SlotMap::Local => (expert as usize, 0),
            SlotMap::Placed { placement, layer } => {
                let slot = placement.slot_for(layer, ExpertId(expert), ordinal);
                (slot, placement.device_of(layer, slot).0 as usize)
            }
        }
    }
}

/// One layer's pairs, grouped for the devices. Its buffers are reused from step to step.
#[derive(Default)]
pub(crate) struct Dispatch {
    /// `[num_devices]`
    pub(crate) work: Vec<DeviceWork>,
    /// `[routed.pairs.len()]`: `(device, row of that device's output)` of each pair.
    location: Vec<(usize, usize)>,
    hidden: usize,
    /// `[num_devices]`: pairs each device computes.
    pub(crate) device_pairs: Vec<u64>,
    /// Scratch of `plan`: pairs routed to each expert so far.
    ordinal: Vec<usize>,
    /// Scratch of `plan`: (device, slot, pass, pair index) of every pair.
    keyed: Vec<(usize, usize, u32, usize)>,
    /// Scratch of `combine`: one token's pairs in expert order.
    order: Vec<usize>,
}

impl Dispatch {
    /// Groups `routed`'s pairs by (device, slot, pass) and gathers their rows of
    /// `x: [num_tokens, hidden]`. Within a segment rows keep token order.
    #[cfg(test)]
    pub(crate) fn plan(routed: &RoutedStep, x: &[f32], hidden: usize, slots: SlotMap<'_>) -> Self {
        let mut dispatch = Dispatch::default();
        dispatch.replan(routed, x, hidden, slots);
        dispatch
    }

    /// `plan` into this dispatch's buffers.
    pub(crate) fn replan(
        &mut self,
        routed: &RoutedStep,
        x: &[f32],
        hidden: usize,
        slots: SlotMap<'_>,
    ) {
        let (ordinal, keyed) = (&mut self.ordinal, &mut self.keyed);
        ordinal.clear();
        ordinal.resize(routed.num_experts(), 0);
        keyed.clear();
        for (i, pair) in routed.pairs.iter().enumerate() {
            let nth = &mut ordinal[pair.expert as usize];
            let (slot, device) = slots.locate(pair.expert, *nth);
            *nth += 1;
            // Unique (the pair index), so the sort is deterministic.
            keyed.push((device, slot, pair.pass, i));
        }
        keyed.sort_unstable();
        let work = &mut self.work;
        work.resize_with(slots.num_devices(), DeviceWork::default);
        for w in work.iter_mut() {
            w.hidden = hidden;
            w.input.clear();
            w.segments.clear();
        }
        self.hidden = hidden;
        self.location.clear();
        self.location.resize(routed.pairs.len(), (0, 0));
        let rows = &mut self.device_pairs;
        rows.clear();
        rows.resize(work.len(), 0);
        for &(device, slot, pass, i) in keyed.iter() {
            let pair = &routed.pairs[i];
            let w = &mut work[device];
            match w.segments.last_mut() {
                Some(s) if s.slot == slot && s.pass == pass => s.num_rows += 1,
                _ => w.segments.push(Segment {
                    expert: ExpertId(pair.expert),
                    slot,
                    pass,
                    num_rows: 1,
                }),
            }
            w.input
                .extend_from_slice(&x[pair.token * hidden..(pair.token + 1) * hidden]);
            self.location[i] = (device, rows[device] as usize);
            rows[device] += 1;
        }
    }

    /// `out[t] = Σ weight · expert output` over token `t`'s pairs in ascending expert order;
    /// tokens without pairs get zeros. `outputs` are the devices' results for the work.
    pub(crate) fn combine(
        &mut self,
        routed: &RoutedStep,
        outputs: &[DeviceOutput],
        out: &mut [f32],
    ) {
        let hidden = self.hidden;
        out.fill(0.0);
        let order = &mut self.order;
        for (t, o) in out.chunks_exact_mut(hidden.max(1)).enumerate() {
            order.clear();
            order.extend(routed.token_offsets[t]..routed.token_offsets[t + 1]);
            order.sort_unstable_by_key(|i| routed.pairs[*i].expert);
            for &i in order.iter() {
                let (device, row) = self.location[i];
                let y = &outputs[device].output[row * hidden..(row + 1) * hidden];
                let w = routed.pairs[i].weight;
                o.iter_mut().zip(y).for_each(|(o, y)| *o += w * y);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::moe::capacity::{Capacity, OverflowPolicy};
    use crate::moe::router::{RouterConfig, route};
    use moeserve_core::{DeviceId, LayerPlacement};

    /// Three tokens, hidden 1 (x = token index + 1); every token ranks 0 > 1 > 2.
    fn step(capacity: Capacity) -> (RoutedStep, Vec<f32>) {
        let logits = [2.0, 1.0, 0.0].repeat(3);
        let routed = route(
            &logits,
            3,
            &RouterConfig {
                top_k: 2,
                capacity,
                renormalize: true,
                scoring: Default::default(),
                scale: 1.0,
            },
        );
        (routed, vec![1.0, 2.0, 3.0])
    }

    fn segments(work: &DeviceWork) -> Vec<(usize, u32, usize)> {
        work.segments
            .iter()
            .map(|s| (s.slot, s.pass, s.num_rows))
            .collect()
    }

    #[test]
    fn local_dispatch_makes_one_segment_per_expert_in_token_order() {
        let (routed, x) = step(Capacity::Dropless);
        let d = Dispatch::plan(&routed, &x, 1, SlotMap::Local);
        assert_eq!(d.work.len(), 1);
        assert_eq!(segments(&d.work[0]), vec![(0, 0, 3), (1, 0, 3)]);
        assert_eq!(d.work[0].input, vec![1.0, 2.0, 3.0, 1.0, 2.0, 3.0]);
        assert_eq!(d.device_pairs, vec![6]);
    }

    #[test]
    fn spilled_pairs_get_their_own_segments() {
        let spill = Capacity::Factor {
            alpha: 0.5,
            overflow: OverflowPolicy::Spill,
        }; // C = ceil(3·2/3·0.5) = 1
        let (routed, x) = step(spill);
        let d = Dispatch::plan(&routed, &x, 1, SlotMap::Local);
        let expected = vec![
            (0, 0, 1),
            (0, 1, 1),
            (0, 2, 1),
            (1, 0, 1),
            (1, 1, 1),
            (1, 2, 1),
        ];
        assert_eq!(segments(&d.work[0]), expected);
    }

    #[test]
    fn replicas_take_turns_and_devices_get_their_slots() {
        // Expert 0 on slots 0 (device 0) and 3 (device 1); experts 1, 2 on device 1, 0.
        let layer = LayerPlacement {
            physical_to_logical: [0, 1, 2, 0].map(ExpertId).to_vec(),
            physical_to_device: [0, 1, 0, 1].map(DeviceId).to_vec(),
        };
        let placement = ExpertPlacement::new(2, 3, vec![layer]).unwrap();
        let (routed, x) = step(Capacity::Dropless);
        let slots = SlotMap::Placed {
            placement: &placement,
            layer: 0,
        };
        let d = Dispatch::plan(&routed, &x, 1, slots);
        assert_eq!(segments(&d.work[0]), vec![(0, 0, 2)]);
        assert_eq!(d.work[0].input, vec![1.0, 3.0]);
        assert_eq!(segments(&d.work[1]), vec![(1, 0, 3), (3, 0, 1)]);
        assert_eq!(d.work[1].input, vec![1.0, 2.0, 3.0, 2.0]);
        assert_eq!(d.device_pairs, vec![2, 4]);
    }

    #[test]
    fn combine_weights_outputs_back_into_token_order() {
        let (routed, x) = step(Capacity::Dropless);
        let mut d = Dispatch::plan(&routed, &x, 1, SlotMap::Local);
        // A fake expert e maps row r to 10·r + e.
        let mut output = Vec::new();
        for s in &d.work[0].segments {
            let start = output.len();
            let rows = &d.work[0].input[start..start + s.num_rows];
            output.extend(rows.iter().map(|r| 10.0 * r + s.expert.0 as f32));
        }
        let outputs = [DeviceOutput {
            output,
            compute_seconds: 0.0,
        }];
        let mut out = vec![f32::NAN; 3];
        d.combine(&routed, &outputs, &mut out);
        let (w0, w1) = (routed.pairs[0].weight, routed.pairs[1].weight);
        for (t, got) in out.iter().enumerate() {
            let r = (t + 1) as f32;
            assert_eq!(*got, 0.0 + w0 * (10.0 * r) + w1 * (10.0 * r + 1.0));
        }
    }
}
