//! Model loading and the forward pass.
//!
//! - `config`: HF `config.json`, one `ModelConfig` for every family.
//! - `checkpoint`: safetensors (single file or sharded), memory-mapped, with hub tensor names.
//! - `tokenizer`, `chat_template`, `generation_config`: text in and out.
//! - `gguf` and `convert`: reading GGUF files and upcycling dense Llama models into Mixtral.
//! - `writer` and `presets`: writing HF-format checkpoints, random presets for tests and benches.
//! - `families`: each family's config.json read into one `ModelConfig`.
//! - `models::decoder`: the one forward pass every family runs, over a varlen batch with a paged
//!   KV cache.

pub mod batch;
pub mod chat_template;
pub mod checkpoint;
pub mod config;
pub mod convert;
mod error;
mod families;
pub mod generation_config;
pub mod gguf;
pub mod kv_cache;
pub mod layers;
pub mod models;
pub mod moe;
pub mod presets;
pub mod quantize;
pub mod tokenizer;
pub mod writer;

pub use error::{ModelError, Result};
