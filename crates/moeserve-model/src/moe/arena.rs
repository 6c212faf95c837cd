//! Experts spread over devices: an [`ExpertPlacement`], each device's memory arena (the expert
//! weights of the slots placed on it) and the [`AllToAll`] that carries work between them.
//!
//! At start-up an expert's first slot references the loaded (memory-mapped or packed) weights;
//! every other copy, replicas and experts that EPLB moved, is a real copy made for its device
//! (fresh owned bytes, put into the kernels' layout when built, not on first use). A device
//! holds one copy of an expert however many of its slots replicate it. Re-placing builds new
//! arenas layer by layer, sharing what a device already holds, so it can run on a background
//! thread while the old one serves.

use std::collections::BTreeMap;
use std::sync::Arc;

use moeserve_core::{ExpertId, ExpertPlacement};

use super::dispatch::SlotMap;
use super::experts::{Expert, SparseMoe};
use super::parallel::{AllToAll, DeviceOutput, DeviceWork, compute_segments};
use crate::{ModelError, Result};

/// The expert weights one device holds.
#[derive(Clone, Default)]
struct ExpertArena {
    /// `[num_layers]`: logical expert → its weights on this device.
    layers: Vec<BTreeMap<u32, Expert>>,
}

impl ExpertArena {
    fn expert(&self, layer: usize, expert: ExpertId) -> &Expert {
        self.layers[layer]
            .get(&expert.0)
            .expect("dispatch only sends a device the experts its arena holds")
    }
}

/// A placement with its per-device weights and the all-to-all between the devices.
pub struct ExpertParallel {
    placement: ExpertPlacement,
    /// `[num_devices]`
    arenas: Vec<ExpertArena>,
    exchange: Arc<dyn AllToAll>,
    bytes_copied: u64,
}

impl ExpertParallel {
    /// The start-up arenas of `placement` for the MoE `layers` of a model.
    pub fn new(
        layers: &[&SparseMoe],
        placement: ExpertPlacement,
        exchange: Arc<dyn AllToAll>,
    ) -> Result<Self> {
        check_fit(layers, &placement, exchange.as_ref())?;
        let (arenas, bytes_copied) = build_arenas(layers, &placement, None)?;
        Ok(ExpertParallel {
            placement,
            arenas,
            exchange,
            bytes_copied,
        })
    }

    /// The same devices under a new `placement`: experts a device already holds are shared,
    /// the others copied. Slow (it copies weights); meant for a background thread.
    pub fn replace(&self, layers: &[&SparseMoe], placement: ExpertPlacement) -> Result<Self> {
        check_fit(layers, &placement, self.exchange.as_ref())?;
        let (arenas, bytes_copied) = build_arenas(layers, &placement, Some(&self.arenas))?;
        Ok(ExpertParallel {
            placement,
            arenas,
            exchange: self.exchange.clone(),
            bytes_copied,
        })
    }

    pub fn placement(&self) -> &ExpertPlacement {
        &self.placement
    }

    pub fn num_devices(&self) -> usize {
        self.placement.num_devices()
    }

    /// Bytes of expert weights copied to build these arenas.
    pub fn bytes_copied(&self) -> u64 {
        self.bytes_copied
    }

    /// `[num_devices]`: how many (layer, expert) weight sets each device holds.
    pub fn experts_held(&self) -> Vec<usize> {
        self.arenas
            .iter()
            .map(|a| a.layers.iter().map(BTreeMap::len).sum())
            .collect()
    }

    /// The weights of `expert` of `layer` that `device` holds (a GPU model uploads them from
    /// here); `None` when the placement puts no slot of it there.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // only the CUDA model reads it
    pub(crate) fn held_expert(
        &self,
        device: usize,
        layer: usize,
        expert: ExpertId,
    ) -> Option<&Expert> {
        self.arenas.get(device)?.layers.get(layer)?.get(&expert.0)
    }

    /// Where the pairs of `layer` go.
    pub(crate) fn slot_map(&self, layer: usize) -> SlotMap<'_> {
        SlotMap::Placed {
            placement: &self.placement,
            layer,
        }
    }

    /// Sends a dispatched layer's work to the devices; outputs are indexed by device.
    pub(crate) fn run(&self, layer: usize, work: Vec<DeviceWork>) -> Vec<DeviceOutput> {
        let compute = |device: usize, work: &DeviceWork| {
            compute_segments(work, |s| self.arenas[device].expert(layer, s.expert))
        };
        self.exchange.run(work, &compute)
    }
}

fn invalid(message: String) -> ModelError {
    ModelError::ExpertParallel { message }
}

fn check_fit(
    layers: &[&SparseMoe],
    placement: &ExpertPlacement,
    exchange: &dyn AllToAll,
) -> Result<()> {
    if placement.num_layers() != layers.len() {
        return Err(invalid(format!(
            "the placement has {} layers but the model has {} MoE layers",
            placement.num_layers(),
            layers.len()
        )));
    }
    if let Some(moe) = layers.first()
        && moe.num_experts() != placement.num_experts()
    {
        return Err(invalid(format!(
            "the placement has {} experts per layer but the model has {}",
            placement.num_experts(),
            moe.num_experts()
        )));
    }
    if exchange.num_devices() != placement.num_devices() {
        return Err(invalid(format!(
            "the placement spans {} devices but {} device workers run",
            placement.num_devices(),
            exchange.num_devices()
        )));
    }
    Ok(())
}

/// Per device, the experts its slots hold, layer by layer; returns the arenas and the bytes
/// copied. Without `previous`, an expert's first slot references the loaded weights.
fn build_arenas(
    layers: &[&SparseMoe],
    placement: &ExpertPlacement,
    previous: Option<&[ExpertArena]>,
) -> Result<(Vec<ExpertArena>, u64)> {
    let mut arenas = vec![ExpertArena::default(); placement.num_devices()];
    let mut copied = 0u64;
    for (l, moe) in layers.iter().enumerate() {
        arenas
            .iter_mut()
            .for_each(|a| a.layers.push(BTreeMap::new()));
        let slots = placement.layer(l);
        for (slot, (e, d)) in slots
            .physical_to_logical
            .iter()
            .zip(&slots.physical_to_device)
            .enumerate()
        {
            let (device, expert) = (d.0 as usize, e.0);
            if arenas[device].layers[l].contains_key(&expert) {
                continue;
            }
            let held = previous.and_then(|p| p.get(device)?.layers.get(l)?.get(&expert));
            let weights = match held {
                Some(w) => w.clone(),
                None if previous.is_none() && placement.logical_to_physical(l, *e)[0] == slot => {
                    moe.experts[expert as usize].clone()
                }
                None => {
                    let source = &moe.experts[expert as usize];
                    copied += source.size_in_bytes() as u64;
                    source.deep_copy()
                }
            };
            arenas[device].layers[l].insert(expert, weights);
        }
    }
    Ok((arenas, copied))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::moe::experts::tests::layer;
    use crate::moe::parallel::InProcessAllToAll;
    use moeserve_core::{DeviceId, LayerPlacement};

    fn exchange(devices: usize) -> Arc<dyn AllToAll> {
        Arc::new(InProcessAllToAll::new(devices, devices).unwrap())
    }

    fn same_bytes(a: &Expert, b: &Expert) -> bool {
        a.w1.as_bytes().as_ptr() == b.w1.as_bytes().as_ptr()
    }

    #[test]
    fn first_slots_reference_the_loaded_weights_and_replicas_are_copies() {
        let layers = [layer(4, 2), layer(4, 2)];
        let refs: Vec<&SparseMoe> = layers.iter().collect();
        let placement = ExpertPlacement::round_robin(2, 4, 2, 2).unwrap();
        let ep = ExpertParallel::new(&refs, placement, exchange(2)).unwrap();
        let expert_bytes = layers[0].experts[0].size_in_bytes() as u64;
        // Two replicas per layer, each a copy on the other device.
        assert_eq!(ep.bytes_copied(), 4 * expert_bytes);
        assert_eq!(ep.experts_held(), vec![6, 6]);
        let home = ep.arenas[0].expert(1, ExpertId(0));
        assert!(same_bytes(home, &layers[1].experts[0]));
        let replica = ep.arenas[1].expert(1, ExpertId(0));
        assert!(!same_bytes(replica, &layers[1].experts[0]));
        assert_eq!(replica.w2.as_bytes(), layers[1].experts[0].w2.as_bytes());
    }

    #[test]
    fn replacing_copies_only_experts_new_to_a_device() {
        let layers = [layer(4, 2)];
        let refs: Vec<&SparseMoe> = layers.iter().collect();
        let start = ExpertPlacement::round_robin(1, 4, 2, 0).unwrap(); // 0, 2 | 1, 3
        let ep = ExpertParallel::new(&refs, start, exchange(2)).unwrap();
        assert_eq!(ep.bytes_copied(), 0);
        // Swap experts 2 and 3 between the devices and replicate 0 onto device 1.
        let moved = LayerPlacement {
            physical_to_logical: [0, 3, 1, 2, 0].map(ExpertId).to_vec(),
            physical_to_device: [0, 0, 1, 1, 1].map(DeviceId).to_vec(),
        };
        let next = ExpertPlacement::new(2, 4, vec![moved]).unwrap();
        let replaced = ep.replace(&refs, next.clone()).unwrap();
        let expert_bytes = layers[0].experts[0].size_in_bytes() as u64;
        assert_eq!(replaced.bytes_copied(), 3 * expert_bytes);
        assert_eq!(replaced.placement(), &next);
        let kept = replaced.arenas[0].expert(0, ExpertId(0));
        assert!(same_bytes(kept, ep.arenas[0].expert(0, ExpertId(0))));
    }

    #[test]
    fn placements_that_do_not_fit_are_refused() {
        let layers = [layer(4, 2)];
        let refs: Vec<&SparseMoe> = layers.iter().collect();
        let message =
            |p: ExpertPlacement, devices| match ExpertParallel::new(&refs, p, exchange(devices)) {
                Err(ModelError::ExpertParallel { message }) => message,
                Err(other) => panic!("unexpected error {other}"),
                Ok(_) => panic!("a mismatch was accepted"),
            };
        let two_layers = ExpertPlacement::round_robin(2, 4, 1, 0).unwrap();
        assert!(message(two_layers, 1).contains("2 layers"));
        let six_experts = ExpertPlacement::round_robin(1, 6, 1, 0).unwrap();
        assert!(message(six_experts, 1).contains("6 experts"));
        let two_devices = ExpertPlacement::round_robin(1, 4, 2, 0).unwrap();
        assert!(message(two_devices, 3).contains("3 device workers"));
    }
}
