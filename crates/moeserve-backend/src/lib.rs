//! Devices, weight storage and compute kernels.
//!
//! The model crate describes *what* to compute; this crate owns *how*: weight bytes (memory-mapped
//! or owned), and the CPU kernels (a scalar reference plus ISA-specific variants chosen once at
//! start-up). Model code never names an instruction set.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(not(feature = "cuda"))]
#[path = "cuda_stub.rs"]
pub mod cuda;
pub mod device;
mod weight;

pub use weight::{Weight, WeightBytes, WeightData};

/// Errors raised by backends.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("{op}: expected shape {expected:?}, got {got:?}")]
    ShapeMismatch {
        op: &'static str,
        expected: Vec<usize>,
        got: Vec<usize>,
    },
    #[error("{op}: byte length {len} does not match shape {shape:?} of {dtype}")]
    ByteLength {
        op: &'static str,
        len: usize,
        shape: Vec<usize>,
        dtype: moeserve_core::DType,
    },
    #[error("FP8 weight: {message}")]
    Fp8Scales { message: String },
    #[error("MXFP4 weight: {message}")]
    Mxfp4 { message: String },
    /// An int4 (GPTQ / AWQ) weight that is not whole.
    #[error("int4 weight: {message}")]
    Int4 { message: String },
    /// A weight whose panels are its only copy asked for what needs its rows.
    #[error("prepacked weight: {message}")]
    Prepacked { message: String },
    #[error(transparent)]
    Cuda(#[from] cuda::CudaError),
}

pub type Result<T> = std::result::Result<T, BackendError>;
