//! The text crate's error type; every variant names the file it is about where there is one.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum TextError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A JSON file (tokenizer_config.json, generation_config.json) that is malformed or holds a
    /// bad value.
    #[error("{path}: {message}")]
    Config { path: PathBuf, message: String },
    #[error("{path}: tokenizer: {message}")]
    Tokenizer { path: PathBuf, message: String },
    #[error("chat template: {message}")]
    ChatTemplate { message: String },
}

pub type Result<T> = std::result::Result<T, TextError>;

impl TextError {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        TextError::Io {
            path: path.into(),
            source,
        }
    }

    pub fn config(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        TextError::Config {
            path: path.into(),
            message: message.into(),
        }
    }
}
