//! The engine's one error type.

use moeserve_core::SamplingParamsError;
use moeserve_model::ModelError;

use crate::scheduler::AdmissionError;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The tokenizer, the chat template or the generation config.
    #[error(transparent)]
    Text(#[from] moeserve_text::TextError),
    #[error(transparent)]
    InvalidParams(#[from] SamplingParamsError),
    /// A request field that cannot be served, named like the API field.
    #[error("invalid `{field}`: {message}")]
    InvalidRequest {
        field: &'static str,
        message: String,
    },
    /// An engine configuration under which some admissible request could never run, refused at
    /// start-up; the message names the flags that would make it servable.
    #[error("{message}")]
    Unservable { message: String },
    /// Refused at admission: it could never be served (too long for the context or the cache).
    #[error(transparent)]
    Admission(#[from] AdmissionError),
    /// The engine thread died (a panic inside a step): every request fails with this, and the
    /// server reports itself unhealthy and exits.
    #[error("the engine failed: {message}")]
    Failed { message: String },
    /// One request failed while being processed (e.g. its logits were all NaN).
    #[error("request failed: {0}")]
    RequestFailed(String),
    /// An expert placement that cannot be used (bad file or table, impossible plan).
    #[error(transparent)]
    Placement(#[from] moeserve_core::PlacementError),
    /// A routing trace (`--record-routing`) that cannot be written or read.
    #[error("routing trace {path}: {message}")]
    RoutingTrace { path: String, message: String },
}

pub type Result<T> = std::result::Result<T, EngineError>;
