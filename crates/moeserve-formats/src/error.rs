//! The formats crate's error type. Every variant names the file (or tensor) it is about, so a
//! broken GGUF or an unwritable directory is reported as "what and where", never as a panic.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A JSON file or a conversion setting that is malformed or holds a bad value.
    #[error("{path}: {message}")]
    Config { path: PathBuf, message: String },
    #[error("{path}: architecture {found:?} is not supported (supported: {supported})")]
    UnsupportedArchitecture {
        path: PathBuf,
        found: String,
        supported: &'static str,
    },
    #[error("{path}: missing tensor `{name}`")]
    MissingTensor { path: PathBuf, name: String },
    #[error("{path}: tensor `{name}` has shape {got:?}, expected {expected:?}")]
    TensorShape {
        path: PathBuf,
        name: String,
        expected: Vec<usize>,
        got: Vec<usize>,
    },
    /// A safetensors file that cannot be written or read back.
    #[error("{path}: invalid safetensors file: {message}")]
    Safetensors { path: PathBuf, message: String },
    #[error("{path}: invalid GGUF file: {message}")]
    Gguf { path: PathBuf, message: String },
    #[error("{path}: tokenizer: {message}")]
    Tokenizer { path: PathBuf, message: String },
}

pub type Result<T> = std::result::Result<T, FormatError>;

impl FormatError {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        FormatError::Io {
            path: path.into(),
            source,
        }
    }

    pub fn config(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        FormatError::Config {
            path: path.into(),
            message: message.into(),
        }
    }
}
