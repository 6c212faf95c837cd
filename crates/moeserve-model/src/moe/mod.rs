//! The sparse mixture-of-experts block: router (top-k over softmax, or over sigmoid scores with
//! a correction bias and groups; with an optional capacity limit), dispatch and combine,
//! grouped experts, and expert parallelism over device workers.
//!
//! - `router`, `capacity`: which (token, expert) pairs are computed.
//! - `dispatch`: pairs grouped into per-device, per-slot segments; outputs combined per token.
//! - `experts`: the SwiGLU experts and the block's forward.
//! - `parallel`: the `AllToAll` interface and its in-process (CPU device worker) version.
//! - `arena`: a placement with each device's expert weights (`ExpertParallel`).
//! - `record`: forward options and per-layer routing summaries for the engine.

pub mod arena;
pub mod capacity;
mod dispatch;
pub mod experts;
pub mod parallel;
pub mod record;
pub mod router;

pub use arena::ExpertParallel;
pub use capacity::{Capacity, OverflowPolicy, expert_capacity};
pub use experts::{Expert, MoeLayerStep, SparseMoe};
pub use parallel::{AllToAll, DeviceCompute, DeviceOutput, DeviceWork, InProcessAllToAll, Segment};
pub use record::{LayerRouting, MoeOptions, MoeStepRecord, TokenPairCounts};
pub use router::{
    GroupLimit, RoutedPair, RoutedStep, RouterConfig, Routing, RoutingCounts, Scoring, route,
    route_top_k, route_with_bias,
};
