//! Text in and out of a model, apart from its weights:
//!
//! - `tokenizer`: the HF `tokenizer.json` tokenizer, streaming detokenization, stop strings;
//!   `token_bound`: the fewest tokens a text can become, from its length alone.
//! - `chat_template`: messages rendered into a prompt as transformers' `apply_chat_template`;
//!   `harmony`: GPT-OSS's replies split into their channels (reasoning and content), and
//!   [`HARMONY_TEMPLATE`], moeserve's chat template for that format.
//! - `generation_config`: `generation_config.json`'s end-of-sequence ids and sampling defaults.

pub mod chat_template;
mod error;
pub mod generation_config;
pub mod harmony;
pub mod token_bound;
pub mod tokenizer;

pub use error::{Result, TextError};

/// GPT-OSS's chat template in the harmony format (see the file's header).
pub const HARMONY_TEMPLATE: &str = include_str!("../templates/gpt_oss_harmony.jinja");
