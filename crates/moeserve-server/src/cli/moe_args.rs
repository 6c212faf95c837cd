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
    /// Least relative imbalance improvement worth a re-placement, in [0, 1).
    #[arg(long, default_value_t = 0.05)]
    pub rebalance_min_gain: f64,
    /// Assumed bandwidth of expert weight copies between devices (bytes/s), for the cost of a
    /// move.
    #[arg(long, default_value_t = 10e9)]
    pub expert_copy_bytes_per_second: f64,
    /// Record every step's routing (JSONL) to this file.
    #[arg(long)]
    pub record_routing: Option<PathBuf>,
    /// Per (layer, expert) metric series: full or off.
    #[arg(long, default_value = "full")]
    pub expert_metrics: ExpertMetrics,
}

impl MoeArgs {
    /// The MoE settings of these flags.
    pub fn to_config(&self) -> MoeConfig {
        MoeConfig {
            capacity_factor: self.capacity_factor,
            moe_overflow: self.moe_overflow,
            expert_parallel_size: self.expert_parallel_size,
            num_redundant_experts: self.num_redundant_experts,
            expert_placement: self.expert_placement.clone(),
            load_window: self.load_window,
            rebalance_threshold: self.rebalance_threshold,
            rebalance_interval: self.rebalance_interval,
            rebalance_min_gain: self.rebalance_min_gain,
            expert_copy_bytes_per_second: self.expert_copy_bytes_per_second,
            record_routing: self.record_routing.clone(),
            expert_metrics: self.expert_metrics,
        }
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
    fn defaults_are_the_moe_configs() {
        let c = Cli::parse_from(["x"]).moe.to_config();
        assert_eq!(format!("{c:?}"), format!("{:?}", MoeConfig::default()));
    }
}
