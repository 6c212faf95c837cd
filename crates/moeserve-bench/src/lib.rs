//! `moeserve-bench`: the serving benchmark and the capacity planner.
//!
//! - `dataset`: the prompts (random token ids of an exact length, or a JSONL file).
//! - `client`: one streamed `/v1/completions` request, timed per chunk (TTFT, ITL, e2e).
//! - `load`: a concurrency level: closed loop or Poisson arrivals, in-flight sampling.
//! - `stats`: percentiles, latency summaries and the Little's-law check of one level.
//! - `report`: the JSON result file.
//! - `plot`: the latency-versus-throughput SVG of one or more result files.
//! - `planner`: the largest batch within a TPOT target and the KV cache; Little's law sizing.

pub mod client;
pub mod dataset;
mod error;
pub mod load;
pub mod planner;
pub mod plot;
pub mod report;
pub mod stats;

pub use error::{BenchError, Result};
