//! Every error case end to end, in OpenAI's shape with its status: 400 (bad JSON, bad field,
//! prompt too long, n > 1), 404 (model, route), 405, 413, 429 with Retry-After, start-up
//! failures; and the server keeps serving everyone else.

use std::time::Duration;

use moeserve_e2e::{
    JsonResponse, Server, SseData, client, post_json, post_stream, run_to_exit, send, tiny_model,
    tiny_model_path,
};
use serde_json::{Value, json};

fn assert_error(r: &JsonResponse, status: u16, param: Option<&str>) {
    assert_eq!(r.status, status, "{}", r.body);
    let error = r.error();
    assert!(error["message"].as_str().is_some_and(|m| !m.is_empty()));
    assert!(error["type"].is_string());
    assert!(
        error.get("code").is_some(),
        "code is always present: {error}"
    );
    assert_eq!(
        error["param"],
        param.map_or(Value::Null, Value::from),
        "{error}"
    );
}

async fn post_raw(server: &Server, path: &str, body: &'static str) -> JsonResponse {
    let request = client()
        .post(server.url(path))
        .header("content-type", "application/json")
        .body(body);
    send(request).await
}

#[tokio::test]
async fn bad_requests_are_400_naming_the_field_and_the_server_keeps_serving() {
    let model = tiny_model(None);
    let server = Server::start(&["--model", tiny_model_path(&model).to_str().unwrap()]).await;
    let completions = server.url("/v1/completions");
    let r = post_raw(&server, "/v1/completions", "{not json").await;
    assert_error(&r, 400, None);
    let cases = [
        (json!({"prompt": "x", "temperature": "hot"}), "temperature"),
        (json!({"prompt": "x", "top_p": 0}), "top_p"),
        (json!({"prompt": "x", "max_tokens": 0}), "max_tokens"),
        (json!({"prompt": "x", "n": 0}), "n"),
        (json!({"prompt": "x", "logprobs": 21}), "logprobs"),
        (
            json!({"prompt": "x", "presence_penalty": 3}),
            "presence_penalty",
        ),
        (json!({"prompt": "x", "seed": -1}), "seed"),
        (json!({"max_tokens": 3}), "prompt"),
        (json!({"prompt": [1, 99999]}), "prompt"),
        (json!({"prompt": ["a", "b"]}), "prompt"),
    ];
    for (body, param) in cases {
        let r = post_json(&completions, &body).await;
        assert_error(&r, 400, Some(param));
    }
    let chat = server.url("/v1/chat/completions");
    let r = post_json(&chat, &json!({"max_tokens": 2})).await;
    assert_error(&r, 400, Some("messages"));
    let r = post_json(
        &chat,
        &json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
    )
    .await;
    assert_error(&r, 400, Some("top_logprobs"));
    // Roles and what they need, as OpenAI checks them: nothing unknown reaches the template.
    let messages = [
        (
            json!([{"role": "wizard", "content": "x"}]),
            "messages[0].role",
        ),
        (
            json!([{"role": "function", "content": "x"}]),
            "messages[0].role",
        ),
        (
            json!([{"role": "user", "content": "q"}, {"role": "tool", "content": "4"}]),
            "messages[1].tool_call_id",
        ),
        (
            json!([{"role": "user", "content": ""}]),
            "messages[0].content",
        ),
        (json!([{"role": "user"}]), "messages[0].content"),
    ];
    for (messages, param) in messages {
        let r = post_json(&chat, &json!({"messages": messages, "max_tokens": 2})).await;
        assert_error(&r, 400, Some(param));
    }
    // Still serving.
    let ok = post_json(&completions, &json!({"prompt": "x", "max_tokens": 2})).await;
    assert_eq!(ok.status, 200, "{}", ok.body);
}

#[tokio::test]
async fn a_prompt_longer_than_the_context_is_400_with_the_limit_and_the_length() {
    let model = tiny_model(None);
    let server = Server::start(&["--model", tiny_model_path(&model).to_str().unwrap()]).await;
    let prompt: Vec<u32> = (0..1000).map(|i| 3 + i % 200).collect();
    let r = post_json(
        &server.url("/v1/completions"),
        &json!({"prompt": prompt, "max_tokens": 100}),
    )
    .await;
    assert_error(&r, 400, None);
    assert_eq!(r.error()["code"], "context_length_exceeded");
    let message = r.error_message();
    assert!(
        message.contains("1024") && message.contains("1000") && message.contains("100"),
        "{message}"
    );
    // A chat prompt that fills the context is refused the same way.
    let long = "x".repeat(1100);
    let r = post_json(
        &server.url("/v1/chat/completions"),
        &json!({"messages": [{"role": "user", "content": long}]}),
    )
    .await;
    assert_error(&r, 400, None);
    assert!(r.error_message().contains("1024"), "{}", r.error_message());
    // Near a megabyte of text is refused from its length alone, before it is tokenized: the
    // tokenizer's longest token bounds the bytes one token can stand for.
    let huge = "x".repeat(1_000_000);
    for (path, body) in [
        ("/v1/completions", json!({"prompt": huge})),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": huge}]}),
        ),
    ] {
        let r = post_json(&server.url(path), &body).await;
        assert_error(&r, 400, None);
        assert_eq!(r.error()["code"], "context_length_exceeded");
        let message = r.error_message();
        assert!(
            message.contains("1024") && message.contains("bytes of text"),
            "{message}"
        );
    }
}

#[tokio::test]
async fn unknown_models_routes_and_methods_are_404_and_405() {
    let model = tiny_model(None);
    let path = tiny_model_path(&model);
    let server = Server::start(&[
        "--model",
        path.to_str().unwrap(),
        "--served-model-name",
        "served",
    ])
    .await;
    let r = post_json(
        &server.url("/v1/completions"),
        &json!({"model": "gpt-4", "prompt": "x"}),
    )
    .await;
    assert_error(&r, 404, Some("model"));
    assert!(r.error_message().contains("gpt-4"));
    let r = post_json(
        &server.url("/v1/chat/completions"),
        &json!({"model": "tiny", "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_error(&r, 404, Some("model"));
    let r = send(client().get(server.url("/v1/nothing-here"))).await;
    assert_error(&r, 404, None);
    let r = send(client().get(server.url("/v1/completions"))).await;
    assert_error(&r, 405, None);
    let models = send(client().get(server.url("/v1/models"))).await;
    assert_eq!(models.body["data"][0]["id"], "served");
    assert_eq!(models.body["object"], "list");
}

#[tokio::test]
async fn a_body_over_the_limit_is_413() {
    let model = tiny_model(None);
    let path = tiny_model_path(&model);
    let server = Server::start(&[
        "--model",
        path.to_str().unwrap(),
        "--max-request-bytes",
        "1000",
    ])
    .await;
    let big = json!({"prompt": "y".repeat(5000)});
    let r = post_json(&server.url("/v1/completions"), &big).await;
    assert_error(&r, 413, None);
    assert!(r.error_message().contains("1000"));
    let small = json!({"prompt": "y", "max_tokens": 1});
    assert_eq!(
        post_json(&server.url("/v1/completions"), &small)
            .await
            .status,
        200
    );
    // A declared length over the limit is answered from the header at once, without waiting
    // for a body that never comes (it used to end in a 408 after --request-read-timeout).
    let address = server
        .url("")
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string();
    let started = std::time::Instant::now();
    let head = declared_length_reply(&address, 10_000_000);
    assert!(head.starts_with("HTTP/1.1 413"), "{head}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    // hyper keeps the three largest u64 values for itself and used to answer them with 431
    // (headers too large); they are bodies too large like any other.
    for length in [u64::MAX, u64::MAX - 1, u64::MAX - 2, u64::MAX - 3] {
        let head = declared_length_reply(&address, length);
        assert!(head.starts_with("HTTP/1.1 413"), "{length}: {head}");
    }
    // The server still serves.
    assert_eq!(
        post_json(&server.url("/v1/completions"), &small)
            .await
            .status,
        200
    );
}

/// The status line and headers the server answers to a POST that declares `length` bytes and
/// sends none of them.
fn declared_length_reply(address: &str, length: u64) -> String {
    use std::io::{Read, Write};
    let mut socket = std::net::TcpStream::connect(address).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\n\
         Content-Length: {length}\r\n\r\n"
    );
    socket.write_all(request.as_bytes()).unwrap();
    let mut reply = vec![0u8; 4096];
    let n = socket.read(&mut reply).unwrap_or(0);
    String::from_utf8_lossy(&reply[..n]).into_owned()
}

#[tokio::test]
async fn a_full_queue_is_429_with_retry_after() {
    // One sequence at a time and one waiting place: a long request runs, a second one waits,
    // a third is refused. The long context keeps the first one running meanwhile.
    let model = tiny_model(Some(32768));
    let path = tiny_model_path(&model);
    let server = Server::start(&[
        "--model",
        path.to_str().unwrap(),
        "--max-num-seqs",
        "1",
        "--max-waiting-requests",
        "1",
    ])
    .await;
    let long = json!({"prompt": "run", "max_tokens": 32000, "ignore_eos": true, "stream": true});
    let url = server.url("/v1/completions");
    let mut running = post_stream(&url, &long).await;
    assert!(matches!(running.next().await, Some(SseData::Json(_))));
    let waiting = post_stream(&url, &long).await;
    let r = post_json(&url, &json!({"prompt": "x", "max_tokens": 1})).await;
    assert_error(&r, 429, None);
    assert_eq!(r.headers["retry-after"], "1");
    assert_eq!(r.error()["code"], "queue_full");
    drop(running);
    drop(waiting);
}

#[tokio::test]
async fn a_model_that_fails_to_load_stops_the_server_with_the_reason() {
    let model = tiny_model(None);
    let path = tiny_model_path(&model);
    std::fs::remove_file(path.join("model.safetensors")).unwrap();
    let (status, log) = run_to_exit(
        &["serve", "--model", path.to_str().unwrap(), "--port", "0"],
        Duration::from_secs(60),
    );
    assert!(!status.success());
    assert!(log.contains("listening on http://"), "{log}");
    assert!(
        log.contains("error:") && log.contains("safetensors"),
        "{log}"
    );
}

#[tokio::test]
async fn a_dtype_other_than_the_checkpoints_is_refused_before_listening() {
    let model = tiny_model(None);
    let path = tiny_model_path(&model);
    let (status, log) = run_to_exit(
        &[
            "serve",
            "--model",
            path.to_str().unwrap(),
            "--port",
            "0",
            "--dtype",
            "float32",
        ],
        Duration::from_secs(60),
    );
    assert!(!status.success());
    assert!(log.contains("not supported yet"), "{log}");
    assert!(!log.contains("listening on"), "{log}");
    // The checkpoint's own dtype is accepted.
    let server = Server::start(&["--model", path.to_str().unwrap(), "--dtype", "bfloat16"]).await;
    assert!(
        server.log_shows("ready", Duration::from_secs(10)),
        "{}",
        server.logs()
    );
}

#[tokio::test]
async fn an_unknown_architecture_is_refused_at_start_up_naming_it_and_the_supported_list() {
    let model = tiny_model(None);
    let path = tiny_model_path(&model);
    let config_path = path.join("config.json");
    let config = std::fs::read_to_string(&config_path).unwrap();
    let config = config
        .replace("MixtralForCausalLM", "LlamaForCausalLM")
        .replace("\"mixtral\"", "\"llama\"");
    std::fs::write(&config_path, config).unwrap();
    let (status, log) = run_to_exit(
        &["serve", "--model", path.to_str().unwrap(), "--port", "0"],
        Duration::from_secs(60),
    );
    assert!(!status.success());
    assert!(
        log.contains("\"LlamaForCausalLM\" is not supported"),
        "{log}"
    );
    for supported in [
        "MixtralForCausalLM",
        "Qwen3MoeForCausalLM",
        "Qwen2MoeForCausalLM",
        "OlmoeForCausalLM",
        "Glm4MoeForCausalLM",
        "DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM",
    ] {
        assert!(log.contains(supported), "{supported}: {log}");
    }
    assert!(!log.contains("listening on"), "{log}");
}

/// Settings under which some admissible request could never run are refused at start-up with
/// the flags that fix them (the engine used to start, then leave such a request waiting forever
/// or answer every request without `max_tokens` with a 400).
#[tokio::test]
async fn an_engine_that_could_never_serve_some_request_is_refused_at_start_up() {
    let model = tiny_model(None); // context 1024, 512 bytes of KV per token
    let path = tiny_model_path(&model);
    let model_arg = path.to_str().unwrap();
    let cases: [(&[&str], &str); 3] = [
        (
            &["--kv-cache-memory", "100KiB"],
            "Use --max-model-len 192 (the longest that fits) or --kv-cache-memory 512KiB",
        ),
        (
            &[
                "--no-enable-chunked-prefill",
                "--max-num-batched-tokens",
                "512",
            ],
            "Use --max-num-batched-tokens 1024, --max-model-len 512, or --enable-chunked-prefill",
        ),
        (
            &["--max-model-len", "4096"],
            "--max-model-len 4096 is longer than the model's context of 1024 tokens",
        ),
    ];
    for (flags, says) in cases {
        let mut args = vec!["serve", "--model", model_arg, "--port", "0"];
        args.extend_from_slice(flags);
        let (status, log) = run_to_exit(&args, Duration::from_secs(60));
        assert!(!status.success(), "{flags:?}: {log}");
        assert!(log.contains(says), "{flags:?}: {log}");
        assert!(!log.contains(" ready"), "{flags:?}: {log}");
    }
}
