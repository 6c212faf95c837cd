//! Text in and out of a model, apart from its weights:
//!
//! - `tokenizer`: the HF `tokenizer.json` tokenizer, streaming detokenization, stop strings.
//! - `chat_template`: messages rendered into a prompt as transformers' `apply_chat_template`.
//! - `generation_config`: `generation_config.json`'s end-of-sequence ids and sampling defaults.

pub mod chat_template;
mod error;
pub mod generation_config;
pub mod tokenizer;

pub use error::{Result, TextError};
