//! Expert capacity: how many (token, expert) pairs one expert takes per step, and what happens
//! to the pairs beyond it (`--capacity-factor`, `--moe-overflow`). Follows the capacity factor
//! of GShard / Switch Transformer, `C = ceil(T·k/N·α)`, with slots taken in token order.
//!
//! Overflow policies, for a pair whose expert is full:
//! - `Drop`: the pair is skipped; the token keeps its other experts, weights renormalised.
//! - `Reroute`: the pair moves to the token's next-ranked expert with room (ranks k, k+1, … of
//!   the full softmax order), at that expert's router probability; dropped if none has room.
//! - `Spill`: the pair is computed in an extra pass; the result equals dropless routing.

use moeserve_core::ConfigError;
/// Lives in core so `MoeConfig` can name it; re-exported here with the capacity it applies to.
pub use moeserve_core::OverflowPolicy;

use super::router::{Ranking, RoutedPair, RoutedStep, RouterConfig, RoutingCounts};

/// The per-expert limit of one step.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum Capacity {
    /// No limit: every pair is computed (HF semantics, the default).
    #[default]
    Dropless,
    /// At most `expert_capacity(T, k, N, alpha)` pairs per expert and pass.
    Factor {
        alpha: f32,
        overflow: OverflowPolicy,
    },
}

impl Capacity {
    /// The capacity `MoeConfig` asks for: dropless without a factor.
    pub fn from_factor(capacity_factor: Option<f32>, overflow: OverflowPolicy) -> Self {
        match capacity_factor {
            None => Capacity::Dropless,
            Some(alpha) => Capacity::Factor { alpha, overflow },
        }
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        match *self {
            Capacity::Factor { alpha, .. } if !(alpha.is_finite() && alpha > 0.0) => {
                Err(ConfigError {
                    field: "capacity_factor",
                    message: format!("must be a finite number above 0, got {alpha}"),
                })
            }
            _ => Ok(()),
        }
    }
}

/// `C = ceil(T·k/N·α)`: pairs one expert takes per step (per pass when spilling); at least 1
/// when the step has tokens, 0 when it has none.
///
/// NOTE: `alpha` is an f32, so a value meant as 1.1 is 1.10000002…; a product meant to be an
/// integer (40·1.1/4 = 11) lands a hair above it. Products within f32 precision of an integer
/// are taken as that integer, so exact cases stay exact instead of gaining a slot.
pub fn expert_capacity(num_tokens: usize, top_k: usize, num_experts: usize, alpha: f32) -> usize {
    if num_tokens == 0 || top_k == 0 || num_experts == 0 {
        return 0;
    }
    let exact = (num_tokens * top_k) as f64 * f64::from(alpha) / num_experts as f64;
    let nearest = exact.round();
    let tolerance = exact * 4.0 * f64::from(f32::EPSILON);
    let slots = if (exact - nearest).abs() <= tolerance {
        nearest
    } else {
        exact.ceil()
    };
    (slots as usize).max(1)
}

/// Assigns slots in token order, and within a token in rank order: fills the pairs, token
/// offsets, counts, loads, capacity and passes of `out` (its buffers are reused).
pub(crate) fn assign(ranking: &Ranking, config: &RouterConfig, out: &mut RoutedStep) {
    let (num_tokens, num_experts) = (ranking.num_tokens(), ranking.num_experts());
    let top_k = config.top_k;
    let (limit, policy) = match config.capacity {
        Capacity::Dropless => (None, None),
        Capacity::Factor { alpha, overflow } => (
            Some(expert_capacity(num_tokens, top_k, num_experts, alpha)),
            Some(overflow),
        ),
    };
    let has_room = |load: &[u32], e: u32| limit.is_none_or(|c| (load[e as usize] as usize) < c);
    out.pairs.clear();
    out.token_offsets.clear();
    out.counts = RoutingCounts {
        pairs: (num_tokens * top_k) as u64,
        ..RoutingCounts::default()
    };
    out.expert_load.clear();
    out.expert_load.resize(num_experts, 0);
    out.expert_capacity = limit;
    out.num_passes = 0;
    out.token_offsets.push(0);
    for token in 0..num_tokens {
        let (probs, order) = (ranking.probs(token), ranking.order(token));
        let start = out.pairs.len();
        // Next reroute candidate. Candidates passed over were full and stay full (loads only
        // grow), or were taken by this token, so the scan never needs to restart.
        let mut cursor = top_k;
        for &expert in &order[..top_k] {
            let target = if has_room(&out.expert_load, expert) {
                Some((expert, 0))
            } else {
                match policy {
                    Some(OverflowPolicy::Spill) => {
                        out.counts.spilled += 1;
                        let c = limit.expect("spill implies a capacity") as u32;
                        Some((expert, out.expert_load[expert as usize] / c))
                    }
                    Some(OverflowPolicy::Reroute) => {
                        let found = order[cursor..]
                            .iter()
                            .position(|c| has_room(&out.expert_load, *c));
                        cursor = found.map_or(num_experts, |i| cursor + i + 1);
                        found.map(|_| {
                            out.counts.rerouted += 1;
                            (order[cursor - 1], 0)
                        })
                    }
                    Some(OverflowPolicy::Drop) | None => None,
                }
            };
            match target {
                Some((expert, pass)) => {
                    out.expert_load[expert as usize] += 1;
                    out.num_passes = out.num_passes.max(pass + 1);
                    out.pairs.push(RoutedPair {
                        token,
                        expert,
                        weight: probs[expert as usize],
                        pass,
                    });
                }
                None => out.counts.dropped += 1,
            }
        }
        let kept = &mut out.pairs[start..];
        if kept.is_empty() {
            out.counts.dropped_tokens += 1;
        }
        if config.renormalize {
            // Same summation order as `route_top_k`, so unconstrained tokens get identical
            // weights.
            let sum: f32 = kept.iter().map(|p| p.weight).sum();
            kept.iter_mut().for_each(|p| p.weight /= sum);
        }
        if config.scale != 1.0 {
            kept.iter_mut().for_each(|p| p.weight *= config.scale);
        }
        out.token_offsets.push(out.pairs.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::moe::router::{RoutedStep, route};

    fn config(alpha: f32, overflow: OverflowPolicy, top_k: usize) -> RouterConfig {
        RouterConfig {
            top_k,
            capacity: Capacity::Factor { alpha, overflow },
            renormalize: true,
            scoring: Default::default(),
            scale: 1.0,
        }
    }

    fn experts_of(step: &RoutedStep, token: usize) -> Vec<u32> {
        step.token_pairs(token).iter().map(|p| p.expert).collect()
    }

    fn softmax(row: &[f32]) -> Vec<f32> {
        let mut p = row.to_vec();
        moeserve_backend::cpu::softmax_in_place(&mut p);
        p
    }

    #[test]
    fn capacity_is_exact_at_integer_boundaries() {
        assert_eq!(expert_capacity(8, 2, 4, 1.0), 4);
        assert_eq!(expert_capacity(16, 1, 4, 1.0), 4);
        assert_eq!(expert_capacity(17, 1, 4, 1.0), 5);
        assert_eq!(expert_capacity(4, 2, 3, 1.5), 4);
        // 1.1f32 and 0.3f32 are a hair above their decimals; the exact products stay exact.
        assert_eq!(expert_capacity(20, 2, 4, 1.1), 11);
        assert_eq!(expert_capacity(10, 1, 3, 0.3), 1);
        assert_eq!(expert_capacity(10, 1, 7, 0.7), 1);
    }

    #[test]
    fn capacity_rounds_fractions_up() {
        assert_eq!(expert_capacity(10, 2, 8, 1.25), 4); // 3.125
        assert_eq!(expert_capacity(21, 2, 4, 1.1), 12); // 11.55
        assert_eq!(expert_capacity(5, 1, 2, 1.0), 3); // 2.5
        assert_eq!(expert_capacity(1000, 2, 8, 1.0001), 251); // 250.025
    }

    #[test]
    fn capacity_is_zero_without_tokens_and_at_least_one_with() {
        assert_eq!(expert_capacity(0, 2, 8, 1.0), 0);
        assert_eq!(expert_capacity(1, 1, 64, 0.01), 1);
    }

    #[test]
    fn overflow_policy_parses_and_prints_its_cli_names() {
        for p in [
            OverflowPolicy::Drop,
            OverflowPolicy::Reroute,
            OverflowPolicy::Spill,
        ] {
            assert_eq!(p.to_string().parse::<OverflowPolicy>().unwrap(), p);
        }
        assert_eq!(
            "skip".parse::<OverflowPolicy>().unwrap_err().field,
            "moe_overflow"
        );
    }

    #[test]
    fn capacity_factor_must_be_positive_and_finite() {
        for alpha in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            let c = Capacity::Factor {
                alpha,
                overflow: OverflowPolicy::Drop,
            };
            assert_eq!(c.validate().unwrap_err().field, "capacity_factor");
        }
        Capacity::Dropless.validate().unwrap();
    }

    #[test]
    fn drop_skips_pairs_in_token_order_and_counts_dropped_tokens() {
        // Four tokens all want expert 0; C = ceil(4·1/2·1) = 2.
        let step = route(
            &[1.0, 0.0].repeat(4),
            2,
            &config(1.0, OverflowPolicy::Drop, 1),
        );
        assert_eq!(step.expert_capacity, Some(2));
        assert_eq!(step.token_offsets, vec![0, 1, 2, 2, 2]);
        assert_eq!(step.expert_load, vec![2, 0]);
        assert_eq!((step.counts.dropped, step.counts.dropped_tokens), (2, 2));
        assert_eq!(step.counts.computed(), 2);
    }

    #[test]
    fn drop_renormalises_the_remaining_weights() {
        // C = ceil(2·2/4·1) = 1. Token 0 takes experts 0 and 1; token 1 wants 2 then 0 (full).
        let x = [3.0, 2.0, 0.0, 0.0, 2.0, 0.0, 3.0, 0.0];
        let step = route(&x, 4, &config(1.0, OverflowPolicy::Drop, 2));
        assert_eq!(experts_of(&step, 0), vec![0, 1]);
        assert_eq!(experts_of(&step, 1), vec![2]);
        assert_eq!(step.token_pairs(1)[0].weight, 1.0);
        assert_eq!((step.counts.dropped, step.counts.dropped_tokens), (1, 0));
    }

    #[test]
    fn reroute_moves_to_the_next_ranked_expert_with_room() {
        // Token 1's order is [2, 0, 1, 3] (1 and 3 tie, lower first); 0 is full and 1 is
        // taken by token 0, so its second pair goes to 3 at expert 3's router weight.
        let x = [3.0, 2.0, 0.0, 0.0, 2.0, 0.0, 3.0, 0.0];
        let step = route(&x, 4, &config(1.0, OverflowPolicy::Reroute, 2));
        assert_eq!(experts_of(&step, 1), vec![2, 3]);
        let p = softmax(&x[4..]);
        let w = step.token_pairs(1);
        assert_eq!(w[0].weight, p[2] / (p[2] + p[3]));
        assert_eq!(w[1].weight, p[3] / (p[2] + p[3]));
        assert_eq!((step.counts.rerouted, step.counts.dropped), (1, 0));
    }

    #[test]
    fn reroute_never_reuses_an_expert_and_drops_when_nothing_has_room() {
        // All tokens rank 0 > 1 > 2; C = ceil(3·2/3·0.5) = 1.
        let step = route(
            &[2.0, 1.0, 0.0].repeat(3),
            3,
            &config(0.5, OverflowPolicy::Reroute, 2),
        );
        assert_eq!(experts_of(&step, 0), vec![0, 1]);
        assert_eq!(experts_of(&step, 1), vec![2]);
        assert!(experts_of(&step, 2).is_empty());
        let c = step.counts;
        assert_eq!(
            (c.pairs, c.rerouted, c.dropped, c.dropped_tokens),
            (6, 1, 3, 1)
        );
        assert_eq!(step.expert_load, vec![1, 1, 1]);
    }

    #[test]
    fn reroute_of_several_pairs_walks_down_the_ranking() {
        // Everyone ranks 0 > 1 > … > 5; C = ceil(3·2/6·1) = 1.
        let row = [5.0, 4.0, 3.0, 2.0, 1.0, 0.0];
        let step = route(&row.repeat(3), 6, &config(1.0, OverflowPolicy::Reroute, 2));
        assert_eq!(experts_of(&step, 1), vec![2, 3]);
        assert_eq!(experts_of(&step, 2), vec![4, 5]);
        assert_eq!(step.counts.rerouted, 4);
    }

    #[test]
    fn spill_marks_overflow_passes_and_keeps_weights() {
        let x = [1.0, 0.0].repeat(5);
        let step = route(&x, 2, &config(1.0, OverflowPolicy::Spill, 1)); // C = 3
        let passes: Vec<u32> = step.pairs.iter().map(|p| p.pass).collect();
        assert_eq!(passes, vec![0, 0, 0, 1, 1]);
        assert_eq!((step.counts.spilled, step.num_passes), (2, 2));
        assert!(step.pairs.iter().all(|p| p.weight == 1.0));
        let tight = route(&x, 2, &config(0.4, OverflowPolicy::Spill, 1)); // C = 1
        assert_eq!(tight.num_passes, 5);
        assert_eq!(tight.expert_load, vec![5, 0]);
    }

    #[test]
    fn ties_fill_lower_experts_first() {
        let step = route(&[0.0; 12], 4, &config(1.0, OverflowPolicy::Drop, 2)); // C = 2
        assert_eq!(experts_of(&step, 0), vec![0, 1]);
        assert_eq!(experts_of(&step, 1), vec![0, 1]);
        assert!(experts_of(&step, 2).is_empty());
    }

    #[test]
    fn seeded_steps_keep_the_invariants_for_every_policy() {
        let mut state = 7u64;
        let mut next = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) % 1000) as f32 / 250.0
        };
        for round in 0..60 {
            let (num_experts, top_k, num_tokens) = (2 + round % 7, 1 + round % 4, round * 3 % 41);
            let top_k = top_k.min(num_experts);
            let x: Vec<f32> = (0..num_tokens * num_experts).map(|_| next()).collect();
            for policy in [
                OverflowPolicy::Drop,
                OverflowPolicy::Reroute,
                OverflowPolicy::Spill,
            ] {
                let alpha = 0.25 + (round % 5) as f32 * 0.25;
                let step = route(&x, num_experts, &config(alpha, policy, top_k));
                let c = step.counts;
                assert_eq!(c.pairs, (num_tokens * top_k) as u64);
                assert_eq!(c.computed(), step.pairs.len() as u64);
                assert_eq!(
                    step.expert_load.iter().map(|l| *l as u64).sum::<u64>(),
                    c.computed()
                );
                let cap = step.expert_capacity.unwrap_or(usize::MAX);
                if policy != OverflowPolicy::Spill {
                    assert!(step.expert_load.iter().all(|l| *l as usize <= cap));
                }
                for t in 0..num_tokens {
                    let mut ids = experts_of(&step, t);
                    let sum: f32 = step.token_pairs(t).iter().map(|p| p.weight).sum();
                    assert!(ids.is_empty() || (sum - 1.0).abs() < 1e-5);
                    ids.sort_unstable();
                    ids.dedup();
                    assert_eq!(ids.len(), step.token_pairs(t).len());
                }
            }
        }
    }
}
