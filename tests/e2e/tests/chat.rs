//! `/v1/chat/completions` end to end: the chat template, plain and streamed answers (role first,
//! `[DONE]` last), usage, logprobs, and the default length (the rest of the context).

use moeserve_e2e::{JsonResponse, Server, post_json, post_stream, tiny_model, tiny_model_path};
use serde_json::{Value, json};

async fn chat(server: &Server, body: Value) -> JsonResponse {
    let response = post_json(&server.url("/v1/chat/completions"), &body).await;
    assert_eq!(response.status, 200, "{}", response.body);
    response
}

fn hi() -> Value {
    json!([{"role": "user", "content": "hi"}])
}

/// Tokens of `<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n` with the tiny model's
/// byte-level tokenizer: 3 special tokens, 18 bytes.
const HI_PROMPT_TOKENS: u64 = 21;

#[tokio::test]
async fn chat_answer_has_the_assistant_message_and_usage() {
    let model = tiny_model(None);
    let server = Server::start(&["--model", tiny_model_path(&model).to_str().unwrap()]).await;
    let r = chat(
        &server,
        json!({"model": "tiny", "messages": hi(), "max_tokens": 7, "temperature": 0,
               "ignore_eos": true, "user": "someone", "unknown_field": {"ignored": true}}),
    )
    .await;
    let body = &r.body;
    assert_eq!(body["object"], "chat.completion");
    assert!(body["id"].as_str().unwrap().starts_with("chatcmpl-"));
    let choice = &body["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert!(choice["message"]["content"].is_string());
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(choice["logprobs"], Value::Null);
    assert_eq!(
        body["usage"],
        json!({"prompt_tokens": HI_PROMPT_TOKENS, "completion_tokens": 7,
               "total_tokens": HI_PROMPT_TOKENS + 7})
    );
    // max_completion_tokens is the newer name, and wins.
    let r = chat(
        &server,
        json!({"messages": hi(), "max_tokens": 7, "max_completion_tokens": 3,
               "temperature": 0, "ignore_eos": true}),
    )
    .await;
    assert_eq!(r.body["usage"]["completion_tokens"], 3);
}

#[tokio::test]
async fn streamed_chat_sends_the_role_first_and_equals_the_plain_answer() {
    let model = tiny_model(None);
    let server = Server::start(&["--model", tiny_model_path(&model).to_str().unwrap()]).await;
    let request = json!({"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hello"}]}],
        "max_tokens": 12, "temperature": 0, "ignore_eos": true});
    let plain = chat(&server, request.clone()).await;
    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let chunks = post_stream(&server.url("/v1/chat/completions"), &streamed)
        .await
        .collect()
        .await;
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let mut content = String::new();
    let mut finish = None;
    for chunk in &chunks {
        assert_eq!(chunk["object"], "chat.completion.chunk");
        assert_eq!(chunk["id"], chunks[0]["id"]);
        let Some(choice) = chunk["choices"].get(0) else {
            continue;
        };
        if !std::ptr::eq(chunk, &chunks[0]) {
            assert!(
                choice["delta"].get("role").is_none(),
                "role only comes first"
            );
        }
        content.push_str(choice["delta"]["content"].as_str().unwrap_or(""));
        if let Some(reason) = choice["finish_reason"].as_str() {
            finish = Some(reason.to_string());
        }
    }
    assert_eq!(content, plain.body["choices"][0]["message"]["content"]);
    assert_eq!(finish.as_deref(), Some("length"));
    let usage_chunk = chunks.last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(usage_chunk["usage"], plain.body["usage"]);
}

#[tokio::test]
async fn chat_logprobs_list_each_token_with_its_alternatives() {
    let model = tiny_model(None);
    let server = Server::start(&["--model", tiny_model_path(&model).to_str().unwrap()]).await;
    let r = chat(
        &server,
        json!({"messages": hi(), "max_tokens": 5, "temperature": 0, "ignore_eos": true,
               "logprobs": true, "top_logprobs": 2}),
    )
    .await;
    let content = r.body["choices"][0]["logprobs"]["content"]
        .as_array()
        .expect("logprobs.content");
    assert_eq!(content.len(), 5);
    for entry in content {
        assert!(entry["token"].is_string());
        assert!(entry["logprob"].as_f64().unwrap() <= 0.0);
        assert!(entry["bytes"].is_array());
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 2);
        // Greedy: the chosen token is the first alternative.
        assert_eq!(top[0]["logprob"], entry["logprob"]);
        assert!(top[0]["logprob"].as_f64() >= top[1]["logprob"].as_f64());
    }
}

#[tokio::test]
async fn chat_without_a_limit_may_fill_the_rest_of_the_context() {
    let model = tiny_model(None);
    let server = Server::start(&["--model", tiny_model_path(&model).to_str().unwrap()]).await;
    let r = chat(
        &server,
        json!({"messages": hi(), "temperature": 0, "ignore_eos": true}),
    )
    .await;
    // mixtral-tiny's context is 1024 tokens.
    assert_eq!(
        r.body["usage"]["completion_tokens"],
        1024 - HI_PROMPT_TOKENS
    );
    assert_eq!(r.body["choices"][0]["finish_reason"], "length");
}
