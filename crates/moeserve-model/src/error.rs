//! The model crate's one error type. Every variant names the file (or tensor) it is about, so a
//! broken checkpoint is reported as "what and where", never as a panic.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// config.json (or another JSON file) is malformed, misses a field or holds a bad value.
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
    #[error("{path}: tensor `{name}` has unsupported dtype {dtype} (supported: F32, F16, BF16)")]
    UnsupportedDType {
        path: PathBuf,
        name: String,
        dtype: String,
    },
    /// A safetensors file whose header or data is malformed (e.g. truncated).
    #[error("{path}: invalid safetensors file: {message}")]
    Safetensors { path: PathBuf, message: String },
    /// The generation config (`moeserve quantize` reads its end-of-sequence ids).
    #[error(transparent)]
    Text(#[from] moeserve_text::TextError),
    /// Writing a checkpoint directory (`moeserve quantize`).
    #[error(transparent)]
    Format(#[from] moeserve_formats::FormatError),
    #[error(transparent)]
    Backend(#[from] moeserve_backend::BackendError),
    /// A forward batch that does not fit the model (token id out of vocabulary, bad lengths).
    #[error("invalid input: {message}")]
    InvalidInput { message: String },
    /// An expert placement that does not fit the model, or device workers that cannot start.
    #[error("expert parallelism: {message}")]
    ExpertParallel { message: String },
}

pub type Result<T> = std::result::Result<T, ModelError>;

impl ModelError {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ModelError::Io {
            path: path.into(),
            source,
        }
    }

    pub fn config(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        ModelError::Config {
            path: path.into(),
            message: message.into(),
        }
    }
}
