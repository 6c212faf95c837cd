//! A model of any family and how it runs:
//! - `decoder.rs`: [`MoeModel`], the loaded weights per layer and the CPU forward's entry;
//! - `ops.rs`: the operations a backend implements, and `decode`, the one definition of the
//!   layer order on them (its per-layer options from the family's
//!   [`ModelConfig`](crate::config::ModelConfig));
//! - `cpu_step.rs`: those operations on the CPU; `workspace.rs`: the buffers a CPU forward
//!   reuses;
//! - `cuda.rs` (feature `cuda`): those operations on a GPU, [`CudaMoeModel`]; without the
//!   feature a stub of the same name, so callers have no `cfg`.

mod cpu_step;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg(not(feature = "cuda"))]
#[path = "cuda_stub.rs"]
mod cuda;
pub mod decoder;
pub(crate) mod ops;
mod pool;
pub(crate) mod workspace;

pub use cuda::CudaMoeModel;
#[cfg(feature = "cuda")]
pub use cuda::{StepShape, step_plan, weight_bytes_per_gpu};
pub use decoder::{ForwardOptions, ForwardTrace, Greedy, GreedyRows, LogitsFor, MoeModel};
pub use workspace::ForwardWorkspace;
