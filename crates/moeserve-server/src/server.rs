//! `moeserve serve` at run time: checks what is cheap to check, binds the port (printing
//! `listening on http://ADDR`), loads the model in the background (`/health` is 503 until then)
//! and drains on Ctrl-C or SIGTERM: new requests and `/health` get 503 while the requests in
//! flight finish, those still running after `--shutdown-timeout` are cancelled, then the process
//! exits 0. A model that fails to load stops the server with its error (exit 1).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use moeserve_engine::assets::ModelAssets;
use moeserve_engine::handle::Engine;
use moeserve_model::config::ModelConfig;
use tokio::net::TcpListener;
use tokio::sync::{Notify, watch};

use crate::app::app;
use crate::config::{GenerationConfigMode, ServeConfig};
use crate::listener::{ConnectionLimits, accept};
use crate::metrics::{ServerMetrics, install_recorder};
use crate::state::{AppOptions, AppState, TimeLimits};

/// How long cancelled requests get to send their last chunk, and open connections to close,
/// once the drain is over.
const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// Start-up and shutdown progress, one line per stage, on stderr.
fn log(message: impl std::fmt::Display) {
    tracing::info!("{message}");
}

/// Runs the server until a signal, or until the model fails to load (that error is returned).
pub async fn serve(config: ServeConfig) -> anyhow::Result<()> {
    let model_config = ModelConfig::from_dir(&config.model)
        .with_context(|| format!("cannot serve {}", config.model.display()))?;
    config
        .dtype
        .check(&model_config, &config.model.join("config.json"))
        .map_err(anyhow::Error::msg)?;
    let context_len = model_config.max_position_embeddings;
    let max_model_len = config
        .engine
        .scheduler
        .max_model_len
        .map_or(context_len, |len| len.min(context_len));
    let exporter =
        install_recorder(config.metrics_compat, max_model_len).map_err(anyhow::Error::msg)?;
    let metrics = ServerMetrics::new(exporter, &config.served_model_name, config.metrics_compat);
    let limits = config.limits;
    let options = AppOptions {
        served_model_name: config.served_model_name.clone(),
        api_key: config.api_key.clone(),
        max_request_bytes: config.max_request_bytes,
        max_waiting_requests: config.max_waiting_requests,
        metrics_auth: config.metrics_auth,
        origin_policy: config.origin_policy.clone(),
        generation_config: config.generation_config,
        auto_tool_parser: config.auto_tool_parser,
        time_limits: TimeLimits {
            read: limits.request_read_timeout,
            request: limits.request_timeout,
        },
    };
    let state = AppState::new(options, metrics);
    let listener = TcpListener::bind((config.host.as_str(), config.port))
        .await
        .with_context(|| format!("cannot listen on {}:{}", config.host, config.port))?;
    let address = listener.local_addr().context("no local address")?;
    log(format_args!("listening on http://{address}"));
    if config.api_key.is_some() {
        let metrics = if config.metrics_auth {
            " and /metrics"
        } else {
            ""
        };
        log(format_args!("an API key is required on /v1/*{metrics}"));
    }

    let load_failed = Arc::new(Notify::new());
    let engine_failed = Arc::new(Notify::new());
    let loader = tokio::spawn(load_in_background(
        config,
        state.clone(),
        load_failed.clone(),
        engine_failed.clone(),
    ));
    let (stop_accepting, accepting) = watch::channel(false);
    let connection_limits = ConnectionLimits {
        max_connections: limits.max_connections,
        max_header_bytes: limits.max_header_bytes,
        header_read_timeout: limits.request_read_timeout,
    };
    let acceptor = tokio::spawn(accept(
        listener,
        app(state.clone()),
        connection_limits,
        async move {
            let mut accepting = accepting;
            let _ = accepting.wait_for(|&stop| stop).await;
        },
    ));
    let reason = wait_for_shutdown(&load_failed, &engine_failed).await;
    match reason {
        Shutdown::Signal => drain(&state, limits.shutdown_timeout).await,
        // Every request has its error already; give them and `/health`'s 503 a moment to be
        // seen, then exit non-zero for the supervisor to restart the server.
        Shutdown::EngineFailed => tokio::time::sleep(CLOSE_GRACE).await,
        Shutdown::LoadFailed => {}
    }
    let _ = stop_accepting.send(true);
    let connections = acceptor.await.context("the accept loop panicked")?;
    let still_open = connections.close(CLOSE_GRACE).await;
    if still_open > 0 {
        log(format_args!("closed {still_open} connections still open"));
    }
    // A failed load has signalled just before returning its error: wait for that error.
    if reason == Shutdown::LoadFailed || loader.is_finished() {
        loader.await.context("the model loader panicked")??;
    } else {
        loader.abort();
    }
    if reason == Shutdown::EngineFailed {
        let message = state
            .loaded_engine()
            .and_then(|engine| engine.failure())
            .unwrap_or_default();
        anyhow::bail!("the engine failed: {message}");
    }
    log("stopped");
    Ok(())
}

/// Stops admitting (503 on new requests and `/health`), waits for the requests in flight at
/// most `timeout`, then cancels the rest (they end with a 503 error).
async fn drain(state: &AppState, timeout: Duration) {
    state.begin_shutdown();
    let drain = state.drain();
    log(format_args!(
        "draining: {} requests in flight, new ones get 503 (--shutdown-timeout {} s)",
        drain.num_in_flight(),
        timeout.as_secs_f64()
    ));
    if tokio::time::timeout(timeout, drain.wait_idle())
        .await
        .is_ok()
    {
        log("drained: every request finished");
        return;
    }
    log(format_args!(
        "cancelling {} requests still running after {} s",
        drain.num_in_flight(),
        timeout.as_secs_f64()
    ));
    drain.cancel_all();
    let _ = tokio::time::timeout(CLOSE_GRACE, drain.wait_idle()).await;
}

async fn load_in_background(
    config: ServeConfig,
    state: AppState,
    stop: Arc<Notify>,
    engine_failed: Arc<Notify>,
) -> anyhow::Result<()> {
    let served_name = config.served_model_name.clone();
    let loaded = tokio::task::spawn_blocking(move || load_engine(&config)).await;
    let engine = match loaded {
        Ok(Ok(engine)) => engine,
        Ok(Err(e)) => {
            stop.notify_one();
            return Err(e);
        }
        Err(e) => {
            stop.notify_one();
            anyhow::bail!("the model loader failed: {e}");
        }
    };
    let engine = Arc::new(engine);
    if state.set_engine(engine.clone()).is_err() {
        anyhow::bail!("the engine was started twice");
    }
    log(format_args!("ready: serving `{served_name}`"));
    // The server lives as long as its engine: a dead engine stops it (exit 1).
    tokio::spawn(async move {
        let message = engine.failed().await;
        log(format_args!(
            "the engine failed: {message}; /health answers 503, every request in flight got a \
             500, exiting"
        ));
        engine_failed.notify_one();
    });
    Ok(())
}

/// Loads weights, tokenizer and template, sizes the KV cache and starts the engine thread.
fn load_engine(config: &ServeConfig) -> anyhow::Result<Engine> {
    let dir = &config.model;
    log(format_args!("loading {}", dir.display()));
    let start = Instant::now();
    let assets = ModelAssets::load_for(dir, &config.engine.device)
        .with_context(|| format!("cannot load {}", dir.display()))?;
    let yes_no = |present: bool| if present { "yes" } else { "no" };
    log(format_args!(
        "loaded weights: {:.2} GB in {:.1} s (kernels: {}, quantization: {}); tokenizer: {}, \
         chat template: {}{}",
        assets.model.weight_bytes() as f64 / 1e9,
        start.elapsed().as_secs_f64(),
        crate::cli::device::kernels_name(&config.engine.device),
        assets.model.quantization_summary(),
        yes_no(assets.tokenizer.is_some()),
        yes_no(assets.chat_template.is_some()),
        match assets.harmony {
            Some(_) => " (replies split by harmony channel: analysis → reasoning_content)",
            None => "",
        },
    ));
    let defaults = assets.sampling_defaults().describe();
    match (config.generation_config, defaults.is_empty()) {
        (_, true) => {
            log("sampling defaults: vLLM's (the model's generation_config.json sets none)")
        }
        (GenerationConfigMode::Auto, false) => log(format_args!(
            "sampling defaults from the model's generation_config.json: {defaults} \
             (--generation-config vllm ignores them)"
        )),
        (GenerationConfigMode::Vllm, false) => log(format_args!(
            "sampling defaults: vLLM's; the model's generation_config.json recommends \
             {defaults} (--generation-config auto uses them)"
        )),
    }
    let engine =
        Engine::start(Arc::new(assets), &config.engine).context("cannot start the engine")?;
    let stats = engine.stats();
    let tokens = (stats.num_kv_blocks * config.engine.cache.block_size).max(1) as u64;
    log(format_args!(
        "KV cache: {} blocks of {} tokens ({:.2} GB; {} bytes per token: {} in {}); max model len {}; \
         max concurrency at max model len: {:.1}",
        stats.num_kv_blocks,
        config.engine.cache.block_size,
        stats.kv_cache_bytes as f64 / 1e9,
        stats.kv_cache_bytes / tokens,
        engine.assets().model.config().kv_cache_row_summary(),
        stats.kv_cache_dtype,
        stats.max_model_len,
        stats.max_concurrency_at_max_len,
    ));
    Ok(engine)
}

/// Why the server stops.
#[derive(Debug, PartialEq, Eq)]
enum Shutdown {
    /// Ctrl-C or SIGTERM: drain.
    Signal,
    /// The model failed to load: nothing to drain.
    LoadFailed,
    /// The engine thread died: nothing can run any more.
    EngineFailed,
}

/// Resolves on Ctrl-C, SIGTERM, a failed load or a dead engine.
async fn wait_for_shutdown(load_failed: &Notify, engine_failed: &Notify) -> Shutdown {
    tokio::select! {
        _ = tokio::signal::ctrl_c() => log("interrupted"),
        _ = terminate_signal() => log("terminated"),
        _ = load_failed.notified() => return Shutdown::LoadFailed,
        _ = engine_failed.notified() => return Shutdown::EngineFailed,
    }
    Shutdown::Signal
}

/// SIGTERM (what `docker stop` and Kubernetes send).
#[cfg(unix)]
async fn terminate_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            term.recv().await;
        }
        Err(_) => std::future::pending().await,
    }
}

#[cfg(not(unix))]
async fn terminate_signal() {
    std::future::pending::<()>().await
}
