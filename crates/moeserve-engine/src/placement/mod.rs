//! Expert parallelism bookkeeping (pure, synchronous): how loaded each expert is, where experts
//! should live, and routing traces. The placement table itself is
//! `moeserve_core::ExpertPlacement`; the plan follows DeepSeek's EPLB.
//!
//! - `load`: per (layer, expert) counts per step, windowed and cumulative; per device tokens and
//!   expert time; imbalance = max device load / mean device load.
//! - `eplb`: replicate hot experts and pack slots onto devices; the weight bytes a plan moves.
//! - `rebalance`: when a rebalance pays off (threshold, interval, gain vs. copy cost).
//! - `trace`: `--record-routing` JSONL writer and reader.
//!
//! The engine's loop around them, per step:
//!
//! ```text
//! route each layer ──► LoadTracker::record_step(layer, &routed.expert_load)
//!                 └──► RoutingTraceWriter::write_routed(step, layer, &routed)   (if recording)
//! every step:     current = step_imbalance(&tracker.windowed(), &placement)
//!                 if current > threshold and the interval passed:
//!                     planned = eplb::plan(&windowed, num_devices, num_physical)
//!                     policy.should_rebalance(&RebalanceCandidate { .. }) ──► move weights
//! ```

pub mod eplb;
pub mod load;
pub mod rebalance;
pub mod trace;

pub use eplb::{bytes_to_move, plan};
pub use load::{
    DeviceTotals, LoadTracker, WindowedLoad, device_loads, device_tokens_of_step, imbalance,
    step_imbalance,
};
pub use rebalance::{Decision, RebalanceCandidate, RebalancePolicy, RebalanceRecord, SkipReason};
pub use trace::{RoutingTraceReader, RoutingTraceRecord, RoutingTraceWriter};
