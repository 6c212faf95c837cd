//! The engine's one error type.

use moeserve_core::SamplingParamsError;
use moeserve_model::ModelError;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    InvalidParams(#[from] SamplingParamsError),
    /// A request field that cannot be served, named like the API field.
    #[error("invalid `{field}`: {message}")]
    InvalidRequest { field: &'static str, message: String },
    /// Prompt plus requested output exceed the context (vLLM's wording: limit and length).
    #[error(
        "this model's maximum context length is {max_model_len} tokens, but the request has \
         {prompt_len} prompt tokens and asks for {max_tokens} more ({total} in all)"
    )]
    ContextTooLong { max_model_len: usize, prompt_len: usize, max_tokens: usize, total: usize },
    /// Sampling failed for one request (e.g. its logits were all NaN).
    #[error("sampling failed: {0}")]
    Sampling(String),
}

pub type Result<T> = std::result::Result<T, EngineError>;
