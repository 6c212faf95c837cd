//! The one error type of the benchmark crate.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{origin}: {message}")]
    Parse { origin: String, message: String },
    #[error("invalid {field}: {message}")]
    Invalid {
        field: &'static str,
        message: String,
    },
    #[error("HTTP client: {0}")]
    Http(#[from] reqwest::Error),
}

impl BenchError {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        BenchError::Io {
            path: path.into(),
            source,
        }
    }

    pub fn invalid(field: &'static str, message: impl Into<String>) -> Self {
        BenchError::Invalid {
            field,
            message: message.into(),
        }
    }
}

pub type Result<T> = std::result::Result<T, BenchError>;
