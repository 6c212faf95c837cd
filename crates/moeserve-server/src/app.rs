//! The router: OpenAI endpoints, `GET /v1/moe/load` and `GET /v1/stats` under `/v1`, and
//! `POST /tokenize` / `/detokenize` (all behind the API key when one is set), `/health`, `/version`, `/dashboard` (the page only; its data comes
//! from `/v1`), and `/metrics` on its own router merged in. Unknown routes and methods answer in
//! the OpenAI error shape; bodies are limited to `--max-request-bytes`.

use axum::Router;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::middleware;
use axum::response::{IntoResponse, Json};
use axum::routing::{get, post};

use crate::auth::require_api_key;
use crate::dashboard;
use crate::error::{ApiError, ErrorBody};
use crate::metrics;
use crate::moe;
use crate::openai::{chat, completions, models, tokenize};
use crate::state::AppState;

/// The whole HTTP API over `state`.
pub fn app(state: AppState) -> Router {
    let v1 = Router::new()
        .route("/v1/completions", post(completions::create))
        .route("/v1/chat/completions", post(chat::create))
        .route("/v1/models", get(models::list))
        .route("/v1/moe/load", get(moe::load))
        .route("/v1/stats", get(dashboard::stats::stats))
        // vLLM's tokenizer endpoints, outside /v1 as in vLLM, but behind the key (they spend
        // the server's CPU).
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ));
    Router::new()
        .merge(v1)
        .route("/health", get(health))
        .route("/version", get(version))
        .route("/openapi.json", get(crate::openapi::openapi_json))
        .merge(metrics_router(&state))
        .merge(dashboard::router())
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(state.max_request_bytes()))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            crate::origin::check_origin,
        ))
        // Outermost: every response, refusals included, has its request id and log line.
        .layer(middleware::from_fn(crate::access_log::layer))
        .with_state(state)
}

/// `/metrics`, behind the API key with `--metrics-auth`.
fn metrics_router(state: &AppState) -> Router<AppState> {
    let router = metrics::router();
    if !state.metrics_auth() {
        return router;
    }
    router.route_layer(middleware::from_fn_with_state(
        state.clone(),
        require_api_key,
    ))
}

/// 200 once the model is loaded; 503 while loading or shutting down.
#[utoipa::path(get, path = "/health", tag = "server",
    responses(
        (status = 200, description = "Ready"),
        (status = 503, description = "Loading or shutting down", body = ErrorBody),
    ))]
pub async fn health(State(state): State<AppState>) -> Result<StatusCode, ApiError> {
    state.engine()?;
    Ok(StatusCode::OK)
}

#[utoipa::path(get, path = "/version", tag = "server",
    responses((status = 200, description = "`{\"version\": …}`", body = serde_json::Value)))]
pub async fn version() -> impl IntoResponse {
    Json(serde_json::json!({ "version": env!("CARGO_PKG_VERSION") }))
}

/// A path under `/v1` answers 401 before 404 or 405 when the key is missing: which routes
/// exist is not told to a client without it.
fn unauthorized_under_v1(state: &AppState, uri: &Uri, headers: &HeaderMap) -> Option<ApiError> {
    let under_v1 = uri.path() == "/v1" || uri.path().starts_with("/v1/");
    (under_v1 && !crate::auth::carries_key(state, headers)).then_some(ApiError::Unauthorized)
}

async fn not_found(
    State(state): State<AppState>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
) -> ApiError {
    if let Some(denied) = unauthorized_under_v1(&state, &uri, &headers) {
        return denied;
    }
    ApiError::RouteNotFound {
        method: method.to_string(),
        path: uri.path().to_string(),
    }
}

async fn method_not_allowed(
    State(state): State<AppState>,
    uri: Uri,
    headers: HeaderMap,
) -> ApiError {
    unauthorized_under_v1(&state, &uri, &headers).unwrap_or(ApiError::MethodNotAllowed)
}
