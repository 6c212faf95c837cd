//! Dense building blocks of a decoder layer.

pub mod attention;
pub mod mla;
pub mod rope;
