//! How a forward pass's MoE layers route and where their experts run ([`MoeOptions`]), and
//! what they report back per layer ([`LayerRouting`]): the routing counts, per-expert loads,
//! the router's choices (for routing traces), per-token pair counts (so the engine can charge
//! dropped and rerouted pairs to requests) and per-device pairs and compute time.

use std::ops::Range;

use super::arena::ExpertParallel;
use super::capacity::Capacity;
use super::router::{RoutedStep, RoutingCounts};
use crate::config::ModelConfig;

/// MoE settings of one forward pass.
#[derive(Default)]
pub struct MoeOptions<'a> {
    /// Dropless (HF routing, the default) or a capacity factor with an overflow policy.
    pub capacity: Capacity,
    /// Experts spread over devices; `None` runs the model's own experts on the caller's threads.
    pub experts: Option<&'a ExpertParallel>,
    /// Receives one [`LayerRouting`] per MoE layer, in layer order (appended; a record
    /// [`MoeStepRecord::clear`]ed between steps reuses its buffers).
    pub record: Option<&'a mut MoeStepRecord>,
}

impl MoeOptions<'_> {
    /// A valid capacity and, with expert parallelism, a placement made for a model of `config`
    /// (its sparse layers and experts); checked before every forward, on any backend.
    pub(crate) fn check(&self, config: &ModelConfig) -> crate::Result<()> {
        let invalid = |message: String| Err(crate::ModelError::InvalidInput { message });
        if let Err(e) = self.capacity.validate() {
            return invalid(e.to_string());
        }
        if let Some(ep) = self.experts {
            let p = ep.placement();
            let c = config;
            if p.num_layers() != c.num_moe_layers() || p.num_experts() != c.num_local_experts {
                return invalid(format!(
                    "the expert placement is for {} layers of {} experts, the model has {} of {}",
                    p.num_layers(),
                    p.num_experts(),
                    c.num_moe_layers(),
                    c.num_local_experts
                ));
            }
        }
        Ok(())
    }
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
    #[cfg(any(test, feature = "cuda"))]
    pub(crate) fn from_routed(routed: &RoutedStep, capacity: &Capacity) -> Self {
        let mut summary = LayerRouting::default();
        summary.set_routed(routed, capacity);
        summary
    }

    /// [`LayerRouting::from_routed`] into this summary's buffers; the device figures are
    /// cleared.
    pub(crate) fn set_routed(&mut self, routed: &RoutedStep, capacity: &Capacity) {
        self.counts = routed.counts;
        self.top_k = routed.top_k;
        self.expert_load.clear();
        self.expert_load.extend_from_slice(&routed.expert_load);
        self.chosen_experts.clear();
        self.chosen_experts
            .extend_from_slice(&routed.chosen_experts);
        self.token_counts.clear();
        if let Capacity::Factor { .. } = capacity {
            let counts = (0..routed.num_tokens).map(|t| token_pair_counts(routed, t));
            self.token_counts.extend(counts);
        }
        self.device_pairs.clear();
        self.device_seconds.clear();
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
#[derive(Clone, Debug, Default)]
pub struct MoeStepRecord {
    /// In layer order.
    pub layers: Vec<LayerRouting>,
    /// Summaries of an earlier step kept for their buffers (see [`MoeStepRecord::clear`]).
    spare: Vec<LayerRouting>,
}

impl PartialEq for MoeStepRecord {
    fn eq(&self, other: &Self) -> bool {
        self.layers == other.layers
    }
}

impl MoeStepRecord {
    /// Empties the record for the next step; its summaries' buffers are reused, so recording
    /// a step of the same size allocates nothing.
    pub fn clear(&mut self) {
        self.spare.append(&mut self.layers);
    }

    /// A summary appended for the next layer (a reused one when the record was cleared).
    pub(crate) fn push_layer(&mut self) -> &mut LayerRouting {
        let summary = self.spare.pop().unwrap_or_default();
        self.layers.push(summary);
        self.layers.last_mut().expect("just pushed")
    }

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
        let config = RouterConfig {
            top_k: 2,
            capacity,
            renormalize: true,
            scoring: Default::default(),
            scale: 1.0,
        };
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
            ..MoeStepRecord::default()
        };
        assert_eq!(record.total_counts().pairs, 12);
    }
}
