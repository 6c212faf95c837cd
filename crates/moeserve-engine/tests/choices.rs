//! `n` > 1: the choices of one prompt are forked from the first one's KV blocks in the step
//! that computes the prompt. The prompt is computed once (with prefix caching or without), and
//! every choice gets exactly the tokens and logprobs it gets alone with its seed.

mod common;

use std::sync::Arc;

use common::repo_root;
use moeserve_core::{CacheConfig, SamplingParams, SchedulerConfig};
use moeserve_engine::assets::ModelAssets;
use moeserve_engine::engine_core::{EngineConfig, EngineCore, RequestEvent};
use moeserve_engine::offline::{LlmEngine, generate_one};
use moeserve_engine::request::{GenerateOutput, GenerateRequest, Prompt, RoutedExpertsMode};
use moeserve_structured::{GrammarSpec, StructuredOutput};

fn fixture(case: &str) -> Arc<ModelAssets> {
    Arc::new(ModelAssets::load(&repo_root().join("tests/fixtures").join(case)).unwrap())
}

/// `n` choices of `prompt` as the server makes them: seeds `seed`, `seed + 1`, …
fn choices(prompt: &[u32], n: usize, max_tokens: usize) -> Vec<GenerateRequest> {
    (0..n)
        .map(|i| GenerateRequest {
            prompt: Prompt::TokenIds(prompt.to_vec()),
            params: SamplingParams {
                temperature: 0.9,
                seed: Some(7 + i as u64),
                max_tokens,
                ignore_eos: true,
                logprobs: Some(2),
                ..Default::default()
            },
            grammar: None,
            routed_experts: Default::default(),
        })
        .collect()
}

fn config(block_size: usize, enable_prefix_caching: bool, max_num_seqs: usize) -> EngineConfig {
    EngineConfig {
        cache: CacheConfig {
            block_size,
            enable_prefix_caching,
            ..CacheConfig::default()
        },
        scheduler: SchedulerConfig {
            max_num_seqs,
            ..Default::default()
        },
        ..Default::default()
    }
}

fn run_group(
    assets: &Arc<ModelAssets>,
    group: &[GenerateRequest],
    config: &EngineConfig,
) -> (Vec<GenerateOutput>, LlmEngine) {
    let mut engine = LlmEngine::new(assets.clone(), config).unwrap();
    let outputs = engine
        .generate_groups(vec![group.to_vec()], |_, _| {})
        .pop()
        .unwrap()
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    (outputs, engine)
}

fn assert_alone(assets: &Arc<ModelAssets>, group: &[GenerateRequest], outputs: &[GenerateOutput]) {
    for (i, (request, out)) in group.iter().zip(outputs).enumerate() {
        let alone = generate_one(assets.clone(), request.clone()).unwrap();
        assert_eq!(out.token_ids, alone.token_ids, "choice {i}");
        assert_eq!(
            out.logprobs, alone.logprobs,
            "choice {i}: bit-identical logprobs"
        );
        assert_eq!(out.top_logprobs, alone.top_logprobs, "choice {i}");
    }
}

#[test]
fn forked_choices_compute_the_prompt_once_and_equal_their_solo_runs() {
    // MLA (a latent cache row), GQA with sliding window, and GPT-OSS's sinks.
    for case in ["deepseek-v2-lite", "mixtral-swa", "gpt-oss"] {
        let assets = fixture(case);
        // 21 tokens: two full blocks of 8 and a partial one (copied), or one full block of 16
        // and a partial one; 16 tokens: whole blocks only (nothing to copy).
        for (prompt_len, block_size) in [(21, 8), (21, 16), (16, 8)] {
            for prefix_caching in [false, true] {
                let prompt: Vec<u32> = (0..prompt_len).map(|i| 3 + (i * 17) % 200).collect();
                let (n, max_tokens) = (3, 6);
                let group = choices(&prompt, n, max_tokens);
                let (outputs, engine) =
                    run_group(&assets, &group, &config(block_size, prefix_caching, 8));
                let what = format!(
                    "{case}, {prompt_len} tokens, blocks of {block_size}, prefix caching {prefix_caching}"
                );
                let stats = engine.core().stats();
                // The prompt once, then each choice's tokens but its last (never fed back).
                assert_eq!(
                    stats.num_batched_tokens as usize,
                    prompt_len as usize + n * (max_tokens - 1),
                    "{what}: no prompt token is computed twice"
                );
                assert_eq!(stats.prefix_cache_hits, 0, "{what}: forked, not cache hits");
                assert_eq!(
                    stats.kv_cache_usage, 0.0,
                    "{what}: every block is free at the end"
                );
                assert!(
                    outputs.windows(2).any(|w| w[0].token_ids != w[1].token_ids),
                    "{what}: the seeds differ, so the choices should"
                );
                assert_alone(&assets, &group, &outputs);
            }
        }
    }
}

#[test]
fn choices_beyond_the_sequence_limit_or_the_free_blocks_wait_and_still_match() {
    let assets = fixture("mixtral-gqa");
    let prompt: Vec<u32> = (0..21).map(|i| 5 + i * 3).collect();
    let group = choices(&prompt, 4, 5);
    // Two sequences at a time: one choice is forked, two wait and compute the prompt again.
    let (outputs, engine) = run_group(&assets, &group, &config(8, false, 2));
    let computed = engine.core().stats().num_batched_tokens as usize;
    assert_eq!(
        computed,
        3 * 21 + 4 * 4,
        "the forked choice did not compute the prompt"
    );
    assert_alone(&assets, &group, &outputs);

    // A cache of 5 blocks of 8: the prompt takes 3, the first fork its copy of the partial
    // block, and the others wait; decoding then runs out of blocks and preempts.
    let layout = assets.model.kv_layout(1, 8);
    let mut small = config(8, false, 8);
    small.cache.kv_cache_memory = Some((5 * 8 * layout.bytes_per_token()) as u64);
    small.scheduler.max_model_len = Some(40);
    let (outputs, engine) = run_group(&assets, &group, &small);
    assert!(engine.core().stats().num_preemptions > 0);
    assert_alone(&assets, &group, &outputs);
}

#[test]
fn held_choices_run_on_when_the_first_is_cancelled_before_its_prompt_is_computed() {
    let assets = fixture("qwen3-moe");
    let prompt: Vec<u32> = (0..40).map(|i| 4 + i * 5).collect();
    let group = choices(&prompt, 3, 4);
    let mut cfg = config(8, true, 8);
    // Chunks of 16: the prompt takes three steps.
    cfg.scheduler.max_num_batched_tokens = 16;
    cfg.scheduler.max_model_len = Some(64);
    let mut core = EngineCore::new(assets.clone(), &cfg).unwrap();
    let ids = core.add_group(group.clone()).unwrap();
    assert!(
        core.step().unwrap().is_empty(),
        "the first chunk samples nothing"
    );
    assert_eq!(core.stats().num_waiting, 2, "the other choices are held");
    core.abort(ids[0]);
    let mut outputs = vec![None, None];
    while core.has_unfinished() {
        for event in core.step().unwrap() {
            match event {
                RequestEvent::Finished { id, output } => {
                    let at = ids.iter().position(|i| *i == id).unwrap();
                    outputs[at - 1] = Some(output);
                }
                RequestEvent::Failed { error, .. } => panic!("{error}"),
                RequestEvent::Token { .. } => {}
            }
        }
    }
    let outputs: Vec<GenerateOutput> = outputs.into_iter().map(Option::unwrap).collect();
    assert_alone(&assets, &group[1..], &outputs);
}

#[test]
fn forked_choices_keep_their_constraint_and_the_prompts_routed_experts() {
    let assets = fixture("gpt-oss-harmony");
    let output = StructuredOutput::new(GrammarSpec::Regex("[a-e]{2,6}-[0-9]{2}".into()));
    let grammar = assets.compile_grammar(&output, "regex").unwrap();
    let prompt = vec![11, 40, 77, 9, 13];
    let group: Vec<GenerateRequest> = choices(&prompt, 3, 30)
        .into_iter()
        .map(|mut r| {
            r.params.ignore_eos = false;
            r.grammar = Some(grammar.clone());
            r.routed_experts = RoutedExpertsMode::WithPrompt;
            r
        })
        .collect();
    let (outputs, engine) = run_group(&assets, &group, &config(16, false, 8));
    let decoded: usize = outputs.iter().map(|o| o.token_ids.len() - 1).sum();
    assert_eq!(
        engine.core().stats().num_batched_tokens as usize,
        prompt.len() + decoded,
        "the prompt is computed once though its routing is wanted"
    );
    for (i, (request, out)) in group.iter().zip(&outputs).enumerate() {
        let (letters, digits) = out.text.split_once('-').expect("the regex's dash");
        assert!(
            (2..=6).contains(&letters.len()),
            "choice {i}: {:?}",
            out.text
        );
        assert!(
            letters.bytes().all(|b| (b'a'..=b'e').contains(&b)),
            "{:?}",
            out.text
        );
        assert!(digits.len() == 2 && digits.bytes().all(|b| b.is_ascii_digit()));
        let alone = generate_one(assets.clone(), request.clone()).unwrap();
        assert_eq!(out.token_ids, alone.token_ids, "choice {i}");
        assert_eq!(
            out.routed_experts, alone.routed_experts,
            "choice {i}: the prompt's experts, copied from the first choice"
        );
        assert!(out.routed_experts.as_ref().unwrap().prompt.is_some());
    }
}
