//! The sparse mixture-of-experts block: router (top-k over softmax, with an optional capacity
//! limit) and grouped experts.

pub mod capacity;
pub mod experts;
pub mod router;

pub use capacity::{Capacity, OverflowPolicy, expert_capacity};
pub use experts::SparseMoe;
pub use router::{
    RoutedPair, RoutedStep, RouterConfig, Routing, RoutingCounts, route, route_top_k,
};
