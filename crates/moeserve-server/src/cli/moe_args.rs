//! MoE flags shared by `generate` and `serve`: the router's capacity factor and overflow
//! policy, expert parallelism and placement, load tracking, re-placement, routing traces.

use std::path::PathBuf;

use clap::Args;
use moeserve_core::{ExpertMetrics, MoeConfig, OverflowPolicy};

#[derive(Debug, Clone, Args)]
pub struct MoeArgs {
    /// Per-expert capacity factor α: each expert takes at most ceil(T·k/N·α) (token, expert)
    /// pairs per step. Absent = dropless (exact).
    #[arg(long)]
    pub capacity_factor: Option<f32>,
    /// What happens to pairs over capacity: drop, reroute or spill.
    #[arg(long, default_value = "drop")]
    pub moe_overflow: OverflowPolicy,
    /// Number of expert-parallel devices (CPU: device workers with their own threads).
    #[arg(long, default_value_t = 1)]
    pub expert_parallel_size: usize,
    /// Extra physical expert slots per layer, for replicas of hot experts.
    #[arg(long, default_value_t = 0)]
    pub num_redundant_experts: usize,
    /// A placement (JSON, as served by GET /v1/moe/load's `placement`) to start from.
    #[arg(long)]
    pub expert_placement: Option<PathBuf>,
    /// Steps in the sliding window of per-expert load.
    #[arg(long, default_value_t = 1000)]
    pub load_window: usize,
    /// Re-place experts when windowed imbalance (max / mean device load) exceeds this.
    #[arg(long, default_value_t = 1.25)]
    pub rebalance_threshold: f64,
    /// At most one re-placement per this many steps (0 = never).
    #[arg(long, default_value_t = 1000)]
    pub rebalance_interval: u64,
    /// Record every step's routing (JSONL) to this file.
    #[arg(long)]
    pub record_routing: Option<PathBuf>,
    /// Per (layer, expert) metric series: full or off.
    #[arg(long, default_value = "full")]
    pub expert_metrics: ExpertMetrics,
}

impl MoeArgs {
    /// `base` with every flag applied for which `given(flag id)` is true.
    pub fn apply(&self, base: MoeConfig, given: impl Fn(&str) -> bool) -> MoeConfig {
        let mut c = base;
        if given("capacity_factor") {
            c.capacity_factor = self.capacity_factor;
        }
        if given("moe_overflow") {
            c.moe_overflow = self.moe_overflow;
        }
        if given("expert_parallel_size") {
            c.expert_parallel_size = self.expert_parallel_size;
        }
        if given("num_redundant_experts") {
            c.num_redundant_experts = self.num_redundant_experts;
        }
        if given("expert_placement") {
            c.expert_placement = self.expert_placement.clone();
        }
        if given("load_window") {
            c.load_window = self.load_window;
        }
        if given("rebalance_threshold") {
            c.rebalance_threshold = self.rebalance_threshold;
        }
        if given("rebalance_interval") {
            c.rebalance_interval = self.rebalance_interval;
        }
        if given("record_routing") {
            c.record_routing = self.record_routing.clone();
        }
        if given("expert_metrics") {
            c.expert_metrics = self.expert_metrics;
        }
        c
    }

    /// The flags alone, over the defaults.
    pub fn to_config(&self) -> MoeConfig {
        self.apply(MoeConfig::default(), |_| true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        moe: MoeArgs,
    }

    #[test]
    fn flags_parse_into_the_moe_config() {
        let cli = Cli::parse_from([
            "x",
            "--capacity-factor",
            "1.25",
            "--moe-overflow",
            "reroute",
            "--expert-parallel-size",
            "2",
        ]);
        let c = cli.moe.to_config();
        assert_eq!(c.capacity_factor, Some(1.25));
        assert_eq!(c.moe_overflow, OverflowPolicy::Reroute);
        assert_eq!(c.expert_parallel_size, 2);
        assert_eq!(c.load_window, MoeConfig::default().load_window);
    }

    #[test]
    fn only_given_flags_override_the_base() {
        let cli = Cli::parse_from(["x", "--load-window", "7"]);
        let base = MoeConfig {
            capacity_factor: Some(2.0),
            ..MoeConfig::default()
        };
        let c = cli.moe.apply(base, |id| id == "load_window");
        assert_eq!((c.capacity_factor, c.load_window), (Some(2.0), 7));
    }
}
