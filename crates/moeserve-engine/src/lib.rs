//! The serving engine: turns requests into tokens with a loaded model.
//!
//! - `assets`: a model directory loaded (weights, tokenizer, chat template, eos ids).
//! - `request`: prompts, requests and outputs; `routing_capture`: a request's routed experts.
//! - `sampler`: per-request sampling (vLLM semantics).
//! - `output`: per-sequence stop conditions and incremental text.
//! - `kv_cache`: paged KV block bookkeeping with prefix caching.
//! - `scheduler`: continuous batching with chunked prefill and preemption (pure, synchronous).
//! - `engine_core`: one step = one batched forward pass; `offline`: the batch API on top.
//! - `stats`: engine statistics.
//! - `placement`: expert load tracking, EPLB re-placement and routing traces (pure).
//! - `moe`: the MoE runtime around each step (capacity, expert parallelism, load tracking,
//!   online re-placement, routing traces) and its `MoeStats` reports.

pub mod assets;
pub mod engine_core;
mod error;
mod executor;
pub mod handle;
pub mod kv_cache;
pub mod metrics;
pub mod moe;
pub mod offline;
pub mod output;
pub mod placement;
pub mod request;
mod routing_capture;
pub mod sampler;
pub mod scheduler;
pub mod stats;

pub use error::{EngineError, Result};
