//! `--api-key` / `MOESERVE_API_KEY` end to end: /v1/* needs `Authorization: Bearer KEY`
//! (401 with `WWW-Authenticate: Bearer`, before any 404 or 405 under /v1); /health and /metrics
//! stay open; the key never shows up in the log, not even a refused one; a secrets file's
//! trailing newline is removed.

use std::time::Duration;

use moeserve_e2e::{Server, client, run_to_exit, send, status_of, tiny_model, tiny_model_path};
use serde_json::json;

const KEY: &str = "sk-e2e-Secret-123";

async fn check_key_is_required(server: &Server) {
    let c = client();
    let models = server.url("/v1/models");
    let missing = send(c.get(&models)).await;
    assert_eq!(missing.status, 401, "{}", missing.body);
    assert_eq!(missing.error()["code"], "invalid_api_key");
    assert_eq!(missing.headers["www-authenticate"], "Bearer");
    // Which routes exist under /v1 is not told without the key: 401 before 404 and 405.
    let unknown = server.url("/v1/no-such-route");
    let unknown_missing = send(c.get(&unknown)).await;
    assert_eq!(unknown_missing.status, 401, "{}", unknown_missing.body);
    assert_eq!(unknown_missing.headers["www-authenticate"], "Bearer");
    assert_eq!(status_of(c.get(&unknown).bearer_auth(KEY)).await, 404);
    assert_eq!(status_of(c.delete(&models)).await, 401);
    assert_eq!(status_of(c.delete(&models).bearer_auth(KEY)).await, 405);
    assert_eq!(status_of(c.get(server.url("/no-such-route"))).await, 404);
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

#[tokio::test]
async fn a_trailing_newline_is_removed_and_said() {
    let model = tiny_model(None);
    let path = tiny_model_path(&model);
    let from_file = format!("{KEY}\n");
    let server = Server::start_with_env(
        &["--model", path.to_str().unwrap()],
        &[("MOESERVE_API_KEY", &from_file)],
    )
    .await;
    check_key_is_required(&server).await;
    assert!(
        server.logs().contains("removed the key's trailing newline"),
        "{}",
        server.logs()
    );
}

#[tokio::test]
async fn a_refused_key_is_never_printed() {
    let model = tiny_model(None);
    let path = tiny_model_path(&model);
    let secret = "SuperSecret key\n";
    let (status, log) = run_to_exit(
        &[
            "serve",
            "--model",
            path.to_str().unwrap(),
            "--port",
            "0",
            "--api-key",
            secret,
        ],
        Duration::from_secs(60),
    );
    assert!(!status.success());
    assert!(log.contains("invalid API key"), "{log}");
    assert!(
        !log.contains("SuperSecret"),
        "the refused key was printed: {log}"
    );
    assert!(!log.contains("listening on"), "{log}");
}
