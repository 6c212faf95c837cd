//! Logs through `tracing`: `--log-level` (or `RUST_LOG`, a `tracing` filter) and
//! `--log-format text|json`, to stderr. The server's lines carry the request id of the request
//! they belong to (the `request` span of `access_log`).

use std::io::IsTerminal;
use std::sync::OnceLock;

use tracing_subscriber::EnvFilter;

/// `--log-format`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One human-readable line per event.
    #[default]
    Text,
    /// One JSON object per line, for log stacks (the event's fields at the top level, the
    /// request id among them).
    Json,
}

/// `--log-level`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogLevel {
    Error,
    Warn,
    Info,
    Debug,
    Trace,
}

impl LogLevel {
    fn filter(self) -> &'static str {
        match self {
            LogLevel::Error => "error",
            LogLevel::Warn => "warn",
            LogLevel::Info => "info",
            LogLevel::Debug => "debug",
            LogLevel::Trace => "trace",
        }
    }
}

/// The format logging was started with.
static STARTED: OnceLock<LogFormat> = OnceLock::new();

/// Starts logging: `level` if given, else `RUST_LOG`, else `info`. The first call wins.
pub fn init(level: Option<LogLevel>, format: LogFormat) {
    let filter = match level {
        Some(level) => EnvFilter::new(level.filter()),
        None => EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let started = match format {
        LogFormat::Text => builder
            .with_ansi(std::io::stderr().is_terminal())
            .try_init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false)
            .try_init(),
    };
    if started.is_ok() {
        let _ = STARTED.set(format);
    }
}

/// Logging for the command-line tools (`generate`, `quantize`, …): their messages are read by
/// a person, so no time stamps or module paths.
pub fn init_for_tools() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let started = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .without_time()
        .with_target(false)
        .try_init();
    if started.is_ok() {
        let _ = STARTED.set(LogFormat::Text);
    }
}

/// Whether log lines are JSON: then a fatal error is one too, else it is a plain `error: …`
/// line for the person at the terminal.
pub fn is_json() -> bool {
    STARTED.get() == Some(&LogFormat::Json)
}
