//! The README's quick start, served: the demo model (`models/smolmoe-8x135m`, made by
//! `models/smolmoe-8x135m.sh`, which scripts/test.sh runs first; `MOESERVE_DEMO_MODEL`
//! overrides the location) answers the README's chat request with real text.

use moeserve_e2e::{Server, demo_model_dir, post_json};
use serde_json::json;

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
