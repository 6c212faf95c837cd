//! Replays a routing trace (`--record-routing`) under a capacity factor: the router's top-k of
//! every token in every step and layer, assigned to expert slots exactly as the engine assigns
//! them (`moeserve_model::moe::capacity`: `C = ceil(T·k/N·α)` per expert and step, slots taken in
//! token order and within a token in rank order).
//!
//! NOTE: a trace holds each token's top-k only, so it replays `drop` (and `spill`, which drops
//! nothing but needs extra passes) exactly; `reroute` moves pairs to experts ranked below the
//! top-k, which the trace does not hold, so only a run of the prompts measures it.

use moeserve_engine::placement::RoutingTraceRecord;
use moeserve_model::moe::OverflowPolicy;
use moeserve_model::moe::expert_capacity;
use serde::Serialize;

/// What a capacity factor would have done to the traced routing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ReplayCounts {
    /// (step, layer) records replayed.
    pub num_records: u64,
    /// Pairs the router chose.
    pub pairs: u64,
    /// Pairs over capacity that are not computed (`drop`).
    pub dropped: u64,
    /// Tokens that lost every pair in some layer (`drop`).
    pub dropped_tokens: u64,
    /// Pairs computed in an extra pass (`spill`).
    pub spilled: u64,
    /// Most passes any (step, layer) needed (`spill`; 1 when nothing overflows).
    pub max_passes: u32,
}

impl ReplayCounts {
    pub fn dropped_rate(&self) -> f64 {
        ratio(self.dropped, self.pairs)
    }

    pub fn spilled_rate(&self) -> f64 {
        ratio(self.spilled, self.pairs)
    }
}

fn ratio(n: u64, d: u64) -> f64 {
    if d == 0 { 0.0 } else { n as f64 / d as f64 }
}

/// Replays `records` with `num_experts` experts per layer at capacity factor `alpha` under
/// `policy` (`drop` or `spill`; see the module note on `reroute`).
pub fn replay<'a>(
    records: impl IntoIterator<Item = &'a RoutingTraceRecord>,
    num_experts: usize,
    alpha: f32,
    policy: OverflowPolicy,
) -> ReplayCounts {
    let mut counts = ReplayCounts::default();
    let mut load = vec![0usize; num_experts];
    for record in records {
        let top_k = record.experts.first().map_or(0, Vec::len);
        let capacity = expert_capacity(record.num_tokens, top_k, num_experts, alpha);
        load.iter_mut().for_each(|l| *l = 0);
        counts.num_records += 1;
        for token in &record.experts {
            let mut kept = 0;
            for &expert in token {
                counts.pairs += 1;
                let slot = &mut load[expert as usize];
                if *slot < capacity {
                    *slot += 1;
                    kept += 1;
                } else if policy == OverflowPolicy::Spill {
                    *slot += 1;
                    kept += 1;
                    counts.spilled += 1;
                } else {
                    counts.dropped += 1;
                }
            }
            if kept == 0 && !token.is_empty() {
                counts.dropped_tokens += 1;
            }
        }
        // Pass p holds slots p·C .. (p+1)·C of each expert.
        let passes = load.iter().map(|l| l.div_ceil(capacity.max(1))).max();
        counts.max_passes = counts.max_passes.max(passes.unwrap_or(0) as u32);
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;
    use moeserve_model::moe::{Capacity, RouterConfig, route};

    fn record(step: u64, experts: Vec<Vec<u32>>) -> RoutingTraceRecord {
        RoutingTraceRecord {
            step,
            layer: 0,
            num_tokens: experts.len(),
            experts,
        }
    }

    /// Two steps over 4 experts, top-2: every token of step 0 wants experts 0 and 1.
    fn synthetic_trace() -> Vec<RoutingTraceRecord> {
        vec![
            // T = 4, k = 2, N = 4: C = ceil(2α). At α = 1: C = 2, so tokens 2 and 3 lose both
            // pairs (4 dropped, 2 dropped tokens).
            record(0, vec![vec![0, 1]; 4]),
            // Balanced: each expert gets exactly 2 pairs; nothing drops at α ≥ 1.
            record(1, vec![vec![0, 1], vec![2, 3], vec![1, 0], vec![3, 2]]),
        ]
    }

    #[test]
    fn drop_counts_of_a_synthetic_trace_are_known() {
        let trace = synthetic_trace();
        let at = |alpha| replay(&trace, 4, alpha, OverflowPolicy::Drop);
        let c = at(1.0);
        assert_eq!((c.num_records, c.pairs), (2, 16));
        assert_eq!((c.dropped, c.dropped_tokens), (4, 2));
        assert_eq!(c.dropped_rate(), 0.25);
        // α = 1.5: C = 3; token 3 of step 0 loses both pairs.
        assert_eq!((at(1.5).dropped, at(1.5).dropped_tokens), (2, 1));
        // α = 2: C = 4 holds all four tokens.
        assert_eq!(at(2.0).dropped, 0);
        // α = 0.5: C = 1; step 0 keeps token 0 only, step 1 keeps tokens 0 and 1.
        assert_eq!((at(0.5).dropped, at(0.5).dropped_tokens), (10, 5));
    }

    #[test]
    fn spill_drops_nothing_and_counts_the_extra_passes() {
        let c = replay(&synthetic_trace(), 4, 1.0, OverflowPolicy::Spill);
        assert_eq!((c.dropped, c.spilled), (0, 4));
        assert_eq!(c.max_passes, 2);
        assert_eq!(c.spilled_rate(), 0.25);
    }

    #[test]
    fn replaying_the_routers_top_k_gives_the_routers_own_drop_counts() {
        let mut state = 11u64;
        let mut next = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) % 1000) as f32 / 200.0
        };
        let (num_experts, top_k) = (8, 2);
        for (step, num_tokens) in [1usize, 3, 17, 40, 64].into_iter().enumerate() {
            let logits: Vec<f32> = (0..num_tokens * num_experts).map(|_| next()).collect();
            let traced = route(&logits, num_experts, &RouterConfig::dropless(top_k));
            let experts = traced.chosen_by_token().map(<[u32]>::to_vec).collect();
            let trace = [record(step as u64, experts)];
            for alpha in [0.5, 1.0, 1.25, 2.0] {
                let capacity = Capacity::Factor {
                    alpha,
                    overflow: OverflowPolicy::Drop,
                };
                let config = RouterConfig {
                    top_k,
                    capacity,
                    renormalize: true,
                    scoring: Default::default(),
                    scale: 1.0,
                };
                let engine = route(&logits, num_experts, &config).counts;
                let replayed = replay(&trace, num_experts, alpha, OverflowPolicy::Drop);
                assert_eq!(replayed.pairs, engine.pairs);
                assert_eq!(replayed.dropped, engine.dropped, "T={num_tokens} α={alpha}");
                assert_eq!(replayed.dropped_tokens, engine.dropped_tokens);
            }
        }
    }
}
