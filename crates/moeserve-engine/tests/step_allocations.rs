//! What an engine step still allocates: the forward pass allocates nothing (the model's
//! `tests/alloc_free.rs`), so what is left is the engine's bookkeeping — the step's sequence
//! list, sampling jobs, events, output tokens and new KV blocks — a few small allocations per
//! request, whatever the model's depth. `CountingAllocator` counts them (all threads); this
//! binary holds one test so no other test allocates meanwhile. Run with `--nocapture` to see
//! the figure.

mod common;

use std::sync::Arc;

use moeserve_core::SamplingParams;
use moeserve_core::alloc_count::{CountingAllocator, allocations_in};
use moeserve_engine::assets::ModelAssets;
use moeserve_engine::engine_core::{EngineConfig, EngineCore};
use moeserve_engine::request::{GenerateRequest, Prompt};

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator;

#[test]
fn an_engine_step_allocates_a_few_times_per_request_not_per_layer() {
    let dir = common::repo_root().join("tests/fixtures/mixtral-gqa");
    let assets = Arc::new(ModelAssets::load(&dir).unwrap());
    let num_layers = assets.model.config().num_hidden_layers;
    let mut core = EngineCore::new(assets, &EngineConfig::default()).unwrap();
    const REQUESTS: u32 = 4;
    for r in 0..REQUESTS {
        let params = SamplingParams {
            max_tokens: 40,
            ignore_eos: true,
            seed: Some(u64::from(r)),
            ..SamplingParams::default()
        };
        let prompt = Prompt::TokenIds(vec![3 + r, 5, 7, 9]);
        core.add_request(GenerateRequest {
            prompt,
            params,
            grammar: None,
            routed_experts: Default::default(),
        })
        .unwrap();
    }
    // Prefill and a few decodes warm the forward's workspace.
    for _ in 0..5 {
        core.step().unwrap();
    }
    const STEPS: usize = 10;
    let allocations = allocations_in(|| {
        for _ in 0..STEPS {
            core.step().unwrap();
        }
    });
    let per_step = allocations as f64 / STEPS as f64;
    eprintln!(
        "{REQUESTS} decoding requests, {num_layers} layers: {per_step} heap allocations per engine step"
    );
    // Measured 2026-11-30: 10.0 (before the forward's workspace: ≈ 36 more per layer).
    assert!(
        per_step <= 4.0 * f64::from(REQUESTS),
        "{per_step} allocations per step (MOESERVE_ALLOC_TRACE=1 shows them)"
    );
}
