//! Shared vocabulary of moeserve: element types, ids and sampling parameters.
//!
//! Nothing here knows about devices, models or HTTP; every other crate may depend on it.

mod config;
mod dtype;
mod ids;
mod sampling;

pub use config::{CacheConfig, ConfigError, SchedulerConfig};
pub use dtype::DType;
pub use ids::{BlockId, DeviceId, ExpertId, RequestId};
pub use sampling::{MAX_LOGPROBS, SamplingParams, SamplingParamsError};
