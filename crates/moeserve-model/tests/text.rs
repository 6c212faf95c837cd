//! Text in/out against the references: chat templates, tokenization and streaming
//! detokenization of a model upcycled from the tiny Llama GGUF fixture (SmolLM2's tokenizer and
//! chat template), so the GGUF → `tokenizer.json` conversion is checked along the way.
//!
//! Expected values come from tests/fixtures/llama-tiny-gguf (made by tests/reference scripts):
//! `chat_cases.json` rendered by Python jinja2 as transformers' `apply_chat_template` does, and
//! `tokenizer_cases.json` from llama.cpp's tokenizer.

use std::path::{Path, PathBuf};

use moeserve_core::DType;
use moeserve_formats::convert::{UpcycleOptions, upcycle_gguf};
use moeserve_text::chat_template::{ChatMessage, ChatTemplate, RenderOptions};
use moeserve_text::generation_config::GenerationConfig;
use moeserve_text::tokenizer::{IncrementalDecoder, SpecialTokens, Tokenizer};
use serde::Deserialize;
use tempfile::TempDir;

#[derive(Deserialize)]
struct ChatCase {
    messages: Vec<ChatMessage>,
    add_generation_prompt: bool,
    rendered: String,
    ids: Vec<u32>,
}

#[derive(Deserialize)]
struct TokenizerCase {
    text: String,
    ids: Vec<u32>,
    decoded: String,
}

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/llama-tiny-gguf")
}

fn read_cases<T: for<'de> Deserialize<'de>>(name: &str) -> Vec<T> {
    let path = fixture_dir().join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The fixture GGUF upcycled into an HF-format directory (small: 2 experts, f32).
fn converted_model() -> TempDir {
    let out = tempfile::tempdir().expect("tempdir");
    upcycle_gguf(&UpcycleOptions {
        gguf: fixture_dir().join("model.gguf"),
        out: out.path().to_path_buf(),
        num_experts: 2,
        top_k: 1,
        seed: 0,
        expert_jitter: 0.0,
        dtype: DType::F32,
    })
    .expect("upcycle the fixture GGUF");
    out
}

#[test]
fn chat_cases_render_and_encode_like_transformers() {
    let dir = converted_model();
    let template = ChatTemplate::from_dir(dir.path())
        .unwrap()
        .expect("the model has a chat template");
    let tokenizer = Tokenizer::from_dir(dir.path()).unwrap();
    let cases: Vec<ChatCase> = read_cases("chat_cases.json");
    assert!(!cases.is_empty());
    for case in &cases {
        let opts = RenderOptions {
            add_generation_prompt: case.add_generation_prompt,
            ..Default::default()
        };
        let rendered = template.render(&case.messages, &opts).unwrap();
        assert_eq!(rendered, case.rendered, "messages {:?}", case.messages);
        assert_eq!(
            tokenizer.encode(&rendered).unwrap(),
            case.ids,
            "{rendered:?}"
        );
    }
}

#[test]
fn tokenizer_cases_encode_and_decode_like_the_reference() {
    let dir = converted_model();
    let tokenizer = Tokenizer::from_dir(dir.path()).unwrap();
    let cases: Vec<TokenizerCase> = read_cases("tokenizer_cases.json");
    assert!(!cases.is_empty());
    for case in &cases {
        assert_eq!(
            tokenizer.encode(&case.text).unwrap(),
            case.ids,
            "{:?}",
            case.text
        );
        assert_eq!(
            tokenizer.decode(&case.ids, SpecialTokens::Keep).unwrap(),
            case.decoded
        );
    }
}

#[test]
fn streaming_decode_of_tokenizer_cases_equals_full_decode() {
    let dir = converted_model();
    let tokenizer = Tokenizer::from_dir(dir.path()).unwrap();
    for case in read_cases::<TokenizerCase>("tokenizer_cases.json") {
        let mut decoder = IncrementalDecoder::new(tokenizer.clone(), SpecialTokens::Keep);
        let mut text = String::new();
        for &id in &case.ids {
            if let Some(piece) = decoder.push(id).unwrap() {
                assert!(
                    !piece.contains('\u{FFFD}'),
                    "{:?} emitted a split character",
                    case.text
                );
                text.push_str(&piece);
            }
        }
        text.extend(decoder.flush().unwrap());
        assert_eq!(text, case.decoded);
    }
}

#[test]
fn converted_model_declares_smollm2_special_tokens() {
    let dir = converted_model();
    let generation = GenerationConfig::from_dir(dir.path()).unwrap();
    assert_eq!(generation.eos_token_ids, vec![2]);
    assert_eq!(generation.bos_token_id, Some(1));
    let tokenizer = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(tokenizer.token_to_id("<|im_end|>"), Some(2));
    assert_eq!(tokenizer.vocab_size(), 49152);
    let template = ChatTemplate::from_dir(dir.path())
        .unwrap()
        .expect("chat template");
    assert_eq!(
        template.special_tokens().eos_token.as_deref(),
        Some("<|im_end|>")
    );
}
