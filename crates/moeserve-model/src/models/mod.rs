//! Model families; one file each, plus the CUDA forward of Mixtral (`mixtral_cuda.rs`, feature
//! `cuda`; a stub of the same name without it, so callers have no `cfg`).

pub mod mixtral;
#[cfg(feature = "cuda")]
mod mixtral_cuda;
#[cfg(not(feature = "cuda"))]
#[path = "mixtral_cuda_stub.rs"]
mod mixtral_cuda;

pub use mixtral::{ForwardOptions, ForwardTrace, LogitsFor, MixtralModel};
pub use mixtral_cuda::CudaMixtral;
