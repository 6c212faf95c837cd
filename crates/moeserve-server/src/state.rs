//! What every handler shares: the engine once loaded, the served name, limits, the API key and
//! the metric handles. Cheap to clone (one `Arc`).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use moeserve_core::SamplingDefaults;
use moeserve_engine::assets::ModelAssets;
use moeserve_engine::handle::Engine;

use crate::auth::ApiKey;
use crate::config::GenerationConfigMode;
use crate::drain::Drain;
use crate::error::ApiError;
use crate::metrics::ServerMetrics;
use crate::openai::tools::ToolCallParser;

/// Settings of the HTTP layer.
#[derive(Clone, Debug)]
pub struct AppOptions {
    /// The only model name this server answers to.
    pub served_model_name: String,
    pub api_key: Option<ApiKey>,
    pub max_request_bytes: usize,
    /// Requests waiting for their first token beyond this are refused with 429.
    pub max_waiting_requests: usize,
    /// `--metrics-auth`: `/metrics` needs the API key too.
    pub metrics_auth: bool,
    pub time_limits: TimeLimits,
    /// `--allowed-hosts`, `--allowed-origins`.
    pub origin_policy: crate::origin::OriginPolicy,
    /// `--generation-config`: whether the model's generation_config.json sets the defaults.
    pub generation_config: GenerationConfigMode,
    /// `--enable-auto-tool-choice` with `--tool-call-parser`.
    pub auto_tool_parser: Option<ToolCallParser>,
}

impl Default for AppOptions {
    fn default() -> Self {
        AppOptions {
            served_model_name: String::new(),
            api_key: None,
            max_request_bytes: 1 << 20,
            max_waiting_requests: 1024,
            metrics_auth: false,
            time_limits: TimeLimits::default(),
            origin_policy: crate::origin::OriginPolicy::any(),
            generation_config: GenerationConfigMode::Auto,
            auto_tool_parser: None,
        }
    }
}

/// How long the server waits for a client, and a request for the engine.
#[derive(Clone, Copy, Debug)]
pub struct TimeLimits {
    /// `--request-read-timeout`: the request head and body must arrive within this.
    pub read: Duration,
    /// `--request-timeout`: a generation request is cancelled (504) after this; `None`: never.
    pub request: Option<Duration>,
}

impl Default for TimeLimits {
    fn default() -> Self {
        TimeLimits {
            read: Duration::from_secs(30),
            request: None,
        }
    }
}

/// Prompts rendered and tokenized at once: the cores less one, at least one.
fn text_workers() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().saturating_sub(1).max(1))
}

/// Shared state of the router.
#[derive(Clone)]
pub struct AppState(Arc<Shared>);

struct Shared {
    options: AppOptions,
    /// Set once, when the model has loaded; `/health` answers 503 until then.
    engine: OnceLock<Arc<Engine>>,
    shutting_down: AtomicBool,
    /// Generation requests in flight, for the drain at shutdown.
    drain: Drain,
    /// Requests submitted that have not produced their first token yet.
    num_waiting: AtomicUsize,
    /// Bounds the chat-template renderings and tokenizations running at once on tokio's
    /// blocking pool (one core is left to the runtime: `/health` and streaming stay prompt).
    text_work: Arc<tokio::sync::Semaphore>,
    metrics: ServerMetrics,
    /// Unix time the server started (`created` of `/v1/models`).
    started_at: u64,
}

impl AppState {
    pub fn new(options: AppOptions, metrics: ServerMetrics) -> AppState {
        AppState(Arc::new(Shared {
            options,
            engine: OnceLock::new(),
            shutting_down: AtomicBool::new(false),
            drain: Drain::default(),
            num_waiting: AtomicUsize::new(0),
            text_work: Arc::new(tokio::sync::Semaphore::new(text_workers())),
            metrics,
            started_at: unix_now(),
        }))
    }

    /// The defaults of sampling fields a request leaves out (`--generation-config`).
    pub fn sampling_defaults(&self, assets: &ModelAssets) -> SamplingDefaults {
        match self.0.options.generation_config {
            GenerationConfigMode::Auto => assets.sampling_defaults(),
            GenerationConfigMode::Vllm => SamplingDefaults::default(),
        }
    }

    /// The parser of `tool_choice: "auto"` replies; `None` when auto tool choice is off.
    pub fn auto_tool_parser(&self) -> Option<ToolCallParser> {
        self.0.options.auto_tool_parser
    }

    /// A permit to render and tokenize one prompt on the blocking pool.
    pub async fn text_work_permit(&self) -> tokio::sync::OwnedSemaphorePermit {
        self.0
            .text_work
            .clone()
            .acquire_owned()
            .await
            .expect("the text-work semaphore is never closed")
    }

    /// Makes the server ready. A second engine is refused (returned).
    pub fn set_engine(&self, engine: Arc<Engine>) -> Result<(), Arc<Engine>> {
        self.0.engine.set(engine)
    }

    /// New requests get 503 from now on; running ones finish.
    pub fn begin_shutdown(&self) {
        self.0.shutting_down.store(true, Ordering::SeqCst);
    }

    /// The engine, or 503 while loading, shutting down, or once the engine has died.
    pub fn engine(&self) -> Result<Arc<Engine>, ApiError> {
        if self.0.shutting_down.load(Ordering::SeqCst) {
            return Err(ApiError::ShuttingDown);
        }
        let engine = self.0.engine.get().cloned().ok_or(ApiError::NotReady)?;
        if let Some(message) = engine.failure() {
            return Err(ApiError::EngineFailed { message });
        }
        Ok(engine)
    }

    /// The engine if loaded, regardless of shutdown (for metrics).
    pub fn loaded_engine(&self) -> Option<&Arc<Engine>> {
        self.0.engine.get()
    }

    pub fn served_model_name(&self) -> &str {
        &self.0.options.served_model_name
    }

    /// Accepts an absent `model` or the served name; anything else is 404.
    pub fn check_model(&self, requested: Option<&str>) -> Result<(), ApiError> {
        match requested {
            Some(model) if model != self.served_model_name() => Err(ApiError::ModelNotFound {
                model: model.to_string(),
            }),
            _ => Ok(()),
        }
    }

    pub fn api_key(&self) -> Option<&ApiKey> {
        self.0.options.api_key.as_ref()
    }

    pub fn max_request_bytes(&self) -> usize {
        self.0.options.max_request_bytes
    }

    pub fn metrics_auth(&self) -> bool {
        self.0.options.metrics_auth
    }

    pub fn origin_policy(&self) -> &crate::origin::OriginPolicy {
        &self.0.options.origin_policy
    }

    pub fn time_limits(&self) -> TimeLimits {
        self.0.options.time_limits
    }

    pub fn drain(&self) -> &Drain {
        &self.0.drain
    }

    pub fn metrics(&self) -> &ServerMetrics {
        &self.0.metrics
    }

    pub fn started_at(&self) -> u64 {
        self.0.started_at
    }

    /// Takes a place in the waiting queue, or 429 when it is full.
    pub fn reserve_waiting_slot(&self) -> Result<WaitingSlot, ApiError> {
        let max = self.0.options.max_waiting_requests;
        let taken = self
            .0
            .num_waiting
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < max).then_some(n + 1)
            });
        match taken {
            Ok(_) => Ok(WaitingSlot(Some(self.clone()))),
            Err(_) => Err(ApiError::QueueFull {
                max_waiting_requests: max,
            }),
        }
    }
}

/// A place in the waiting queue, given back on the first token or when dropped.
pub struct WaitingSlot(Option<AppState>);

impl WaitingSlot {
    pub fn release(&mut self) {
        if let Some(state) = self.0.take() {
            state.0.num_waiting.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl Drop for WaitingSlot {
    fn drop(&mut self) {
        self.release();
    }
}

pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(max_waiting_requests: usize) -> AppState {
        let options = AppOptions {
            served_model_name: "m".to_string(),
            api_key: None,
            max_request_bytes: 1024,
            max_waiting_requests,
            ..AppOptions::default()
        };
        AppState::new(options, ServerMetrics::unexported("m"))
    }

    #[test]
    fn waiting_slots_are_bounded_and_given_back() {
        let state = state(2);
        let a = state.reserve_waiting_slot().unwrap();
        let mut b = state.reserve_waiting_slot().unwrap();
        assert!(matches!(
            state.reserve_waiting_slot(),
            Err(ApiError::QueueFull { .. })
        ));
        b.release();
        b.release();
        let _c = state.reserve_waiting_slot().unwrap();
        drop(a);
        let _d = state.reserve_waiting_slot().unwrap();
        assert!(state.reserve_waiting_slot().is_err());
    }

    #[test]
    fn only_the_served_model_name_is_accepted() {
        let state = state(1);
        assert!(state.check_model(None).is_ok());
        assert!(state.check_model(Some("m")).is_ok());
        assert_eq!(
            state.check_model(Some("gpt-4")),
            Err(ApiError::ModelNotFound {
                model: "gpt-4".to_string()
            })
        );
    }

    #[test]
    fn not_ready_until_an_engine_is_set() {
        assert_eq!(state(1).engine().err(), Some(ApiError::NotReady));
        let s = state(1);
        s.begin_shutdown();
        assert_eq!(s.engine().err(), Some(ApiError::ShuttingDown));
    }
}
