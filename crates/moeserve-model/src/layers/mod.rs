//! Dense building blocks of a decoder layer.

pub mod attention;
pub mod rope;
