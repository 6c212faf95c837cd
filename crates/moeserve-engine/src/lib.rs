//! The serving engine: turns requests into tokens with a loaded model.
//!
//! - `assets`: a model directory loaded (weights, tokenizer, chat template, eos ids).
//! - `request`: prompts, requests and outputs.
//! - `sampler`: per-request sampling (vLLM semantics).
//! - `output`: per-sequence stop conditions and incremental text.
//! - `generate`: one request on its own KV cache, the reference path.

pub mod assets;
mod error;
pub mod generate;
pub mod output;
pub mod request;
pub mod sampler;

pub use error::{EngineError, Result};
