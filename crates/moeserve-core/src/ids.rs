//! Newtype ids, so a block id is never passed where a request id is meant.

use serde::{Deserialize, Serialize};

/// One request inside the engine (unique for the engine's lifetime).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RequestId(pub u64);

/// One block of the paged KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[repr(transparent)]
pub struct BlockId(pub u32);

impl BlockId {
    /// A block table as the raw ids a forward pass takes, without copying it.
    pub fn raw_table(table: &[BlockId]) -> &[u32] {
        // SAFETY: `BlockId` is `repr(transparent)` over `u32`: same size, alignment and valid
        // values, so the slice's memory is a valid `[u32]` of the same length and lifetime.
        unsafe { std::slice::from_raw_parts(table.as_ptr().cast::<u32>(), table.len()) }
    }
}

/// A logical expert of a layer (the model's index).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ExpertId(pub u32);

/// A compute device (a GPU, or a CPU device worker).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct DeviceId(pub u32);

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "req-{}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_table_views_as_its_raw_ids() {
        let table = [BlockId(7), BlockId(0), BlockId(u32::MAX)];
        assert_eq!(BlockId::raw_table(&table), &[7, 0, u32::MAX]);
        assert!(BlockId::raw_table(&[]).is_empty());
    }
}
