//! Engine statistics for logs, /metrics and the dashboard; a plain snapshot, cheap to copy.

use serde::Serialize;

/// A snapshot of the engine's state and its monotonic counters.
#[derive(Clone, Debug, Default, Serialize)]
pub struct EngineStats {
    pub num_running: usize,
    pub num_waiting: usize,
    /// Fraction of KV blocks in use.
    pub kv_cache_usage: f32,
    pub num_kv_blocks: usize,
    pub kv_cache_bytes: u64,
    /// The cached keys' and values' element type (`--kv-cache-dtype` resolved).
    pub kv_cache_dtype: String,
    pub max_model_len: usize,
    /// How many requests of `max_model_len` tokens the cache holds at once.
    pub max_concurrency_at_max_len: f64,
    /// Prompt tokens looked up in the prefix cache / found there.
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub num_preemptions: u64,
    pub num_steps: u64,
    /// Tokens run through the model (prompt chunks and decodes).
    pub num_batched_tokens: u64,
    pub generation_tokens: u64,
    pub last_step_seconds: f64,
    /// Token masks computed for constrained sequences (structured outputs), and their time.
    pub structured_masks: u64,
    pub structured_mask_seconds: f64,
    /// Time steps waited for masks after the forward had finished (0 while masks keep up).
    pub structured_wait_seconds: f64,
}
