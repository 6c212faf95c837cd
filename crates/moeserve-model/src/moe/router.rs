//! Top-k routing as HF `MixtralSparseMoeBlock` does it, plus the capacity-limited variant of the
//! MoE core issue (capacity per expert and overflow policy live in `capacity.rs`):
//!
//! ```python
//! routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
//! routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
//! routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
//! ```
//! Ties go to the lower expert index.
//!
//! DeepSeek-V3's `noaux_tc` and GLM-4.5's `Glm4MoeTopkRouter` score with a sigmoid instead
//! ([`Scoring::Sigmoid`]): experts are chosen by `sigmoid(logit) + e_score_correction_bias`,
//! only from the `keep` best of `groups` groups (a group scored by the sum of its two best
//! biased scores), and weighted by the unbiased scores, renormalised with `norm_topk_prob`;
//! every family's weights are then multiplied by `routed_scaling_factor` (`scale`).
//! DeepSeek-V2's `group_limited_greedy` ([`Scoring::SoftmaxGrouped`]) keeps the softmax but
//! chooses only from the `keep` groups whose best expert scores highest.
//!
//! - `route_top_k` is the plain HF softmax routing.
//! - `route` applies a `RouterConfig`: dropless (exactly the family's routing) or a capacity
//!   factor with a drop, reroute or spill policy, and reports what it did (`RoutingCounts`).

use moeserve_backend::cpu;
use moeserve_core::ConfigError;

use super::capacity::{self, Capacity};

/// Chosen experts and their renormalised weights, `top_k` per token, best first.
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    pub top_k: usize,
    /// `[num_tokens * top_k]`
    pub expert_ids: Vec<u32>,
    /// `[num_tokens * top_k]`, summing to 1 per token.
    pub weights: Vec<f32>,
}

impl Routing {
    pub fn num_tokens(&self) -> usize {
        self.expert_ids.len() / self.top_k
    }
}

/// Routes every row of `router_logits: [num_tokens, num_experts]` to its `top_k` experts.
pub fn route_top_k(router_logits: &[f32], num_experts: usize, top_k: usize) -> Routing {
    let ranking = Ranking::new(router_logits, num_experts);
    let mut routing = Routing {
        top_k,
        expert_ids: Vec::with_capacity(ranking.num_tokens() * top_k),
        weights: Vec::with_capacity(ranking.num_tokens() * top_k),
    };
    for t in 0..ranking.num_tokens() {
        let (probs, chosen) = (ranking.probs(t), &ranking.order(t)[..top_k]);
        let sum: f32 = chosen.iter().map(|e| probs[*e as usize]).sum();
        for e in chosen {
            routing.expert_ids.push(*e);
            routing.weights.push(probs[*e as usize] / sum);
        }
    }
    routing
}

/// How one MoE layer routes its tokens (`--capacity-factor`, `--moe-overflow`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RouterConfig {
    /// Experts per token (`num_experts_per_tok`).
    pub top_k: usize,
    pub capacity: Capacity,
    /// Whether the kept pairs' weights are renormalised to sum to 1 per token (Mixtral,
    /// `norm_topk_prob`); else they stay the softmax probabilities over all experts.
    pub renormalize: bool,
    /// How logits become choices and weights (softmax, or sigmoid with groups).
    pub scoring: Scoring,
    /// `routed_scaling_factor`: every weight is multiplied by it, after renormalisation.
    pub scale: f32,
}

/// How a router turns one token's logits into its ranking of experts and their weights.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum Scoring {
    /// Softmax over all experts: ranked and weighted by the probabilities (Mixtral, Qwen,
    /// OLMoE).
    #[default]
    Softmax,
    /// Softmax over all experts, ranked only within the `keep` groups whose best probability
    /// is highest (DeepSeek-V2's `group_limited_greedy`).
    SoftmaxGrouped { group_limit: GroupLimit },
    /// `sigmoid(logit)` weights; ranked by them plus the layer's `e_score_correction_bias`
    /// (when it has one), within the groups `group_limit` keeps (DeepSeek-V3, GLM-4.5).
    Sigmoid { group_limit: Option<GroupLimit> },
}

impl Scoring {
    fn group_limit(self) -> Option<GroupLimit> {
        match self {
            Scoring::Softmax => None,
            Scoring::SoftmaxGrouped { group_limit } => Some(group_limit),
            Scoring::Sigmoid { group_limit } => group_limit,
        }
    }
}

/// Experts are chosen from the `keep` best of `groups` equal groups only (`n_group`,
/// `topk_group`); a group's score is the sum of its two best biased scores (`noaux_tc`), or
/// its best probability (`group_limited_greedy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupLimit {
    pub groups: usize,
    pub keep: usize,
}

impl RouterConfig {
    /// Every pair is computed, exactly as HF does (the default).
    pub fn dropless(top_k: usize) -> Self {
        RouterConfig {
            top_k,
            capacity: Capacity::Dropless,
            renormalize: true,
            scoring: Scoring::Softmax,
            scale: 1.0,
        }
    }

    /// Checks the config against a layer with `num_experts` experts; run once at start-up.
    pub fn validate(&self, num_experts: usize) -> Result<(), ConfigError> {
        if self.top_k == 0 || self.top_k > num_experts {
            return Err(ConfigError {
                field: "top_k",
                message: format!("must be in 1..={num_experts}, got {}", self.top_k),
            });
        }
        if let Some(GroupLimit { groups, keep }) = self.scoring.group_limit() {
            let bad = |message: String| {
                Err(ConfigError {
                    field: "n_group",
                    message,
                })
            };
            if groups == 0 || !num_experts.is_multiple_of(groups) {
                return bad(format!(
                    "{groups} groups do not divide {num_experts} experts"
                ));
            }
            if keep == 0 || keep > groups || self.top_k > keep * (num_experts / groups) {
                return bad(format!(
                    "topk_group {keep} of {groups} groups cannot hold {} experts",
                    self.top_k
                ));
            }
        }
        if !(self.scale.is_finite() && self.scale > 0.0) {
            return Err(ConfigError {
                field: "routed_scaling_factor",
                message: format!("must be a number above 0, got {}", self.scale),
            });
        }
        self.capacity.validate()
    }
}

/// One (token, expert) pair that is computed, with its final weight.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RoutedPair {
    /// Row of the step's hidden states.
    pub token: usize,
    pub expert: u32,
    /// The pair's share of the token's MoE output; a token's pairs sum to 1.
    pub weight: f32,
    /// 0 for the main pass; spilled pairs run in pass `ordinal / capacity` (≥ 1).
    pub pass: u32,
}

/// What the capacity limit did to one layer's step; add them up across layers and steps.
///
/// Invariant: `pairs == computed() + dropped`; `rerouted` and `spilled` pairs are computed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RoutingCounts {
    /// Pairs the router chose: `num_tokens * top_k`.
    pub pairs: u64,
    /// Pairs not computed (their expert was full, and for reroute no other expert had room).
    pub dropped: u64,
    /// Pairs moved to a lower-ranked expert with room.
    pub rerouted: u64,
    /// Pairs computed in an extra pass (pass ≥ 1).
    pub spilled: u64,
    /// Tokens that lost all their pairs: their MoE output is zero (the residual passes through).
    pub dropped_tokens: u64,
    /// Tokens through the layer's shared expert (every token, never capacity-limited; apart
    /// from the pairs, which count routed experts only). 0 without a shared expert.
    pub shared_expert_tokens: u64,
}

impl RoutingCounts {
    pub fn computed(&self) -> u64 {
        self.pairs - self.dropped
    }

    pub fn accumulate(&mut self, other: &RoutingCounts) {
        self.pairs += other.pairs;
        self.dropped += other.dropped;
        self.rerouted += other.rerouted;
        self.spilled += other.spilled;
        self.dropped_tokens += other.dropped_tokens;
        self.shared_expert_tokens += other.shared_expert_tokens;
    }
}

/// One layer's routing of one step after capacity.
///
/// `pairs` is token-major: token `t`'s pairs are `pairs[token_offsets[t]..token_offsets[t + 1]]`,
/// in the rank order of the router's choice (a rerouted pair takes the place of the pair it
/// replaces). Group them by `expert` to run the experts.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RoutedStep {
    pub num_tokens: usize,
    pub top_k: usize,
    /// `[num_tokens * top_k]`: the router's top-k before capacity, best first (what routing
    /// traces record).
    pub chosen_experts: Vec<u32>,
    /// The pairs that are computed.
    pub pairs: Vec<RoutedPair>,
    /// `[num_tokens + 1]`
    pub token_offsets: Vec<usize>,
    pub counts: RoutingCounts,
    /// `[num_experts]`: pairs computed per expert, all passes.
    pub expert_load: Vec<u32>,
    /// Slots per expert and pass; `None` when dropless.
    pub expert_capacity: Option<usize>,
    /// 1 unless spill needed extra passes; 0 for an empty step.
    pub num_passes: u32,
}

impl RoutedStep {
    pub fn num_experts(&self) -> usize {
        self.expert_load.len()
    }

    /// Token `token`'s computed pairs (empty when all of them were dropped).
    pub fn token_pairs(&self, token: usize) -> &[RoutedPair] {
        &self.pairs[self.token_offsets[token]..self.token_offsets[token + 1]]
    }

    /// The router's top-k experts of each token, before capacity.
    pub fn chosen_by_token(&self) -> std::slice::ChunksExact<'_, u32> {
        self.chosen_experts.chunks_exact(self.top_k.max(1))
    }
}

/// Routes every row of `router_logits: [num_tokens, num_experts]` under `config`.
///
/// Slots are taken in token order, and within a token in rank order, so the result is a pure
/// function of the logits. `config` must have passed `validate(num_experts)`.
pub fn route(router_logits: &[f32], num_experts: usize, config: &RouterConfig) -> RoutedStep {
    route_with_bias(router_logits, num_experts, config, None)
}

/// [`route`] with a layer's `e_score_correction_bias` (`[num_experts]`, sigmoid scoring only).
pub fn route_with_bias(
    router_logits: &[f32],
    num_experts: usize,
    config: &RouterConfig,
    correction_bias: Option<&[f32]>,
) -> RoutedStep {
    let mut routed = RoutedStep::default();
    route_into(
        router_logits,
        num_experts,
        config,
        correction_bias,
        &mut Ranking::default(),
        &mut routed,
    );
    routed
}

/// [`route_with_bias`] into `out`, reusing its buffers and those of `ranking` (a step's
/// workspace).
pub(crate) fn route_into(
    router_logits: &[f32],
    num_experts: usize,
    config: &RouterConfig,
    correction_bias: Option<&[f32]>,
    ranking: &mut Ranking,
    out: &mut RoutedStep,
) {
    ranking.rank_scored(router_logits, num_experts, config.scoring, correction_bias);
    let top_k = config.top_k;
    out.num_tokens = ranking.num_tokens();
    out.top_k = top_k;
    out.chosen_experts.clear();
    out.chosen_experts
        .extend((0..ranking.num_tokens()).flat_map(|t| ranking.order(t)[..top_k].iter().copied()));
    capacity::assign(ranking, config, out);
}

/// Each token's expert weights (softmax probabilities or sigmoid scores) and its experts in
/// the order the router prefers them.
#[derive(Default)]
pub(crate) struct Ranking {
    num_experts: usize,
    /// `[num_tokens * num_experts]`: what a chosen expert weighs (before renormalisation).
    probs: Vec<f32>,
    /// `[num_tokens * num_experts]`: expert ids, best first; ties keep the lower index first.
    order: Vec<u32>,
    /// One token's choice values (sigmoid scoring) and group scores, reused.
    choice: Vec<f32>,
    groups: Vec<(f32, usize)>,
}

impl Ranking {
    pub(crate) fn new(router_logits: &[f32], num_experts: usize) -> Self {
        let mut ranking = Ranking::default();
        ranking.rank(router_logits, num_experts);
        ranking
    }

    /// Ranks the rows of `router_logits` by softmax, reusing this ranking's buffers.
    pub(crate) fn rank(&mut self, router_logits: &[f32], num_experts: usize) {
        self.rank_scored(router_logits, num_experts, Scoring::Softmax, None);
    }

    /// Ranks the rows of `router_logits` under `scoring`, reusing this ranking's buffers.
    pub(crate) fn rank_scored(
        &mut self,
        router_logits: &[f32],
        num_experts: usize,
        scoring: Scoring,
        correction_bias: Option<&[f32]>,
    ) {
        let (probs, order) = (&mut self.probs, &mut self.order);
        probs.clear();
        probs.extend_from_slice(&router_logits[..router_logits.len() / num_experts * num_experts]);
        order.clear();
        for row in probs.chunks_exact_mut(num_experts) {
            let start = order.len();
            order.extend(0..num_experts as u32);
            let ranked = &mut order[start..];
            match scoring {
                Scoring::Softmax => {
                    cpu::softmax_in_place(row);
                    sort_descending(ranked, row);
                }
                Scoring::SoftmaxGrouped { group_limit } => {
                    cpu::softmax_in_place(row);
                    let choice = &mut self.choice;
                    choice.clear();
                    choice.extend_from_slice(row);
                    mask_groups(choice, group_limit, GroupScore::Best, &mut self.groups);
                    sort_descending(ranked, choice);
                }
                Scoring::Sigmoid { group_limit } => {
                    row.iter_mut().for_each(|x| *x = 1.0 / (1.0 + (-*x).exp()));
                    let choice = &mut self.choice;
                    choice.clear();
                    choice.extend_from_slice(row);
                    if let Some(bias) = correction_bias {
                        choice.iter_mut().zip(bias).for_each(|(c, b)| *c += b);
                    }
                    if let Some(limit) = group_limit {
                        mask_groups(choice, limit, GroupScore::TopTwoSum, &mut self.groups);
                    }
                    sort_descending(ranked, choice);
                }
            }
        }
        self.num_experts = num_experts;
    }

    pub(crate) fn num_tokens(&self) -> usize {
        self.probs.len() / self.num_experts
    }

    pub(crate) fn num_experts(&self) -> usize {
        self.num_experts
    }

    pub(crate) fn probs(&self, token: usize) -> &[f32] {
        &self.probs[token * self.num_experts..(token + 1) * self.num_experts]
    }

    pub(crate) fn order(&self, token: usize) -> &[u32] {
        &self.order[token * self.num_experts..(token + 1) * self.num_experts]
    }
}

/// `experts` by descending `value`, lower index first among ties (what a stable sort gives; the
/// unstable sort never allocates).
fn sort_descending(experts: &mut [u32], value: &[f32]) {
    experts.sort_unstable_by(|a, b| {
        value[*b as usize]
            .total_cmp(&value[*a as usize])
            .then(a.cmp(b))
    });
}

/// How a group of experts is scored when groups are limited.
#[derive(Clone, Copy)]
enum GroupScore {
    /// The sum of its two best values, as HF's (DeepSeek-V3)
    /// `scores_for_choice.view(-1, n_group, E // n_group).topk(2)[0].sum(-1)`.
    TopTwoSum,
    /// Its best value, as HF's (DeepSeek-V2) `scores.view(-1, n_group, E // n_group).max(-1)`.
    Best,
}

/// Sets the choice values of the experts outside the `keep` best groups to -inf (they rank
/// last).
fn mask_groups(
    choice: &mut [f32],
    limit: GroupLimit,
    by: GroupScore,
    groups: &mut Vec<(f32, usize)>,
) {
    let size = choice.len() / limit.groups;
    groups.clear();
    for (g, members) in choice.chunks_exact(size).enumerate() {
        let (mut best, mut second) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
        for &v in members {
            if v > best {
                (best, second) = (v, best);
            } else if v > second {
                second = v;
            }
        }
        let score = match by {
            GroupScore::TopTwoSum if size > 1 => best + second,
            _ => best,
        };
        groups.push((score, g));
    }
    groups.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    for &(_, g) in &groups[limit.keep..] {
        choice[g * size..(g + 1) * size].fill(f32::NEG_INFINITY);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::moe::capacity::OverflowPolicy;

    /// Deterministic pseudo-random logits with a few exact ties.
    fn logits(num_tokens: usize, num_experts: usize, seed: u64) -> Vec<f32> {
        let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
        (0..num_tokens * num_experts)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 40) % 7) as f32 * 0.5 - 1.5
            })
            .collect()
    }

    fn factor(alpha: f32, overflow: OverflowPolicy, top_k: usize) -> RouterConfig {
        RouterConfig {
            top_k,
            capacity: Capacity::Factor { alpha, overflow },
            renormalize: true,
            scoring: Default::default(),
            scale: 1.0,
        }
    }

    fn assert_matches_top_k(step: &RoutedStep, reference: &Routing) {
        let ids: Vec<u32> = step.pairs.iter().map(|p| p.expert).collect();
        let weights: Vec<f32> = step.pairs.iter().map(|p| p.weight).collect();
        assert_eq!(ids, reference.expert_ids);
        assert_eq!(weights, reference.weights);
        assert_eq!(step.chosen_experts, reference.expert_ids);
    }

    #[test]
    fn without_renormalisation_the_weights_stay_the_softmax_probabilities() {
        let logits = [0.0, 2.0, 1.0, -1.0];
        let config = RouterConfig {
            renormalize: false,
            ..RouterConfig::dropless(2)
        };
        let step = route(&logits, 4, &config);
        let mut probs = logits.to_vec();
        cpu::softmax_in_place(&mut probs);
        let got: Vec<(u32, f32)> = step.pairs.iter().map(|p| (p.expert, p.weight)).collect();
        assert_eq!(got, vec![(1, probs[1]), (2, probs[2])]);
        assert!(got.iter().map(|p| p.1).sum::<f32>() < 0.95);
        // With it (Mixtral), the same pairs sum to 1.
        let renormalised = route(&logits, 4, &RouterConfig::dropless(2));
        let sum: f32 = renormalised.pairs.iter().map(|p| p.weight).sum();
        assert!((sum - 1.0).abs() < 1e-6);
    }

    #[test]
    fn picks_the_largest_logits_and_renormalises() {
        let r = route_top_k(&[0.0, 2.0, 1.0, -1.0], 4, 2);
        assert_eq!(r.expert_ids, vec![1, 2]);
        let e = std::f32::consts::E;
        assert!((r.weights[0] - e / (e + 1.0)).abs() < 1e-6);
        assert!((r.weights.iter().sum::<f32>() - 1.0).abs() < 1e-6);
    }

    #[test]
    fn ties_go_to_the_lower_expert() {
        let r = route_top_k(&[1.0, 3.0, 3.0, 3.0, 1.0, 1.0], 3, 2);
        assert_eq!(r.expert_ids, vec![1, 2, 0, 1]);
        assert_eq!(r.num_tokens(), 2);
    }

    #[test]
    fn top_k_of_all_experts_keeps_softmax_weights() {
        let r = route_top_k(&[0.5, 0.5], 2, 2);
        assert_eq!(r.weights, vec![0.5, 0.5]);
    }

    #[test]
    fn dropless_and_spill_equal_route_top_k_for_k_1_to_4() {
        for top_k in 1..=4 {
            let x = logits(37, 6, top_k as u64);
            let reference = route_top_k(&x, 6, top_k);
            let dropless = route(&x, 6, &RouterConfig::dropless(top_k));
            assert_matches_top_k(&dropless, &reference);
            assert_eq!(dropless.counts.pairs, 37 * top_k as u64);
            assert_eq!(dropless.num_passes, 1);
            let spill = route(&x, 6, &factor(0.5, OverflowPolicy::Spill, top_k));
            assert_matches_top_k(&spill, &reference);
            assert_eq!(spill.counts.dropped, 0);
        }
    }

    #[test]
    fn pairs_are_token_major_with_offsets() {
        let x = logits(5, 4, 9);
        let step = route(&x, 4, &RouterConfig::dropless(2));
        assert_eq!(step.token_offsets, vec![0, 2, 4, 6, 8, 10]);
        for t in 0..5 {
            assert!(step.token_pairs(t).iter().all(|p| p.token == t));
        }
        assert_eq!(step.chosen_by_token().count(), 5);
        assert_eq!(step.expert_load.iter().sum::<u32>(), 10);
    }

    #[test]
    fn routing_is_deterministic() {
        let x = logits(64, 8, 3);
        for policy in [
            OverflowPolicy::Drop,
            OverflowPolicy::Reroute,
            OverflowPolicy::Spill,
        ] {
            let config = factor(0.75, policy, 2);
            assert_eq!(route(&x, 8, &config), route(&x, 8, &config));
        }
    }

    #[test]
    fn empty_step_routes_nothing() {
        let step = route(&[], 4, &factor(1.0, OverflowPolicy::Drop, 2));
        assert_eq!(step.num_tokens, 0);
        assert!(step.pairs.is_empty());
        assert_eq!(step.token_offsets, vec![0]);
        assert_eq!(step.counts, RoutingCounts::default());
        assert_eq!(step.num_passes, 0);
        assert_eq!(step.expert_load, vec![0; 4]);
    }

    #[test]
    fn validate_rejects_top_k_outside_the_experts() {
        assert_eq!(
            RouterConfig::dropless(0).validate(8).unwrap_err().field,
            "top_k"
        );
        assert_eq!(
            RouterConfig::dropless(9).validate(8).unwrap_err().field,
            "top_k"
        );
        RouterConfig::dropless(8).validate(8).unwrap();
    }

    #[test]
    fn counts_accumulate_across_layers() {
        let mut total = RoutingCounts::default();
        let one = RoutingCounts {
            pairs: 8,
            dropped: 2,
            rerouted: 1,
            spilled: 0,
            dropped_tokens: 1,
            shared_expert_tokens: 4,
        };
        total.accumulate(&one);
        total.accumulate(&one);
        assert_eq!(total.pairs, 16);
        assert_eq!(total.shared_expert_tokens, 8);
        assert_eq!(total.computed(), 12);
        assert_eq!(total.dropped_tokens, 2);
    }

    fn sigmoid(x: f32) -> f32 {
        1.0 / (1.0 + (-x).exp())
    }

    /// GLM-4.5 / DeepSeek-V3 routing written out for one token: the groups whose two best
    /// biased scores sum highest are kept, the best biased scores among them chosen, and the
    /// unbiased scores renormalised and scaled.
    #[test]
    fn sigmoid_routing_chooses_within_the_best_groups_by_the_biased_scores() {
        // 8 experts in 4 groups of 2. Expert 0 has the best raw score, but its group (0, 1)
        // sums lowest once biased; the bias lifts expert 5 above expert 4.
        let logits = [3.0, -4.0, 0.5, 0.4, 1.0, 0.9, 0.2, 0.1];
        let bias = [0.0, 0.0, 0.0, 0.0, 0.0, 0.2, 0.0, 0.0];
        let config = RouterConfig {
            scoring: Scoring::Sigmoid {
                group_limit: Some(GroupLimit { groups: 4, keep: 2 }),
            },
            scale: 2.5,
            ..RouterConfig::dropless(3)
        };
        config.validate(8).unwrap();
        let step = route_with_bias(&logits, 8, &config, Some(&bias));
        // Group sums (biased): g0 0.95 + 0.02, g1 0.62 + 0.60, g2 0.73 + 0.91, g3 0.55 + 0.52.
        // Kept: g2 and g1; within them by biased score: 5, 4, 2.
        assert_eq!(step.chosen_experts, [5, 4, 2]);
        let scores: Vec<f32> = [5, 4, 2].iter().map(|&e| sigmoid(logits[e])).collect();
        let sum: f32 = scores.iter().sum();
        let got: Vec<f32> = step.pairs.iter().map(|p| p.weight).collect();
        let want: Vec<f32> = scores.iter().map(|s| s / sum * 2.5).collect();
        assert_eq!(got, want);
        // Without the group limit expert 0 wins; without renormalisation the weights are the
        // scores themselves, scaled.
        let open = RouterConfig {
            scoring: Scoring::Sigmoid { group_limit: None },
            renormalize: false,
            ..config
        };
        let step = route_with_bias(&logits, 8, &open, Some(&bias));
        assert_eq!(step.chosen_experts, [0, 5, 4]);
        assert_eq!(step.pairs[0].weight, sigmoid(3.0) * 2.5);
    }

    #[test]
    fn validate_rejects_groups_that_cannot_hold_the_choice() {
        let grouped = |groups, keep, top_k| RouterConfig {
            scoring: Scoring::Sigmoid {
                group_limit: Some(GroupLimit { groups, keep }),
            },
            ..RouterConfig::dropless(top_k)
        };
        assert_eq!(grouped(3, 1, 2).validate(8).unwrap_err().field, "n_group");
        assert_eq!(grouped(4, 5, 2).validate(8).unwrap_err().field, "n_group");
        assert_eq!(grouped(4, 1, 3).validate(8).unwrap_err().field, "n_group");
        grouped(4, 2, 4).validate(8).unwrap();
        let unscaled = RouterConfig {
            scale: 0.0,
            ..RouterConfig::dropless(2)
        };
        assert_eq!(
            unscaled.validate(8).unwrap_err().field,
            "routed_scaling_factor"
        );
    }
}
