//! Online expert re-placement under a skewed load: a router bias sends every token to expert 0
//! (plus one other), the windowed imbalance over 4 device workers exceeds the threshold, the
//! engine re-places experts in the background and swaps the placement between steps; the
//! imbalance falls under the threshold, no request fails, and outputs equal a run that never
//! re-places (dropless routing does not depend on where experts live).

mod common;

use std::sync::Arc;

use common::repo_root;
use moeserve_core::{MoeConfig, SamplingParams, SchedulerConfig};
use moeserve_engine::assets::ModelAssets;
use moeserve_engine::engine_core::EngineConfig;
use moeserve_engine::offline::LlmEngine;
use moeserve_engine::request::{GenerateOutput, GenerateRequest, Prompt};

const THRESHOLD: f64 = 1.3;

/// A fixture of 8 experts, top-2 (mixtral-swa; gpt-oss-mxfp4, whose experts move as their
/// 4-bit panels) with expert 0 made the favourite of every token.
fn skewed_assets(case: &str) -> Arc<ModelAssets> {
    let dir = repo_root().join("tests/fixtures").join(case);
    let mut assets = ModelAssets::load(&dir).unwrap();
    let mut bias = vec![0.0; 8];
    bias[0] = 8.0;
    assets.model.add_router_bias(&bias).unwrap();
    Arc::new(assets)
}

fn requests() -> Vec<GenerateRequest> {
    (0..16u32)
        .map(|i| GenerateRequest {
            prompt: Prompt::TokenIds((0..4 + i).map(|t| 3 + (t * 29 + i * 11) % 497).collect()),
            params: SamplingParams {
                ignore_eos: true,
                ..SamplingParams::greedy(40)
            },
            grammar: None,
            routed_experts: Default::default(),
        })
        .collect()
}

fn config(rebalance_interval: u64) -> EngineConfig {
    EngineConfig {
        scheduler: SchedulerConfig {
            max_num_seqs: 16,
            max_num_batched_tokens: 256,
            ..Default::default()
        },
        moe: MoeConfig {
            expert_parallel_size: 4,
            num_redundant_experts: 4,
            load_window: 8,
            rebalance_threshold: THRESHOLD,
            rebalance_interval,
            // Fixture experts are tiny: make copies free so the decision rests on the gain.
            expert_copy_bytes_per_second: 1e18,
            ..Default::default()
        },
        ..Default::default()
    }
}

fn run(assets: &Arc<ModelAssets>, config: &EngineConfig) -> (Vec<GenerateOutput>, LlmEngine) {
    let mut engine = LlmEngine::new(assets.clone(), config).unwrap();
    let outputs = engine
        .generate(requests(), |_, _| {})
        .into_iter()
        .map(|r| r.expect("no request fails while experts move"))
        .collect();
    (outputs, engine)
}

#[test]
fn skewed_load_is_rebalanced_under_the_threshold_with_outputs_unchanged() {
    for case in ["mixtral-swa", "gpt-oss-mxfp4"] {
        rebalanced_under_the_threshold_with_outputs_unchanged(case);
    }
}

fn rebalanced_under_the_threshold_with_outputs_unchanged(case: &str) {
    let assets = skewed_assets(case);
    let (fixed, fixed_engine) = run(&assets, &config(0));
    let before = fixed_engine.core().moe_stats();
    assert!(
        before.step_imbalance > THRESHOLD,
        "the bias should unbalance round-robin placement: {}",
        before.step_imbalance
    );
    let (rebalanced, engine) = run(&assets, &config(8));
    let after = engine.core().moe_stats();
    eprintln!(
        "{case}: imbalance {} → {}; records {:?}",
        before.step_imbalance, after.step_imbalance, after.rebalances
    );
    assert!(after.num_rebalances >= 1, "{after:?}");
    assert_eq!(
        after.num_rebalance_failures, 0,
        "{:?}",
        after.last_rebalance_error
    );
    let first = after.rebalances[0];
    assert!(first.imbalance_before > THRESHOLD);
    assert!(first.predicted_imbalance < THRESHOLD, "{first:?}");
    let realised = first.realised_imbalance;
    assert!(realised.is_some_and(|r| r < THRESHOLD), "{first:?}");
    assert!(first.bytes_moved > 0);
    assert!(after.step_imbalance < THRESHOLD, "{}", after.step_imbalance);
    assert!(after.last_rebalance_gain_ratio.is_some_and(|g| g > 1.0));
    assert_ne!(after.placement, before.placement);
    for (r, (a, b)) in fixed.iter().zip(&rebalanced).enumerate() {
        assert_eq!(a.token_ids, b.token_ids, "request {r}");
        assert_eq!(
            a.logprobs, b.logprobs,
            "request {r}: logprobs are bit-identical"
        );
    }
}
