//! The engine's MoE runtime (the MoE core issue): what the step loop does around each forward
//! pass's MoE layers.
//!
//! - Before the forward: routing capacity (`--capacity-factor`, `--moe-overflow`) and, with
//!   expert parallelism, the current `ExpertParallel` (placement + device arenas).
//! - After it: per (layer, expert) loads into the `LoadTracker` (`--load-window`), per-device
//!   pairs and compute time, routing totals per layer, the `--record-routing` trace, and the
//!   online re-placement (`rebalancer.rs`).
//! - Reports: `MoeStats` snapshots and per-request `MoeRequestCounts` (`stats.rs`).

mod rebalancer;
pub mod stats;

use std::fs::File;
use std::io::BufWriter;
use std::ops::Range;
use std::sync::Arc;

use moeserve_core::{DeviceId, ExpertMetrics, ExpertPlacement, MoeConfig, PlacementError};
use moeserve_model::models::MoeModel;
use moeserve_model::moe::{
    Capacity, ExpertParallel, InProcessAllToAll, MoeOptions, MoeStepRecord, RoutingCounts,
};

use crate::assets::ModelAssets;
use crate::placement::{LoadTracker, RoutingTraceRecord, RoutingTraceWriter, step_imbalance};
use crate::{EngineError, Result};
use rebalancer::{Rebalancer, SlotShape, StepView};
pub use stats::{DeviceMoeStats, LayerMoeStats, MoeRequestCounts, MoeStats};

/// Weight of the newest step in the smoothed expert seconds per step.
const SECONDS_SMOOTHING: f64 = 0.1;

/// MoE state of one engine; see the module docs.
pub struct MoeRuntime {
    config: MoeConfig,
    capacity: Capacity,
    top_k: usize,
    /// `None`: the model's own experts on the engine's threads.
    experts: Option<Arc<ExpertParallel>>,
    /// The placement serving now (one device holding every expert without parallelism).
    placement: ExpertPlacement,
    tracker: LoadTracker,
    /// `[num_layers]`
    layer_totals: Vec<RoutingCounts>,
    trace: Option<RoutingTraceWriter<BufWriter<File>>>,
    trace_error: Option<String>,
    rebalancer: Option<Rebalancer>,
    expert_seconds_per_step: f64,
}

impl MoeRuntime {
    /// Checks `config` against `model`, loads or deals the placement, builds the device
    /// arenas and opens the routing trace.
    pub fn new(model: &MoeModel, config: &MoeConfig) -> Result<Self> {
        config
            .validate()
            .map_err(crate::engine_core::config_error)?;
        let c = model.config();
        let (num_layers, num_experts) = (c.num_moe_layers(), c.num_local_experts);
        let shape = SlotShape {
            num_devices: config.expert_parallel_size,
            num_physical: num_experts + config.num_redundant_experts,
            expert_bytes: model
                .moe_layers()
                .first()
                .and_then(|l| l.experts.first())
                .map_or(0, |e| e.size_in_bytes() as u64),
        };
        if config.rebalancing_enabled() && !shape.num_physical.is_multiple_of(shape.num_devices) {
            return Err(EngineError::InvalidRequest {
                field: "expert_parallel_size",
                message: format!(
                    "online re-placement needs the {} slots per layer (experts + redundant) to \
                     split evenly over {} devices; change --num-redundant-experts or set \
                     --rebalance-interval 0",
                    shape.num_physical, shape.num_devices
                ),
            });
        }
        let (experts, placement) = if config.uses_expert_parallelism() {
            let placement = initial_placement(config, num_layers, num_experts)?;
            let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
            let exchange = Arc::new(InProcessAllToAll::new(shape.num_devices, threads)?);
            let ep = ExpertParallel::new(&model.moe_layers(), placement.clone(), exchange)?;
            (Some(Arc::new(ep)), placement)
        } else {
            (
                None,
                ExpertPlacement::round_robin(num_layers, num_experts, 1, 0)?,
            )
        };
        let trace = match &config.record_routing {
            Some(path) => Some(RoutingTraceWriter::create(path)?),
            None => None,
        };
        Ok(MoeRuntime {
            capacity: Capacity::from_factor(config.capacity_factor, config.moe_overflow),
            top_k: c.num_experts_per_tok,
            experts,
            placement,
            tracker: LoadTracker::new(num_layers, num_experts, config.load_window),
            layer_totals: vec![RoutingCounts::default(); num_layers],
            trace,
            trace_error: None,
            rebalancer: config
                .rebalancing_enabled()
                .then(|| Rebalancer::new(config, shape)),
            expert_seconds_per_step: 0.0,
            config: config.clone(),
        })
    }

    /// The MoE options of the next forward pass; `record` receives its layers.
    pub fn options<'a>(&'a self, record: &'a mut MoeStepRecord) -> MoeOptions<'a> {
        MoeOptions {
            capacity: self.capacity,
            experts: self.experts.as_deref(),
            record: Some(record),
        }
    }

    /// Whether requests get `MoeRequestCounts` (a capacity factor is set).
    pub fn counts_requests(&self) -> bool {
        self.capacity != Capacity::Dropless
    }

    /// What the step did to the request whose step tokens are `tokens`.
    pub fn request_step_counts(
        &self,
        record: &MoeStepRecord,
        tokens: Range<usize>,
    ) -> MoeRequestCounts {
        let routed = (tokens.len() * self.top_k * record.layers.len()) as u64;
        let mut counts = MoeRequestCounts::default();
        counts.add(routed, &record.pair_counts(tokens));
        counts
    }

    /// Books a finished step (`step` numbers them from 0): loads, totals, device figures and
    /// the trace; then swaps in a finished re-placement or considers starting one.
    pub fn finish_step(&mut self, step: u64, record: &MoeStepRecord, assets: &Arc<ModelAssets>) {
        let mut slowest_sum = 0.0;
        for (l, layer) in record.layers.iter().enumerate() {
            self.tracker.record_step(l, &layer.expert_load);
            self.layer_totals[l].accumulate(&layer.counts);
            for (d, (pairs, seconds)) in layer
                .device_pairs
                .iter()
                .zip(&layer.device_seconds)
                .enumerate()
            {
                self.tracker
                    .record_device_tokens(DeviceId(d as u32), *pairs);
                self.tracker
                    .record_device_time(DeviceId(d as u32), *seconds);
            }
            slowest_sum += layer.device_seconds.iter().copied().fold(0.0, f64::max);
        }
        self.expert_seconds_per_step = if step == 0 {
            slowest_sum
        } else {
            SECONDS_SMOOTHING * slowest_sum
                + (1.0 - SECONDS_SMOOTHING) * self.expert_seconds_per_step
        };
        self.write_trace(step, record);
        self.rebalance(step, assets);
    }

    fn write_trace(&mut self, step: u64, record: &MoeStepRecord) {
        let Some(writer) = self.trace.as_mut() else {
            return;
        };
        let written = record.layers.iter().enumerate().try_for_each(|(layer, l)| {
            writer.write_record(&RoutingTraceRecord {
                step,
                layer,
                num_tokens: l.num_tokens(),
                experts: l.chosen_by_token().map(<[u32]>::to_vec).collect(),
            })
        });
        if let Err(e) = written.and_then(|()| writer.flush()) {
            // Recording is a side channel: stop it, keep serving, report the error.
            self.trace = None;
            self.trace_error = Some(e.to_string());
        }
    }

    fn rebalance(&mut self, step: u64, assets: &Arc<ModelAssets>) {
        let (Some(rebalancer), Some(current)) = (self.rebalancer.as_mut(), self.experts.as_ref())
        else {
            return;
        };
        if let Some(replaced) = rebalancer.poll(step) {
            self.placement = replaced.placement().clone();
            self.experts = Some(Arc::new(replaced));
            rebalancer.observe(step, &self.tracker, &self.placement);
            return;
        }
        rebalancer.observe(step, &self.tracker, &self.placement);
        let view = StepView {
            step,
            tracker: &self.tracker,
            expert_seconds_per_step: self.expert_seconds_per_step,
        };
        rebalancer.consider(&view, current, assets);
    }

    /// The placement serving now.
    pub fn placement(&self) -> &ExpertPlacement {
        &self.placement
    }

    pub fn tracker(&self) -> &LoadTracker {
        &self.tracker
    }

    /// A snapshot for metrics and load reports.
    pub fn snapshot(&self) -> MoeStats {
        let full = self.config.expert_metrics == ExpertMetrics::Full;
        let layers = self
            .layer_totals
            .iter()
            .enumerate()
            .map(|(l, t)| LayerMoeStats {
                pairs: t.pairs,
                dropped: t.dropped,
                rerouted: t.rerouted,
                spilled: t.spilled,
                dropped_tokens: t.dropped_tokens,
                shared_expert_tokens: t.shared_expert_tokens,
                windowed_imbalance: self.tracker.imbalance(&self.placement, l),
                windowed_load: if full {
                    self.tracker.windowed_load(l).to_vec()
                } else {
                    Vec::new()
                },
                cumulative_load: if full {
                    self.tracker.cumulative_load(l).to_vec()
                } else {
                    Vec::new()
                },
            })
            .collect();
        let held = self.experts.as_ref().map(|ep| ep.experts_held());
        let devices = (0..self.placement.num_devices())
            .map(|d| {
                let totals = self
                    .tracker
                    .device_totals()
                    .get(d)
                    .copied()
                    .unwrap_or_default();
                DeviceMoeStats {
                    tokens: totals.tokens,
                    compute_seconds: totals.compute_seconds,
                    experts_held: held.as_ref().map_or(
                        self.placement.num_physical(0) * self.placement.num_layers(),
                        |h| h[d],
                    ),
                }
            })
            .collect();
        let r = self.rebalancer.as_ref();
        let rebalances = r.map(Rebalancer::records).unwrap_or_default();
        MoeStats {
            capacity_factor: self.config.capacity_factor,
            moe_overflow: self.config.moe_overflow,
            expert_metrics: self.config.expert_metrics,
            num_layers: self.tracker.num_layers(),
            num_experts: self.tracker.num_experts(),
            top_k: self.top_k,
            expert_parallel_size: self.placement.num_devices(),
            load_window: self.tracker.window_steps(),
            steps_in_window: self.tracker.windowed().num_steps,
            layers,
            step_imbalance: step_imbalance(&self.tracker.windowed(), &self.placement),
            devices,
            num_physical_experts: self.placement.num_physical(0),
            placement: Some(self.placement.clone()),
            num_rebalances: r.map_or(0, |r| r.num_rebalances),
            last_rebalance_gain_ratio: rebalances
                .last()
                .map(|last| last.imbalance_before / last.predicted_imbalance),
            rebalance_in_progress: r.is_some_and(Rebalancer::in_progress),
            num_rebalance_failures: r.map_or(0, |r| r.num_failures),
            last_rebalance_error: r.and_then(|r| r.last_error.clone()),
            rebalances,
            routing_trace_error: self.trace_error.clone(),
        }
    }
}

/// `--expert-placement FILE` checked against the model and the flags, or round-robin.
fn initial_placement(
    config: &MoeConfig,
    num_layers: usize,
    num_experts: usize,
) -> Result<ExpertPlacement> {
    let (devices, redundant) = (config.expert_parallel_size, config.num_redundant_experts);
    let Some(path) = &config.expert_placement else {
        return Ok(ExpertPlacement::round_robin(
            num_layers,
            num_experts,
            devices,
            redundant,
        )?);
    };
    let placement = ExpertPlacement::from_json_file(path)?;
    let invalid = |message: String| PlacementError::Invalid {
        origin: path.display().to_string(),
        message,
    };
    if placement.num_devices() != devices {
        return Err(invalid(format!(
            "it spans {} devices but --expert-parallel-size is {devices}",
            placement.num_devices()
        ))
        .into());
    }
    if placement.num_layers() != num_layers || placement.num_experts() != num_experts {
        return Err(invalid(format!(
            "it places {} layers of {} experts but the model has {num_layers} layers of {num_experts}",
            placement.num_layers(),
            placement.num_experts()
        ))
        .into());
    }
    let slots = num_experts + redundant;
    if let Some(l) = (0..num_layers).find(|l| placement.num_physical(*l) != slots) {
        return Err(invalid(format!(
            "layer {l} has {} slots but experts + --num-redundant-experts = {slots}",
            placement.num_physical(l)
        ))
        .into());
    }
    Ok(placement)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn placement_file(name: &str, placement: &ExpertPlacement) -> std::path::PathBuf {
        let path = std::env::temp_dir().join(format!("moe-{}-{name}.json", std::process::id()));
        placement.write_json_file(&path).unwrap();
        path
    }

    fn config(path: &std::path::Path, devices: usize, redundant: usize) -> MoeConfig {
        MoeConfig {
            expert_parallel_size: devices,
            num_redundant_experts: redundant,
            expert_placement: Some(path.to_path_buf()),
            ..Default::default()
        }
    }

    fn error_of(result: Result<ExpertPlacement>) -> String {
        result.expect_err("a mismatch").to_string()
    }

    #[test]
    fn a_matching_placement_file_is_used_as_is() {
        let p = ExpertPlacement::round_robin(3, 4, 2, 2).unwrap();
        let path = placement_file("ok", &p);
        let loaded = initial_placement(&config(&path, 2, 2), 3, 4);
        std::fs::remove_file(&path).unwrap();
        assert_eq!(loaded.unwrap(), p);
    }

    #[test]
    fn placement_file_mismatches_name_the_file_and_the_setting() {
        let p = ExpertPlacement::round_robin(3, 4, 2, 2).unwrap();
        let path = placement_file("bad", &p);
        let devices = error_of(initial_placement(&config(&path, 4, 2), 3, 4));
        let layers = error_of(initial_placement(&config(&path, 2, 2), 5, 4));
        let slots = error_of(initial_placement(&config(&path, 2, 0), 3, 4));
        std::fs::remove_file(&path).unwrap();
        let file = path.display().to_string();
        assert!(devices.contains(&file) && devices.contains("--expert-parallel-size is 4"));
        assert!(layers.contains("model has 5 layers of 4"), "{layers}");
        assert!(slots.contains("layer 0 has 6 slots"), "{slots}");
    }

    #[test]
    fn without_a_file_slots_are_dealt_round_robin() {
        let c = MoeConfig {
            expert_parallel_size: 2,
            num_redundant_experts: 2,
            ..Default::default()
        };
        let p = initial_placement(&c, 2, 6).unwrap();
        assert_eq!(p, ExpertPlacement::round_robin(2, 6, 2, 2).unwrap());
    }
}
