//! Chat messages from clients rendered with real chat templates (ChatML as in `mixtral-tiny`,
//! SmolLM2's as in the demo model, Mixtral-Instruct's with `raise_exception`, moeserve's GPT-OSS
//! harmony template with and without a reasoning effort). The input is
//! split on NUL bytes into role, content, role, content, ...: a template may refuse the
//! messages with an error, but never panic; ChatML output holds every content verbatim.

#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use moeserve_text::chat_template::{
    ChatMessage, ChatTemplate, ReasoningEffort, RenderOptions, SpecialTokenStrings,
};

fn template(source: &str, bos: &str, eos: &str) -> ChatTemplate {
    let special = SpecialTokenStrings {
        bos_token: Some(bos.to_string()),
        eos_token: Some(eos.to_string()),
        ..SpecialTokenStrings::default()
    };
    ChatTemplate::new(source, special).expect("the template compiles")
}

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let parts: Vec<&str> = text.split('\0').collect();
    let messages: Vec<ChatMessage> = parts
        .chunks(2)
        .map(|pair| ChatMessage::new(pair[0], pair.get(1).copied().unwrap_or("")))
        .collect();
    static TEMPLATES: OnceLock<[ChatTemplate; 4]> = OnceLock::new();
    let templates = TEMPLATES.get_or_init(|| {
        [
            template(include_str!("../templates/chatml.jinja"), "<s>", "</s>"),
            template(
                include_str!("../templates/smollm2.jinja"),
                "<|im_start|>",
                "<|im_end|>",
            ),
            template(include_str!("../templates/mixtral.jinja"), "<s>", "</s>"),
            template(moeserve_text::HARMONY_TEMPLATE, "<|startoftext|>", "<|return|>"),
        ]
    });
    let efforts = [None, Some(ReasoningEffort::High)];
    for (add_generation_prompt, reasoning_effort) in [true, false].into_iter().zip(efforts) {
        let options = RenderOptions {
            add_generation_prompt,
            reasoning_effort,
        };
        for (i, t) in templates.iter().enumerate() {
            let rendered = t.render(&messages, &options);
            if i == 0 {
                let rendered = rendered.expect("ChatML renders any messages");
                for m in &messages {
                    assert!(rendered.contains(m.content.as_str()));
                }
            }
        }
    }
});
