//! GPT-OSS's harmony chat against tests/fixtures/gpt-oss-harmony (made by
//! tests/reference/gpt_oss_harmony.py): moeserve's template renders as transformers'
//! `apply_chat_template` rendered it, and the replies transformers' greedy decoding gave split
//! into the scripted reasoning and answer.

use std::path::{Path, PathBuf};

use moeserve_text::HARMONY_TEMPLATE;
use moeserve_text::chat_template::{ChatMessage, ChatTemplate, ReasoningEffort, RenderOptions};
use moeserve_text::harmony::{ChannelText, HarmonyParser, HarmonyTokens};
use moeserve_text::tokenizer::Tokenizer;
use serde::Deserialize;

#[derive(Deserialize)]
struct ChatCase {
    messages: Vec<ChatMessage>,
    add_generation_prompt: bool,
    rendered: String,
    ids: Vec<u32>,
    greedy_ids: Vec<u32>,
    #[serde(default)]
    reasoning_effort: Option<ReasoningEffort>,
}

#[derive(Deserialize)]
struct Manifest {
    reasoning: String,
    answer: String,
}

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gpt-oss-harmony")
}

fn read<T: for<'de> Deserialize<'de>>(name: &str) -> T {
    let path = fixture().join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn tokenizer() -> (Tokenizer, HarmonyTokens) {
    let tokenizer = Tokenizer::from_dir(fixture()).unwrap();
    let tokens = HarmonyTokens::from_tokenizer(&tokenizer).expect("the harmony tokens");
    (tokenizer, tokens)
}

/// The text with the system message's date (rendered on the day it was made) taken out.
fn undated(text: &str) -> String {
    const LABEL: &str = "Current date: ";
    let at = text.find(LABEL).expect("a date line") + LABEL.len();
    let date = &text[at..at + 10];
    let digits = date.bytes().enumerate().all(|(i, b)| match i {
        4 | 7 => b == b'-',
        _ => b.is_ascii_digit(),
    });
    assert!(digits, "not a YYYY-MM-DD date: {date:?}");
    format!("{}<date>{}", &text[..at], &text[at + 10..])
}

#[test]
fn the_harmony_template_renders_as_transformers_did() {
    let on_disk = std::fs::read_to_string(fixture().join("chat_template.jinja")).unwrap();
    assert_eq!(
        on_disk, HARMONY_TEMPLATE,
        "the fixture holds another template"
    );
    let template = ChatTemplate::from_dir(fixture())
        .unwrap()
        .expect("a template");
    let (tokenizer, _) = tokenizer();
    let cases: Vec<ChatCase> = read("chat_cases.json");
    assert_eq!(cases.len(), 4);
    assert!(
        cases
            .iter()
            .any(|c| c.reasoning_effort == Some(ReasoningEffort::High))
    );
    for case in &cases {
        let opts = RenderOptions {
            add_generation_prompt: case.add_generation_prompt,
            reasoning_effort: case.reasoning_effort,
        };
        let rendered = template.render(&case.messages, &opts).unwrap();
        assert_eq!(
            undated(&rendered),
            undated(&case.rendered),
            "{:?}",
            case.messages
        );
        assert_eq!(tokenizer.encode(&case.rendered).unwrap(), case.ids);
    }
}

#[test]
fn the_template_refuses_what_it_cannot_render_by_saying_what() {
    let template = ChatTemplate::from_dir(fixture()).unwrap().unwrap();
    let opts = RenderOptions {
        add_generation_prompt: true,
        ..Default::default()
    };
    let refused = [
        (vec![("user", "q"), ("tool", "42")], "tool call"),
        (
            vec![("user", "q"), ("system", "late")],
            "may only come first",
        ),
        (
            vec![("user", "q"), ("assistant", "<|channel|>final<|message|>a")],
            "<|channel|> tags",
        ),
    ];
    for (messages, why) in refused {
        let messages: Vec<_> = messages
            .into_iter()
            .map(|(role, content)| ChatMessage::new(role, content))
            .collect();
        let err = template.render(&messages, &opts).unwrap_err().to_string();
        assert!(err.contains(why), "{err}");
    }
}

#[test]
fn transformers_replies_split_into_the_scripted_reasoning_and_answer() {
    let (tokenizer, tokens) = tokenizer();
    let manifest: Manifest = read("manifest.json");
    let expected = ChannelText {
        reasoning: manifest.reasoning,
        content: manifest.answer,
        calls: Vec::new(),
    };
    for case in read::<Vec<ChatCase>>("chat_cases.json") {
        let whole = HarmonyParser::parse(tokens, tokenizer.clone(), &case.greedy_ids).unwrap();
        assert_eq!(whole, expected);
        // Streamed token by token, the pieces add up to the same split.
        let mut parser = HarmonyParser::new(tokens, tokenizer.clone());
        let mut streamed = ChannelText::default();
        for &id in &case.greedy_ids {
            streamed.append(parser.push(id).unwrap());
        }
        let rest = parser.finish().unwrap();
        assert!(
            rest.is_empty(),
            "a reply ended by <|return|> holds nothing back"
        );
        assert_eq!(streamed, expected);
    }
}

#[test]
fn output_that_leaves_the_format_is_kept_as_content() {
    let (tokenizer, tokens) = tokenizer();
    let split = |text: &str| {
        let ids = tokenizer.encode_with_special_tokens(text).unwrap();
        let got = HarmonyParser::parse(tokens, tokenizer.clone(), &ids).unwrap();
        (got.reasoning, got.content)
    };
    let owned = |r: &str, c: &str| (r.to_string(), c.to_string());
    // No header at all: a model that ignores the format still answers.
    let long = "no header here, just text that goes on and on for a good many tokens";
    assert_eq!(split(long), owned("", long));
    assert_eq!(split("short"), owned("", "short"));
    // Cut off in the reasoning (max_tokens): what came is reasoning.
    assert_eq!(
        split("<|channel|>analysis<|message|>Hmm, a gr"),
        owned("Hmm, a gr", "")
    );
    // Commentary (a preamble to the user) is content; text between messages too.
    assert_eq!(
        split("<|channel|>commentary<|message|>One moment.<|end|>stray<|return|>"),
        owned("", "One moment.stray")
    );
    // A final message straight away, and one that starts without the previous <|end|>.
    assert_eq!(
        split("<|channel|>final<|message|>Hi!<|return|>"),
        owned("", "Hi!")
    );
    assert_eq!(
        split("<|channel|>analysis<|message|>a<|start|>assistant<|channel|>final<|message|>b"),
        owned("a", "b")
    );
}

#[test]
fn a_message_to_a_recipient_is_a_tool_call_not_content() {
    let (tokenizer, tokens) = tokenizer();
    let text = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant\
                <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>\
                {\"city\": \"Paris\"}<|call|>";
    let ids = tokenizer.encode_with_special_tokens(text).unwrap();
    let whole = HarmonyParser::parse(tokens, tokenizer.clone(), &ids).unwrap();
    assert_eq!(whole.reasoning, "Need the weather.");
    assert_eq!(whole.content, "");
    assert_eq!(whole.calls.len(), 1);
    assert_eq!(whole.calls[0].function_name(), Some("get_weather"));
    assert_eq!(whole.calls[0].arguments, r#"{"city": "Paris"}"#);
    // Streamed, the call arrives whole with the token that ends it.
    let mut parser = HarmonyParser::new(tokens, tokenizer.clone());
    let pieces: Vec<ChannelText> = ids.iter().map(|&id| parser.push(id).unwrap()).collect();
    let with_calls: Vec<usize> = (0..pieces.len())
        .filter(|&i| !pieces[i].calls.is_empty())
        .collect();
    assert_eq!(with_calls, [ids.len() - 1]);
    // The recipient may come before the channel, too.
    let text = "<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.get_time\
                <|channel|>commentary json<|message|>{}<|call|>";
    let ids = tokenizer.encode_with_special_tokens(text).unwrap();
    let whole = HarmonyParser::parse(tokens, tokenizer, &ids).unwrap();
    assert_eq!(whole.calls[0].function_name(), Some("get_time"));
}
