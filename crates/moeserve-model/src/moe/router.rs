//! Top-k routing as HF `MixtralSparseMoeBlock` does it:
//!
//! ```python
//! routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
//! routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
//! routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
//! ```
//! Ties go to the lower expert index.

use moeserve_backend::cpu;

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
    let num_tokens = router_logits.len() / num_experts;
    let mut routing = Routing {
        top_k,
        expert_ids: Vec::with_capacity(num_tokens * top_k),
        weights: Vec::with_capacity(num_tokens * top_k),
    };
    let mut probs = vec![0.0; num_experts];
    let mut order: Vec<u32> = Vec::with_capacity(num_experts);
    for row in router_logits.chunks_exact(num_experts) {
        probs.copy_from_slice(row);
        cpu::softmax_in_place(&mut probs);
        order.clear();
        order.extend(0..num_experts as u32);
        // Stable sort by descending probability keeps lower indices first among ties.
        order.sort_by(|a, b| probs[*b as usize].total_cmp(&probs[*a as usize]));
        let chosen = &order[..top_k];
        let sum: f32 = chosen.iter().map(|e| probs[*e as usize]).sum();
        for e in chosen {
            routing.expert_ids.push(*e);
            routing.weights.push(probs[*e as usize] / sum);
        }
    }
    routing
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
