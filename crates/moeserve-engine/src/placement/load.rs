//! Expert load tracking: per (layer, expert) pair counts of every step, over a sliding window
//! (`--load-window` steps) and cumulative; per device tokens and expert-compute time; and the
//! imbalance measure EPLB rebalances against (max device load / mean device load, as in
//! DeepSeek's EPLB and SGLang's expert distribution recorder).

use moeserve_core::{DeviceId, ExpertId, ExpertPlacement};

/// Windowed per-(layer, expert) loads: what EPLB plans from.
#[derive(Clone, Debug, PartialEq)]
pub struct WindowedLoad {
    /// Steps summed: the fewest any layer has recorded, at most the window.
    pub num_steps: usize,
    /// `[num_layers][num_experts]`: pairs computed in the window.
    pub loads: Vec<Vec<u64>>,
}

impl WindowedLoad {
    pub fn num_layers(&self) -> usize {
        self.loads.len()
    }

    pub fn num_experts(&self) -> usize {
        self.loads.first().map_or(0, Vec::len)
    }

    pub fn layer(&self, layer: usize) -> &[u64] {
        &self.loads[layer]
    }
}

/// Totals of one device since start-up.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct DeviceTotals {
    /// (token, expert) pairs the device computed.
    pub tokens: u64,
    /// Seconds the device spent in expert compute.
    pub compute_seconds: f64,
}

/// One layer's ring of the last `window_steps` steps.
#[derive(Clone, Debug)]
struct LayerLoad {
    /// `[window_steps * num_experts]`, row `next` is the oldest once full.
    ring: Vec<u32>,
    next: usize,
    filled: usize,
    windowed: Vec<u64>,
    cumulative: Vec<u64>,
}

/// Loads of every MoE layer; the engine calls `record_step` once per layer per step.
#[derive(Clone, Debug)]
pub struct LoadTracker {
    num_experts: usize,
    window_steps: usize,
    layers: Vec<LayerLoad>,
    /// Indexed by device id; grows as devices report.
    devices: Vec<DeviceTotals>,
}

impl LoadTracker {
    /// A window of 0 steps is taken as 1 (the last step only).
    pub fn new(num_layers: usize, num_experts: usize, window_steps: usize) -> Self {
        let window_steps = window_steps.max(1);
        let layer = LayerLoad {
            ring: vec![0; window_steps * num_experts],
            next: 0,
            filled: 0,
            windowed: vec![0; num_experts],
            cumulative: vec![0; num_experts],
        };
        LoadTracker {
            num_experts,
            window_steps,
            layers: vec![layer; num_layers],
            devices: Vec::new(),
        }
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    pub fn num_experts(&self) -> usize {
        self.num_experts
    }

    pub fn window_steps(&self) -> usize {
        self.window_steps
    }

    /// Records one step of `layer`: `expert_load[e]` pairs computed by expert `e`
    /// (`RoutedStep::expert_load`). The oldest step leaves the window once it is full.
    ///
    /// # Panics
    /// If `layer` is out of range or `expert_load` is not `num_experts` long (a wiring bug).
    pub fn record_step(&mut self, layer: usize, expert_load: &[u32]) {
        assert_eq!(
            expert_load.len(),
            self.num_experts,
            "expert_load per expert"
        );
        let n = self.num_experts;
        let state = &mut self.layers[layer];
        let row = &mut state.ring[state.next * n..(state.next + 1) * n];
        for (e, (old, new)) in row.iter_mut().zip(expert_load).enumerate() {
            state.windowed[e] = state.windowed[e] - u64::from(*old) + u64::from(*new);
            state.cumulative[e] += u64::from(*new);
            *old = *new;
        }
        state.next = (state.next + 1) % self.window_steps;
        state.filled = (state.filled + 1).min(self.window_steps);
    }

    /// `[num_experts]`: pairs per expert over the last `window_steps` steps of `layer`.
    pub fn windowed_load(&self, layer: usize) -> &[u64] {
        &self.layers[layer].windowed
    }

    /// `[num_experts]`: pairs per expert of `layer` since start-up.
    pub fn cumulative_load(&self, layer: usize) -> &[u64] {
        &self.layers[layer].cumulative
    }

    /// Steps of `layer` in the window (less than `window_steps` until it fills).
    pub fn steps_in_window(&self, layer: usize) -> usize {
        self.layers[layer].filled
    }

    /// A snapshot of all layers' windowed loads.
    pub fn windowed(&self) -> WindowedLoad {
        WindowedLoad {
            num_steps: self.layers.iter().map(|l| l.filled).min().unwrap_or(0),
            loads: self.layers.iter().map(|l| l.windowed.clone()).collect(),
        }
    }

    /// `[num_devices]`: windowed pairs per device of `layer` under `placement`.
    pub fn device_loads(&self, placement: &ExpertPlacement, layer: usize) -> Vec<f64> {
        device_loads(self.windowed_load(layer), placement, layer)
    }

    /// Windowed imbalance of `layer` under `placement`; see `imbalance`.
    pub fn imbalance(&self, placement: &ExpertPlacement, layer: usize) -> f64 {
        imbalance(&self.device_loads(placement, layer))
    }

    /// Adds expert-compute seconds of `device`.
    pub fn record_device_time(&mut self, device: DeviceId, seconds: f64) {
        self.device_mut(device).compute_seconds += seconds;
    }

    /// Adds (token, expert) pairs computed by `device` (see `device_tokens_of_step`).
    pub fn record_device_tokens(&mut self, device: DeviceId, tokens: u64) {
        self.device_mut(device).tokens += tokens;
    }

    /// Indexed by device id; devices that never reported are absent or zero.
    pub fn device_totals(&self) -> &[DeviceTotals] {
        &self.devices
    }

    fn device_mut(&mut self, device: DeviceId) -> &mut DeviceTotals {
        let index = device.0 as usize;
        if self.devices.len() <= index {
            self.devices.resize(index + 1, DeviceTotals::default());
        }
        &mut self.devices[index]
    }
}

/// `[num_devices]`: `expert_loads` (per logical expert of `layer`) spread over devices, each
/// expert's load split evenly across its replicas.
///
/// # Panics
/// If `expert_loads` is not `placement.num_experts()` long.
pub fn device_loads(expert_loads: &[u64], placement: &ExpertPlacement, layer: usize) -> Vec<f64> {
    assert_eq!(
        expert_loads.len(),
        placement.num_experts(),
        "loads per expert"
    );
    let mut devices = vec![0.0; placement.num_devices()];
    for (e, load) in expert_loads.iter().enumerate() {
        let slots = placement.logical_to_physical(layer, ExpertId(e as u32));
        let share = *load as f64 / slots.len() as f64;
        for p in slots {
            devices[placement.device_of(layer, *p).0 as usize] += share;
        }
    }
    devices
}

/// `[num_devices]`: the exact pairs per device of one step, replicas taking turns as
/// `ExpertPlacement::slot_for` assigns them (`expert_load` is `RoutedStep::expert_load`).
pub fn device_tokens_of_step(
    expert_load: &[u32],
    placement: &ExpertPlacement,
    layer: usize,
) -> Vec<u64> {
    let mut devices = vec![0u64; placement.num_devices()];
    for (e, load) in expert_load.iter().map(|l| u64::from(*l)).enumerate() {
        let slots = placement.logical_to_physical(layer, ExpertId(e as u32));
        let (each, extra) = (load / slots.len() as u64, load % slots.len() as u64);
        for (i, p) in slots.iter().enumerate() {
            let tokens = each + u64::from((i as u64) < extra);
            devices[placement.device_of(layer, *p).0 as usize] += tokens;
        }
    }
    devices
}

/// Max device load / mean device load: 1.0 is perfect balance, `num_devices` is everything on
/// one device. With no load at all (or no devices) there is nothing to balance: 1.0.
pub fn imbalance(device_loads: &[f64]) -> f64 {
    let total: f64 = device_loads.iter().sum();
    if device_loads.is_empty() || total <= 0.0 {
        return 1.0;
    }
    let max = device_loads.iter().copied().fold(0.0, f64::max);
    max / (total / device_loads.len() as f64)
}

/// Imbalance of a whole step: Σ_layers max device load / Σ_layers mean device load. Layers
/// run one after another and each waits for its slowest device, so this is the step's expert
/// time over its time under perfect balance. 1.0 without load.
pub fn step_imbalance(load: &WindowedLoad, placement: &ExpertPlacement) -> f64 {
    let (mut max_sum, mut mean_sum) = (0.0, 0.0);
    for layer in 0..load.num_layers() {
        let devices = device_loads(load.layer(layer), placement, layer);
        max_sum += devices.iter().copied().fold(0.0, f64::max);
        mean_sum += devices.iter().sum::<f64>() / devices.len() as f64;
    }
    if mean_sum <= 0.0 {
        1.0
    } else {
        max_sum / mean_sum
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use moeserve_core::{DeviceId as D, ExpertId as E, LayerPlacement};

    fn placement(logical: &[u32], devices: &[u32], num_devices: usize) -> ExpertPlacement {
        let num_experts = *logical.iter().max().expect("non-empty") as usize + 1;
        let layer = LayerPlacement {
            physical_to_logical: logical.iter().map(|e| E(*e)).collect(),
            physical_to_device: devices.iter().map(|d| D(*d)).collect(),
        };
        ExpertPlacement::new(num_devices, num_experts, vec![layer]).unwrap()
    }

    #[test]
    fn window_forgets_old_steps_and_cumulative_keeps_them() {
        let mut t = LoadTracker::new(2, 3, 2);
        t.record_step(0, &[1, 0, 0]);
        t.record_step(0, &[0, 2, 0]);
        assert_eq!(t.windowed_load(0), &[1, 2, 0]);
        t.record_step(0, &[0, 0, 4]);
        assert_eq!(t.windowed_load(0), &[0, 2, 4]);
        assert_eq!(t.cumulative_load(0), &[1, 2, 4]);
        assert_eq!(t.steps_in_window(0), 2);
        assert_eq!(t.windowed_load(1), &[0, 0, 0]);
        let w = t.windowed();
        assert_eq!((w.num_steps, w.num_layers(), w.num_experts()), (0, 2, 3));
    }

    #[test]
    fn zero_window_keeps_the_last_step() {
        let mut t = LoadTracker::new(1, 2, 0);
        t.record_step(0, &[3, 1]);
        t.record_step(0, &[0, 5]);
        assert_eq!((t.window_steps(), t.windowed_load(0)), (1, &[0u64, 5][..]));
    }

    #[test]
    fn replicas_split_windowed_load_evenly() {
        // Expert 0 on devices 0 and 1, expert 1 on device 1.
        let p = placement(&[0, 1, 0], &[0, 1, 1], 2);
        let mut t = LoadTracker::new(1, 2, 4);
        t.record_step(0, &[6, 2]);
        assert_eq!(t.device_loads(&p, 0), vec![3.0, 5.0]);
        assert_eq!(t.imbalance(&p, 0), 5.0 / 4.0);
    }

    #[test]
    fn step_tokens_follow_slot_for_exactly() {
        let p = placement(&[0, 1, 0, 0], &[0, 1, 1, 2], 3);
        let devices = device_tokens_of_step(&[5, 1], &p, 0);
        let mut expected = vec![0u64; 3];
        for i in 0..5 {
            expected[p.device_of(0, p.slot_for(0, E(0), i)).0 as usize] += 1;
        }
        expected[1] += 1;
        assert_eq!(devices, expected);
        assert_eq!(devices, vec![2, 3, 1]);
    }

    #[test]
    fn imbalance_edge_cases() {
        assert_eq!(imbalance(&[4.0, 4.0, 4.0]), 1.0);
        assert_eq!(imbalance(&[0.0, 0.0]), 1.0);
        assert_eq!(imbalance(&[]), 1.0);
        assert_eq!(imbalance(&[8.0, 0.0, 0.0, 0.0]), 4.0);
        assert_eq!(imbalance(&[3.0, 1.0]), 1.5);
    }

    #[test]
    fn step_imbalance_weighs_layers_by_their_load() {
        let p = ExpertPlacement::round_robin(2, 2, 2, 0).unwrap();
        let load = WindowedLoad {
            num_steps: 1,
            loads: vec![vec![10, 10], vec![4, 0]],
        };
        // Layer maxima 10 + 4 over means 10 + 2.
        assert_eq!(step_imbalance(&load, &p), 14.0 / 12.0);
        let idle = WindowedLoad {
            num_steps: 0,
            loads: vec![vec![0, 0]; 2],
        };
        assert_eq!(step_imbalance(&idle, &p), 1.0);
    }

    #[test]
    fn device_totals_grow_as_devices_report() {
        let mut t = LoadTracker::new(1, 1, 1);
        t.record_device_time(D(2), 0.5);
        t.record_device_time(D(2), 0.25);
        t.record_device_tokens(D(0), 7);
        let totals = t.device_totals();
        assert_eq!(totals.len(), 3);
        assert_eq!(totals[2].compute_seconds, 0.75);
        assert_eq!((totals[0].tokens, totals[1]), (7, DeviceTotals::default()));
    }
}
