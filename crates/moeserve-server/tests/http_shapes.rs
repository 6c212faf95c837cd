//! Fast shape tests of the router, in process (`app(state).oneshot(request)`, axum's testing
//! example), over the real engine and a tiny random model. The end-to-end tests in tests/e2e
//! run the real binary; these check JSON and SSE shapes and the not-ready state directly.

use std::sync::Arc;

use axum::body::{Body, to_bytes};
use axum::http::{Request, StatusCode, header};
use moeserve_engine::assets::ModelAssets;
use moeserve_engine::engine_core::EngineConfig;
use moeserve_engine::handle::Engine;
use moeserve_formats::presets::{MakeModelOptions, Preset, make_model};
use moeserve_server::metrics::ServerMetrics;
use moeserve_server::{AppOptions, AppState, app};
use serde_json::{Value, json};
use tower::ServiceExt;

fn state() -> AppState {
    let options = AppOptions {
        served_model_name: "tiny".to_string(),
        api_key: None,
        max_request_bytes: 64 * 1024,
        max_waiting_requests: 16,
        ..AppOptions::default()
    };
    AppState::new(options, ServerMetrics::unexported("tiny"))
}

/// A state whose engine runs `mixtral-tiny` (made in a temp dir that lives as long as needed).
fn ready_state() -> (AppState, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("tiny");
    make_model(&MakeModelOptions {
        preset: Preset::MixtralTiny,
        out: out.clone(),
        seed: 0,
    })
    .unwrap();
    let assets = Arc::new(ModelAssets::load(&out).unwrap());
    let engine = Engine::start(assets, &EngineConfig::default()).unwrap();
    let state = state();
    assert!(state.set_engine(Arc::new(engine)).is_ok());
    (state, dir)
}

fn post(path: &str, body: Value) -> Request<Body> {
    Request::post(path)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()))
        .unwrap()
}

async fn call(state: &AppState, request: Request<Body>) -> (StatusCode, String, String) {
    let response = app(state.clone()).oneshot(request).await.unwrap();
    let status = response.status();
    let content_type = response
        .headers()
        .get(header::CONTENT_TYPE)
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    let bytes = to_bytes(response.into_body(), usize::MAX).await.unwrap();
    (
        status,
        content_type,
        String::from_utf8(bytes.to_vec()).unwrap(),
    )
}

#[tokio::test]
async fn health_and_generation_are_503_until_the_model_is_loaded() {
    let state = state();
    let health = Request::get("/health").body(Body::empty()).unwrap();
    let (status, _, body) = call(&state, health).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let error: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(error["error"]["message"], "the model is still loading");
    let request = post("/v1/completions", json!({"prompt": "x"}));
    let (status, content_type, _) = call(&state, request).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(content_type, "application/json");
    // Metrics and models answer while loading.
    let metrics = Request::get("/metrics").body(Body::empty()).unwrap();
    assert_eq!(call(&state, metrics).await.0, StatusCode::OK);
    let models = Request::get("/v1/models").body(Body::empty()).unwrap();
    let (status, _, body) = call(&state, models).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["data"][0]["id"],
        "tiny"
    );
}

#[tokio::test]
async fn health_is_200_once_loaded_and_503_when_shutting_down() {
    let (state, _dir) = ready_state();
    let health = || Request::get("/health").body(Body::empty()).unwrap();
    assert_eq!(call(&state, health()).await.0, StatusCode::OK);
    state.begin_shutdown();
    let (status, _, body) = call(&state, health()).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(body.contains("shutting down"));
}

#[tokio::test]
async fn completion_json_has_openai_fields() {
    let (state, _dir) = ready_state();
    let request = post(
        "/v1/completions",
        json!({"prompt": [3, 4, 5], "max_tokens": 2, "temperature": 0, "ignore_eos": true}),
    );
    let (status, content_type, body) = call(&state, request).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(content_type, "application/json");
    let body: Value = serde_json::from_str(&body).unwrap();
    let keys: Vec<&str> = body
        .as_object()
        .unwrap()
        .keys()
        .map(|k| k.as_str())
        .collect();
    for key in ["id", "object", "created", "model", "choices", "usage"] {
        assert!(keys.contains(&key), "{key} in {keys:?}");
    }
    let choice = body["choices"][0].as_object().unwrap();
    for key in ["index", "text", "logprobs", "finish_reason"] {
        assert!(choice.contains_key(key), "{key}");
    }
    assert_eq!(body["usage"]["total_tokens"], 5);
}

#[tokio::test]
async fn chat_stream_is_sse_with_role_first_and_done_last() {
    let (state, _dir) = ready_state();
    let request = post(
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
               "temperature": 0, "ignore_eos": true, "stream": true}),
    );
    let (status, content_type, body) = call(&state, request).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(content_type, "text/event-stream");
    let events: Vec<&str> = body.split_terminator("\n\n").collect();
    assert_eq!(events.last(), Some(&"data: [DONE]"));
    let first: Value = serde_json::from_str(events[0].strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    let last_chunk = events[events.len() - 2].strip_prefix("data: ").unwrap();
    let last: Value = serde_json::from_str(last_chunk).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
}

#[tokio::test]
async fn bodies_over_the_limit_are_413_in_the_openai_shape() {
    let state = state();
    let big = json!({"prompt": "z".repeat(100 * 1024)});
    let (status, _, body) = call(&state, post("/v1/completions", big)).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    let error: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(error["error"]["code"], "request_too_large");
}
