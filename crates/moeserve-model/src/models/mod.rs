//! The decoder every family runs (`decoder.rs`: one definition, its per-layer options from the
//! family's [`ModelConfig`](crate::config::ModelConfig)), the buffers a forward reuses
//! (`workspace.rs`), and the CUDA forward (`mixtral_cuda.rs`, feature `cuda`, so far for
//! Mixtral-shaped configs only; a stub of the same name without the feature, so callers have no
//! `cfg`).

pub mod decoder;
#[cfg(feature = "cuda")]
mod mixtral_cuda;
#[cfg(not(feature = "cuda"))]
#[path = "mixtral_cuda_stub.rs"]
mod mixtral_cuda;
pub(crate) mod workspace;

pub use decoder::{ForwardOptions, ForwardTrace, LogitsFor, MoeModel};
pub use mixtral_cuda::CudaMoeModel;
pub use workspace::ForwardWorkspace;
