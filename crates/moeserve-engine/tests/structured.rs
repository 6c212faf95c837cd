//! Structured outputs through the engine, on the random-weight GPT-OSS fixture (whose
//! sampled text is noise, so valid JSON can only come from the constraint).

mod common;

use std::sync::Arc;

use common::{repo_root, run_together};
use moeserve_core::SamplingParams;
use moeserve_engine::EngineError;
use moeserve_engine::assets::ModelAssets;
use moeserve_engine::engine_core::EngineConfig;
use moeserve_engine::offline::generate_one;
use moeserve_engine::request::{FinishReason, GenerateRequest, Prompt};
use moeserve_structured::{GrammarSpec, JsonWhitespace, StructuredOutput};
use serde_json::{Value, json};

fn assets() -> Arc<ModelAssets> {
    Arc::new(ModelAssets::load(&repo_root().join("tests/fixtures/gpt-oss-harmony")).unwrap())
}

/// Bounded, so a random model finishes it well inside `max_tokens`.
fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {
                "type": "array",
                "items": {"enum": ["red", "green"]},
                "maxItems": 3
            },
            "address": {
                "type": "object",
                "properties": {
                    "zip": {"type": "string", "pattern": "^[0-9]{3}$"},
                    "main": {"type": "boolean"}
                },
                "required": ["zip", "main"],
                "additionalProperties": false
            }
        },
        "required": ["name", "age", "tags", "address"],
        "additionalProperties": false
    })
}

/// Checks `value` against [`person_schema`] by hand.
fn check_person(value: &Value) {
    let obj = value.as_object().expect("an object");
    let mut keys: Vec<_> = obj.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["address", "age", "name", "tags"], "{value}");
    assert!(
        obj["name"].as_str().unwrap().chars().count() <= 6,
        "{value}"
    );
    assert!((0..=120).contains(&obj["age"].as_i64().unwrap()), "{value}");
    let tags = obj["tags"].as_array().unwrap();
    assert!(tags.len() <= 3, "{value}");
    assert!(tags.iter().all(|t| t == "red" || t == "green"), "{value}");
    let address = obj["address"].as_object().unwrap();
    assert_eq!(address.len(), 2, "{value}");
    let zip = address["zip"].as_str().unwrap();
    assert!(
        zip.len() == 3 && zip.bytes().all(|b| b.is_ascii_digit()),
        "{value}"
    );
    assert!(address["main"].is_boolean(), "{value}");
}

/// Whether JSON `text` has whitespace between its tokens.
fn spaced_outside_strings(text: &str) -> bool {
    let (mut in_string, mut escaped) = (false, false);
    for c in text.chars() {
        match (in_string, escaped, c) {
            (true, true, _) => escaped = false,
            (true, false, '\\') => escaped = true,
            (_, false, '"') => in_string = !in_string,
            (false, _, c) if c.is_whitespace() => return true,
            _ => {}
        }
    }
    false
}

fn sampled(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        seed: Some(seed),
        max_tokens: 400,
        ..Default::default()
    }
}

fn constrained(assets: &ModelAssets, output: StructuredOutput, seed: u64) -> GenerateRequest {
    GenerateRequest {
        prompt: Prompt::TokenIds(vec![11, 40, 77, 3 + seed as u32]),
        params: sampled(seed),
        grammar: Some(assets.compile_grammar(&output, "response_format").unwrap()),
        routed_experts: Default::default(),
    }
}

#[test]
fn random_weights_yield_schema_valid_json_that_ends_with_the_grammar() {
    let assets = assets();
    for seed in 0..6 {
        let mut output = StructuredOutput::new(GrammarSpec::JsonSchema(person_schema()));
        // Both spacing modes: free whitespace (the default) and compact.
        output.whitespace = JsonWhitespace {
            compact: seed % 2 == 1,
            pattern: None,
        };
        let out = generate_one(assets.clone(), constrained(&assets, output, seed)).unwrap();
        assert_eq!(out.finish_reason, FinishReason::Stop, "{:?}", out.text);
        let value: Value = serde_json::from_str(&out.text)
            .unwrap_or_else(|e| panic!("seed {seed}: {e}: {:?}", out.text));
        check_person(&value);
        if seed % 2 == 1 {
            assert!(
                !spaced_outside_strings(&out.text),
                "compact: {:?}",
                out.text
            );
        }
        // The logprobs are those of the masked distribution: every chosen token was possible.
        assert!(out.logprobs.iter().all(|l| l.is_finite()));
    }
}

#[test]
fn the_unconstrained_request_is_unconstrained_without_a_grammar() {
    // The same prompts without a grammar make no JSON: the constraint is doing the work.
    let assets = assets();
    let out = generate_one(
        assets.clone(),
        GenerateRequest {
            prompt: Prompt::TokenIds(vec![11, 40, 77, 3]),
            params: SamplingParams {
                ignore_eos: true,
                max_tokens: 40,
                ..sampled(0)
            },
            grammar: None,
            routed_experts: Default::default(),
        },
    )
    .unwrap();
    assert!(
        serde_json::from_str::<Value>(&out.text).is_err(),
        "{:?}",
        out.text
    );
}

#[test]
fn regex_choice_and_grammar_constraints_hold_and_end_the_request() {
    let assets = assets();
    let regex = StructuredOutput::new(GrammarSpec::Regex("[a-c]{3}-[0-9]{2}".into()));
    let choice = StructuredOutput::new(GrammarSpec::Choice(vec![
        "alpha".into(),
        "beta".into(),
        "gamma delta".into(),
    ]));
    let lark = StructuredOutput::new(GrammarSpec::Grammar(
        "start: \"(\" item (\",\" item)* \")\"\nitem: /[xy]/".into(),
    ));
    for seed in 0..4 {
        let out = generate_one(assets.clone(), constrained(&assets, regex.clone(), seed)).unwrap();
        let b = out.text.as_bytes();
        assert_eq!(b.len(), 6, "{:?}", out.text);
        assert!(
            b[..3].iter().all(|c| (b'a'..=b'c').contains(c)),
            "{:?}",
            out.text
        );
        assert_eq!(b[3], b'-');
        assert!(b[4..].iter().all(u8::is_ascii_digit), "{:?}", out.text);
        assert_eq!(out.finish_reason, FinishReason::Stop);

        let out = generate_one(assets.clone(), constrained(&assets, choice.clone(), seed)).unwrap();
        assert!(
            ["alpha", "beta", "gamma delta"].contains(&out.text.as_str()),
            "{:?}",
            out.text
        );

        let out = generate_one(assets.clone(), constrained(&assets, lark.clone(), seed)).unwrap();
        let inner = out
            .text
            .strip_prefix('(')
            .and_then(|t| t.strip_suffix(')'))
            .unwrap_or_else(|| panic!("{:?}", out.text));
        assert!(
            inner.split(',').all(|i| i == "x" || i == "y"),
            "{:?}",
            out.text
        );
    }
}

#[test]
fn unconstrained_neighbours_get_the_tokens_they_get_alone() {
    let assets = assets();
    let free = |seed: u64| GenerateRequest {
        prompt: Prompt::TokenIds(vec![20, 21, 22, seed as u32]),
        params: SamplingParams {
            ignore_eos: true,
            max_tokens: 24,
            ..sampled(seed + 100)
        },
        grammar: None,
        routed_experts: Default::default(),
    };
    let alone: Vec<_> = (0..3)
        .map(|s| generate_one(assets.clone(), free(s)).unwrap().token_ids)
        .collect();
    let schema = StructuredOutput::new(GrammarSpec::JsonSchema(person_schema()));
    let mut requests = Vec::new();
    for s in 0..3 {
        requests.push(constrained(&assets, schema.clone(), s));
        requests.push(free(s));
    }
    let (outputs, engine) = run_together(&assets, &requests, EngineConfig::default());
    for (s, pair) in outputs.chunks(2).enumerate() {
        check_person(&serde_json::from_str(&pair[0].text).unwrap());
        assert_eq!(pair[1].token_ids, alone[s], "unconstrained request {s}");
    }
    let stats = engine.core().stats();
    assert!(stats.structured_masks > 0);
    assert!(stats.structured_mask_seconds > 0.0);
}

#[test]
fn invalid_constraints_are_refused_naming_the_field() {
    let assets = assets();
    let cases = [
        (
            GrammarSpec::JsonSchema(json!({"type": "object", "properties": {"a": {"type": 5}}})),
            "json schema",
        ),
        (GrammarSpec::Regex("(unclosed".into()), "regex"),
        (
            GrammarSpec::Grammar("start: missing_rule".into()),
            "grammar",
        ),
    ];
    for (spec, kind) in cases {
        match assets.compile_grammar(&StructuredOutput::new(spec), "response_format") {
            Err(EngineError::InvalidRequest { field, message }) => {
                assert_eq!(field, "response_format");
                assert!(message.starts_with(kind), "{message}");
            }
            other => panic!("{kind}: {other:?}"),
        }
    }
}
