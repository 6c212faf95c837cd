//! How many bytes of weights each GPU holds: every tensor `DeviceModel::build` uploads, by
//! [`Tensor`] and its shape, and with expert parallelism the experts each GPU's placement puts
//! on it (one copy per expert however many of its slots replicate it). The GPU test checks
//! these figures against what the model really uploaded.

use moeserve_core::ExpertPlacement;

use super::weights::{Tensor, tensor_shape};
use crate::config::{ModelConfig, QkNorm};
use crate::models::ops::LayerWeight;

/// The tensors of layer `l` the device model uploads besides its routed experts.
pub(super) fn layer_tensors(c: &ModelConfig, l: usize) -> Vec<Tensor> {
    use LayerWeight as W;
    let mut t = vec![Tensor::InputNorm(l), Tensor::PostNorm(l)];
    let mut attn = |on: bool, role| {
        if on {
            t.push(Tensor::Attention(l, role));
        }
    };
    match &c.mla {
        Some(m) => {
            let low_rank = m.q_lora_rank.is_some();
            attn(!low_rank, W::QProj);
            attn(true, W::OProj);
            attn(m.bias, W::OBias);
            attn(low_rank, W::QAProj);
            attn(low_rank && m.bias, W::QABias);
            attn(low_rank, W::QANorm);
            attn(low_rank, W::QBProj);
            attn(true, W::KvAProj);
            attn(m.bias, W::KvABias);
            attn(true, W::KvANorm);
            t.extend([Tensor::AbsorbKey(l), Tensor::ExpandValue(l)]);
        }
        None => {
            let a = &c.attention;
            for role in [W::QProj, W::KProj, W::VProj, W::OProj] {
                attn(true, role);
            }
            for role in [W::QBias, W::KBias, W::VBias] {
                attn(a.qkv_bias, role);
            }
            attn(a.o_bias, W::OBias);
            attn(a.qk_norm != QkNorm::None, W::QNorm);
            attn(a.qk_norm != QkNorm::None, W::KNorm);
        }
    }
    if c.sparse_layers[l] {
        t.push(Tensor::Gate(l));
        if let Some(s) = c.shared_expert {
            t.extend([Tensor::SharedW13(l), Tensor::SharedW2(l)]);
            if s.gated {
                t.push(Tensor::SharedGate(l));
            }
        }
    } else {
        t.extend([Tensor::DenseW13(l), Tensor::DenseW2(l)]);
    }
    t
}

fn elements(c: &ModelConfig, tensors: impl IntoIterator<Item = Tensor>) -> u64 {
    tensors
        .into_iter()
        .map(|t| tensor_shape(c, t).0 as u64)
        .sum()
}

/// Elements of everything but the routed experts: embeddings, every layer's attention, norms,
/// router, shared expert or dense MLP, the final norm and lm_head (what GPU 0 holds).
pub(super) fn non_expert_elements(c: &ModelConfig) -> u64 {
    let top = [Tensor::Embed, Tensor::Norm, Tensor::LmHead];
    elements(c, top)
        + (0..c.num_hidden_layers)
            .map(|l| elements(c, layer_tensors(c, l)))
            .sum::<u64>()
}

/// Elements of one routed expert (`w1 | w3` and `w2`).
fn expert_elements(c: &ModelConfig) -> u64 {
    elements(c, [Tensor::W13(0, 0), Tensor::W2(0, 0)])
}

/// Bytes of weights on each GPU for a model of `c` whose elements take `element_bytes`:
/// `[total]` on one GPU, else one figure per device of `placement` (GPU 0 adds everything but
/// the experts to its own experts).
pub fn weight_bytes_per_gpu(
    c: &ModelConfig,
    element_bytes: usize,
    placement: Option<&ExpertPlacement>,
) -> Vec<u64> {
    let expert = expert_elements(c);
    let mut per_gpu = match placement {
        None => vec![c.num_moe_layers() as u64 * c.num_local_experts as u64 * expert],
        Some(p) => {
            let mut per_gpu = vec![0u64; p.num_devices()];
            for layer in 0..p.num_layers() {
                let mut held = std::collections::BTreeSet::new();
                let placed = p.physical_to_logical(layer).iter();
                for (e, d) in placed.zip(p.physical_to_device(layer)) {
                    if held.insert((d.0, e.0)) {
                        per_gpu[d.0 as usize] += expert;
                    }
                }
            }
            per_gpu
        }
    };
    per_gpu[0] += non_expert_elements(c);
    per_gpu.iter().map(|e| e * element_bytes as u64).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::cuda::plan::tests::config;
    use moeserve_formats::presets::Preset;

    const GB: f64 = 1e9;

    /// Mixtral-8x7B in bf16: 46.7 B parameters on one GPU; expert parallelism spreads the
    /// 45.1 B expert parameters, so the most any GPU holds falls with the group size.
    #[test]
    fn expert_parallelism_spreads_mixtral_8x7b_over_the_gpus() {
        let c = config(Preset::Mixtral8x7b2l, 32);
        let one = weight_bytes_per_gpu(&c, 2, None);
        assert_eq!(one.len(), 1);
        assert!(
            (one[0] as f64 / GB - 93.4).abs() < 0.2,
            "{}",
            one[0] as f64 / GB
        );
        let mut largest = one[0];
        for n in [1usize, 2, 4] {
            let placement = ExpertPlacement::round_robin(32, 8, n, 0).unwrap();
            let per_gpu = weight_bytes_per_gpu(&c, 2, Some(&placement));
            assert_eq!(per_gpu.len(), n);
            // Nothing is held twice and nothing is lost.
            assert_eq!(per_gpu.iter().sum::<u64>(), one[0], "EP={n}");
            let most = *per_gpu.iter().max().unwrap();
            if n > 1 {
                assert!(most < largest, "EP={n}: {per_gpu:?}");
            }
            largest = most;
            // GPU 0 holds the attention, embeddings and lm_head besides its share.
            let share = (c.num_local_experts / n) as u64 * 32 * expert_elements(&c) * 2;
            assert_eq!(per_gpu[0], share + non_expert_elements(&c) * 2, "EP={n}");
            eprintln!(
                "Mixtral-8x7B bf16, EP={n}: {:?} GB",
                per_gpu
                    .iter()
                    .map(|b| (*b as f64 / GB * 10.0).round() / 10.0)
                    .collect::<Vec<_>>()
            );
        }
        let four = weight_bytes_per_gpu(
            &c,
            2,
            Some(&ExpertPlacement::round_robin(32, 8, 4, 0).unwrap()),
        );
        assert!((four[1] as f64 / GB - 22.5).abs() < 0.2, "{four:?}");
    }

    /// A replicated expert costs its device one more copy only where the replica lands on
    /// another device than the original.
    #[test]
    fn replicas_cost_memory_only_on_other_gpus() {
        let c = config(Preset::Mixtral8x7b2l, 2);
        let plain = ExpertPlacement::round_robin(2, 8, 2, 0).unwrap();
        let replicated = ExpertPlacement::round_robin(2, 8, 2, 2).unwrap();
        let (a, b) = (
            weight_bytes_per_gpu(&c, 2, Some(&plain)),
            weight_bytes_per_gpu(&c, 2, Some(&replicated)),
        );
        let extra: u64 = b.iter().sum::<u64>() - a.iter().sum::<u64>();
        let expert = expert_elements(&c) * 2;
        assert_eq!(extra % expert, 0);
        assert!(extra <= 2 * 2 * expert, "{a:?} → {b:?}");
    }
}
