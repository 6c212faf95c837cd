//! Model file formats beside the loader: what reads and writes files rather than runs models.
//!
//! - `gguf`: a memory-mapped GGUF reader (typed metadata, f32 dequantisation) and a writer.
//! - `writer`: Hugging Face checkpoint directories (safetensors, shards, index, side files).
//! - `convert`: a dense llama GGUF upcycled into a Mixtral checkpoint; the checkpoint spec
//!   (tensor names, shapes, config.json) the converter and the presets write.
//! - `presets`: random checkpoints of real shapes for tests and benchmarks.

pub mod convert;
mod error;
pub mod gguf;
pub mod presets;
pub mod writer;

pub use error::{FormatError, Result};
