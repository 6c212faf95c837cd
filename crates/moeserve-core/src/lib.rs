//! Shared vocabulary of moeserve: element types, sampling parameters and ids.
//!
//! Nothing here knows about devices, models or HTTP; every other crate may depend on it.

mod dtype;
mod sampling;

pub use dtype::DType;
pub use sampling::{SamplingParams, SamplingParamsError};
