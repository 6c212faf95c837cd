//! The experts of one sparse MoE block, computed grouped: the tokens routed to an expert are
//! gathered into one contiguous matrix and go through that expert's SwiGLU MLP as one GEMM, so
//! each routed expert's weights are read once per step, whatever the number of its tokens.
//!
//! HF `MixtralBlockSparseTop2MLP`: `w2(act_fn(w1(x)) * w3(x))`, outputs weighted by the router
//! and summed per token in expert order (`index_add_`).

use moeserve_backend::{Weight, cpu};

use super::router::{Routing, route_top_k};
use crate::Result;
use crate::checkpoint::Checkpoint;
use crate::config::MixtralConfig;

/// One expert's SwiGLU MLP.
pub struct Expert {
    /// gate projection `[intermediate, hidden]`
    pub w1: Weight,
    /// down projection `[hidden, intermediate]`
    pub w2: Weight,
    /// up projection `[intermediate, hidden]`
    pub w3: Weight,
}

/// Router plus experts of one layer.
pub struct SparseMoe {
    /// `[num_experts, hidden]`
    pub gate: Weight,
    pub experts: Vec<Expert>,
    pub top_k: usize,
}

/// The tokens routed to each expert, in token order, with their routing weights.
#[derive(Debug, Default)]
struct ExpertGroups {
    /// `offsets[e]..offsets[e + 1]` indexes `tokens`/`weights` for expert `e`.
    offsets: Vec<usize>,
    tokens: Vec<usize>,
    weights: Vec<f32>,
}

impl ExpertGroups {
    /// Counting sort of the (token, expert) pairs by expert.
    fn from_routing(routing: &Routing, num_experts: usize) -> Self {
        let mut counts = vec![0usize; num_experts + 1];
        routing
            .expert_ids
            .iter()
            .for_each(|e| counts[*e as usize + 1] += 1);
        for e in 0..num_experts {
            counts[e + 1] += counts[e];
        }
        let offsets = counts.clone();
        let mut cursor = counts;
        let n = routing.expert_ids.len();
        let (mut tokens, mut weights) = (vec![0; n], vec![0.0; n]);
        for (pair, (e, w)) in routing.expert_ids.iter().zip(&routing.weights).enumerate() {
            let at = &mut cursor[*e as usize];
            tokens[*at] = pair / routing.top_k;
            weights[*at] = *w;
            *at += 1;
        }
        ExpertGroups {
            offsets,
            tokens,
            weights,
        }
    }
}

impl SparseMoe {
    /// Loads `{prefix}.gate.weight` and `{prefix}.experts.{e}.w{1,2,3}.weight`.
    pub fn load(ckpt: &Checkpoint, prefix: &str, config: &MixtralConfig) -> Result<Self> {
        let (h, i, n) = (
            config.hidden_size,
            config.intermediate_size,
            config.num_local_experts,
        );
        let experts = (0..n)
            .map(|e| {
                let p = format!("{prefix}.experts.{e}");
                Ok(Expert {
                    w1: ckpt.weight(&format!("{p}.w1.weight"), &[i, h])?,
                    w2: ckpt.weight(&format!("{p}.w2.weight"), &[h, i])?,
                    w3: ckpt.weight(&format!("{p}.w3.weight"), &[i, h])?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(SparseMoe {
            gate: ckpt.weight(&format!("{prefix}.gate.weight"), &[n, h])?,
            experts,
            top_k: config.num_experts_per_tok,
        })
    }

    pub fn num_experts(&self) -> usize {
        self.experts.len()
    }

    /// Router logits `[num_tokens, num_experts]` of the normed input `x: [num_tokens, hidden]`.
    pub fn router_logits(&self, x: &[f32], num_tokens: usize) -> Vec<f32> {
        let mut logits = vec![0.0; num_tokens * self.num_experts()];
        cpu::matmul_wt(x, num_tokens, &self.gate, &mut logits);
        logits
    }

    /// `out[t] = Σ_k weight(t, k) · expert_k(x[t])`; `x, out: [num_tokens, hidden]`.
    pub fn forward(&self, x: &[f32], router_logits: &[f32], out: &mut [f32]) {
        let hidden = self.gate.shape()[1];
        let routing = route_top_k(router_logits, self.num_experts(), self.top_k);
        let groups = ExpertGroups::from_routing(&routing, self.num_experts());
        out.fill(0.0);
        // Expert outputs per (token, k) pair, added to `out` in expert order at the end so the
        // sum order per token matches HF's `index_add_` loop over experts.
        let mut expert_out = vec![0.0f32; groups.tokens.len() * hidden];
        for (e, expert) in self.experts.iter().enumerate() {
            let range = groups.offsets[e]..groups.offsets[e + 1];
            if range.is_empty() {
                continue;
            }
            let rows = &groups.tokens[range.clone()];
            let gathered: Vec<f32> = rows
                .iter()
                .flat_map(|t| &x[t * hidden..(t + 1) * hidden])
                .copied()
                .collect();
            let y = &mut expert_out[range.start * hidden..range.end * hidden];
            expert.forward(&gathered, rows.len(), y);
        }
        for (pair, (t, w)) in groups.tokens.iter().zip(&groups.weights).enumerate() {
            let o = &mut out[t * hidden..(t + 1) * hidden];
            let y = &expert_out[pair * hidden..(pair + 1) * hidden];
            o.iter_mut().zip(y).for_each(|(o, y)| *o += w * y);
        }
    }
}

impl Expert {
    /// SwiGLU of `x: [n, hidden]` into `out: [n, hidden]`, each weight read once for all rows.
    fn forward(&self, x: &[f32], n: usize, out: &mut [f32]) {
        let inter = self.w1.shape()[0];
        let mut gate = vec![0.0; n * inter]; // [n, intermediate]
        let mut up = vec![0.0; n * inter];
        cpu::matmul_wt(x, n, &self.w1, &mut gate);
        cpu::matmul_wt(x, n, &self.w3, &mut up);
        cpu::silu_mul(&mut gate, &up);
        cpu::matmul_wt(&gate, n, &self.w2, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_pairs_by_expert_in_token_order() {
        let routing = Routing {
            top_k: 2,
            expert_ids: vec![2, 0, 0, 2, 1, 2],
            weights: vec![0.6, 0.4, 0.7, 0.3, 0.5, 0.5],
        };
        let g = ExpertGroups::from_routing(&routing, 3);
        assert_eq!(g.offsets, vec![0, 2, 3, 6]);
        assert_eq!(g.tokens, vec![0, 1, 2, 0, 1, 2]);
        assert_eq!(g.weights, vec![0.4, 0.7, 0.5, 0.6, 0.3, 0.5]);
    }
}
