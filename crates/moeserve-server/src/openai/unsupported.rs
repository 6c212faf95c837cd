//! OpenAI and vLLM request fields that moeserve does not implement. A client that sends one
//! expects it to be honoured; answering as if it were would be a silent lie, so each is refused
//! with a 400 naming it — unless it holds the value that asks for nothing (`"echo": false`,
//! `"modalities": ["text"]`, `"tools": []`, …), which is what many clients send by default.
//! Fields that no API defines stay ignored, as OpenAI's own server ignores them.

use serde::Deserialize;
use serde_json::Value;

use crate::error::ApiError;

/// Which endpoint a body was sent to (a few fields exist on one only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

/// The unimplemented fields, as sent.
#[derive(Debug, Default, Deserialize)]
struct Fields {
    // OpenAI.
    suffix: Option<Value>,
    modalities: Option<Value>,
    audio: Option<Value>,
    prediction: Option<Value>,
    functions: Option<Value>,
    function_call: Option<Value>,
    tools: Option<Value>,
    tool_choice: Option<Value>,
    web_search_options: Option<Value>,
    store: Option<Value>,
    // vLLM's extensions.
    prompt_logprobs: Option<Value>,
    use_beam_search: Option<Value>,
    length_penalty: Option<Value>,
    min_tokens: Option<Value>,
    bad_words: Option<Value>,
    allowed_token_ids: Option<Value>,
    include_stop_str_in_output: Option<Value>,
    skip_special_tokens: Option<Value>,
    spaces_between_special_tokens: Option<Value>,
    truncate_prompt_tokens: Option<Value>,
    add_generation_prompt: Option<Value>,
    continue_final_message: Option<Value>,
    add_special_tokens: Option<Value>,
    chat_template: Option<Value>,
    chat_template_kwargs: Option<Value>,
    documents: Option<Value>,
    logits_processors: Option<Value>,
    return_tokens_as_token_ids: Option<Value>,
    return_token_ids: Option<Value>,
    prompt_embeds: Option<Value>,
    echo: Option<Value>,
}

/// Whether `value` asks for nothing: null, false, 0, an empty string, list or object.
fn is_neutral(value: &Value) -> bool {
    match value {
        Value::Null | Value::Bool(false) => true,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        Value::Bool(true) => false,
    }
}

/// Refuses the first unimplemented field the body sets to something other than its neutral
/// value. Each check below reads "the field asks for nothing".
pub fn refuse_unsupported(body: &[u8], endpoint: Endpoint) -> Result<(), ApiError> {
    // Only these fields are read: a body that is not an object is refused by the caller's own
    // parse, with its own message.
    let Ok(f) = serde_json::from_slice::<Fields>(body) else {
        return Ok(());
    };
    let set = |v: &Option<Value>| v.as_ref().is_some_and(|v| !is_neutral(v));
    // Fields whose "asks for nothing" value is not the generic one.
    let text_only = |v: &Option<Value>| match v {
        Some(Value::Array(items)) => items.iter().all(|m| m == "text"),
        other => !set(other),
    };
    let is_true_or_absent = |v: &Option<Value>| matches!(v, None | Some(Value::Bool(true)));
    let tool_choice_none = |v: &Option<Value>| match v {
        None | Some(Value::Null) => true,
        Some(Value::String(s)) => s == "none" || s == "auto",
        Some(_) => false,
    };
    let checks: [(&str, bool, &str); 31] = [
        (
            "suffix",
            !set(&f.suffix),
            "insertion (`suffix`) is not supported",
        ),
        (
            "modalities",
            text_only(&f.modalities),
            "only text output is supported",
        ),
        ("audio", !set(&f.audio), "audio output is not supported"),
        (
            "prediction",
            !set(&f.prediction),
            "predicted outputs are not supported",
        ),
        (
            "functions",
            !set(&f.functions),
            "the deprecated `functions` are not supported",
        ),
        (
            "function_call",
            !set(&f.function_call) || f.function_call.as_ref().is_some_and(|v| v == "none"),
            "the deprecated `function_call` is not supported",
        ),
        (
            "tools",
            endpoint == Endpoint::Chat || !set(&f.tools),
            "tools are a chat completions field",
        ),
        (
            "tool_choice",
            endpoint == Endpoint::Chat || tool_choice_none(&f.tool_choice),
            "tools are a chat completions field",
        ),
        (
            "web_search_options",
            !set(&f.web_search_options),
            "web search is not supported",
        ),
        (
            "store",
            !set(&f.store),
            "stored completions are not supported",
        ),
        (
            "prompt_logprobs",
            // 0 asks for the prompt tokens' own logprobs: only null asks for nothing.
            f.prompt_logprobs.as_ref().is_none_or(Value::is_null),
            "prompt logprobs are not supported",
        ),
        (
            "use_beam_search",
            !set(&f.use_beam_search),
            "beam search is not supported",
        ),
        (
            "length_penalty",
            f.length_penalty
                .as_ref()
                .is_none_or(|v| v.is_null() || v == 1.0),
            "`length_penalty` applies to beam search, which is not supported",
        ),
        (
            "min_tokens",
            !set(&f.min_tokens),
            "`min_tokens` is not supported",
        ),
        (
            "bad_words",
            !set(&f.bad_words),
            "`bad_words` is not supported",
        ),
        (
            "allowed_token_ids",
            !set(&f.allowed_token_ids),
            "`allowed_token_ids` is not supported (a `structured_outputs` choice or regex \
             constrains the output)",
        ),
        (
            "include_stop_str_in_output",
            !set(&f.include_stop_str_in_output),
            "`include_stop_str_in_output` is not supported",
        ),
        (
            "skip_special_tokens",
            is_true_or_absent(&f.skip_special_tokens),
            "special tokens are always skipped in the text",
        ),
        (
            "spaces_between_special_tokens",
            is_true_or_absent(&f.spaces_between_special_tokens),
            "`spaces_between_special_tokens` is not supported",
        ),
        (
            "truncate_prompt_tokens",
            !set(&f.truncate_prompt_tokens),
            "prompt truncation is not supported",
        ),
        (
            "add_generation_prompt",
            endpoint == Endpoint::Completions || is_true_or_absent(&f.add_generation_prompt),
            "the assistant's turn is always opened",
        ),
        (
            "continue_final_message",
            !set(&f.continue_final_message),
            "`continue_final_message` is not supported",
        ),
        (
            "add_special_tokens",
            // What each endpoint does anyway: a prompt gets the tokenizer's special tokens, a
            // rendered chat none (vLLM's defaults).
            match endpoint {
                Endpoint::Completions => is_true_or_absent(&f.add_special_tokens),
                Endpoint::Chat => !set(&f.add_special_tokens),
            },
            "only the endpoint's default (completions: true, chat: false) is supported",
        ),
        (
            "chat_template",
            !set(&f.chat_template),
            "the model's own chat template is always used",
        ),
        (
            "chat_template_kwargs",
            !set(&f.chat_template_kwargs),
            "`chat_template_kwargs` are not supported (`reasoning_effort` is)",
        ),
        (
            "documents",
            !set(&f.documents),
            "`documents` are not supported",
        ),
        (
            "logits_processors",
            !set(&f.logits_processors),
            "custom logits processors are not supported",
        ),
        (
            "return_tokens_as_token_ids",
            !set(&f.return_tokens_as_token_ids),
            "`return_tokens_as_token_ids` is not supported",
        ),
        (
            "return_token_ids",
            !set(&f.return_token_ids),
            "`return_token_ids` is not supported",
        ),
        (
            "prompt_embeds",
            !set(&f.prompt_embeds),
            "prompt embeddings are not supported",
        ),
        ("echo", !set(&f.echo), "echo is not supported"),
    ];
    for (field, ok, why) in checks {
        if !ok {
            return Err(ApiError::invalid(field, format!("`{field}`: {why}")));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(body: &str, endpoint: Endpoint) -> Option<String> {
        refuse_unsupported(body.as_bytes(), endpoint)
            .err()
            .and_then(|e| e.body().param)
    }

    #[test]
    fn unimplemented_fields_are_refused_by_name() {
        for (body, field) in [
            (r#"{"suffix": "end"}"#, "suffix"),
            (r#"{"modalities": ["text", "audio"]}"#, "modalities"),
            (r#"{"audio": {"voice": "alloy"}}"#, "audio"),
            (r#"{"functions": [{"name": "f"}]}"#, "functions"),
            (r#"{"min_tokens": 4}"#, "min_tokens"),
            (r#"{"prompt_logprobs": 0}"#, "prompt_logprobs"),
            (r#"{"use_beam_search": true}"#, "use_beam_search"),
            (r#"{"skip_special_tokens": false}"#, "skip_special_tokens"),
            (
                r#"{"add_generation_prompt": false}"#,
                "add_generation_prompt",
            ),
            (r#"{"echo": true}"#, "echo"),
        ] {
            assert_eq!(
                refused(body, Endpoint::Chat).as_deref(),
                Some(field),
                "{body}"
            );
        }
    }

    #[test]
    fn neutral_values_and_unknown_fields_pass() {
        for body in [
            "{}",
            r#"{"suffix": null, "modalities": ["text"], "tools": [], "tool_choice": "none"}"#,
            r#"{"skip_special_tokens": true, "min_tokens": 0, "echo": false, "store": false}"#,
            r#"{"length_penalty": 1.0, "made_up_field": {"x": 1}}"#,
            "[1, 2]",
        ] {
            assert_eq!(refused(body, Endpoint::Chat), None, "{body}");
        }
        // Each endpoint's own add_special_tokens default passes, the other is refused.
        let add = |v: bool| format!(r#"{{"add_special_tokens": {v}}}"#);
        assert_eq!(refused(&add(true), Endpoint::Completions), None);
        assert_eq!(refused(&add(false), Endpoint::Chat), None);
        assert_eq!(
            refused(&add(false), Endpoint::Completions).as_deref(),
            Some("add_special_tokens")
        );
        assert_eq!(
            refused(&add(true), Endpoint::Chat).as_deref(),
            Some("add_special_tokens")
        );
        // Completions have no assistant turn to open, and no tools.
        assert_eq!(
            refused(r#"{"add_generation_prompt": false}"#, Endpoint::Completions),
            None
        );
        assert_eq!(
            refused(
                r#"{"tools": [{"type": "function"}]}"#,
                Endpoint::Completions
            )
            .as_deref(),
            Some("tools")
        );
        assert_eq!(
            refused(r#"{"tools": [{"type": "function"}]}"#, Endpoint::Chat),
            None
        );
    }
}
