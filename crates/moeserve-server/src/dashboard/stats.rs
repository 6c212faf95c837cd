//! `GET /v1/stats`: the engine's queue, KV-cache and step statistics with the latency
//! percentiles of the last minutes, as JSON, for the dashboard (behind the API key like the
//! rest of `/v1`; 503 while loading or shutting down).

use axum::Json;
use axum::extract::State;
use moeserve_engine::stats::EngineStats;
use serde::Serialize;

use crate::error::{ApiError, ErrorBody};
use crate::latency_window::LatencySummary;
use crate::state::{AppState, unix_now};

/// The body of `GET /v1/stats`.
#[derive(Serialize)]
pub struct StatsReport {
    pub object: &'static str,
    pub model: String,
    /// Unix time of the snapshot, in seconds.
    pub time: u64,
    pub uptime_seconds: u64,
    /// Requests running and waiting, KV-cache usage, steps and token totals.
    pub engine: EngineStats,
    /// TTFT, TPOT and end-to-end percentiles over the requests finished within the window.
    pub latency: LatencySummary,
}

/// `GET /v1/stats`.
#[utoipa::path(get, path = "/v1/stats", tag = "moe",
    security((), ("api_key" = [])),
    responses(
        (status = 200, description = "The dashboard's data: engine, latency and MoE figures", body = serde_json::Value),
        (status = 401, description = "Missing or wrong API key", body = ErrorBody),
        (status = 503, description = "Loading or shutting down", body = ErrorBody),
    ))]
pub async fn stats(State(state): State<AppState>) -> Result<Json<StatsReport>, ApiError> {
    let engine = state.engine()?;
    let time = unix_now();
    Ok(Json(StatsReport {
        object: "stats",
        model: state.served_model_name().to_string(),
        time,
        uptime_seconds: time.saturating_sub(state.started_at()),
        engine: engine.stats(),
        latency: state.metrics().recent_latencies().summary(),
    }))
}
