//! Shared vocabulary of moeserve: element types, ids and sampling parameters.
//!
//! Nothing here knows about devices, models or HTTP; every other crate may depend on it.

mod dtype;
mod ids;
mod sampling;

pub use dtype::DType;
pub use ids::{BlockId, DeviceId, ExpertId, RequestId};
pub use sampling::{MAX_LOGPROBS, SamplingParams, SamplingParamsError};
