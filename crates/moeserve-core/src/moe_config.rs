//! MoE serving settings of the MoE core issue: capacity factor and overflow policy of the
//! router, expert parallelism (devices, redundant slots, a placement file), load tracking,
//! online re-placement (EPLB) and routing traces. Validated once at start-up like
//! `CacheConfig`; checks that need the model (expert counts) are the engine's.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::config::ConfigError;

fn invalid(field: &'static str, message: String) -> Result<(), ConfigError> {
    Err(ConfigError { field, message })
}

/// What to do with a (token, expert) pair whose expert is full (`--moe-overflow`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OverflowPolicy {
    /// Skip the pair; the token keeps its other experts, weights renormalised.
    #[default]
    Drop,
    /// Move the pair to the token's next-ranked expert with room.
    Reroute,
    /// Compute the pair in an extra pass (outputs equal dropless routing).
    Spill,
}

impl fmt::Display for OverflowPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            OverflowPolicy::Drop => "drop",
            OverflowPolicy::Reroute => "reroute",
            OverflowPolicy::Spill => "spill",
        })
    }
}

impl FromStr for OverflowPolicy {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self, ConfigError> {
        match s {
            "drop" => Ok(OverflowPolicy::Drop),
            "reroute" => Ok(OverflowPolicy::Reroute),
            "spill" => Ok(OverflowPolicy::Spill),
            other => Err(ConfigError {
                field: "moe_overflow",
                message: format!("expected drop, reroute or spill, got {other:?}"),
            }),
        }
    }
}

/// How much per-expert detail the engine exports (`--expert-metrics`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ExpertMetrics {
    /// Per (layer, expert) series and load tables as well as the per-layer ones.
    #[default]
    Full,
    /// Per-layer and per-device series only.
    Off,
}

impl fmt::Display for ExpertMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ExpertMetrics::Full => "full",
            ExpertMetrics::Off => "off",
        })
    }
}

impl FromStr for ExpertMetrics {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self, ConfigError> {
        match s {
            "full" => Ok(ExpertMetrics::Full),
            "off" => Ok(ExpertMetrics::Off),
            other => Err(ConfigError {
                field: "expert_metrics",
                message: format!("expected full or off, got {other:?}"),
            }),
        }
    }
}

/// MoE settings of one engine.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MoeConfig {
    /// α of the expert capacity `C = ceil(T·k/N·α)` (`--capacity-factor`); `None` = dropless,
    /// exactly Hugging Face's routing (the default).
    pub capacity_factor: Option<f32>,
    /// What happens to pairs beyond the capacity (`--moe-overflow`); unused when dropless.
    pub moe_overflow: OverflowPolicy,
    /// Devices the experts are spread over (`--expert-parallel-size`); on the CPU, device
    /// workers with their own threads and expert weights.
    pub expert_parallel_size: usize,
    /// Extra physical expert slots per layer for replicas of hot experts
    /// (`--num-redundant-experts`).
    pub num_redundant_experts: usize,
    /// Start from this placement (JSON, see `ExpertPlacement`) instead of round-robin
    /// (`--expert-placement`).
    pub expert_placement: Option<PathBuf>,
    /// Steps of the sliding load window (`--load-window`).
    pub load_window: usize,
    /// Windowed imbalance (max / mean device load) above which experts are re-placed
    /// (`--rebalance-threshold`, ≥ 1).
    pub rebalance_threshold: f64,
    /// Fewest steps between two re-placements (`--rebalance-interval`); 0 turns online
    /// re-placement off.
    pub rebalance_interval: u64,
    /// Least relative imbalance improvement worth a re-placement, in `[0, 1)`.
    pub rebalance_min_gain: f64,
    /// Assumed bandwidth of expert weight copies between devices, for the cost of a move.
    pub expert_copy_bytes_per_second: f64,
    /// Write every step's routing (each layer's top-k per token) to this JSONL file
    /// (`--record-routing`).
    pub record_routing: Option<PathBuf>,
    /// Per-expert detail in metrics and load reports (`--expert-metrics`).
    pub expert_metrics: ExpertMetrics,
}

impl Default for MoeConfig {
    fn default() -> Self {
        MoeConfig {
            capacity_factor: None,
            moe_overflow: OverflowPolicy::Drop,
            expert_parallel_size: 1,
            num_redundant_experts: 0,
            expert_placement: None,
            load_window: 1000,
            rebalance_threshold: 1.25,
            rebalance_interval: 1000,
            rebalance_min_gain: 0.05,
            expert_copy_bytes_per_second: 10e9,
            record_routing: None,
            expert_metrics: ExpertMetrics::Full,
        }
    }
}

impl MoeConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Some(alpha) = self.capacity_factor
            && !(alpha.is_finite() && alpha > 0.0)
        {
            return invalid(
                "capacity_factor",
                format!("must be a finite number above 0, got {alpha}"),
            );
        }
        if self.expert_parallel_size == 0 {
            return invalid("expert_parallel_size", "must be at least 1".to_string());
        }
        if self.load_window == 0 {
            return invalid("load_window", "must be at least 1 step".to_string());
        }
        if self.rebalance_threshold.is_nan() || self.rebalance_threshold < 1.0 {
            let got = self.rebalance_threshold;
            return invalid(
                "rebalance_threshold",
                format!("must be at least 1, got {got}"),
            );
        }
        if !(0.0..1.0).contains(&self.rebalance_min_gain) {
            let got = self.rebalance_min_gain;
            return invalid(
                "rebalance_min_gain",
                format!("must be in [0, 1), got {got}"),
            );
        }
        if self.expert_copy_bytes_per_second.is_nan() || self.expert_copy_bytes_per_second <= 0.0 {
            let got = self.expert_copy_bytes_per_second;
            return invalid(
                "expert_copy_bytes_per_second",
                format!("must be above 0, got {got}"),
            );
        }
        Ok(())
    }

    /// Whether experts run through the expert-parallel path (device workers, a placement)
    /// rather than the model's own experts on the caller's threads.
    pub fn uses_expert_parallelism(&self) -> bool {
        self.expert_parallel_size > 1
            || self.num_redundant_experts > 0
            || self.expert_placement.is_some()
    }

    /// Whether online re-placement can happen: more than one device and an interval.
    pub fn rebalancing_enabled(&self) -> bool {
        self.expert_parallel_size > 1 && self.rebalance_interval > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_dropless_on_one_device() {
        let c = MoeConfig::default();
        c.validate().unwrap();
        assert_eq!(c.capacity_factor, None);
        assert!(!c.uses_expert_parallelism());
        assert!(!c.rebalancing_enabled());
    }

    #[test]
    fn bad_values_name_their_field() {
        let bad = |c: MoeConfig| c.validate().unwrap_err().field;
        let base = MoeConfig::default();
        for alpha in [0.0, -0.5, f32::NAN, f32::INFINITY] {
            let c = MoeConfig {
                capacity_factor: Some(alpha),
                ..base.clone()
            };
            assert_eq!(bad(c), "capacity_factor");
        }
        let c = MoeConfig {
            expert_parallel_size: 0,
            ..base.clone()
        };
        assert_eq!(bad(c), "expert_parallel_size");
        let c = MoeConfig {
            load_window: 0,
            ..base.clone()
        };
        assert_eq!(bad(c), "load_window");
        let c = MoeConfig {
            rebalance_threshold: f64::NAN,
            ..base.clone()
        };
        assert_eq!(bad(c), "rebalance_threshold");
        let c = MoeConfig {
            rebalance_min_gain: 1.0,
            ..base.clone()
        };
        assert_eq!(bad(c), "rebalance_min_gain");
        let c = MoeConfig {
            expert_copy_bytes_per_second: 0.0,
            ..base
        };
        assert_eq!(bad(c), "expert_copy_bytes_per_second");
    }

    #[test]
    fn cli_names_parse_and_print() {
        for p in [
            OverflowPolicy::Drop,
            OverflowPolicy::Reroute,
            OverflowPolicy::Spill,
        ] {
            assert_eq!(p.to_string().parse::<OverflowPolicy>().unwrap(), p);
        }
        for m in [ExpertMetrics::Full, ExpertMetrics::Off] {
            assert_eq!(m.to_string().parse::<ExpertMetrics>().unwrap(), m);
        }
        assert_eq!(
            "some".parse::<ExpertMetrics>().unwrap_err().field,
            "expert_metrics"
        );
    }

    #[test]
    fn toml_style_json_fills_defaults_and_refuses_unknown_fields() {
        let c: MoeConfig =
            serde_json::from_str(r#"{"capacity_factor": 1.25, "moe_overflow": "reroute"}"#)
                .unwrap();
        assert_eq!(c.capacity_factor, Some(1.25));
        assert_eq!(c.moe_overflow, OverflowPolicy::Reroute);
        assert_eq!(c.load_window, 1000);
        assert!(serde_json::from_str::<MoeConfig>(r#"{"alpha": 1}"#).is_err());
    }

    #[test]
    fn parallelism_and_rebalancing_follow_the_settings() {
        let ep = MoeConfig {
            expert_parallel_size: 2,
            ..Default::default()
        };
        assert!(ep.uses_expert_parallelism() && ep.rebalancing_enabled());
        let fixed = MoeConfig {
            rebalance_interval: 0,
            ..ep
        };
        assert!(!fixed.rebalancing_enabled());
        let replicas = MoeConfig {
            num_redundant_experts: 2,
            ..Default::default()
        };
        assert!(replicas.uses_expert_parallelism() && !replicas.rebalancing_enabled());
    }
}
