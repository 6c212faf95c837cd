//! The CUDA backend's names when the `cuda` feature is off (as candle's `dummy_cuda_backend`):
//! callers compile unchanged, and every entry point returns [`CudaError::NotCompiled`].

use crate::device::CudaDeviceInfo;

/// Errors of the CUDA backend; without the feature there is only one.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error(
        "this moeserve was built without CUDA support; rebuild with \
         `cargo build --release --bin moeserve --features cuda`"
    )]
    NotCompiled,
}

/// A CUDA device with its compiled kernels; never constructed without the feature.
pub struct CudaBackend {
    _never: std::convert::Infallible,
}

impl CudaBackend {
    pub fn new(_ordinal: usize) -> Result<Self, CudaError> {
        Err(CudaError::NotCompiled)
    }

    pub fn info(&self) -> &CudaDeviceInfo {
        match self._never {}
    }
}

/// Finds device 0 and the libraries the backend needs.
pub fn probe() -> Result<CudaDeviceInfo, CudaError> {
    Err(CudaError::NotCompiled)
}
