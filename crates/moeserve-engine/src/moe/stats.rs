//! What the engine reports about its MoE layers: a [`MoeStats`] snapshot for `/metrics` and
//! `GET /v1/moe/load` (routing totals per layer, windowed imbalance, per-device totals, loads
//! per layer × expert, the current placement, re-placements), and [`MoeRequestCounts`], the
//! pairs the capacity limit changed for one request.

use moeserve_core::{ExpertMetrics, ExpertPlacement, OverflowPolicy};
use moeserve_model::moe::TokenPairCounts;
use serde::Serialize;

use crate::placement::RebalanceRecord;

/// One request's (token, expert) pairs over all its steps and layers; set on its output when
/// a capacity factor is configured.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MoeRequestCounts {
    /// Pairs the router chose: tokens run × top_k × MoE layers.
    pub pairs: u64,
    pub dropped: u64,
    pub rerouted: u64,
    pub spilled: u64,
}

impl MoeRequestCounts {
    pub fn accumulate(&mut self, other: &MoeRequestCounts) {
        self.pairs += other.pairs;
        self.dropped += other.dropped;
        self.rerouted += other.rerouted;
        self.spilled += other.spilled;
    }

    /// Adds one step: `tokens × top_k × num_layers` routed pairs and what capacity did.
    pub(crate) fn add(&mut self, pairs: u64, changed: &TokenPairCounts) {
        self.pairs += pairs;
        self.dropped += u64::from(changed.dropped);
        self.rerouted += u64::from(changed.rerouted);
        self.spilled += u64::from(changed.spilled);
    }
}

/// One MoE layer since start-up, plus its windowed load.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct LayerMoeStats {
    pub pairs: u64,
    pub dropped: u64,
    pub rerouted: u64,
    pub spilled: u64,
    /// Tokens that lost every pair (their MoE output was zero).
    pub dropped_tokens: u64,
    /// Tokens through the layer's shared expert (never capacity-limited; not in `pairs`).
    pub shared_expert_tokens: u64,
    /// Max / mean device load over the window under the current placement (1 = balanced).
    pub windowed_imbalance: f64,
    /// `[num_experts]`: pairs per expert in the window; empty with `--expert-metrics off`.
    pub windowed_load: Vec<u64>,
    /// `[num_experts]`: pairs per expert since start-up; empty with `--expert-metrics off`.
    pub cumulative_load: Vec<u64>,
}

/// One device since start-up.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct DeviceMoeStats {
    /// (token, expert) pairs it computed.
    pub tokens: u64,
    /// Seconds it spent in expert compute.
    pub compute_seconds: f64,
    /// (layer, expert) weight sets in its arena.
    pub experts_held: usize,
}

/// A snapshot of the MoE state; cheap enough to take after every step.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct MoeStats {
    /// `None` = dropless.
    pub capacity_factor: Option<f32>,
    pub moe_overflow: OverflowPolicy,
    pub expert_metrics: ExpertMetrics,
    pub num_layers: usize,
    pub num_experts: usize,
    pub top_k: usize,
    pub expert_parallel_size: usize,
    pub load_window: usize,
    /// Steps in the window so far (up to `load_window`).
    pub steps_in_window: usize,
    /// `[num_layers]`
    pub layers: Vec<LayerMoeStats>,
    /// Windowed imbalance of whole steps: Σ layer maxima / Σ layer means (see `step_imbalance`).
    pub step_imbalance: f64,
    /// `[expert_parallel_size]`
    pub devices: Vec<DeviceMoeStats>,
    /// Slots per layer (experts + redundant).
    pub num_physical_experts: usize,
    /// The placement serving now (JSON as `--expert-placement` reads it).
    pub placement: Option<ExpertPlacement>,
    pub num_rebalances: u64,
    /// `imbalance_before / predicted_imbalance` of the last re-placement (> 1 is better).
    pub last_rebalance_gain_ratio: Option<f64>,
    /// A re-placement is copying weights in the background.
    pub rebalance_in_progress: bool,
    pub num_rebalance_failures: u64,
    pub last_rebalance_error: Option<String>,
    /// The latest re-placements, oldest first.
    pub rebalances: Vec<RebalanceRecord>,
    /// Set once writing `--record-routing` failed (recording then stops; serving goes on).
    pub routing_trace_error: Option<String>,
}

impl MoeStats {
    /// Pairs of all layers together.
    pub fn total_pairs(&self) -> (u64, u64, u64, u64) {
        self.layers.iter().fold((0, 0, 0, 0), |t, l| {
            (
                t.0 + l.pairs,
                t.1 + l.dropped,
                t.2 + l.rerouted,
                t.3 + l.spilled,
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_counts_add_up_steps() {
        let mut c = MoeRequestCounts::default();
        let changed = TokenPairCounts {
            dropped: 2,
            rerouted: 1,
            spilled: 0,
        };
        c.add(12, &changed);
        c.add(4, &TokenPairCounts::default());
        assert_eq!(
            c,
            MoeRequestCounts {
                pairs: 16,
                dropped: 2,
                rerouted: 1,
                spilled: 0
            }
        );
    }

    #[test]
    fn snapshot_serializes_with_its_placement_in_file_format() {
        let stats = MoeStats {
            placement: Some(ExpertPlacement::round_robin(1, 2, 1, 0).unwrap()),
            layers: vec![
                LayerMoeStats {
                    pairs: 10,
                    dropped: 1,
                    ..Default::default()
                };
                2
            ],
            ..Default::default()
        };
        assert_eq!(stats.total_pairs(), (20, 2, 0, 0));
        let json = serde_json::to_value(&stats).unwrap();
        assert_eq!(json["placement"]["num_experts"], 2);
        assert_eq!(json["moe_overflow"], "drop");
        assert_eq!(json["layers"][1]["pairs"], 10);
    }
}
