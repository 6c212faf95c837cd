//! The MoE core on the transformers fixtures: capacity routing and expert parallelism leave
//! the computation exactly as it was where they should (dropless, spill, any number of devices
//! and replicas), and the drop counts equal an independent count from the router logits.

mod common;

use std::sync::Arc;

use common::*;
use moeserve_core::ExpertPlacement;
use moeserve_model::models::{ForwardOptions, ForwardTrace, LogitsFor, MoeModel};
use moeserve_model::moe::{
    Capacity, ExpertParallel, GroupLimit, InProcessAllToAll, MoeOptions, MoeStepRecord,
    OverflowPolicy, Scoring, SparseMoe,
};

fn load(case: &str) -> MoeModel {
    MoeModel::load(&fixtures_dir().join(case)).unwrap_or_else(|e| panic!("{case}: {e}"))
}

/// A 70-token prompt, long enough for several GEMM row tiles per expert.
fn prompt(model: &MoeModel) -> Vec<u32> {
    let vocab = model.config().vocab_size as u32;
    (0..70u32)
        .map(|i| 3 + (i * 37 + 11) % (vocab - 3))
        .collect()
}

fn expert_parallel(model: &MoeModel, devices: usize, redundant: usize) -> ExpertParallel {
    let c = model.config();
    let placement =
        ExpertPlacement::round_robin(c.num_moe_layers(), c.num_local_experts, devices, redundant)
            .unwrap();
    let exchange = Arc::new(InProcessAllToAll::new(devices, 2).unwrap());
    ExpertParallel::new(&model.moe_layers(), placement, exchange).unwrap()
}

/// All-token logits and the routing record of one prefill.
fn run(
    model: &MoeModel,
    capacity: Capacity,
    experts: Option<&ExpertParallel>,
) -> (Vec<f32>, MoeStepRecord, ForwardTrace) {
    let mut record = MoeStepRecord::default();
    let mut trace = ForwardTrace::default();
    let opts = ForwardOptions {
        logits: LogitsFor::AllTokens,
        trace: Some(&mut trace),
        moe: MoeOptions {
            capacity,
            experts,
            record: Some(&mut record),
        },
        greedy: None,
    };
    let logits = prefill(model, &prompt(model), opts);
    (logits, record, trace)
}

fn factor(alpha: f32, overflow: OverflowPolicy) -> Capacity {
    Capacity::Factor { alpha, overflow }
}

#[test]
fn dropless_and_spill_equal_the_default_path_exactly() {
    for case in all_cases() {
        let model = load(case);
        let want = prefill_all_logits(&model, &prompt(&model), None);
        let (dropless, record, _) = run(&model, Capacity::Dropless, None);
        assert_eq!(dropless, want, "{case}: dropless");
        assert_eq!(record.layers.len(), model.config().num_moe_layers());
        assert_eq!(record.total_counts().dropped, 0);
        for alpha in [0.25, 0.5, 1.0] {
            let (spilled, record, _) = run(&model, factor(alpha, OverflowPolicy::Spill), None);
            assert_eq!(spilled, want, "{case}: spill at α = {alpha}");
            assert_eq!(record.total_counts().dropped, 0);
        }
        let (_, record, _) = run(&model, factor(0.25, OverflowPolicy::Spill), None);
        assert!(
            record.total_counts().spilled > 0,
            "{case}: α = 0.25 must spill"
        );
    }
}

#[test]
fn expert_parallel_outputs_equal_one_device_exactly() {
    for case in all_cases() {
        let model = load(case);
        let want = prefill_all_logits(&model, &prompt(&model), None);
        let drop = factor(1.0, OverflowPolicy::Drop);
        let (want_drop, _, _) = run(&model, drop, None);
        for (devices, redundant) in [(1, 0), (1, 2), (2, 0), (2, 2), (4, 0), (4, 4)] {
            let ep = expert_parallel(&model, devices, redundant);
            let (got, record, _) = run(&model, Capacity::Dropless, Some(&ep));
            assert_eq!(got, want, "{case}: EP {devices}, {redundant} redundant");
            let per_layer = record.layers[0].device_pairs.iter().sum::<u64>();
            assert_eq!(per_layer, record.layers[0].counts.computed());
            let (got, _, _) = run(&model, drop, Some(&ep));
            assert_eq!(got, want_drop, "{case}: drop on EP {devices}");
        }
    }
}

/// What a router ranks one token's experts by, recomputed from its logits: the logits
/// themselves for softmax (monotonic); for DeepSeek-V2's grouped softmax the logits with all
/// but the `keep` groups of highest best logit pushed to the end; for the sigmoid router
/// (GLM-4.5, DeepSeek-V3) the scores plus the correction bias, with the experts of all but the
/// `keep` groups of highest two-best sums pushed to the end.
/// A group's score from its members' values, best first.
type GroupScore = fn(&[f32]) -> f32;

fn choice_values(row: &[f32], scoring: Scoring, bias: Option<&[f32]>) -> Vec<f32> {
    let (mut choice, limit, group_score): (Vec<f32>, _, GroupScore) = match scoring {
        Scoring::Softmax => return row.to_vec(),
        Scoring::SoftmaxGrouped { group_limit } => (row.to_vec(), Some(group_limit), |s| s[0]),
        Scoring::Sigmoid { group_limit } => {
            let mut choice: Vec<f32> = row.iter().map(|x| 1.0 / (1.0 + (-x).exp())).collect();
            if let Some(bias) = bias {
                choice.iter_mut().zip(bias).for_each(|(c, b)| *c += b);
            }
            (choice, group_limit, |s| s[0] + s[1])
        }
    };
    if let Some(GroupLimit { groups, keep }) = limit {
        let size = choice.len() / groups;
        let mut sums: Vec<(f32, usize)> = choice
            .chunks(size)
            .enumerate()
            .map(|(g, members)| {
                let mut sorted = members.to_vec();
                sorted.sort_by(|a, b| b.total_cmp(a));
                (group_score(&sorted), g)
            })
            .collect();
        sums.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        for (_, g) in &sums[keep..] {
            choice[g * size..(g + 1) * size].fill(f32::NEG_INFINITY);
        }
    }
    choice
}

/// Drop at α = 1 computed again from the traced router logits: top-k per token by the router's
/// choice values (ties to the lower expert), slots in token order, `C = ceil(T·k/N)`.
fn independent_drop_count(
    logits: &[f32],
    block: &SparseMoe,
    num_experts: usize,
    top_k: usize,
) -> (u64, Vec<u32>) {
    let num_tokens = logits.len() / num_experts;
    let capacity = (num_tokens * top_k).div_ceil(num_experts);
    let mut load = vec![0u32; num_experts];
    let mut dropped = 0;
    for row in logits.chunks_exact(num_experts) {
        let row = choice_values(row, block.scoring, block.correction_bias.as_deref());
        let mut order: Vec<usize> = (0..num_experts).collect();
        order.sort_by(|a, b| row[*b].total_cmp(&row[*a]).then(a.cmp(b)));
        for e in &order[..top_k] {
            if (load[*e] as usize) < capacity {
                load[*e] += 1;
            } else {
                dropped += 1;
            }
        }
    }
    (dropped, load)
}

#[test]
fn drop_counts_at_capacity_factor_one_equal_an_independent_count() {
    for case in all_cases() {
        let model = load(case);
        let c = model.config();
        let (_, record, trace) = run(&model, factor(1.0, OverflowPolicy::Drop), None);
        let mut total_dropped = 0;
        for (l, layer) in record.layers.iter().enumerate() {
            let (dropped, load) = independent_drop_count(
                &trace.router_logits[l],
                model.moe_layers()[l],
                c.num_local_experts,
                c.num_experts_per_tok,
            );
            assert_eq!(layer.counts.dropped, dropped, "{case} layer {l}");
            assert_eq!(layer.expert_load, load, "{case} layer {l}");
            assert_eq!(
                layer.counts.pairs,
                (70 * c.num_experts_per_tok) as u64,
                "{case} layer {l}"
            );
            let charged: u32 = layer.token_counts.iter().map(|t| t.dropped).sum();
            assert_eq!(u64::from(charged), dropped, "{case} layer {l}");
            total_dropped += dropped;
        }
        assert!(total_dropped > 0, "{case}: α = 1 should drop some pairs");
    }
}

#[test]
fn reroute_keeps_every_pair_it_can_and_changes_the_output() {
    for case in all_cases() {
        let model = load(case);
        let (dropless, _, _) = run(&model, Capacity::Dropless, None);
        let (rerouted, record, _) = run(&model, factor(1.0, OverflowPolicy::Reroute), None);
        let counts = record.total_counts();
        assert!(counts.rerouted > 0, "{case}: nothing rerouted");
        assert_eq!(counts.computed() + counts.dropped, counts.pairs);
        assert_ne!(rerouted, dropless, "{case}");
        assert!(rerouted.iter().all(|v| v.is_finite()));
    }
}
