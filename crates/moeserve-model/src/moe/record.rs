//! How a forward pass's MoE layers route and where their experts run ([`MoeOptions`]), and
//! what they report back per layer ([`LayerRouting`]): the routing counts, per-expert loads,
//! the router's choices (for routing traces), per-token pair counts (so the engine can charge
//! dropped and rerouted pairs to requests) and per-device pairs and compute time.

use std::ops::Range;

use super::arena::ExpertParallel;
use super::capacity::Capacity;
use super::router::{RoutedStep, RoutingCounts};

/// MoE settings of one forward pass.
#[derive(Default)]
pub struct MoeOptions<'a> {
    /// Dropless (HF routing, the default) or a capacity factor with an overflow policy.
    pub capacity: Capacity,
    /// Experts spread over devices; `None` runs the model's own experts on the caller's threads.
    pub experts: Option<&'a ExpertParallel>,
    /// Receives one [`LayerRouting`] per MoE layer, in layer order (appended).
    pub record: Option<&'a mut MoeStepRecord>,
}

/// One token's pairs that the capacity limit changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TokenPairCounts {
    /// Pairs not computed.
    pub dropped: u32,
    /// Pairs moved to a lower-ranked expert.
    pub rerouted: u32,
    /// Pairs computed in an extra pass.
    pub spilled: u32,
}

impl TokenPairCounts {
    pub fn accumulate(&mut self, other: &TokenPairCounts) {
        self.dropped += other.dropped;
        self.rerouted += other.rerouted;
        self.spilled += other.spilled;
    }
}

/// One MoE layer's step, summarised.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LayerRouting {
    pub counts: RoutingCounts,
    /// `[num_experts]`: pairs computed per logical expert, all passes.
    pub expert_load: Vec<u32>,
    pub top_k: usize,
    /// `[num_tokens * top_k]`: the router's top-k per token before capacity, best first.
    pub chosen_experts: Vec<u32>,
    /// `[num_tokens]` when a capacity factor is set; empty when dropless (nothing changes).
    pub token_counts: Vec<TokenPairCounts>,
    /// `[num_devices]`: pairs each device computed.
    pub device_pairs: Vec<u64>,
    /// `[num_devices]`: seconds each device spent in expert compute.
    pub device_seconds: Vec<f64>,
}

impl LayerRouting {
    /// The routing part of the summary (device figures are filled in after the experts ran).
    pub(crate) fn from_routed(routed: &RoutedStep, capacity: &Capacity) -> Self {
        let token_counts = match capacity {
            Capacity::Dropless => Vec::new(),
            Capacity::Factor { .. } => (0..routed.num_tokens)
                .map(|t| token_pair_counts(routed, t))
                .collect(),
        };
        LayerRouting {
            counts: routed.counts,
            expert_load: routed.expert_load.clone(),
            top_k: routed.top_k,
            chosen_experts: routed.chosen_experts.clone(),
            token_counts,
            device_pairs: Vec::new(),
            device_seconds: Vec::new(),
        }
    }

    pub fn num_tokens(&self) -> usize {
        self.chosen_experts.len() / self.top_k.max(1)
    }

    /// The router's top-k of each token, before capacity.
    pub fn chosen_by_token(&self) -> std::slice::ChunksExact<'_, u32> {
        self.chosen_experts.chunks_exact(self.top_k.max(1))
    }

    /// The pair counts of the step tokens `tokens` (one request's rows); zero when dropless.
    pub fn pair_counts(&self, tokens: Range<usize>) -> TokenPairCounts {
        let mut total = TokenPairCounts::default();
        if let Some(counts) = self.token_counts.get(tokens) {
            counts.iter().for_each(|c| total.accumulate(c));
        }
        total
    }
}

/// A rerouted pair's expert is not among the token's chosen top-k (reroute only takes experts
/// ranked below them); a spilled pair runs after pass 0.
fn token_pair_counts(routed: &RoutedStep, token: usize) -> TokenPairCounts {
    let chosen = &routed.chosen_experts[token * routed.top_k..(token + 1) * routed.top_k];
    let pairs = routed.token_pairs(token);
    TokenPairCounts {
        dropped: (routed.top_k - pairs.len()) as u32,
        rerouted: pairs.iter().filter(|p| !chosen.contains(&p.expert)).count() as u32,
        spilled: pairs.iter().filter(|p| p.pass > 0).count() as u32,
    }
}

/// Every MoE layer's summary of one forward pass.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MoeStepRecord {
    /// In layer order.
    pub layers: Vec<LayerRouting>,
}

impl MoeStepRecord {
    /// All layers' counts added up.
    pub fn total_counts(&self) -> RoutingCounts {
        let mut total = RoutingCounts::default();
        self.layers.iter().for_each(|l| total.accumulate(&l.counts));
        total
    }

    /// One request's pairs over all layers: its step tokens are `tokens`.
    pub fn pair_counts(&self, tokens: Range<usize>) -> TokenPairCounts {
        let mut total = TokenPairCounts::default();
        for layer in &self.layers {
            total.accumulate(&layer.pair_counts(tokens.clone()));
        }
        total
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::moe::capacity::OverflowPolicy;
    use crate::moe::router::{RouterConfig, route};

    fn routed(overflow: OverflowPolicy, alpha: f32) -> (RoutedStep, Capacity) {
        let capacity = Capacity::Factor { alpha, overflow };
        // Four tokens ranking 0 > 1 > 2 > 3; C = ceil(4·2/4·α).
        let logits = [3.0, 2.0, 1.0, 0.0].repeat(4);
        let config = RouterConfig { top_k: 2, capacity };
        (route(&logits, 4, &config), capacity)
    }

    #[test]
    fn dropped_pairs_are_charged_to_their_tokens() {
        let (step, capacity) = routed(OverflowPolicy::Drop, 1.0); // C = 2
        let summary = LayerRouting::from_routed(&step, &capacity);
        let per_token: Vec<u32> = summary.token_counts.iter().map(|c| c.dropped).collect();
        assert_eq!(per_token, vec![0, 0, 2, 2]);
        assert_eq!(summary.pair_counts(1..3).dropped, 2);
        assert_eq!(
            u64::from(summary.pair_counts(0..4).dropped),
            step.counts.dropped
        );
    }

    #[test]
    fn rerouted_and_spilled_pairs_are_recognised() {
        let (step, capacity) = routed(OverflowPolicy::Reroute, 1.0);
        let summary = LayerRouting::from_routed(&step, &capacity);
        assert_eq!(
            u64::from(summary.pair_counts(0..4).rerouted),
            step.counts.rerouted
        );
        assert!(step.counts.rerouted > 0);
        let (step, capacity) = routed(OverflowPolicy::Spill, 0.5);
        let summary = LayerRouting::from_routed(&step, &capacity);
        assert_eq!(
            u64::from(summary.pair_counts(0..4).spilled),
            step.counts.spilled
        );
        assert!(step.counts.spilled > 0);
    }

    #[test]
    fn dropless_keeps_no_token_counts_and_layers_add_up() {
        let logits = [3.0, 2.0, 1.0, 0.0].repeat(3);
        let step = route(&logits, 4, &RouterConfig::dropless(2));
        let summary = LayerRouting::from_routed(&step, &Capacity::Dropless);
        assert!(summary.token_counts.is_empty());
        assert_eq!(summary.pair_counts(0..3), TokenPairCounts::default());
        assert_eq!(summary.num_tokens(), 3);
        assert_eq!(summary.chosen_by_token().next(), Some(&[0u32, 1][..]));
        let record = MoeStepRecord {
            layers: vec![summary.clone(), summary],
        };
        assert_eq!(record.total_counts().pairs, 12);
    }
}
