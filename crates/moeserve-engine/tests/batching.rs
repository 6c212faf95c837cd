//! Batch invariance: requests run together (mixed lengths, shared prefixes, chunked prefill,
//! preemption under a deliberately small cache) give exactly the tokens each gives alone.

mod common;

use std::sync::Arc;

use common::{FIXTURE_CASES, demo_model_dir, repo_root, run_together};
use moeserve_core::{CacheConfig, SamplingParams, SchedulerConfig};
use moeserve_engine::assets::ModelAssets;
use moeserve_engine::engine_core::EngineConfig;
use moeserve_engine::offline::{LlmEngine, generate_one};
use moeserve_engine::request::{GenerateOutput, GenerateRequest, Prompt};
use moeserve_text::chat_template::ChatMessage;

fn fixture(case: &str) -> Arc<ModelAssets> {
    Arc::new(ModelAssets::load(&repo_root().join("tests/fixtures").join(case)).unwrap())
}

/// Prompts of mixed lengths; every third one shares a 24-token prefix with the others.
fn prompts(n: usize, vocab: u32) -> Vec<Vec<u32>> {
    let shared: Vec<u32> = (0..24).map(|i| 3 + (i * 7) % (vocab - 3)).collect();
    (0..n)
        .map(|r| {
            let len = 1 + (r * 13) % 37;
            let own = (0..len as u32).map(|i| 3 + (i * 31 + r as u32 * 17) % (vocab - 3));
            if r.is_multiple_of(3) {
                shared.iter().copied().chain(own).collect()
            } else {
                own.collect()
            }
        })
        .collect()
}

fn params(r: usize) -> SamplingParams {
    // Half greedy, half seeded sampling; lengths differ so sequences leave at different steps.
    let max_tokens = 6 + (r * 5) % 19;
    if r.is_multiple_of(2) {
        SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(max_tokens)
        }
    } else {
        SamplingParams {
            temperature: 0.8,
            top_p: 0.9,
            seed: Some(r as u64),
            max_tokens,
            ignore_eos: true,
            ..Default::default()
        }
    }
}

fn small_cache_config(num_blocks: usize, block_size: usize, assets: &ModelAssets) -> EngineConfig {
    let bytes_per_block = assets.model.kv_layout(1, block_size).bytes_per_token() * block_size;
    EngineConfig {
        cache: CacheConfig {
            block_size,
            kv_cache_memory: Some((num_blocks * bytes_per_block) as u64),
            enable_prefix_caching: true,
            ..CacheConfig::default()
        },
        scheduler: SchedulerConfig {
            max_num_seqs: 16,
            max_num_batched_tokens: 48,
            // A cache smaller than the model's context is refused unless the length fits it.
            max_model_len: Some(num_blocks * block_size),
            ..Default::default()
        },
        ..Default::default()
    }
}

#[test]
fn concurrent_requests_equal_their_solo_runs_on_every_fixture() {
    for case in FIXTURE_CASES {
        let assets = fixture(case);
        let vocab = assets.model.config().vocab_size as u32;
        let requests: Vec<GenerateRequest> = prompts(24, vocab)
            .into_iter()
            .enumerate()
            .map(|(r, p)| GenerateRequest {
                prompt: Prompt::TokenIds(p),
                params: params(r),
                grammar: None,
                routed_experts: Default::default(),
            })
            .collect();
        let alone: Vec<GenerateOutput> = requests
            .iter()
            .map(|r| generate_one(assets.clone(), r.clone()).unwrap())
            .collect();
        // 24 blocks of 8 tokens cannot hold 16 running sequences: preemption must happen.
        let (together, engine) =
            run_together(&assets, &requests, small_cache_config(24, 8, &assets));
        let stats = engine.core().stats();
        assert!(
            stats.num_preemptions > 0,
            "{case}: the small cache should force preemptions"
        );
        assert!(
            stats.prefix_cache_hits > 0,
            "{case}: shared prefixes should hit the prefix cache"
        );
        for (r, (a, b)) in alone.iter().zip(&together).enumerate() {
            assert_eq!(a.token_ids, b.token_ids, "{case} request {r}");
            assert_eq!(
                a.logprobs, b.logprobs,
                "{case} request {r}: logprobs are bit-identical"
            );
        }
        assert_eq!(
            engine.core().stats().kv_cache_usage,
            0.0,
            "{case}: every block is free at the end"
        );
    }
}

#[test]
fn prefix_caching_computes_only_the_new_tokens() {
    let assets = fixture("mixtral-swa");
    let prefix: Vec<u32> = (10..42).collect(); // two full blocks of 16
    let mut engine = LlmEngine::new(assets.clone(), &EngineConfig::default()).unwrap();
    let first = GenerateRequest {
        prompt: Prompt::TokenIds(prefix.clone()),
        params: SamplingParams::greedy(4),
        grammar: None,
        routed_experts: Default::default(),
    };
    let first_out = engine
        .generate(vec![first], |_, _| {})
        .pop()
        .unwrap()
        .unwrap();
    let computed_before = engine.core().stats().num_batched_tokens;
    let hits_before = engine.core().stats().prefix_cache_hits;
    let mut second_prompt = prefix.clone();
    second_prompt.extend([50, 51, 52]);
    let second = GenerateRequest {
        prompt: Prompt::TokenIds(second_prompt.clone()),
        params: SamplingParams::greedy(4),
        grammar: None,
        routed_experts: Default::default(),
    };
    let second_out = engine
        .generate(vec![second.clone()], |_, _| {})
        .pop()
        .unwrap()
        .unwrap();
    let stats = engine.core().stats();
    assert_eq!(
        stats.prefix_cache_hits - hits_before,
        32,
        "both full prefix blocks are reused"
    );
    // 3 new prompt tokens in the first step, then one token per further decode step.
    assert_eq!(stats.num_batched_tokens - computed_before, 3 + 3);
    assert_eq!(
        second_out.token_ids,
        generate_one(assets.clone(), second).unwrap().token_ids
    );
    assert_eq!(first_out.token_ids.len(), 4);
}

#[test]
fn chunked_prefill_of_a_long_prompt_equals_one_chunk() {
    let assets = fixture("mixtral-swa");
    let prompt: Vec<u32> = (0..150).map(|i| 3 + (i * 11) % 500).collect();
    let request = GenerateRequest {
        prompt: Prompt::TokenIds(prompt),
        params: SamplingParams::greedy(8),
        grammar: None,
        routed_experts: Default::default(),
    };
    let config = EngineConfig {
        scheduler: SchedulerConfig {
            max_num_batched_tokens: 16,
            ..Default::default()
        },
        ..Default::default()
    };
    let (chunked, _) = run_together(&assets, std::slice::from_ref(&request), config);
    assert_eq!(
        chunked[0].token_ids,
        generate_one(assets, request).unwrap().token_ids
    );
}

/// The demo model with real chat prompts: batched with preemption equals alone.
#[test]
fn demo_model_batch_equals_alone() {
    let dir = demo_model_dir();
    let assets = Arc::new(ModelAssets::load(&dir).unwrap());
    let questions = [
        "What is the capital of France?",
        "Name a primary color.",
        "What is 2+2?",
        "Say hello in Spanish.",
        "What is the capital of France? Answer briefly.",
    ];
    let requests: Vec<GenerateRequest> = questions
        .iter()
        .enumerate()
        .map(|(r, q)| GenerateRequest {
            prompt: Prompt::chat(vec![ChatMessage::new("user", *q)]),
            params: params(r),
            grammar: None,
            routed_experts: Default::default(),
        })
        .collect();
    let alone: Vec<Vec<u32>> = requests
        .iter()
        .map(|r| generate_one(assets.clone(), r.clone()).unwrap().token_ids)
        .collect();
    let (together, engine) = run_together(&assets, &requests, small_cache_config(7, 16, &assets));
    assert!(
        engine.core().stats().num_preemptions > 0,
        "the small cache should force preemptions"
    );
    for (r, (a, b)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(a, &b.token_ids, "request {r}");
    }
}
