//! `--api-key` / `MOESERVE_API_KEY` end to end: /v1/* needs `Authorization: Bearer KEY`;
//! /health and /metrics stay open; the key never shows up in the log.

use std::time::Duration;

use moeserve_e2e::{Server, client, send, status_of, tiny_model, tiny_model_path};
use serde_json::json;

const KEY: &str = "sk-e2e-Secret-123";

async fn check_key_is_required(server: &Server) {
    let c = client();
    let models = server.url("/v1/models");
    let missing = send(c.get(&models)).await;
    assert_eq!(missing.status, 401, "{}", missing.body);
    assert_eq!(missing.error()["code"], "invalid_api_key");
    assert_eq!(status_of(c.get(&models).bearer_auth("sk-wrong")).await, 401);
    assert_eq!(
        status_of(c.get(&models).bearer_auth(&KEY[..KEY.len() - 1])).await,
        401
    );
    assert_eq!(
        status_of(c.get(&models).header("authorization", KEY)).await,
        401
    );
    assert_eq!(status_of(c.get(&models).bearer_auth(KEY)).await, 200);
    let completion = c
        .post(server.url("/v1/completions"))
        .json(&json!({"prompt": "x", "max_tokens": 2}));
    assert_eq!(status_of(completion).await, 401);
    let completion = c
        .post(server.url("/v1/completions"))
        .bearer_auth(KEY)
        .json(&json!({"prompt": "x", "max_tokens": 2}));
    assert_eq!(status_of(completion).await, 200);
    assert_eq!(status_of(c.get(server.url("/health"))).await, 200);
    assert_eq!(status_of(c.get(server.url("/metrics"))).await, 200);
    assert_eq!(status_of(c.get(server.url("/version"))).await, 200);
    // Every start-up line is in once `ready` is.
    assert!(server.log_shows("ready", Duration::from_secs(10)));
    assert!(!server.logs().contains(KEY), "the key was logged");
}

#[tokio::test]
async fn the_api_key_flag_guards_v1() {
    let model = tiny_model(None);
    let path = tiny_model_path(&model);
    let server = Server::start(&["--model", path.to_str().unwrap(), "--api-key", KEY]).await;
    check_key_is_required(&server).await;
}

#[tokio::test]
async fn the_api_key_environment_variable_guards_v1() {
    let model = tiny_model(None);
    let path = tiny_model_path(&model);
    let server = Server::start_with_env(
        &["--model", path.to_str().unwrap()],
        &[("MOESERVE_API_KEY", KEY)],
    )
    .await;
    check_key_is_required(&server).await;
}
