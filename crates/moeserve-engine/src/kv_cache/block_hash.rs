//! Prefix-cache keys of full KV blocks; design follows vLLM v1 `hash_block_tokens`, made exact.
//!
//! A full block's key chains its parent's: `value = hash(parent value, token ids)`, so the chain
//! encodes the block's position and whole prefix. vLLM trusts that value. Here the 64-bit value
//! only picks a bucket: a key also carries the block's token ids and the *identity* of its cached
//! parent (a [`CacheEntryId`], never reused), and a lookup compares those. By induction from the
//! first block (no parent), a hit's parent is the very block the lookup matched one position
//! earlier, so a hash collision costs at most a miss and never returns a foreign block. The
//! price: a child whose parent block was evicted stays unreachable until it is evicted too,
//! which is rare, since a sequence's tail is freed (so evicted) before its head.

use std::hash::{BuildHasher, RandomState};

/// One caching of one block: fresh for every `BlockPool::cache_full_block` and never reused, so
/// a child's key stops matching once its parent block has been evicted and refilled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CacheEntryId(pub(crate) u64);

/// What a child block's key takes from its cached parent: the parent's hash value (to chain the
/// value) and its cache entry (to make the key exact). Get it from `BlockPool::cached_link`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParentLink {
    pub(crate) value: u64,
    pub(crate) entry: CacheEntryId,
}

impl ParentLink {
    pub fn entry(&self) -> CacheEntryId {
        self.entry
    }
}

/// The prefix-cache key of one full block.
///
/// Invariant: `value == hash_fn(parent's value, token_ids)` for the hasher that built it, so
/// equal keys always have equal values.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockHash {
    value: u64,
    parent: Option<CacheEntryId>,
    token_ids: Box<[u32]>,
}

impl BlockHash {
    /// The chained 64-bit hash (the bucket of the prefix cache).
    pub fn value(&self) -> u64 {
        self.value
    }

    /// The cache entry of the parent block; `None` for a sequence's first block.
    pub fn parent(&self) -> Option<CacheEntryId> {
        self.parent
    }

    pub fn token_ids(&self) -> &[u32] {
        &self.token_ids
    }
}

/// A block hash function: `(parent's hash value, the block's token ids) -> hash value`.
pub type BlockHashFn = fn(parent_value: Option<u64>, token_ids: &[u32]) -> u64;

/// Computes block keys. The default is SipHash with random keys per hasher, so a client cannot
/// craft prompts that pile into one bucket; [`BlockHasher::from_fn`] plugs in another function
/// (tests use a constant one to force collisions).
#[derive(Clone, Debug)]
pub struct BlockHasher {
    kind: HasherKind,
}

#[derive(Clone, Debug)]
enum HasherKind {
    Keyed(RandomState),
    Custom(BlockHashFn),
}

impl Default for BlockHasher {
    fn default() -> Self {
        BlockHasher {
            kind: HasherKind::Keyed(RandomState::new()),
        }
    }
}

impl BlockHasher {
    pub fn from_fn(hash_fn: BlockHashFn) -> Self {
        BlockHasher {
            kind: HasherKind::Custom(hash_fn),
        }
    }

    /// The key of a full block with `token_ids`, whose parent (the previous block of the same
    /// sequence) is `parent`, or `None` for the first block.
    pub fn hash_block(&self, parent: Option<ParentLink>, token_ids: &[u32]) -> BlockHash {
        let parent_value = parent.map(|p| p.value);
        let value = match &self.kind {
            HasherKind::Keyed(state) => state.hash_one((parent_value, token_ids)),
            HasherKind::Custom(hash_fn) => hash_fn(parent_value, token_ids),
        };
        BlockHash {
            value,
            parent: parent.map(|p| p.entry),
            token_ids: token_ids.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(value: u64, entry: u64) -> ParentLink {
        ParentLink {
            value,
            entry: CacheEntryId(entry),
        }
    }

    #[test]
    fn equal_tokens_and_parent_give_equal_keys() {
        let hasher = BlockHasher::default();
        let a = hasher.hash_block(Some(link(7, 3)), &[1, 2, 3, 4]);
        let b = hasher.hash_block(Some(link(7, 3)), &[1, 2, 3, 4]);
        assert_eq!(a, b);
        assert_eq!(a.value(), b.value());
        assert_eq!(a.token_ids(), &[1, 2, 3, 4]);
        assert_eq!(a.parent(), Some(CacheEntryId(3)));
    }

    #[test]
    fn the_chain_encodes_the_position() {
        let hasher = BlockHasher::default();
        let first = hasher.hash_block(None, &[5, 5]);
        let second = hasher.hash_block(Some(link(first.value(), 0)), &[5, 5]);
        assert_ne!(first.value(), second.value());
        assert_ne!(first, second);
        assert_eq!(first.parent(), None);
    }

    #[test]
    fn parent_value_changes_the_hash_value() {
        let hasher = BlockHasher::default();
        let a = hasher.hash_block(Some(link(1, 0)), &[9, 9]);
        let b = hasher.hash_block(Some(link(2, 0)), &[9, 9]);
        assert_ne!(a.value(), b.value());
    }

    #[test]
    fn keys_differ_by_parent_entry_even_when_values_collide() {
        let hasher = BlockHasher::from_fn(|_, _| 0);
        let a = hasher.hash_block(Some(link(11, 1)), &[1, 2]);
        let b = hasher.hash_block(Some(link(11, 2)), &[1, 2]);
        assert_eq!(a.value(), b.value());
        assert_ne!(a, b);
    }

    #[test]
    fn keys_differ_by_tokens_even_when_values_collide() {
        let hasher = BlockHasher::from_fn(|_, _| 42);
        let a = hasher.hash_block(None, &[1, 2]);
        let b = hasher.hash_block(None, &[2, 1]);
        assert_eq!(a.value(), 42);
        assert_ne!(a, b);
    }

    #[test]
    fn custom_function_sees_parent_value_and_tokens() {
        let hasher = BlockHasher::from_fn(|parent, tokens| {
            parent.unwrap_or(100) * 1000 + tokens.iter().map(|&t| u64::from(t)).sum::<u64>()
        });
        assert_eq!(hasher.hash_block(None, &[1, 2, 3]).value(), 100_006);
        assert_eq!(
            hasher.hash_block(Some(link(4, 0)), &[1, 2, 3]).value(),
            4006
        );
    }

    #[test]
    fn one_hasher_is_deterministic_across_calls() {
        let hasher = BlockHasher::default();
        let values: Vec<u64> = (0..3)
            .map(|_| hasher.hash_block(None, &[3, 1, 4, 1]).value())
            .collect();
        assert!(values.windows(2).all(|w| w[0] == w[1]));
    }
}
