//! The engine's generation path against the transformers fixtures and the demo model.

mod common;

use std::path::Path;
use std::sync::Arc;

use common::{FIXTURE_CASES, demo_model_dir, repo_root};
use moeserve_core::SamplingParams;
use moeserve_engine::assets::ModelAssets;
use moeserve_engine::offline::generate_one;
use moeserve_engine::request::{FinishReason, GenerateRequest, Prompt};
use moeserve_text::chat_template::ChatMessage;
use serde::Deserialize;

#[derive(Deserialize)]
struct ReferencePrompt {
    #[serde(default)]
    messages: Vec<ChatMessage>,
    prompt_ids: Vec<u32>,
    greedy_ids: Vec<u32>,
    greedy_logprobs: Vec<f32>,
    #[serde(default)]
    text: Option<String>,
}

#[derive(Deserialize)]
struct Reference {
    prompts: Vec<ReferencePrompt>,
}

fn read_reference(path: &Path) -> Reference {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn greedy_generation_matches_transformers_on_fixtures() {
    for case in FIXTURE_CASES {
        let dir = repo_root().join("tests/fixtures").join(case);
        let assets = Arc::new(ModelAssets::load(&dir).unwrap());
        for want in read_reference(&dir.join("reference.json")).prompts {
            let params = SamplingParams {
                ignore_eos: true,
                ..SamplingParams::greedy(want.greedy_ids.len())
            };
            let request = GenerateRequest {
                prompt: Prompt::TokenIds(want.prompt_ids.clone()),
                params,
                grammar: None,
                routed_experts: Default::default(),
            };
            let out = generate_one(assets.clone(), request).unwrap();
            assert_eq!(out.token_ids, want.greedy_ids, "{case}");
            assert_eq!(out.finish_reason, FinishReason::Length);
            for (got, want) in out.logprobs.iter().zip(&want.greedy_logprobs) {
                assert!((got - want).abs() < 1e-4, "{case}: logprob {got} vs {want}");
            }
        }
    }
}

#[test]
fn seeded_sampling_is_reproducible_and_seed_dependent() {
    let dir = repo_root().join("tests/fixtures/mixtral-swa");
    let assets = Arc::new(ModelAssets::load(&dir).unwrap());
    let run = |seed| {
        let params = SamplingParams {
            temperature: 1.0,
            seed: Some(seed),
            max_tokens: 24,
            ignore_eos: true,
            ..Default::default()
        };
        generate_one(
            assets.clone(),
            GenerateRequest {
                prompt: Prompt::TokenIds(vec![5, 6, 7]),
                params,
                grammar: None,
                routed_experts: Default::default(),
            },
        )
        .unwrap()
        .token_ids
    };
    assert_eq!(run(7), run(7));
    assert_ne!(run(7), run(8));
}

#[test]
fn over_long_request_is_refused_with_limit_and_length() {
    let dir = repo_root().join("tests/fixtures/mixtral-swa");
    let assets = Arc::new(ModelAssets::load(&dir).unwrap());
    let max = assets.model.config().max_position_embeddings;
    let request = GenerateRequest {
        prompt: Prompt::TokenIds(vec![5; max - 4]),
        params: SamplingParams::greedy(10),
        grammar: None,
        routed_experts: Default::default(),
    };
    let msg = generate_one(assets.clone(), request)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains(&format!("maximum context length is {max} tokens")),
        "{msg}"
    );
    let request = GenerateRequest {
        prompt: Prompt::TokenIds(vec![100_000]),
        params: SamplingParams::greedy(1),
        grammar: None,
        routed_experts: Default::default(),
    };
    let msg = generate_one(assets.clone(), request)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("out of the vocabulary"), "{msg}");
}

/// The demo model (SmolLM2-135M upcycled into 8 identical experts, top-2) answers chat prompts
/// exactly as the dense SmolLM2 does in transformers: same prompt ids through the chat template
/// and tokenizer, same greedy tokens, same text. Needs `models/smolmoe-8x135m.sh` to have run
/// (scripts/test.sh does it); `MOESERVE_DEMO_MODEL` overrides the location.
#[test]
fn demo_model_matches_dense_smollm2() {
    let dir = demo_model_dir();
    let assets = Arc::new(ModelAssets::load(&dir).unwrap());
    let reference = read_reference(&repo_root().join("tests/fixtures/smolmoe-demo/reference.json"));
    let mut worst = 0.0f32;
    for want in reference.prompts {
        let request = GenerateRequest {
            prompt: Prompt::chat(want.messages.clone()),
            params: SamplingParams::greedy(want.greedy_ids.len()),
            grammar: None,
            routed_experts: Default::default(),
        };
        let out = generate_one(assets.clone(), request).unwrap();
        assert_eq!(
            out.prompt_ids, want.prompt_ids,
            "prompt ids of {:?}",
            want.messages
        );
        assert_eq!(
            out.token_ids, want.greedy_ids,
            "greedy tokens of {:?}: got {:?}",
            want.messages, out.text
        );
        if let Some(text) = &want.text {
            assert_eq!(&out.text, text);
        }
        for (got, want) in out.logprobs.iter().zip(&want.greedy_logprobs) {
            worst = worst.max((got - want).abs());
        }
    }
    eprintln!("demo model: max |Δlogprob| vs dense transformers = {worst:e}");
    assert!(worst < 5e-3, "demo model logprobs differ by {worst}");
}
