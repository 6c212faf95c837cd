//! Paged KV block pool: reference counts, the free queue in eviction order and the prefix cache;
//! design follows vLLM v1 `BlockPool`.
//!
//! A block with `ref_cnt == 0` is free. A free block may still be *cached* (its full contents
//! are named by a [`BlockHash`]): a prefix hit takes it back with [`BlockPool::touch`] until an
//! allocation evicts it. Allocation takes the head of the free queue; freeing appends a cached
//! block to the tail, so the least recently freed cached block goes first.
//!
//! NOTE: there is no null block. vLLM reserves block 0 for padding and skipped sliding-window
//! blocks; moeserve's paged attention masks by context length and keeps every block of a
//! sequence, so all `num_blocks` blocks are usable and `usage()` is 0 when nothing is held.

use std::collections::HashMap;

use moeserve_core::BlockId;

use super::block_hash::{BlockHash, CacheEntryId, ParentLink};
use super::free_block_queue::FreeBlockQueue;

/// Whether full blocks are kept for reuse by later requests with the same prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefixCaching {
    Enabled,
    Disabled,
}

/// A cached block's key and the entry naming this caching of it.
#[derive(Debug)]
struct CachedBlock {
    hash: BlockHash,
    entry: CacheEntryId,
}

/// Invariants (checked by [`BlockPool::check_invariants`]):
/// - the free queue holds exactly the blocks with `ref_cnt == 0`, each once;
/// - `buckets[v]` lists exactly the cached blocks whose hash value is `v`, each once, and no
///   bucket is empty; nothing is cached when prefix caching is disabled;
/// - cache entries are unique and below `next_entry`.
#[derive(Debug)]
pub struct BlockPool {
    prefix_caching: PrefixCaching,
    ref_cnts: Vec<u32>,
    cached: Vec<Option<CachedBlock>>,
    free_queue: FreeBlockQueue,
    buckets: HashMap<u64, Vec<BlockId>>,
    next_entry: u64,
}

impl BlockPool {
    /// A pool of `num_blocks` free, uncached blocks.
    ///
    /// # Panics
    /// If `num_blocks` does not fit below `u32::MAX` (block ids are `u32`).
    pub fn new(num_blocks: usize, prefix_caching: PrefixCaching) -> Self {
        BlockPool {
            prefix_caching,
            ref_cnts: vec![0; num_blocks],
            cached: (0..num_blocks).map(|_| None).collect(),
            free_queue: FreeBlockQueue::new(num_blocks),
            buckets: HashMap::new(),
            next_entry: 0,
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.ref_cnts.len()
    }

    /// Blocks that an allocation may take (free, cached or not).
    pub fn num_free_blocks(&self) -> usize {
        self.free_queue.len()
    }

    /// Fraction of blocks in use (`ref_cnt > 0`), in `[0, 1]`.
    pub fn usage(&self) -> f32 {
        match self.num_blocks() {
            0 => 0.0,
            n => (n - self.num_free_blocks()) as f32 / n as f32,
        }
    }

    pub fn prefix_caching(&self) -> PrefixCaching {
        self.prefix_caching
    }

    pub fn ref_cnt(&self, block: BlockId) -> u32 {
        self.ref_cnts[block.0 as usize]
    }

    /// Takes `n` free blocks (evicting their cache entries) with `ref_cnt` 1, or `None`, changing
    /// nothing, when fewer than `n` are free.
    pub fn get_new_blocks(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.num_free_blocks() {
            return None;
        }
        let blocks: Vec<BlockId> = (0..n)
            .map(|_| {
                BlockId(
                    self.free_queue
                        .pop_front()
                        .expect("enough free blocks were counted"),
                )
            })
            .collect();
        for &block in &blocks {
            self.evict(block);
            self.ref_cnts[block.0 as usize] = 1;
        }
        Some(blocks)
    }

    /// Takes one more reference to each block (prefix hits); a free block leaves the free queue.
    pub fn touch(&mut self, blocks: &[BlockId]) {
        for &block in blocks {
            let b = block.0 as usize;
            if self.ref_cnts[b] == 0 {
                self.free_queue.remove(block.0);
            }
            self.ref_cnts[b] += 1;
        }
    }

    /// Drops one reference to each block, in the order given: that order is the eviction order,
    /// so callers pass a block table reversed, and a sequence's tail is evicted first.
    ///
    /// # Panics
    /// If a block is already free (a double free is a bug in the caller).
    pub fn free_blocks(&mut self, blocks: &[BlockId]) {
        for &block in blocks {
            let b = block.0 as usize;
            assert!(self.ref_cnts[b] > 0, "double free of {block:?}");
            self.ref_cnts[b] -= 1;
            if self.ref_cnts[b] == 0 {
                // NOTE: an uncached block holds nothing a later request could reuse, so it goes
                // to the head and is taken before any cached block (vLLM appends it to the tail).
                match self.cached[b] {
                    Some(_) => self.free_queue.push_back(block.0),
                    None => self.free_queue.push_front(block.0),
                }
            }
        }
    }

    /// Records that `block`, in use and now full, holds the contents named by `hash`. Does
    /// nothing when prefix caching is disabled.
    ///
    /// # Panics
    /// If `block` is free or already cached.
    pub fn cache_full_block(&mut self, block: BlockId, hash: BlockHash) {
        if self.prefix_caching == PrefixCaching::Disabled {
            return;
        }
        let b = block.0 as usize;
        assert!(
            self.ref_cnts[b] > 0,
            "only a block in use can be cached, {block:?} is free"
        );
        assert!(self.cached[b].is_none(), "{block:?} is already cached");
        self.buckets.entry(hash.value()).or_default().push(block);
        let entry = CacheEntryId(self.next_entry);
        self.next_entry += 1;
        self.cached[b] = Some(CachedBlock { hash, entry });
    }

    /// The cached block whose key equals `hash` (value, parent entry and token ids), if any.
    pub fn cached_block(&self, hash: &BlockHash) -> Option<BlockId> {
        let bucket = self.buckets.get(&hash.value())?;
        bucket
            .iter()
            .copied()
            .find(|b| self.block_hash(*b) == Some(hash))
    }

    /// The key of a cached block.
    pub fn block_hash(&self, block: BlockId) -> Option<&BlockHash> {
        self.cached[block.0 as usize].as_ref().map(|c| &c.hash)
    }

    /// What the key of a cached block's successor needs from it.
    pub fn cached_link(&self, block: BlockId) -> Option<ParentLink> {
        let cached = self.cached[block.0 as usize].as_ref()?;
        Some(ParentLink {
            value: cached.hash.value(),
            entry: cached.entry,
        })
    }

    /// Forgets every cached block; refused (`false`) while any block is in use, as in vLLM.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.num_free_blocks() != self.num_blocks() {
            return false;
        }
        self.cached.iter_mut().for_each(|c| *c = None);
        self.buckets.clear();
        true
    }

    /// Checks every invariant listed on [`BlockPool`] (a debug and test helper).
    pub fn check_invariants(&self) -> Result<(), String> {
        self.free_queue.check_invariants()?;
        for (b, &ref_cnt) in self.ref_cnts.iter().enumerate() {
            if (ref_cnt == 0) != self.free_queue.contains(b as u32) {
                let queued = self.free_queue.contains(b as u32);
                return Err(format!(
                    "block {b} has ref_cnt {ref_cnt} but queued is {queued}"
                ));
            }
        }
        let num_cached = self.cached.iter().flatten().count();
        if self.prefix_caching == PrefixCaching::Disabled && num_cached > 0 {
            return Err(format!(
                "{num_cached} blocks cached with prefix caching disabled"
            ));
        }
        let mut entries = Vec::with_capacity(num_cached);
        for (b, cached) in self.cached.iter().enumerate() {
            let Some(cached) = cached else { continue };
            let in_bucket = self.buckets.get(&cached.hash.value()).map_or(0, |bucket| {
                bucket.iter().filter(|id| id.0 as usize == b).count()
            });
            if in_bucket != 1 {
                return Err(format!(
                    "cached block {b} is listed {in_bucket} times in its bucket"
                ));
            }
            if cached.entry.0 >= self.next_entry {
                return Err(format!(
                    "block {b} has cache entry {} from the future",
                    cached.entry.0
                ));
            }
            entries.push(cached.entry);
        }
        entries.sort_unstable();
        if entries.windows(2).any(|w| w[0] == w[1]) {
            return Err("two cached blocks share a cache entry".to_string());
        }
        let num_listed: usize = self.buckets.values().map(Vec::len).sum();
        if num_listed != num_cached || self.buckets.values().any(Vec::is_empty) {
            return Err(format!(
                "buckets list {num_listed} blocks, {num_cached} are cached"
            ));
        }
        Ok(())
    }

    /// Drops `block`'s cache entry, if any, before the block is reused.
    fn evict(&mut self, block: BlockId) {
        let Some(cached) = self.cached[block.0 as usize].take() else {
            return;
        };
        let value = cached.hash.value();
        let bucket = self
            .buckets
            .get_mut(&value)
            .expect("a cached block is in its bucket");
        bucket.retain(|&b| b != block);
        if bucket.is_empty() {
            self.buckets.remove(&value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_cache::block_hash::BlockHasher;

    fn ids(raw: &[u32]) -> Vec<BlockId> {
        raw.iter().map(|&b| BlockId(b)).collect()
    }

    fn checked(pool: &BlockPool) {
        pool.check_invariants().expect("pool invariants hold");
    }

    /// Allocates one block per token list and caches each as a first block.
    fn cache_blocks(
        pool: &mut BlockPool,
        hasher: &BlockHasher,
        tokens: &[&[u32]],
    ) -> Vec<BlockHash> {
        let blocks = pool
            .get_new_blocks(tokens.len())
            .expect("enough free blocks");
        let hashes: Vec<BlockHash> = tokens.iter().map(|t| hasher.hash_block(None, t)).collect();
        for (block, hash) in blocks.iter().zip(&hashes) {
            pool.cache_full_block(*block, hash.clone());
        }
        checked(pool);
        hashes
    }

    #[test]
    fn get_new_blocks_returns_none_when_too_few_are_free_and_changes_nothing() {
        let mut pool = BlockPool::new(3, PrefixCaching::Enabled);
        assert_eq!(pool.get_new_blocks(2), Some(ids(&[0, 1])));
        assert_eq!(pool.get_new_blocks(2), None);
        assert_eq!(pool.num_free_blocks(), 1);
        assert_eq!(pool.get_new_blocks(1), Some(ids(&[2])));
        checked(&pool);
    }

    #[test]
    fn lru_evicts_least_recently_freed_first() {
        let mut pool = BlockPool::new(3, PrefixCaching::Enabled);
        let hasher = BlockHasher::default();
        let hashes = cache_blocks(&mut pool, &hasher, &[&[1], &[2], &[3]]);
        pool.free_blocks(&ids(&[1, 2, 0]));
        assert_eq!(pool.get_new_blocks(2), Some(ids(&[1, 2])));
        assert_eq!(pool.cached_block(&hashes[0]), Some(BlockId(0)));
        assert_eq!(pool.cached_block(&hashes[1]), None);
        assert_eq!(pool.cached_block(&hashes[2]), None);
        checked(&pool);
    }

    #[test]
    fn uncached_freed_block_is_reused_before_cached_ones() {
        let mut pool = BlockPool::new(3, PrefixCaching::Enabled);
        let hasher = BlockHasher::default();
        let hashes = cache_blocks(&mut pool, &hasher, &[&[1], &[2]]);
        let plain = pool.get_new_blocks(1).expect("one block is free");
        pool.free_blocks(&ids(&[0, 1]));
        pool.free_blocks(&plain);
        assert_eq!(pool.get_new_blocks(1), Some(plain));
        assert_eq!(pool.cached_block(&hashes[0]), Some(BlockId(0)));
        assert_eq!(pool.cached_block(&hashes[1]), Some(BlockId(1)));
        checked(&pool);
    }

    #[test]
    fn touch_takes_a_free_cached_block_out_of_the_queue() {
        let mut pool = BlockPool::new(2, PrefixCaching::Enabled);
        let hasher = BlockHasher::default();
        let hashes = cache_blocks(&mut pool, &hasher, &[&[7, 7]]);
        pool.free_blocks(&ids(&[0]));
        assert_eq!(pool.num_free_blocks(), 2);
        let hit = pool
            .cached_block(&hashes[0])
            .expect("the freed block is still cached");
        pool.touch(&[hit]);
        assert_eq!(pool.ref_cnt(hit), 1);
        assert_eq!(pool.num_free_blocks(), 1);
        assert_eq!(pool.get_new_blocks(1), Some(ids(&[1])));
        assert_eq!(pool.get_new_blocks(1), None);
        checked(&pool);
    }

    #[test]
    fn shared_block_stays_in_use_until_its_last_reference_is_freed() {
        let mut pool = BlockPool::new(2, PrefixCaching::Enabled);
        let block = pool.get_new_blocks(1).expect("a block is free");
        pool.touch(&block);
        pool.free_blocks(&block);
        assert_eq!(pool.ref_cnt(block[0]), 1);
        assert_eq!(pool.num_free_blocks(), 1);
        pool.free_blocks(&block);
        assert_eq!(pool.num_free_blocks(), 2);
        checked(&pool);
    }

    #[test]
    fn usage_is_the_fraction_of_blocks_in_use() {
        let mut pool = BlockPool::new(4, PrefixCaching::Disabled);
        assert_eq!(pool.usage(), 0.0);
        let blocks = pool.get_new_blocks(3).expect("blocks are free");
        assert_eq!(pool.usage(), 0.75);
        pool.free_blocks(&blocks);
        assert_eq!(pool.usage(), 0.0);
        assert_eq!(BlockPool::new(0, PrefixCaching::Enabled).usage(), 0.0);
    }

    #[test]
    fn disabled_pool_caches_nothing() {
        let mut pool = BlockPool::new(2, PrefixCaching::Disabled);
        let hasher = BlockHasher::default();
        let hashes = cache_blocks(&mut pool, &hasher, &[&[1, 2]]);
        assert_eq!(pool.cached_block(&hashes[0]), None);
        assert_eq!(pool.cached_link(BlockId(0)), None);
    }

    #[test]
    fn colliding_values_share_a_bucket_but_match_only_their_own_tokens() {
        let mut pool = BlockPool::new(2, PrefixCaching::Enabled);
        let hasher = BlockHasher::from_fn(|_, _| 5);
        let hashes = cache_blocks(&mut pool, &hasher, &[&[1], &[2]]);
        assert_eq!(pool.cached_block(&hashes[0]), Some(BlockId(0)));
        assert_eq!(pool.cached_block(&hashes[1]), Some(BlockId(1)));
        assert_eq!(pool.cached_block(&hasher.hash_block(None, &[3])), None);
        pool.free_blocks(&ids(&[0, 1]));
        assert_eq!(pool.get_new_blocks(1), Some(ids(&[0])));
        assert_eq!(pool.cached_block(&hashes[1]), Some(BlockId(1)));
        checked(&pool);
    }

    #[test]
    fn reset_prefix_cache_is_refused_while_blocks_are_in_use() {
        let mut pool = BlockPool::new(2, PrefixCaching::Enabled);
        let hasher = BlockHasher::default();
        let hashes = cache_blocks(&mut pool, &hasher, &[&[4]]);
        assert!(!pool.reset_prefix_cache());
        pool.free_blocks(&ids(&[0]));
        assert!(pool.reset_prefix_cache());
        assert_eq!(pool.cached_block(&hashes[0]), None);
        checked(&pool);
    }
}
