//! Model families; one file each.

pub mod mixtral;

pub use mixtral::{ForwardOptions, ForwardTrace, LogitsFor, MixtralModel};
