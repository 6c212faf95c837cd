//! Shared vocabulary of moeserve: element types, ids, sampling parameters, the engine's config
//! structs (cache, scheduler, MoE) and the expert placement table; plus a counting allocator
//! for tests (`alloc_count`).
//!
//! Nothing here knows about devices, models or HTTP; every other crate may depend on it.

pub mod alloc_count;
mod config;
mod dtype;
pub mod fp8;
mod ids;
mod moe_config;
pub mod mxfp4;
mod placement;
mod sampling;

pub use config::{CacheConfig, ConfigError, KvCacheDtype, SchedulerConfig};
pub use dtype::DType;
pub use ids::{BlockId, DeviceId, ExpertId, RequestId};
pub use moe_config::{ExpertMetrics, MoeConfig, OverflowPolicy};
pub use placement::{ExpertPlacement, LayerPlacement, PlacementError};
pub use sampling::{MAX_LOGPROBS, SamplingDefaults, SamplingParams, SamplingParamsError};
