//! Expert visibility: the MoE series of `/metrics` refreshed from the engine's
//! [`MoeStats`] snapshot, and `GET /v1/moe/load`, the whole snapshot as JSON.
//!
//! Series names come from `moeserve_engine::metrics` (the [`names::MOE`] list); every series
//! carries `model_name`, per-layer ones `layer`, per-device ones `device`, and the per
//! (layer, expert) ones — exported only with `--expert-metrics full` — `layer` and `expert`.
//! Counters are set to the engine's absolute totals, as the other series are.

use axum::Json;
use axum::extract::State;
use moeserve_engine::metrics as names;
use moeserve_engine::moe::MoeStats;
use serde::Serialize;

use crate::error::{ApiError, ErrorBody};
use crate::state::AppState;

/// Copies one snapshot into the MoE series of the installed recorder.
pub fn record_moe_metrics(model_name: &str, stats: &MoeStats) {
    let model = || (names::LABEL_MODEL_NAME, model_name.to_string());
    for (l, layer) in stats.layers.iter().enumerate() {
        let labels = [model(), (names::LABEL_LAYER, l.to_string())];
        let counters = [
            (names::MOE_PAIRS_TOTAL, layer.pairs),
            (names::MOE_DROPPED_PAIRS_TOTAL, layer.dropped),
            (names::MOE_REROUTED_PAIRS_TOTAL, layer.rerouted),
            (names::MOE_SPILLED_PAIRS_TOTAL, layer.spilled),
            (
                names::MOE_SHARED_EXPERT_TOKENS_TOTAL,
                layer.shared_expert_tokens,
            ),
            (names::MOE_DROPPED_TOKENS_TOTAL, layer.dropped_tokens),
        ];
        for (name, value) in counters {
            metrics::counter!(name, &labels).absolute(value);
        }
        metrics::gauge!(names::MOE_LOAD_IMBALANCE, &labels).set(layer.windowed_imbalance);
        // Both lists are empty with `--expert-metrics off`.
        for (e, (&windowed, &total)) in layer
            .windowed_load
            .iter()
            .zip(&layer.cumulative_load)
            .enumerate()
        {
            let labels = [
                model(),
                (names::LABEL_LAYER, l.to_string()),
                (names::LABEL_EXPERT, e.to_string()),
            ];
            metrics::gauge!(names::MOE_EXPERT_WINDOWED_PAIRS, &labels).set(windowed as f64);
            metrics::counter!(names::MOE_EXPERT_TOKENS_TOTAL, &labels).absolute(total);
        }
    }
    for (d, device) in stats.devices.iter().enumerate() {
        let labels = [model(), (names::LABEL_DEVICE, d.to_string())];
        metrics::counter!(names::MOE_DEVICE_TOKENS_TOTAL, &labels).absolute(device.tokens);
        // A running total in seconds, as a gauge: the facade's counters hold integers.
        metrics::gauge!(names::MOE_DEVICE_EXPERT_SECONDS, &labels).set(device.compute_seconds);
    }
    let labels = [model()];
    metrics::counter!(names::MOE_REBALANCES_TOTAL, &labels).absolute(stats.num_rebalances);
    metrics::gauge!(names::MOE_STEP_IMBALANCE, &labels).set(stats.step_imbalance);
    if let Some(gain) = stats.last_rebalance_gain_ratio {
        metrics::gauge!(names::MOE_REBALANCE_GAIN_RATIO, &labels).set(gain);
    }
}

/// The body of `GET /v1/moe/load`.
#[derive(Serialize)]
pub struct MoeLoadReport {
    pub object: &'static str,
    pub model: String,
    /// Engine steps run so far.
    pub num_steps: u64,
    /// The snapshot: per layer totals and (with `--expert-metrics full`) loads per expert,
    /// devices, the placement with its replicas, imbalance and the latest re-placements.
    #[serde(flatten)]
    pub stats: MoeStats,
}

/// `GET /v1/moe/load`; 503 while loading or shutting down.
#[utoipa::path(get, path = "/v1/moe/load", tag = "moe",
    security((), ("api_key" = [])),
    responses(
        (status = 200, description = "Per-layer, per-expert and per-device load, and the placement", body = serde_json::Value),
        (status = 401, description = "Missing or wrong API key", body = ErrorBody),
        (status = 503, description = "Loading or shutting down", body = ErrorBody),
    ))]
pub async fn load(State(state): State<AppState>) -> Result<Json<MoeLoadReport>, ApiError> {
    let engine = state.engine()?;
    Ok(Json(MoeLoadReport {
        object: "moe.load",
        model: state.served_model_name().to_string(),
        num_steps: engine.stats().num_steps,
        stats: engine.moe_snapshot(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use metrics_exporter_prometheus::PrometheusBuilder;
    use moeserve_core::ExpertPlacement;
    use moeserve_engine::moe::{DeviceMoeStats, LayerMoeStats};

    fn stats(expert_loads: bool) -> MoeStats {
        let layer = |l: u64| LayerMoeStats {
            pairs: 20 + l,
            dropped: 3 + l,
            rerouted: 0,
            spilled: 0,
            dropped_tokens: 1,
            shared_expert_tokens: 10 + l,
            windowed_imbalance: 1.5,
            windowed_load: if expert_loads { vec![4, 6] } else { vec![] },
            cumulative_load: if expert_loads { vec![7, 9] } else { vec![] },
        };
        MoeStats {
            layers: vec![layer(0), layer(1)],
            devices: vec![DeviceMoeStats {
                tokens: 33,
                compute_seconds: 0.25,
                experts_held: 4,
            }],
            num_rebalances: 2,
            last_rebalance_gain_ratio: Some(1.4),
            placement: Some(ExpertPlacement::round_robin(2, 2, 1, 0).unwrap()),
            ..MoeStats::default()
        }
    }

    fn rendered(stats: &MoeStats) -> String {
        let recorder = PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || record_moe_metrics("m", stats));
        handle.render()
    }

    #[test]
    fn layer_device_and_rebalance_series_carry_their_labels() {
        let text = rendered(&stats(true));
        for line in [
            "moeserve:moe_pairs_total{model_name=\"m\",layer=\"1\"} 21",
            "moeserve:moe_dropped_pairs_total{model_name=\"m\",layer=\"0\"} 3",
            "moeserve:moe_rerouted_pairs_total{model_name=\"m\",layer=\"0\"} 0",
            "moeserve:moe_shared_expert_tokens_total{model_name=\"m\",layer=\"1\"} 11",
            "moeserve:moe_load_imbalance{model_name=\"m\",layer=\"0\"} 1.5",
            "moeserve:moe_device_tokens_total{model_name=\"m\",device=\"0\"} 33",
            "moeserve:moe_rebalances_total{model_name=\"m\"} 2",
            "moeserve:moe_rebalance_gain_ratio{model_name=\"m\"} 1.4",
            "moeserve:moe_expert_tokens_total{model_name=\"m\",layer=\"1\",expert=\"1\"} 9",
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
    }

    #[test]
    fn expert_series_are_absent_without_expert_loads() {
        let text = rendered(&stats(false));
        assert!(text.contains("moeserve:moe_pairs_total"));
        assert!(!text.contains("moeserve:moe_expert_tokens_total"), "{text}");
        assert!(
            !text.contains("moeserve:moe_expert_windowed_pairs"),
            "{text}"
        );
    }

    #[test]
    fn the_load_report_flattens_the_snapshot() {
        let report = MoeLoadReport {
            object: "moe.load",
            model: "m".to_string(),
            num_steps: 5,
            stats: stats(true),
        };
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["num_steps"], 5);
        assert_eq!(json["layers"][0]["cumulative_load"][1], 9);
        assert_eq!(json["placement"]["num_experts"], 2);
    }
}
