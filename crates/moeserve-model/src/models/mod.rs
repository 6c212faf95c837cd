//! Model families; one file each, plus the buffers a forward reuses (`workspace.rs`) and the CUDA forward of Mixtral (`mixtral_cuda.rs`, feature
//! `cuda`; a stub of the same name without it, so callers have no `cfg`).

pub mod mixtral;
#[cfg(feature = "cuda")]
mod mixtral_cuda;
#[cfg(not(feature = "cuda"))]
#[path = "mixtral_cuda_stub.rs"]
mod mixtral_cuda;
pub(crate) mod workspace;

pub use mixtral::{ForwardOptions, ForwardTrace, LogitsFor, MixtralModel};
pub use mixtral_cuda::CudaMixtral;
pub use workspace::ForwardWorkspace;
