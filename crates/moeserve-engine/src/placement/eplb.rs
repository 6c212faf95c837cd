//! Online expert re-placement after DeepSeek's EPLB (`eplb.py`, the global policy): per layer,
//! replicate the heaviest experts into the redundant slots by load / replica count, then pack
//! the slots onto devices with greedy largest-first balanced packing, equal slots per device.
//! Whether a plan is worth its weight copies is `rebalance.rs`'s call.

use std::collections::BTreeSet;

use moeserve_core::{DeviceId, ExpertId, ExpertPlacement, LayerPlacement, PlacementError};

use super::load::WindowedLoad;

/// A placement for `num_devices` devices with `num_physical_per_layer` slots per layer
/// (`num_experts + --num-redundant-experts`) that balances `load`.
///
/// Device `d` gets slots `d * S..(d + 1) * S`, `S = num_physical_per_layer / num_devices`,
/// holding its experts in ascending logical order. Ties (equal loads) go to the lower expert
/// and the lower device, so the plan is a pure function of its inputs.
pub fn plan(
    load: &WindowedLoad,
    num_devices: usize,
    num_physical_per_layer: usize,
) -> Result<ExpertPlacement, PlacementError> {
    let num_experts = load.num_experts();
    let invalid = |message: String| PlacementError::Invalid {
        origin: "(EPLB plan)".to_string(),
        message,
    };
    if num_devices == 0 || !num_physical_per_layer.is_multiple_of(num_devices) {
        return Err(invalid(format!(
            "{num_physical_per_layer} slots per layer do not split evenly over {num_devices} devices"
        )));
    }
    if num_physical_per_layer < num_experts {
        return Err(invalid(format!(
            "{num_physical_per_layer} slots per layer cannot hold {num_experts} experts"
        )));
    }
    let layers = (0..load.num_layers())
        .map(|l| plan_layer(load.layer(l), num_devices, num_physical_per_layer))
        .collect();
    ExpertPlacement::new(num_devices, num_experts, layers)
}

fn plan_layer(loads: &[u64], num_devices: usize, num_physical: usize) -> LayerPlacement {
    let replicas = replicate(loads, num_physical);
    // One item per slot: (expert, weight = its load / its replicas).
    let slots: Vec<(usize, f64)> = replicas
        .iter()
        .enumerate()
        .flat_map(|(e, r)| std::iter::repeat_n((e, loads[e] as f64 / *r as f64), *r))
        .collect();
    let weights: Vec<f64> = slots.iter().map(|(_, w)| *w).collect();
    let device_of_slot = balanced_packing(&weights, num_devices);
    let mut per_device: Vec<Vec<u32>> = vec![Vec::new(); num_devices];
    for ((e, _), d) in slots.iter().zip(device_of_slot) {
        per_device[d].push(*e as u32);
    }
    let mut layer = LayerPlacement {
        physical_to_logical: Vec::with_capacity(num_physical),
        physical_to_device: Vec::with_capacity(num_physical),
    };
    for (d, mut experts) in per_device.into_iter().enumerate() {
        experts.sort_unstable();
        layer
            .physical_to_device
            .extend(std::iter::repeat_n(DeviceId(d as u32), experts.len()));
        layer
            .physical_to_logical
            .extend(experts.into_iter().map(ExpertId));
    }
    layer
}

/// Replica count per expert: one each, then each extra slot to the expert with the highest
/// load / replicas (compared exactly as cross products); ties go to the expert with fewer
/// replicas, then the lower index, so idle experts share the slots.
fn replicate(loads: &[u64], num_physical: usize) -> Vec<usize> {
    let mut replicas = vec![1usize; loads.len()];
    for _ in loads.len()..num_physical {
        let mut best = 0;
        for e in 1..loads.len() {
            let a = u128::from(loads[e]) * replicas[best] as u128;
            let b = u128::from(loads[best]) * replicas[e] as u128;
            if a > b || (a == b && replicas[e] < replicas[best]) {
                best = e;
            }
        }
        replicas[best] += 1;
    }
    replicas
}

/// Device of each item: heaviest first (stable: ties keep item order) onto the least loaded
/// device that still has room for `items / num_devices` items (ties to the lower device).
fn balanced_packing(weights: &[f64], num_devices: usize) -> Vec<usize> {
    let per_device = weights.len() / num_devices;
    let mut order: Vec<usize> = (0..weights.len()).collect();
    order.sort_by(|a, b| weights[*b].total_cmp(&weights[*a]));
    let (mut load, mut count) = (vec![0.0f64; num_devices], vec![0usize; num_devices]);
    let mut device_of = vec![0; weights.len()];
    for item in order {
        let d = (0..num_devices)
            .filter(|d| count[*d] < per_device)
            .min_by(|a, b| load[*a].total_cmp(&load[*b]))
            .expect("items == per_device * num_devices, so a device has room");
        load[d] += weights[item];
        count[d] += 1;
        device_of[item] = d;
    }
    device_of
}

/// Bytes copied to go from `old` to `new`: per layer and device, each logical expert `new`
/// hosts there that `old` did not costs `expert_bytes` (one copy, however many replicas; moves
/// within a device are free). Layers only in `new` count in full.
pub fn bytes_to_move(old: &ExpertPlacement, new: &ExpertPlacement, expert_bytes: u64) -> u64 {
    let hosted = |p: &ExpertPlacement, layer: usize| -> BTreeSet<(DeviceId, ExpertId)> {
        let l = p.layer(layer);
        l.physical_to_device
            .iter()
            .copied()
            .zip(l.physical_to_logical.iter().copied())
            .collect()
    };
    let copies: usize = (0..new.num_layers())
        .map(|layer| {
            let before = if layer < old.num_layers() {
                hosted(old, layer)
            } else {
                BTreeSet::new()
            };
            hosted(new, layer).difference(&before).count()
        })
        .sum();
    copies as u64 * expert_bytes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::load::step_imbalance;

    fn one_layer(loads: &[u64]) -> WindowedLoad {
        WindowedLoad {
            num_steps: 1,
            loads: vec![loads.to_vec()],
        }
    }

    fn slots_per_device(p: &ExpertPlacement, layer: usize) -> Vec<usize> {
        let mut count = vec![0; p.num_devices()];
        p.physical_to_device(layer)
            .iter()
            .for_each(|d| count[d.0 as usize] += 1);
        count
    }

    const ZIPF: [u64; 16] = [
        4000, 2000, 1300, 1000, 800, 660, 570, 500, 440, 400, 360, 330, 300, 280, 260, 250,
    ];

    #[test]
    fn skewed_load_is_brought_under_the_threshold() {
        let load = WindowedLoad {
            num_steps: 8,
            loads: vec![ZIPF.to_vec(), ZIPF.iter().rev().copied().collect()],
        };
        let before = step_imbalance(&load, &ExpertPlacement::round_robin(2, 16, 4, 0).unwrap());
        let planned = plan(&load, 4, 20).unwrap();
        let after = step_imbalance(&load, &planned);
        assert!(before > 1.5, "round robin imbalance {before}");
        assert!(after <= 1.25, "{after}");
        assert!(after < 1.1, "{after}");
    }

    #[test]
    fn packing_keeps_equal_slots_per_device() {
        let mut state = 11u64;
        for round in 0..20 {
            let loads: Vec<u64> = (0..8)
                .map(|_| {
                    state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
                    (state >> 50) % (1 + round * 100)
                })
                .collect();
            let p = plan(&one_layer(&loads), 4, 12).unwrap();
            assert_eq!(slots_per_device(&p, 0), vec![3; 4]);
            assert_eq!(p.num_physical(0), 12);
        }
    }

    #[test]
    fn the_hottest_expert_gets_the_replicas_on_several_devices() {
        let p = plan(&one_layer(&[100, 1, 1, 1, 1, 1, 1, 1]), 2, 10).unwrap();
        assert_eq!(p.num_replicas(0, ExpertId(0)), 3);
        let devices: BTreeSet<DeviceId> = p
            .logical_to_physical(0, ExpertId(0))
            .iter()
            .map(|s| p.device_of(0, *s))
            .collect();
        assert_eq!(devices.len(), 2);
        assert!((1..8).all(|e| p.num_replicas(0, ExpertId(e)) == 1));
    }

    #[test]
    fn replicas_follow_load_per_replica() {
        // 90/3 = 30 beats 50/2 = 25, so expert 0 gets two extra slots and expert 1 one.
        assert_eq!(replicate(&[90, 50, 10, 10], 7), vec![3, 2, 1, 1]);
        // Equal per-replica loads: fewer replicas first, then the lower expert.
        assert_eq!(replicate(&[0, 0, 0], 5), vec![2, 2, 1]);
        assert_eq!(replicate(&[2, 1], 4), vec![2, 2]);
    }

    #[test]
    fn idle_layers_still_get_a_valid_even_plan() {
        let load = WindowedLoad {
            num_steps: 0,
            loads: vec![vec![0; 6]; 3],
        };
        let p = plan(&load, 2, 8).unwrap();
        assert_eq!(p.num_layers(), 3);
        assert_eq!(slots_per_device(&p, 2), vec![4, 4]);
        assert_eq!(step_imbalance(&load, &p), 1.0);
    }

    #[test]
    fn plan_is_deterministic_and_sorted_within_devices() {
        let load = one_layer(&ZIPF);
        let (a, b) = (plan(&load, 4, 20).unwrap(), plan(&load, 4, 20).unwrap());
        assert_eq!(a, b);
        for chunk in a.physical_to_logical(0).chunks(5) {
            assert!(chunk.windows(2).all(|w| w[0] <= w[1]));
        }
    }

    #[test]
    fn impossible_shapes_are_refused() {
        let load = one_layer(&[1; 8]);
        assert!(
            plan(&load, 3, 8)
                .unwrap_err()
                .to_string()
                .contains("3 devices")
        );
        assert!(
            plan(&load, 2, 6)
                .unwrap_err()
                .to_string()
                .contains("8 experts")
        );
        assert!(plan(&load, 0, 8).is_err());
    }

    #[test]
    fn bytes_to_move_counts_new_experts_per_device() {
        let old = ExpertPlacement::round_robin(2, 4, 2, 0).unwrap();
        assert_eq!(bytes_to_move(&old, &old, 100), 0);
        // Layer 0 swaps experts 0 and 1 between the devices: two copies.
        let swapped = LayerPlacement {
            physical_to_logical: [1, 0, 2, 3].map(ExpertId).to_vec(),
            physical_to_device: [0, 1, 0, 1].map(DeviceId).to_vec(),
        };
        let new = ExpertPlacement::new(2, 4, vec![swapped, old.layer(1).clone()]).unwrap();
        assert_eq!(bytes_to_move(&old, &new, 100), 200);
        // A layer the old placement lacks is copied in full.
        let three = ExpertPlacement::round_robin(3, 4, 2, 0).unwrap();
        assert_eq!(bytes_to_move(&old, &three, 100), 400);
    }
}
