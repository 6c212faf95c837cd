//! Prometheus `/metrics`: a `metrics-exporter-prometheus` recorder installed once per process,
//! rendered on scrape, on its own router (merged into the app).
//!
//! Names come from `moeserve_engine::metrics`. Gauges and counters are refreshed from the engine's
//! statistics right before rendering (counters set to the engine's absolute totals); histograms
//! are observed per request as its events pass through the server. With `--metrics-compat vllm`
//! every series is also recorded under its `vllm:` name (the MoE series, which vLLM lacks, only
//! under their own; see `crate::moe`).

use std::sync::OnceLock;

use axum::Router;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use metrics::{Counter, Gauge, Histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use moeserve_engine::metrics as names;
use moeserve_engine::moe::MoeStats;
use moeserve_engine::request::{FinishReason, GenerateOutput};
use moeserve_engine::stats::EngineStats;

use crate::config::MetricsCompat;
use crate::latency_window::{LatencyWindow, RequestLatency};
use crate::state::AppState;

static RECORDER: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the process-wide Prometheus recorder (once; later calls return the same handle) with
/// vLLM's buckets, and registers the help text of every series.
pub fn install_recorder(
    compat: MetricsCompat,
    max_model_len: usize,
) -> Result<PrometheusHandle, String> {
    if let Some(handle) = RECORDER.get() {
        return Ok(handle.clone());
    }
    let mut builder = PrometheusBuilder::new();
    for def in names::ALL
        .iter()
        .filter(|d| d.buckets != names::Buckets::None)
    {
        let bounds = def.buckets.bounds(max_model_len);
        for name in exported_names(def.name, compat) {
            builder = builder
                .set_buckets_for_metric(Matcher::Full(name), &bounds)
                .map_err(|e| format!("metrics buckets of {}: {e}", def.name))?;
        }
    }
    let recorder = builder.build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder)
        .map_err(|e| format!("cannot install the metrics recorder: {e}"))?;
    names::describe_metrics();
    names::describe_moe_metrics();
    if compat == MetricsCompat::Vllm {
        names::describe_vllm_metrics();
    }
    Ok(RECORDER.get_or_init(|| handle).clone())
}

fn exported_names(name: &str, compat: MetricsCompat) -> Vec<String> {
    match compat {
        MetricsCompat::None => vec![name.to_string()],
        MetricsCompat::Vllm => vec![name.to_string(), names::vllm_name(name)],
    }
}

/// One series under each exported name.
struct Series<T>(Vec<T>);

impl Series<Gauge> {
    fn set(&self, value: f64) {
        self.0.iter().for_each(|g| g.set(value));
    }
}

impl Series<Counter> {
    fn absolute(&self, value: u64) {
        self.0.iter().for_each(|c| c.absolute(value));
    }

    fn increment(&self, value: u64) {
        self.0.iter().for_each(|c| c.increment(value));
    }
}

impl Series<Histogram> {
    fn record(&self, value: f64) {
        self.0.iter().for_each(|h| h.record(value));
    }
}

/// Handles of every series, labelled with the served model name.
pub struct ServerMetrics {
    exporter: Option<PrometheusHandle>,
    /// The `model_name` label of the MoE series, which are labelled per scrape.
    model_name: String,
    running: Series<Gauge>,
    waiting: Series<Gauge>,
    kv_usage: Series<Gauge>,
    prefix_queries: Series<Counter>,
    prefix_hits: Series<Counter>,
    preemptions: Series<Counter>,
    prompt_tokens: Series<Counter>,
    generation_tokens: Series<Counter>,
    success_stop: Series<Counter>,
    success_length: Series<Counter>,
    success_abort: Series<Counter>,
    /// `request_errors_total` by [`ErrorCause`], in its order.
    errors: Vec<Series<Counter>>,
    time_to_first_token: Series<Histogram>,
    time_per_output_token: Series<Histogram>,
    inter_token_latency: Series<Histogram>,
    e2e_latency: Series<Histogram>,
    queue_time: Series<Histogram>,
    prefill_time: Series<Histogram>,
    decode_time: Series<Histogram>,
    request_prompt_tokens: Series<Histogram>,
    request_generation_tokens: Series<Histogram>,
    structured_masks: Counter,
    structured_mask_seconds: Gauge,
    structured_wait_seconds: Gauge,
    /// Latencies of the last minutes, for the dashboard's percentiles.
    recent_latencies: LatencyWindow,
}

/// Why a request did not finish normally (`cause` of `request_errors_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorCause {
    /// `--request-timeout` ran out (504).
    Timeout,
    /// The client went away before the end.
    ClientDisconnect,
    /// The engine failed the request, or died.
    EngineError,
    /// The shutdown drain cancelled it (503).
    Shutdown,
    /// Refused before running: the queue was full (429) or admission refused it (400).
    Rejected,
}

impl ErrorCause {
    const ALL: [ErrorCause; 5] = [
        ErrorCause::Timeout,
        ErrorCause::ClientDisconnect,
        ErrorCause::EngineError,
        ErrorCause::Shutdown,
        ErrorCause::Rejected,
    ];

    pub(crate) fn label(self) -> &'static str {
        match self {
            ErrorCause::Timeout => "timeout",
            ErrorCause::ClientDisconnect => "client_disconnect",
            ErrorCause::EngineError => "engine_error",
            ErrorCause::Shutdown => "shutdown",
            ErrorCause::Rejected => "rejected",
        }
    }
}

impl ServerMetrics {
    /// Handles on the installed recorder; `exporter` renders `/metrics`.
    pub fn new(exporter: PrometheusHandle, model_name: &str, compat: MetricsCompat) -> Self {
        let metrics = Self::build(Some(exporter), model_name, compat);
        // Every outcome is listed from the start, as vLLM does.
        metrics.success_stop.increment(0);
        metrics.success_length.increment(0);
        metrics.success_abort.increment(0);
        metrics.errors.iter().for_each(|e| e.increment(0));
        metrics
    }

    /// Handles that record nowhere in particular and a `/metrics` that says so (for tests of
    /// the HTTP layer that install no recorder).
    pub fn unexported(model_name: &str) -> Self {
        Self::build(None, model_name, MetricsCompat::None)
    }

    fn build(exporter: Option<PrometheusHandle>, model: &str, compat: MetricsCompat) -> Self {
        let model = model.to_string();
        let label = names::LABEL_MODEL_NAME;
        let gauge = |name: &str| {
            Series(
                exported_names(name, compat)
                    .into_iter()
                    .map(|n| metrics::gauge!(n, label => model.clone()))
                    .collect::<Vec<_>>(),
            )
        };
        let counter = |name: &str| {
            Series(
                exported_names(name, compat)
                    .into_iter()
                    .map(|n| metrics::counter!(n, label => model.clone()))
                    .collect(),
            )
        };
        let success = |reason: &'static str| {
            Series(
                exported_names(names::REQUEST_SUCCESS_TOTAL, compat)
                    .into_iter()
                    .map(|n| {
                        metrics::counter!(
                            n, label => model.clone(), names::LABEL_FINISHED_REASON => reason
                        )
                    })
                    .collect(),
            )
        };
        let error = |cause: ErrorCause| {
            Series(
                exported_names(names::REQUEST_ERRORS_TOTAL, compat)
                    .into_iter()
                    .map(|n| {
                        metrics::counter!(
                            n, label => model.clone(), names::LABEL_CAUSE => cause.label()
                        )
                    })
                    .collect(),
            )
        };
        let histogram = |name: &str| {
            Series(
                exported_names(name, compat)
                    .into_iter()
                    .map(|n| metrics::histogram!(n, label => model.clone()))
                    .collect(),
            )
        };
        let mut kv_usage = gauge(names::KV_CACHE_USAGE_PERC);
        if compat == MetricsCompat::Vllm {
            let deprecated = names::VLLM_GPU_CACHE_USAGE_PERC;
            kv_usage
                .0
                .push(metrics::gauge!(deprecated, label => model.clone()));
        }
        ServerMetrics {
            exporter,
            model_name: model.clone(),
            running: gauge(names::NUM_REQUESTS_RUNNING),
            waiting: gauge(names::NUM_REQUESTS_WAITING),
            kv_usage,
            prefix_queries: counter(names::PREFIX_CACHE_QUERIES_TOTAL),
            prefix_hits: counter(names::PREFIX_CACHE_HITS_TOTAL),
            preemptions: counter(names::NUM_PREEMPTIONS_TOTAL),
            prompt_tokens: counter(names::PROMPT_TOKENS_TOTAL),
            generation_tokens: counter(names::GENERATION_TOKENS_TOTAL),
            success_stop: success("stop"),
            success_length: success("length"),
            success_abort: success("abort"),
            errors: ErrorCause::ALL.into_iter().map(error).collect(),
            time_to_first_token: histogram(names::TIME_TO_FIRST_TOKEN_SECONDS),
            time_per_output_token: histogram(names::TIME_PER_OUTPUT_TOKEN_SECONDS),
            inter_token_latency: histogram(names::INTER_TOKEN_LATENCY_SECONDS),
            e2e_latency: histogram(names::E2E_REQUEST_LATENCY_SECONDS),
            queue_time: histogram(names::REQUEST_QUEUE_TIME_SECONDS),
            prefill_time: histogram(names::REQUEST_PREFILL_TIME_SECONDS),
            decode_time: histogram(names::REQUEST_DECODE_TIME_SECONDS),
            request_prompt_tokens: histogram(names::REQUEST_PROMPT_TOKENS),
            request_generation_tokens: histogram(names::REQUEST_GENERATION_TOKENS),
            structured_masks: metrics::counter!(
                names::STRUCTURED_OUTPUT_MASKS_TOTAL,
                names::LABEL_MODEL_NAME => model.clone()
            ),
            structured_mask_seconds: metrics::gauge!(
                names::STRUCTURED_OUTPUT_MASK_SECONDS,
                names::LABEL_MODEL_NAME => model.clone()
            ),
            structured_wait_seconds: metrics::gauge!(
                names::STRUCTURED_OUTPUT_WAIT_SECONDS,
                names::LABEL_MODEL_NAME => model.clone()
            ),
            recent_latencies: LatencyWindow::default(),
        }
    }

    /// Copies the engine's gauges and totals.
    pub fn refresh(&self, stats: &EngineStats) {
        self.running.set(stats.num_running as f64);
        self.waiting.set(stats.num_waiting as f64);
        self.kv_usage.set(f64::from(stats.kv_cache_usage));
        self.prefix_queries.absolute(stats.prefix_cache_queries);
        self.prefix_hits.absolute(stats.prefix_cache_hits);
        self.preemptions.absolute(stats.num_preemptions);
        self.generation_tokens.absolute(stats.generation_tokens);
        self.structured_masks.absolute(stats.structured_masks);
        self.structured_mask_seconds
            .set(stats.structured_mask_seconds);
        self.structured_wait_seconds
            .set(stats.structured_wait_seconds);
    }

    /// Copies the engine's MoE snapshot (per layer, device and, with `--expert-metrics full`,
    /// per expert).
    pub fn refresh_moe(&self, stats: &MoeStats) {
        crate::moe::record_moe_metrics(&self.model_name, stats);
    }

    /// A request's prompt has been prefilled (its first token came).
    pub fn observe_prefilled(&self, prompt_len: usize) {
        self.prompt_tokens.increment(prompt_len as u64);
    }

    /// The gap between two consecutive tokens of one request, measured in the server.
    pub fn observe_inter_token(&self, seconds: f64) {
        self.inter_token_latency.record(seconds);
    }

    /// A request finished: its phases, lengths and outcome.
    pub fn observe_finished(&self, output: &GenerateOutput) {
        let t = &output.timings;
        let generated = output.token_ids.len();
        self.time_to_first_token
            .record(t.time_to_first_token_seconds);
        let tpot = (generated > 1).then(|| t.decode_seconds / (generated - 1) as f64);
        if let Some(tpot) = tpot {
            self.time_per_output_token.record(tpot);
        }
        self.recent_latencies.record(RequestLatency {
            time_to_first_token: t.time_to_first_token_seconds,
            time_per_output_token: tpot,
            e2e: t.e2e_seconds,
        });
        self.e2e_latency.record(t.e2e_seconds);
        self.queue_time.record(t.queue_seconds);
        self.prefill_time.record(t.prefill_seconds);
        self.decode_time.record(t.decode_seconds);
        self.request_prompt_tokens
            .record(output.prompt_ids.len() as f64);
        self.request_generation_tokens.record(generated as f64);
        match output.finish_reason {
            FinishReason::Stop => self.success_stop.increment(1),
            FinishReason::Length => self.success_length.increment(1),
        }
    }

    /// A request that ended before finishing (`cause`), `elapsed` seconds after it arrived:
    /// counted as `finished_reason="abort"` and by cause, its end-to-end time recorded, and its
    /// time to first token — or, when it never got one, the time it waited, a lower bound — so
    /// latency alerts see exactly the requests that time out.
    pub fn observe_aborted(&self, cause: ErrorCause, elapsed: f64, first_token: Option<f64>) {
        self.success_abort.increment(1);
        self.errors[cause as usize].increment(1);
        self.e2e_latency.record(elapsed);
        self.time_to_first_token
            .record(first_token.unwrap_or(elapsed));
    }

    /// A request refused before it ran (429, or the engine's admission 400).
    pub fn observe_rejected(&self) {
        self.errors[ErrorCause::Rejected as usize].increment(1);
    }

    /// Latencies of the requests finished in the last minutes.
    pub fn recent_latencies(&self) -> &LatencyWindow {
        &self.recent_latencies
    }

    /// The Prometheus text exposition, or `None` without an exporter.
    pub fn render(&self) -> Option<String> {
        let exporter = self.exporter.as_ref()?;
        exporter.run_upkeep();
        Some(exporter.render())
    }
}

/// `GET /metrics`.
pub fn router() -> Router<AppState> {
    Router::new().route("/metrics", get(scrape))
}

#[utoipa::path(get, path = "/metrics", tag = "server",
    responses(
        (status = 200, description = "Prometheus text exposition", body = String, content_type = "text/plain"),
        (status = 401, description = "Missing or wrong API key (with --metrics-auth)", body = crate::error::ErrorBody),
    ))]
pub async fn scrape(State(state): State<AppState>) -> axum::response::Response {
    if let Some(engine) = state.loaded_engine() {
        state.metrics().refresh(&engine.stats());
        state.metrics().refresh_moe(&engine.moe_snapshot());
    }
    let text = state
        .metrics()
        .render()
        .unwrap_or_else(|| "# metrics are not exported by this server\n".to_string());
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn local_metrics(compat: MetricsCompat) -> ServerMetrics {
        let recorder = PrometheusBuilder::new().build_recorder();
        let exporter = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            ServerMetrics::build(Some(exporter), "m", compat)
        })
    }

    #[test]
    fn names_keep_their_colons_through_the_exporter() {
        let metrics = local_metrics(MetricsCompat::None);
        metrics.refresh(&EngineStats {
            num_running: 2,
            kv_cache_usage: 0.5,
            generation_tokens: 7,
            ..EngineStats::default()
        });
        let text = metrics.render().unwrap();
        assert!(text.contains("moeserve:num_requests_running{model_name=\"m\"} 2"));
        assert!(text.contains("moeserve:kv_cache_usage_perc{model_name=\"m\"} 0.5"));
        assert!(text.contains("moeserve:generation_tokens_total{model_name=\"m\"} 7"));
        assert!(!text.contains("vllm:"));
    }

    #[test]
    fn vllm_compat_records_every_series_twice() {
        let metrics = local_metrics(MetricsCompat::Vllm);
        metrics.refresh(&EngineStats {
            kv_cache_usage: 0.25,
            ..EngineStats::default()
        });
        let text = metrics.render().unwrap();
        assert!(text.contains("vllm:kv_cache_usage_perc{model_name=\"m\"} 0.25"));
        assert!(text.contains("vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.25"));
        assert!(text.contains("moeserve:kv_cache_usage_perc{model_name=\"m\"} 0.25"));
    }

    #[test]
    fn without_an_exporter_nothing_renders() {
        assert_eq!(ServerMetrics::unexported("m").render(), None);
    }
}
