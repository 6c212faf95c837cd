//! The README's quick start, served: the demo model (`models/smolmoe-8x135m`, made by
//! `models/smolmoe-8x135m.sh`, which scripts/test.sh runs first; `MOESERVE_DEMO_MODEL`
//! overrides the location) answers the README's chat request with real text.

use moeserve_e2e::{Server, demo_model_dir, post_json, repo_root};
use serde_json::{Value, json};

/// The JSON body of the README's curl example, exactly as written there (`-d '…'`).
fn readme_curl_body() -> Value {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    let start = readme
        .find("curl http://127.0.0.1:8000/v1/chat/completions")
        .unwrap();
    let quoted = &readme[start..];
    let body = &quoted[quoted.find("-d '").unwrap() + 4..];
    let body = &body[..body.find('\'').unwrap()];
    serde_json::from_str(body).unwrap_or_else(|e| panic!("README's curl body: {e}\n{body}"))
}

/// The README's curl example exactly as written (no `max_tokens`: the answer may fill the
/// context) against the server as `scripts/serve-demo.sh` starts it (default flags, the served
/// name from the directory): it must not be refused for the KV cache.
#[tokio::test]
async fn the_readme_curl_example_as_written_is_answered() {
    let dir = demo_model_dir();
    let server = Server::start(&["--model", dir.to_str().unwrap()]).await;
    let body = readme_curl_body();
    assert!(body.get("max_tokens").is_none(), "{body}");
    let r = post_json(&server.url("/v1/chat/completions"), &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        r.body["choices"][0]["message"]["content"],
        "The capital of France is Paris."
    );
}

#[tokio::test]
async fn the_demo_model_answers_the_readme_chat_request() {
    let dir = demo_model_dir();
    let server = Server::start(&[
        "--model",
        dir.to_str().unwrap(),
        "--served-model-name",
        "smolmoe-8x135m",
    ])
    .await;
    // The body of the README's curl example.
    let r = post_json(
        &server.url("/v1/chat/completions"),
        &json!({"model": "smolmoe-8x135m",
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "temperature": 0, "max_tokens": 32}),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let choice = &r.body["choices"][0];
    // As dense SmolLM2 answers in transformers (tests/fixtures/smolmoe-demo/reference.json).
    assert_eq!(
        choice["message"]["content"],
        "The capital of France is Paris."
    );
    assert_eq!(choice["finish_reason"], "stop");
}
