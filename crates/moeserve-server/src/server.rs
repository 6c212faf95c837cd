//! `moeserve serve` at run time: checks what is cheap to check, binds the port (printing
//! `listening on http://ADDR`), loads the model in the background (`/health` is 503 until then)
//! and shuts down gracefully on Ctrl-C or SIGTERM.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use moeserve_engine::assets::ModelAssets;
use moeserve_engine::handle::Engine;
use moeserve_model::config::MixtralConfig;
use tokio::net::TcpListener;
use tokio::sync::Notify;

use crate::app::app;
use crate::config::ServeConfig;
use crate::metrics::{ServerMetrics, install_recorder};
use crate::state::{AppOptions, AppState};

/// How long in-flight requests may take to finish once shutdown has begun.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

/// Start-up and shutdown progress, one line per stage, on stderr.
fn log(message: impl std::fmt::Display) {
    eprintln!("moeserve: {message}");
}

/// Runs the server until a signal, or until the model fails to load (that error is returned).
pub async fn serve(config: ServeConfig) -> anyhow::Result<()> {
    let model_config = MixtralConfig::from_dir(&config.model)
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
    let options = AppOptions {
        served_model_name: config.served_model_name.clone(),
        api_key: config.api_key.clone(),
        max_request_bytes: config.max_request_bytes,
        max_waiting_requests: config.max_waiting_requests,
    };
    let state = AppState::new(options, metrics);
    let listener = TcpListener::bind((config.host.as_str(), config.port))
        .await
        .with_context(|| format!("cannot listen on {}:{}", config.host, config.port))?;
    let address = listener.local_addr().context("no local address")?;
    log(format_args!("listening on http://{address}"));
    if config.api_key.is_some() {
        log("an API key is required on /v1/*");
    }

    let stop = Arc::new(Notify::new());
    let shutdown_begun = Arc::new(Notify::new());
    let loader = tokio::spawn(load_in_background(config, state.clone(), stop.clone()));
    let server = axum::serve(listener, app(state.clone()))
        .with_graceful_shutdown(wait_for_shutdown(state, stop, shutdown_begun.clone()));
    tokio::select! {
        result = server.into_future() => result.context("the HTTP server failed")?,
        _ = async {
            shutdown_begun.notified().await;
            tokio::time::sleep(SHUTDOWN_GRACE).await;
        } => log(format_args!(
            "closing connections still open {} s after shutdown began",
            SHUTDOWN_GRACE.as_secs()
        )),
    }
    if loader.is_finished() {
        loader.await.context("the model loader panicked")??;
    } else {
        loader.abort();
    }
    log("stopped");
    Ok(())
}

async fn load_in_background(
    config: ServeConfig,
    state: AppState,
    stop: Arc<Notify>,
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
    if state.set_engine(Arc::new(engine)).is_err() {
        anyhow::bail!("the engine was started twice");
    }
    log(format_args!("ready: serving `{served_name}`"));
    Ok(())
}

/// Loads weights, tokenizer and template, sizes the KV cache and starts the engine thread.
fn load_engine(config: &ServeConfig) -> anyhow::Result<Engine> {
    let dir = &config.model;
    log(format_args!("loading {}", dir.display()));
    let start = Instant::now();
    let assets =
        ModelAssets::load(dir).with_context(|| format!("cannot load {}", dir.display()))?;
    let yes_no = |present: bool| if present { "yes" } else { "no" };
    log(format_args!(
        "loaded weights: {:.2} GB in {:.1} s (kernels: {}); tokenizer: {}, chat template: {}",
        assets.model.weight_bytes() as f64 / 1e9,
        start.elapsed().as_secs_f64(),
        moeserve_backend::cpu::isa(),
        yes_no(assets.tokenizer.is_some()),
        yes_no(assets.chat_template.is_some()),
    ));
    let engine =
        Engine::start(Arc::new(assets), &config.engine).context("cannot start the engine")?;
    let stats = engine.stats();
    log(format_args!(
        "KV cache: {} blocks of {} tokens ({:.2} GB); max model len {}; \
         max concurrency at max model len: {:.1}",
        stats.num_kv_blocks,
        config.engine.cache.block_size,
        stats.kv_cache_bytes as f64 / 1e9,
        stats.max_model_len,
        stats.max_concurrency_at_max_len,
    ));
    Ok(engine)
}

/// Resolves on Ctrl-C, SIGTERM or a failed load; from then on new requests get 503.
async fn wait_for_shutdown(state: AppState, stop: Arc<Notify>, begun: Arc<Notify>) {
    tokio::select! {
        _ = tokio::signal::ctrl_c() => log("interrupted"),
        _ = terminate_signal() => log("terminated"),
        _ = stop.notified() => {}
    }
    state.begin_shutdown();
    begun.notify_one();
    log("shutting down: finishing requests in flight");
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
