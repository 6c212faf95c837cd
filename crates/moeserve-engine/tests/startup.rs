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

/// Multi-head latent attention caches one `kv_lora_rank + qk_rope_head_dim` row per token and
/// layer, whatever the number of heads: the same `--kv-cache-memory` holds as many more tokens
/// than the grouped-query attention of the same heads (every head its own key and value, as
/// DeepSeek's `num_key_value_heads` says) as that row is narrower.
#[test]
fn a_latent_kv_cache_holds_more_tokens_in_the_same_memory() {
    let assets =
        Arc::new(ModelAssets::load(&repo_root().join("tests/fixtures/deepseek-v2-lite")).unwrap());
    let c = assets.model.config();
    let mla = c.mla.expect("an MLA model");
    let layout = assets.model.kv_layout(1, 16);
    let latent_row = mla.kv_lora_rank + mla.qk_rope_head_dim;
    assert_eq!((layout.key_dim, layout.value_dim), (latent_row, 0));
    assert_eq!(
        layout.bytes_per_token(),
        c.num_hidden_layers * latent_row * 4
    );
    let memory: u64 = 16 << 20;
    let config = EngineConfig {
        cache: CacheConfig {
            block_size: 16,
            kv_cache_memory: Some(memory),
            ..CacheConfig::default()
        },
        scheduler: SchedulerConfig {
            max_num_seqs: 1024,
            ..SchedulerConfig::default()
        },
        ..Default::default()
    };
    let engine = LlmEngine::new(assets.clone(), &config).unwrap();
    let tokens = engine.core().stats().num_kv_blocks * 16;
    assert_eq!(
        tokens as u64,
        memory / (layout.bytes_per_token() as u64 * 16) * 16
    );
    // The same heads with a key and a value each: qk_head_dim + v_head_dim per head.
    let expanded = c.num_attention_heads * (mla.qk_head_dim() + mla.v_head_dim);
    let gqa_tokens = memory / (c.num_hidden_layers * expanded * 4 * 16) as u64 * 16;
    let ratio = tokens as f64 / gqa_tokens as f64;
    let want = expanded as f64 / latent_row as f64;
    assert!((ratio - want).abs() < 0.01 * want, "{ratio} vs {want}");
    eprintln!(
        "deepseek-v2-lite fixture: {tokens} tokens in 16 MiB with MLA, {gqa_tokens} with the \
         heads expanded ({ratio:.2}×)"
    );
}

/// `--kv-cache-dtype bfloat16` holds twice the tokens of f32 in the same `--kv-cache-memory`,
/// says so in the stats, and serves: its greedy completion of a prompt is the f32 cache's.
#[test]
fn a_bf16_kv_cache_holds_twice_the_tokens_and_serves() {
    use moeserve_core::{KvCacheDtype, SamplingParams};
    use moeserve_engine::request::{GenerateRequest, Prompt};
    let assets =
        Arc::new(ModelAssets::load(&repo_root().join("tests/fixtures/qwen3-moe")).unwrap());
    let engine = |dtype| {
        let config = EngineConfig {
            cache: CacheConfig {
                block_size: 16,
                kv_cache_memory: Some(8 << 20),
                kv_cache_dtype: dtype,
                ..CacheConfig::default()
            },
            scheduler: SchedulerConfig {
                max_num_seqs: 1024,
                ..SchedulerConfig::default()
            },
            ..Default::default()
        };
        LlmEngine::new(assets.clone(), &config).unwrap()
    };
    let (mut wide, mut narrow) = (engine(KvCacheDtype::Auto), engine(KvCacheDtype::Bfloat16));
    let (a, b) = (wide.core().stats(), narrow.core().stats());
    assert_eq!(
        (a.kv_cache_dtype.as_str(), b.kv_cache_dtype.as_str()),
        ("float32", "bfloat16")
    );
    assert_eq!(b.num_kv_blocks, 2 * a.num_kv_blocks);
    let prompt: Vec<u32> = (1..40).collect();
    let run = |e: &mut LlmEngine| {
        let request = GenerateRequest {
            prompt: Prompt::TokenIds(prompt.clone()),
            params: SamplingParams::greedy(8),
            grammar: None,
            routed_experts: Default::default(),
        };
        let out = e.generate(vec![request], |_, _| {}).pop().unwrap().unwrap();
        out.token_ids
    };
    assert_eq!(run(&mut narrow), run(&mut wide));
}
