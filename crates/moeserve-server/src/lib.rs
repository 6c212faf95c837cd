//! The `moeserve` binary's library: the command line and the OpenAI-compatible HTTP server.
//! This is the only crate that knows HTTP and JSON.
//!
//! - `cli`: subcommands (`generate`, `make-model`, `serve`) and their flags.
//! - `config`: the resolved `serve` settings; `config_file`: every `serve` flag as a key of the
//!   `--config` TOML file, and `--print-config`.
//! - `app`: [`app`] builds the router over an [`AppState`]; `server` binds, loads, shuts down.
//! - `openai`: wire types and handlers, one module per endpoint, and SSE streaming.
//! - `generation`: one request's trip through the engine (queue limit, events, metrics).
//! - `error`: [`ApiError`], the one HTTP error type; `auth`: the API key.
//! - `access_log`: request ids and one log line per request; `logging`: `--log-level`,
//!   `--log-format`.
//! - `listener`: the accept loop (connection, header-size and header-time limits);
//!   `length_guard`: the read-side filter that keeps hyper from answering 431 to a huge
//!   `Content-Length`; `drain`: requests in flight, waited for or cancelled at shutdown.
//! - `metrics`: the Prometheus exporter and `/metrics`; `moe`: the MoE series and
//!   `GET /v1/moe/load`; `dashboard`: `GET /dashboard` and its stats JSON `GET /v1/stats`;
//!   `latency_window`: the recent latencies behind its percentiles.

pub mod access_log;
pub mod app;
pub mod auth;
pub mod cli;
pub mod config;
pub mod config_file;
pub mod dashboard;
pub mod drain;
pub mod error;
pub mod generation;
pub mod latency_window;
pub mod length_guard;
pub mod listener;
pub mod logging;
pub mod metrics;
pub mod moe;
pub mod openai;
pub mod openapi;
pub mod origin;
pub mod server;
pub mod state;

pub use app::app;
pub use error::ApiError;
pub use state::{AppOptions, AppState};
