//! The sparse mixture-of-experts block: router (top-k over softmax) and grouped experts.

pub mod experts;
pub mod router;

pub use experts::SparseMoe;
pub use router::{Routing, route_top_k};
