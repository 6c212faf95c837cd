//! `/v1/completions` end to end: text and token-id prompts, usage, SSE framing and `[DONE]`,
//! stop strings, seeded sampling, logprobs.

use moeserve_e2e::{
    JsonResponse, Server, SseReader, post_json, post_stream, repo_root, tiny_model, tiny_model_path,
};
use serde_json::{Value, json};

async fn complete(server: &Server, body: Value) -> JsonResponse {
    let response = post_json(&server.url("/v1/completions"), &body).await;
    assert_eq!(response.status, 200, "{}", response.body);
    response
}

fn text(response: &JsonResponse) -> String {
    response.body["choices"][0]["text"]
        .as_str()
        .expect("choices[0].text")
        .to_string()
}

/// Concatenated `text` of streamed chunks, the last finish reason and the usage chunk.
async fn stream_text(reader: SseReader) -> (String, Option<String>, Option<Value>) {
    let chunks = reader.collect().await;
    let mut text = String::new();
    let mut finish = None;
    let mut usage = None;
    let id = chunks[0]["id"].clone();
    for chunk in &chunks {
        assert_eq!(chunk["object"], "text_completion");
        assert_eq!(chunk["id"], id, "every chunk carries the response id");
        if let Some(choice) = chunk["choices"].get(0) {
            text.push_str(choice["text"].as_str().expect("chunk text"));
            if let Some(reason) = choice["finish_reason"].as_str() {
                finish = Some(reason.to_string());
            }
        } else {
            usage = Some(chunk["usage"].clone());
        }
    }
    (text, finish, usage)
}

#[tokio::test]
async fn completion_reports_text_usage_and_finish_reason() {
    let model = tiny_model(None);
    let server = Server::start(&["--model", tiny_model_path(&model).to_str().unwrap()]).await;
    let r = complete(
        &server,
        json!({"model": "tiny", "prompt": "Hello, world", "max_tokens": 8, "temperature": 0,
               "ignore_eos": true}),
    )
    .await;
    let body = &r.body;
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["model"], "tiny");
    assert!(body["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_eq!(body["choices"][0]["index"], 0);
    // The tiny model's tokenizer is byte-level: one token per byte, no BOS.
    assert_eq!(
        body["usage"],
        json!({"prompt_tokens": 12, "completion_tokens": 8, "total_tokens": 20})
    );
    // Without max_tokens a completion gets 16 tokens, as OpenAI's default.
    let r = complete(
        &server,
        json!({"prompt": [5, 6, 7], "temperature": 0, "ignore_eos": true}),
    )
    .await;
    assert_eq!(
        r.body["usage"],
        json!({"prompt_tokens": 3, "completion_tokens": 16, "total_tokens": 19})
    );
}

#[tokio::test]
async fn streamed_completion_equals_the_plain_one_and_ends_with_done() {
    let model = tiny_model(None);
    let server = Server::start(&["--model", tiny_model_path(&model).to_str().unwrap()]).await;
    let request = json!({"prompt": "stream me", "max_tokens": 20, "temperature": 0,
                         "ignore_eos": true});
    let plain = complete(&server, request.clone()).await;
    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let reader = post_stream(&server.url("/v1/completions"), &streamed).await;
    let (text_streamed, finish, usage) = stream_text(reader).await;
    assert_eq!(text_streamed, text(&plain));
    assert_eq!(finish.as_deref(), Some("length"));
    assert_eq!(usage, Some(plain.body["usage"].clone()));
    // Without include_usage there is no usage chunk.
    streamed["stream_options"] = json!({"include_usage": false});
    let reader = post_stream(&server.url("/v1/completions"), &streamed).await;
    let (again, _, usage) = stream_text(reader).await;
    assert_eq!((again, usage), (text(&plain), None));
}

/// A short stop string taken from the middle of the greedy text: ASCII, so it is plainly
/// visible in the stream.
fn stop_from_middle(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let graphic = |c: &char| c.is_ascii_graphic();
    let start = chars.len() / 2;
    let pair = (start..chars.len().saturating_sub(1))
        .find(|&i| graphic(&chars[i]) && graphic(&chars[i + 1]))
        .map(|i| chars[i..i + 2].iter().collect());
    pair.or_else(|| chars.iter().find(|c| graphic(c)).map(|c| c.to_string()))
        .expect("the greedy text holds some ASCII")
}

#[tokio::test]
async fn stop_strings_end_the_text_before_the_stop_string() {
    let model = tiny_model(None);
    let server = Server::start(&["--model", tiny_model_path(&model).to_str().unwrap()]).await;
    let request = json!({"prompt": "Hello, world", "max_tokens": 64, "temperature": 0,
                         "ignore_eos": true});
    let full = text(&complete(&server, request.clone()).await);
    let stop = stop_from_middle(&full);
    let expected = &full[..full.find(&stop).expect("stop is in the text")];
    let mut with_stop = request.clone();
    with_stop["stop"] = json!(stop);
    let r = complete(&server, with_stop.clone()).await;
    assert_eq!(text(&r), expected, "stop {stop:?} in {full:?}");
    assert_eq!(r.body["choices"][0]["finish_reason"], "stop");
    // A list works the same, and so does streaming.
    with_stop["stop"] = json!(["never-there", stop]);
    assert_eq!(text(&complete(&server, with_stop.clone()).await), expected);
    with_stop["stream"] = json!(true);
    let reader = post_stream(&server.url("/v1/completions"), &with_stop).await;
    let (streamed, finish, _) = stream_text(reader).await;
    assert_eq!(
        (streamed.as_str(), finish.as_deref()),
        (expected, Some("stop"))
    );
}

#[tokio::test]
async fn seeded_sampling_is_reproducible() {
    let model = tiny_model(None);
    let server = Server::start(&["--model", tiny_model_path(&model).to_str().unwrap()]).await;
    let request = |seed: u64| {
        json!({"prompt": "seed", "max_tokens": 24, "temperature": 1.0, "seed": seed,
               "ignore_eos": true})
    };
    let first = text(&complete(&server, request(1234)).await);
    let second = text(&complete(&server, request(1234)).await);
    assert_eq!(first, second);
    let other = text(&complete(&server, request(4321)).await);
    assert_ne!(first, other, "another seed samples another text");
    let mut streamed = request(1234);
    streamed["stream"] = json!(true);
    let reader = post_stream(&server.url("/v1/completions"), &streamed).await;
    assert_eq!(stream_text(reader).await.0, first);
}

#[tokio::test]
async fn logprobs_have_the_completions_shape() {
    let model = tiny_model(None);
    let server = Server::start(&["--model", tiny_model_path(&model).to_str().unwrap()]).await;
    let r = complete(
        &server,
        json!({"prompt": "Hello", "max_tokens": 6, "temperature": 0, "logprobs": 3,
               "ignore_eos": true}),
    )
    .await;
    let lp = &r.body["choices"][0]["logprobs"];
    let tokens = lp["tokens"].as_array().expect("tokens");
    let token_logprobs = lp["token_logprobs"].as_array().expect("token_logprobs");
    let top = lp["top_logprobs"].as_array().expect("top_logprobs");
    let offsets = lp["text_offset"].as_array().expect("text_offset");
    assert_eq!(
        [tokens.len(), token_logprobs.len(), top.len(), offsets.len()],
        [6; 4]
    );
    assert_eq!(offsets[0], 0);
    for i in 0..6 {
        let chosen = token_logprobs[i].as_f64().unwrap();
        assert!(chosen <= 0.0);
        let alternatives = top[i].as_object().expect("top_logprobs entry is an object");
        // Three alternatives; tokens whose text is the same (e.g. unknown ids) share a key.
        assert!((1..=4).contains(&alternatives.len()), "{alternatives:?}");
        let best = alternatives.values().map(|v| v.as_f64().unwrap());
        // Greedy: the chosen token is the most likely one.
        assert!(best.fold(f64::MIN, f64::max) <= chosen + 1e-6);
        if i > 0 {
            assert!(offsets[i].as_u64() >= offsets[i - 1].as_u64());
        }
    }
    // Streaming carries the same numbers, one token per chunk.
    let reader = post_stream(
        &server.url("/v1/completions"),
        &json!({"prompt": "Hello", "max_tokens": 6, "temperature": 0, "logprobs": 3,
                "ignore_eos": true, "stream": true}),
    )
    .await;
    let streamed: Vec<Value> = reader
        .collect()
        .await
        .iter()
        .map(|c| c["choices"][0]["logprobs"]["token_logprobs"][0].clone())
        .collect();
    assert_eq!(&streamed, token_logprobs);
}

#[tokio::test]
async fn token_id_prompts_work_on_a_model_without_tokenizer() {
    let fixture = repo_root().join("tests/fixtures/mixtral-swa");
    let server = Server::start(&["--model", fixture.to_str().unwrap()]).await;
    let r = complete(
        &server,
        json!({"model": "mixtral-swa", "prompt": [1, 2, 3, 4], "max_tokens": 5,
               "temperature": 0, "logprobs": 1, "ignore_eos": true}),
    )
    .await;
    assert_eq!(r.body["usage"]["prompt_tokens"], 4);
    assert_eq!(r.body["usage"]["completion_tokens"], 5);
    let first = r.body["choices"][0]["logprobs"]["tokens"][0]
        .as_str()
        .unwrap();
    assert!(first.starts_with("token_id:"), "{first}");
    let refused = post_json(
        &server.url("/v1/completions"),
        &json!({"prompt": "text needs a tokenizer"}),
    )
    .await;
    assert_eq!(refused.status, 400);
    assert_eq!(refused.error()["param"], "prompt");
    assert!(refused.error_message().contains("token ids"));
}
