//! Start-up refuses an engine under which some admissible request could never be scheduled (it
//! would wait at the head of the queue forever, blocking every request behind it), naming the
//! flags that would make it servable, as vLLM does; the settings at the edge of each limit
//! start.

mod common;

use std::sync::Arc;

use common::repo_root;
use moeserve_core::{CacheConfig, SchedulerConfig};
use moeserve_engine::EngineError;
use moeserve_engine::assets::ModelAssets;
use moeserve_engine::engine_core::EngineConfig;
use moeserve_engine::offline::LlmEngine;

/// mixtral-swa: a context of 256 tokens.
fn assets() -> Arc<ModelAssets> {
    Arc::new(ModelAssets::load(&repo_root().join("tests/fixtures/mixtral-swa")).unwrap())
}

fn config(cache_tokens: usize, scheduler: SchedulerConfig, assets: &ModelAssets) -> EngineConfig {
    let block_size = 16;
    let per_token = assets.model.kv_layout(1, block_size).bytes_per_token();
    EngineConfig {
        cache: CacheConfig {
            block_size,
            kv_cache_memory: Some((cache_tokens * per_token) as u64),
            ..CacheConfig::default()
        },
        scheduler,
        ..Default::default()
    }
}

fn refusal(config: &EngineConfig, assets: &Arc<ModelAssets>) -> String {
    match LlmEngine::new(assets.clone(), config) {
        Err(EngineError::Unservable { message }) => message,
        Err(other) => panic!("refused for another reason: {other}"),
        Ok(_) => panic!("an unservable engine started"),
    }
}

#[test]
fn a_cache_smaller_than_the_context_is_refused_with_what_fits_and_what_is_needed() {
    let assets = assets();
    let context = assets.model.config().max_position_embeddings;
    assert_eq!(context, 256);
    let msg = refusal(&config(128, SchedulerConfig::default(), &assets), &assets);
    assert!(msg.contains("holds 128 tokens"), "{msg}");
    assert!(msg.contains("--max-model-len 128"), "{msg}");
    let per_block = assets.model.kv_layout(1, 16).bytes_per_token() * 16;
    let needed = (256 / 16 * per_block).div_ceil(1024);
    assert!(
        msg.contains(&format!("--kv-cache-memory {needed}KiB")),
        "{msg}"
    );
    // Either suggestion starts.
    let shorter = SchedulerConfig {
        max_model_len: Some(128),
        ..SchedulerConfig::default()
    };
    LlmEngine::new(assets.clone(), &config(128, shorter, &assets)).unwrap();
    LlmEngine::new(
        assets.clone(),
        &config(256, SchedulerConfig::default(), &assets),
    )
    .unwrap();
}

#[test]
fn without_chunked_prefill_the_step_budget_must_hold_the_longest_prompt() {
    let assets = assets();
    let no_chunking = |budget| SchedulerConfig {
        enable_chunked_prefill: false,
        max_num_batched_tokens: budget,
        ..SchedulerConfig::default()
    };
    // The context comes from the model (no --max-model-len): the case the old check missed.
    let msg = refusal(&config(1024, no_chunking(64), &assets), &assets);
    assert!(msg.contains("--max-num-batched-tokens (64)"), "{msg}");
    assert!(msg.contains("--max-num-batched-tokens 256"), "{msg}");
    assert!(msg.contains("--enable-chunked-prefill"), "{msg}");
    LlmEngine::new(assets.clone(), &config(1024, no_chunking(256), &assets)).unwrap();
}

#[test]
fn a_max_model_len_beyond_the_context_is_refused_not_clamped() {
    let assets = assets();
    let longer = SchedulerConfig {
        max_model_len: Some(257),
        ..SchedulerConfig::default()
    };
    let msg = refusal(&config(1024, longer, &assets), &assets);
    assert!(
        msg.contains("--max-model-len 257 is longer than the model's context of 256"),
        "{msg}"
    );
    let exact = SchedulerConfig {
        max_model_len: Some(256),
        ..SchedulerConfig::default()
    };
    LlmEngine::new(assets.clone(), &config(1024, exact, &assets)).unwrap();
}
