//! When to re-place experts: windowed imbalance above `--rebalance-threshold`, at most every
//! `--rebalance-interval` steps, and only when the predicted gain beats the cost of moving the
//! weights (the MoE core issue's rule; the plan itself is `eplb.rs`).

use moeserve_core::ConfigError;

/// When to re-place experts (`--rebalance-threshold`, `--rebalance-interval`).
///
/// Cost model: a step's expert time is proportional to its imbalance (the slowest device sets
/// it; the mean is fixed by the routing). Moving to the plan saves, per step,
/// `expert_seconds_per_step * (1 - predicted / current)`; summed over the next
/// `interval_steps` steps (the soonest the plan could be replaced) that is the gain. The cost
/// is the copy, assumed not overlapped with compute: `bytes_to_move / copy_bytes_per_second`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RebalancePolicy {
    /// Windowed imbalance above which a rebalance is considered (≥ 1).
    pub threshold: f64,
    /// Fewest steps between two rebalances.
    pub interval_steps: u64,
    /// Least relative improvement `1 - predicted / current` worth acting on, in `[0, 1)`.
    pub min_gain: f64,
    /// Assumed bandwidth of expert weight copies between devices.
    pub copy_bytes_per_second: f64,
}

impl Default for RebalancePolicy {
    /// 1.25 imbalance, every 1000 steps at most, 5 % gain, 10 GB/s (PCIe-class) copies.
    fn default() -> Self {
        RebalancePolicy {
            threshold: 1.25,
            interval_steps: 1000,
            min_gain: 0.05,
            copy_bytes_per_second: 10e9,
        }
    }
}

/// The situation a rebalance decision is made in.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RebalanceCandidate {
    /// Windowed imbalance under the current placement (`step_imbalance`).
    pub current_imbalance: f64,
    /// Imbalance of the planned placement on the same window.
    pub predicted_imbalance: f64,
    pub steps_since_last: u64,
    /// `bytes_to_move(current, planned, expert_bytes)`.
    pub bytes_to_move: u64,
    /// Measured expert-compute seconds per step (the slowest device's, summed over layers).
    pub expert_seconds_per_step: f64,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Decision {
    Rebalance {
        gain_seconds: f64,
        cost_seconds: f64,
    },
    Skip(SkipReason),
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SkipReason {
    /// The current imbalance does not exceed the threshold.
    BelowThreshold,
    /// The last rebalance was too recent.
    TooSoon { steps_left: u64 },
    /// The plan improves the imbalance by less than `min_gain` (relative).
    GainTooSmall { relative_gain: f64 },
    /// The time saved over the next interval does not pay for the copies.
    CostExceedsGain {
        gain_seconds: f64,
        cost_seconds: f64,
    },
}

impl RebalancePolicy {
    pub fn validate(&self) -> Result<(), ConfigError> {
        let fail = |field, message: String| Err(ConfigError { field, message });
        // Written so that NaN fails every check.
        if self.threshold.is_nan() || self.threshold < 1.0 {
            let got = self.threshold;
            return fail(
                "rebalance_threshold",
                format!("must be at least 1, got {got}"),
            );
        }
        if !(0.0..1.0).contains(&self.min_gain) {
            let got = self.min_gain;
            return fail(
                "rebalance_min_gain",
                format!("must be in [0, 1), got {got}"),
            );
        }
        if self.copy_bytes_per_second.is_nan() || self.copy_bytes_per_second <= 0.0 {
            let got = self.copy_bytes_per_second;
            return fail(
                "copy_bytes_per_second",
                format!("must be above 0, got {got}"),
            );
        }
        Ok(())
    }

    pub fn should_rebalance(&self, c: &RebalanceCandidate) -> Decision {
        if c.current_imbalance.is_nan() || c.current_imbalance <= self.threshold {
            return Decision::Skip(SkipReason::BelowThreshold);
        }
        if c.steps_since_last < self.interval_steps {
            let steps_left = self.interval_steps - c.steps_since_last;
            return Decision::Skip(SkipReason::TooSoon { steps_left });
        }
        let relative_gain = 1.0 - c.predicted_imbalance / c.current_imbalance;
        if relative_gain.is_nan() || relative_gain < self.min_gain || relative_gain <= 0.0 {
            return Decision::Skip(SkipReason::GainTooSmall { relative_gain });
        }
        let gain_seconds =
            c.expert_seconds_per_step * relative_gain * self.interval_steps.max(1) as f64;
        let cost_seconds = c.bytes_to_move as f64 / self.copy_bytes_per_second;
        if gain_seconds > cost_seconds {
            Decision::Rebalance {
                gain_seconds,
                cost_seconds,
            }
        } else {
            Decision::Skip(SkipReason::CostExceedsGain {
                gain_seconds,
                cost_seconds,
            })
        }
    }
}

/// One rebalance as it happened, for logs and metrics; `realised_imbalance` is filled in once
/// a window has passed under the new placement.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct RebalanceRecord {
    pub step: u64,
    pub imbalance_before: f64,
    pub predicted_imbalance: f64,
    pub realised_imbalance: Option<f64>,
    pub bytes_moved: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candidate() -> RebalanceCandidate {
        RebalanceCandidate {
            current_imbalance: 1.6,
            predicted_imbalance: 1.04,
            steps_since_last: 5000,
            bytes_to_move: 1 << 30,
            expert_seconds_per_step: 0.02,
        }
    }

    #[test]
    fn rebalance_happens_when_gain_beats_the_copy() {
        let policy = RebalancePolicy::default();
        policy.validate().unwrap();
        // Gain 0.02 s · 0.35 · 1000 = 7 s; cost 2^30 B / 10 GB/s ≈ 0.107 s.
        match policy.should_rebalance(&candidate()) {
            Decision::Rebalance {
                gain_seconds,
                cost_seconds,
            } => {
                assert!((gain_seconds - 7.0).abs() < 1e-9);
                assert!((cost_seconds - 0.1073741824).abs() < 1e-9);
            }
            other => panic!("expected a rebalance, got {other:?}"),
        }
    }

    #[test]
    fn rebalance_is_skipped_for_each_reason() {
        let policy = RebalancePolicy::default();
        let skip = |c: RebalanceCandidate| policy.should_rebalance(&c);
        let below = RebalanceCandidate {
            current_imbalance: 1.25,
            ..candidate()
        };
        assert_eq!(skip(below), Decision::Skip(SkipReason::BelowThreshold));
        let soon = RebalanceCandidate {
            steps_since_last: 400,
            ..candidate()
        };
        assert_eq!(
            skip(soon),
            Decision::Skip(SkipReason::TooSoon { steps_left: 600 })
        );
        let small = RebalanceCandidate {
            predicted_imbalance: 1.56,
            ..candidate()
        };
        assert!(matches!(
            skip(small),
            Decision::Skip(SkipReason::GainTooSmall { .. })
        ));
        let costly = RebalanceCandidate {
            bytes_to_move: 100_000_000_000,
            ..candidate()
        };
        assert!(matches!(
            skip(costly),
            Decision::Skip(SkipReason::CostExceedsGain { .. })
        ));
    }

    #[test]
    fn policy_validation_names_the_field() {
        let bad = |p: RebalancePolicy| p.validate().unwrap_err().field;
        let base = RebalancePolicy::default();
        let threshold = RebalancePolicy {
            threshold: 0.9,
            ..base
        };
        assert_eq!(bad(threshold), "rebalance_threshold");
        let gain = RebalancePolicy {
            min_gain: 1.0,
            ..base
        };
        assert_eq!(bad(gain), "rebalance_min_gain");
        let bandwidth = RebalancePolicy {
            copy_bytes_per_second: f64::NAN,
            ..base
        };
        assert_eq!(bad(bandwidth), "copy_bytes_per_second");
    }
}
