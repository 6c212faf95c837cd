//! The model families, their layers and the MoE block: loading a checkpoint and the forward pass.
//!
//! - `config`: HF `config.json`, one `ModelConfig` for every family.
//! - `checkpoint`: safetensors (single file or sharded), memory-mapped, with hub tensor names.
//! - `families`: each family's config.json read into one `ModelConfig`.
//! - `models::decoder`: the one forward pass every family runs, over a varlen batch with a paged
//!   KV cache.
//! - `layers`: attention with each family's options.
//! - `moe`: the MoE block: router, capacity, dispatch and combine, experts, expert parallelism.
//! - `quantize`: `moeserve quantize` (calibration and GPTQ).
//!
//! Text (tokenizer, chat template, generation config) is `moeserve-text`; file formats beside
//! the loader (GGUF, the checkpoint writer, conversion, presets) are `moeserve-formats`.

pub mod batch;
pub mod checkpoint;
pub mod config;
mod error;
mod families;
pub mod kv_cache;
pub mod layers;
pub mod models;
pub mod moe;
pub mod quantize;

pub use error::{ModelError, Result};
