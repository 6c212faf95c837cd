//! Which KV blocks each request holds, with prefix caching; design follows vLLM v1
//! `KVCacheManager` (`get_computed_blocks`, `allocate_slots`, `free`).
//!
//! The scheduler owns `num_computed_tokens`; it passes it in. One request's block table at
//! [`KvCacheManager::allocate_slots`] (block size 4):
//!
//! ```text
//! positions  |0 1 2 3|4 5 6 7|8 9 . .|. . . .|. . . .|
//! table      [ hit   | hit   | held  | new   | new   ]
//!            |<-- num_computed_tokens ->|<-- num_new_tokens -->|
//!             new_computed_blocks (first allocation only), then blocks held from earlier steps,
//!             then the blocks this call allocates.
//! ```
//! After allocating, every block that is full of known tokens (`token_ids`) is cached, even
//! though this step computes its keys and values only now (as vLLM): a request admitted in the
//! same step may hit it, which is sound because each layer writes the whole step's K/V before
//! any attention reads it.

use std::collections::{HashMap, HashSet};

use moeserve_core::{BlockId, RequestId};

use super::block_hash::BlockHasher;
use super::block_pool::{BlockPool, PrefixCaching};

/// Sizes and switches of the block bookkeeping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvCacheConfig {
    pub num_blocks: usize,
    /// Tokens per block; must be positive.
    pub block_size: usize,
    pub enable_prefix_caching: bool,
}

/// One call of [`KvCacheManager::allocate_slots`].
#[derive(Clone, Copy, Debug)]
pub struct AllocationRequest<'a> {
    /// Every token the request has so far (prompt, then outputs).
    pub token_ids: &'a [u32],
    /// Tokens whose K/V the request already has, counting the prefix hits in
    /// `new_computed_blocks`.
    pub num_computed_tokens: usize,
    /// Tokens this step computes, after the computed ones.
    pub num_new_tokens: usize,
    /// Prefix-hit blocks from [`KvCacheManager::computed_blocks`]; empty except on the first
    /// allocation after admission.
    pub new_computed_blocks: &'a [BlockId],
}

/// Prefix-cache lookups in tokens, totals since start (vLLM's `prefix_cache_queries/hits`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    /// Tokens of every prompt looked up.
    pub queries: u64,
    /// Tokens found in the cache.
    pub hits: u64,
}

/// A block whose first tokens a forked sequence takes as its own copy (the source's partial
/// last block: both sequences write their next positions into it, so it cannot be shared).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockCopy {
    pub src: BlockId,
    pub dst: BlockId,
}

/// A request's block table; its first `num_cached_blocks` blocks are cached (full, keyed).
#[derive(Debug, Default)]
struct RequestBlocks {
    blocks: Vec<BlockId>,
    num_cached_blocks: usize,
}

/// Invariant: a block's `ref_cnt` equals the number of block tables holding it, and each
/// table's cached blocks chain (block `i`'s key names block `i - 1`'s cache entry).
#[derive(Debug)]
pub struct KvCacheManager {
    block_size: usize,
    pool: BlockPool,
    hasher: BlockHasher,
    requests: HashMap<RequestId, RequestBlocks>,
    stats: PrefixCacheStats,
}

impl KvCacheManager {
    /// # Panics
    /// If `block_size` is 0 or `num_blocks` does not fit below `u32::MAX` (the config is
    /// validated before it gets here).
    pub fn new(config: KvCacheConfig) -> Self {
        Self::with_block_hasher(config, BlockHasher::default())
    }

    /// A manager whose prefix cache keys blocks with `hasher` (tests force collisions with it).
    pub fn with_block_hasher(config: KvCacheConfig, hasher: BlockHasher) -> Self {
        assert!(config.block_size > 0, "block_size must be positive");
        let prefix_caching = match config.enable_prefix_caching {
            true => PrefixCaching::Enabled,
            false => PrefixCaching::Disabled,
        };
        KvCacheManager {
            block_size: config.block_size,
            pool: BlockPool::new(config.num_blocks, prefix_caching),
            hasher,
            requests: HashMap::new(),
            stats: PrefixCacheStats::default(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.pool.num_blocks()
    }

    pub fn num_free_blocks(&self) -> usize {
        self.pool.num_free_blocks()
    }

    /// Fraction of blocks in use, in `[0, 1]`.
    pub fn usage(&self) -> f32 {
        self.pool.usage()
    }

    pub fn stats(&self) -> PrefixCacheStats {
        self.stats
    }

    /// Blocks that hold `num_tokens` tokens.
    pub fn blocks_needed(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size)
    }

    /// Whether a request of `num_tokens` tokens fits even with the whole cache to itself.
    pub fn can_ever_fit(&self, num_tokens: usize) -> bool {
        self.blocks_needed(num_tokens) <= self.num_blocks()
    }

    /// The request's block table (empty for an unknown request).
    pub fn block_table(&self, req: RequestId) -> &[BlockId] {
        self.requests.get(&req).map_or(&[], |r| &r.blocks)
    }

    /// The longest prefix of `token_ids` held in cached full blocks, and its length in tokens.
    ///
    /// Never the whole prompt: the last token must be computed for the model to give logits, so
    /// at most `(len - 1) / block_size` blocks hit. Touches nothing; pass the blocks to
    /// [`Self::allocate_slots`]. Counts one query of `token_ids.len()` tokens per call.
    pub fn computed_blocks(&mut self, token_ids: &[u32]) -> (Vec<BlockId>, usize) {
        if self.pool.prefix_caching() == PrefixCaching::Disabled {
            return (Vec::new(), 0);
        }
        let max_hit_blocks = token_ids.len().saturating_sub(1) / self.block_size;
        let mut blocks = Vec::new();
        let mut parent = None;
        for block_tokens in token_ids.chunks_exact(self.block_size).take(max_hit_blocks) {
            let key = self.hasher.hash_block(parent, block_tokens);
            let Some(block) = self.pool.cached_block(&key) else {
                break;
            };
            parent = self.pool.cached_link(block);
            blocks.push(block);
        }
        let num_hit_tokens = blocks.len() * self.block_size;
        self.stats.queries += token_ids.len() as u64;
        self.stats.hits += num_hit_tokens as u64;
        (blocks, num_hit_tokens)
    }

    /// Grows the request's block table to hold `num_computed_tokens + num_new_tokens` tokens
    /// (taking the prefix hits first) and returns the blocks allocated now, or `None`, changing
    /// nothing, when too few blocks are free.
    pub fn allocate_slots(
        &mut self,
        req: RequestId,
        alloc: AllocationRequest<'_>,
    ) -> Option<Vec<BlockId>> {
        let hits = alloc.new_computed_blocks;
        let num_held = self.block_table(req).len();
        assert!(
            num_held == 0 || hits.is_empty(),
            "{req} takes prefix hits after its first allocation"
        );
        debug_assert!(alloc.num_computed_tokens >= hits.len() * self.block_size);
        let num_tokens = alloc.num_computed_tokens + alloc.num_new_tokens;
        let num_to_allocate = self
            .blocks_needed(num_tokens)
            .saturating_sub(num_held + hits.len());
        // Touching a free hit takes it out of the free queue, so it cannot pay for new blocks.
        let num_free_hits = hits.iter().filter(|&&b| self.pool.ref_cnt(b) == 0).count();
        if num_to_allocate > self.pool.num_free_blocks() - num_free_hits {
            return None;
        }
        self.pool.touch(hits);
        let new_blocks = self
            .pool
            .get_new_blocks(num_to_allocate)
            .expect("free blocks were counted above");
        let request = self.requests.entry(req).or_default();
        if request.blocks.is_empty() {
            request.blocks.extend_from_slice(hits);
            request.num_cached_blocks = hits.len();
        }
        request.blocks.extend_from_slice(&new_blocks);
        let known = &alloc.token_ids[..num_tokens.min(alloc.token_ids.len())];
        let num_full_blocks = (known.len() / self.block_size).min(request.blocks.len());
        if self.pool.prefix_caching() == PrefixCaching::Enabled {
            while request.num_cached_blocks < num_full_blocks {
                let i = request.num_cached_blocks;
                let parent = match i {
                    0 => None,
                    _ => Some(
                        self.pool
                            .cached_link(request.blocks[i - 1])
                            .expect("blocks are cached in order"),
                    ),
                };
                let block_tokens = &known[i * self.block_size..(i + 1) * self.block_size];
                self.pool.cache_full_block(
                    request.blocks[i],
                    self.hasher.hash_block(parent, block_tokens),
                );
                request.num_cached_blocks += 1;
            }
        }
        Some(new_blocks)
    }

    /// Gives `child` the first `num_tokens` tokens of `parent`'s table without computing them
    /// again (`n` > 1 choices of one prompt): the full blocks are shared (one more reference
    /// each, so either may be freed first), and a partial last block is given to the child as a
    /// fresh block whose contents the caller copies from the parent's ([`BlockCopy`]) before
    /// either writes there. `None`, changing nothing, when that block cannot be had.
    ///
    /// # Panics
    /// If `child` already holds blocks or `parent` holds fewer than `num_tokens` tokens' worth.
    pub fn fork(
        &mut self,
        parent: RequestId,
        child: RequestId,
        num_tokens: usize,
    ) -> Option<Option<BlockCopy>> {
        assert!(
            self.block_table(child).is_empty(),
            "{child} is forked after its first allocation"
        );
        let source = self.requests.get(&parent)?;
        assert!(
            source.blocks.len() >= self.blocks_needed(num_tokens),
            "{parent} holds fewer than {num_tokens} tokens"
        );
        let num_full = num_tokens / self.block_size;
        let partial =
            (!num_tokens.is_multiple_of(self.block_size)).then(|| source.blocks[num_full]);
        if partial.is_some() && self.pool.num_free_blocks() == 0 {
            return None;
        }
        let mut blocks = source.blocks[..num_full].to_vec();
        let num_cached_blocks = source.num_cached_blocks.min(num_full);
        self.pool.touch(&blocks);
        let copy = partial.map(|src| {
            let dst = self
                .pool
                .get_new_blocks(1)
                .expect("a free block was counted")[0];
            blocks.push(dst);
            BlockCopy { src, dst }
        });
        self.requests.insert(
            child,
            RequestBlocks {
                blocks,
                num_cached_blocks,
            },
        );
        Some(copy)
    }

    /// Releases every block of the request (finished, cancelled or preempted); its full blocks
    /// stay cached until evicted. Freeing an unknown request does nothing.
    pub fn free(&mut self, req: RequestId) {
        if let Some(mut request) = self.requests.remove(&req) {
            request.blocks.reverse();
            self.pool.free_blocks(&request.blocks);
        }
    }

    /// Forgets every cached block; refused (`false`) while any request holds blocks.
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.pool.reset_prefix_cache()
    }

    /// Checks the pool's and this manager's invariants (a debug and test helper).
    pub fn check_invariants(&self) -> Result<(), String> {
        self.pool.check_invariants()?;
        let mut holders = vec![0u32; self.num_blocks()];
        for (req, request) in &self.requests {
            let distinct: HashSet<BlockId> = request.blocks.iter().copied().collect();
            if distinct.len() != request.blocks.len() {
                return Err(format!("{req} holds a block twice"));
            }
            request
                .blocks
                .iter()
                .for_each(|b| holders[b.0 as usize] += 1);
            self.check_cached_chain(*req, request)?;
        }
        for (b, &num_holders) in holders.iter().enumerate() {
            let ref_cnt = self.pool.ref_cnt(BlockId(b as u32));
            if ref_cnt != num_holders {
                return Err(format!(
                    "block {b} has ref_cnt {ref_cnt} but {num_holders} holders"
                ));
            }
        }
        Ok(())
    }

    fn check_cached_chain(&self, req: RequestId, request: &RequestBlocks) -> Result<(), String> {
        if request.num_cached_blocks > request.blocks.len() {
            return Err(format!("{req} counts more cached blocks than it holds"));
        }
        if self.pool.prefix_caching() == PrefixCaching::Disabled {
            return Ok(());
        }
        for i in 0..request.num_cached_blocks {
            let hash = self
                .pool
                .block_hash(request.blocks[i])
                .ok_or(format!("{req}: block {i} not cached"))?;
            let parent = i
                .checked_sub(1)
                .and_then(|p| self.pool.cached_link(request.blocks[p]));
            if hash.parent() != parent.map(|p| p.entry())
                || hash.token_ids().len() != self.block_size
            {
                return Err(format!(
                    "{req}: cached block {i} does not chain to block {}",
                    i as i64 - 1
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BLOCK_SIZE: usize = 4;

    fn manager(num_blocks: usize) -> KvCacheManager {
        KvCacheManager::new(KvCacheConfig {
            num_blocks,
            block_size: BLOCK_SIZE,
            enable_prefix_caching: true,
        })
    }

    /// Admits `req` with `prompt` as the scheduler does: prefix lookup, then one allocation for
    /// the rest of the prompt. Returns the number of prefix-hit tokens.
    fn admit(kv: &mut KvCacheManager, req: u64, prompt: &[u32]) -> Option<usize> {
        let (hits, num_hit_tokens) = kv.computed_blocks(prompt);
        let alloc = AllocationRequest {
            token_ids: prompt,
            num_computed_tokens: num_hit_tokens,
            num_new_tokens: prompt.len() - num_hit_tokens,
            new_computed_blocks: &hits,
        };
        kv.allocate_slots(RequestId(req), alloc)?;
        kv.check_invariants().expect("manager invariants hold");
        Some(num_hit_tokens)
    }

    fn prompt(first: u32, len: usize) -> Vec<u32> {
        (first..first + len as u32).collect()
    }

    #[test]
    fn allocate_fails_when_pool_exhausted_and_changes_nothing() {
        let mut kv = manager(4);
        assert_eq!(admit(&mut kv, 1, &prompt(0, 12)), Some(0));
        kv.free(RequestId(1));
        admit(&mut kv, 2, &prompt(100, 4)).expect("one block fits");
        // Request 3 hits the two cached blocks of request 1 (both free) and needs two more, but
        // only one block would be left to allocate once the hits leave the free queue.
        let tokens = [prompt(0, 8), prompt(500, 5)].concat();
        let (hits, num_hit_tokens) = kv.computed_blocks(&tokens);
        assert_eq!(num_hit_tokens, 8);
        let (free, usage, stats) = (kv.num_free_blocks(), kv.usage(), kv.stats());
        let alloc = AllocationRequest {
            token_ids: &tokens,
            num_computed_tokens: 8,
            num_new_tokens: 5,
            new_computed_blocks: &hits,
        };
        assert_eq!(kv.allocate_slots(RequestId(3), alloc), None);
        assert_eq!(
            (kv.num_free_blocks(), kv.usage(), kv.stats()),
            (free, usage, stats)
        );
        assert!(kv.block_table(RequestId(3)).is_empty());
        assert_eq!(
            kv.computed_blocks(&tokens).0,
            hits,
            "the hits are still cached"
        );
        kv.check_invariants().expect("manager invariants hold");
    }

    #[test]
    fn freed_cached_block_is_reused_by_a_matching_prefix() {
        let mut kv = manager(8);
        admit(&mut kv, 1, &prompt(0, 10)).expect("fits");
        let first_table = kv.block_table(RequestId(1)).to_vec();
        kv.free(RequestId(1));
        let tokens = [prompt(0, 8), prompt(50, 3)].concat();
        assert_eq!(admit(&mut kv, 2, &tokens), Some(8));
        assert_eq!(kv.block_table(RequestId(2))[..2], first_table[..2]);
        assert_eq!(
            kv.stats(),
            PrefixCacheStats {
                queries: 10 + 11,
                hits: 8
            }
        );
    }

    #[test]
    fn shared_prefix_blocks_are_held_by_both_requests() {
        let mut kv = manager(8);
        admit(&mut kv, 1, &prompt(0, 9)).expect("fits");
        assert_eq!(admit(&mut kv, 2, &prompt(0, 6)), Some(4));
        let shared = kv.block_table(RequestId(1))[0];
        assert_eq!(kv.block_table(RequestId(2))[0], shared);
        assert_eq!(kv.num_free_blocks(), 8 - 3 - 1);
        kv.free(RequestId(1));
        assert_eq!(kv.num_free_blocks(), 8 - 2);
        kv.check_invariants().expect("manager invariants hold");
    }

    #[test]
    fn prefix_hit_never_covers_the_whole_prompt() {
        let mut kv = manager(8);
        admit(&mut kv, 1, &prompt(0, 8)).expect("fits");
        assert_eq!(admit(&mut kv, 2, &prompt(0, 8)), Some(4));
        assert_eq!(kv.computed_blocks(&prompt(0, 9)).1, 8);
        assert_eq!(kv.computed_blocks(&[]).1, 0);
    }

    #[test]
    fn hash_collision_never_returns_a_foreign_block() {
        let config = KvCacheConfig {
            num_blocks: 16,
            block_size: BLOCK_SIZE,
            enable_prefix_caching: true,
        };
        let mut kv = KvCacheManager::with_block_hasher(config, BlockHasher::from_fn(|_, _| 0));
        admit(&mut kv, 1, &prompt(0, 9)).expect("fits");
        assert_eq!(
            admit(&mut kv, 2, &prompt(100, 9)),
            Some(0),
            "other tokens, same hash value"
        );
        // Same second block behind a different first block: the chain differs, so no hit.
        let tokens = [prompt(200, 4), prompt(4, 4), vec![9]].concat();
        assert_eq!(admit(&mut kv, 3, &tokens), Some(0));
        assert_eq!(
            admit(&mut kv, 4, &prompt(100, 9)),
            Some(8),
            "the true prefix still hits"
        );
        assert_eq!(
            kv.block_table(RequestId(4))[..2],
            kv.block_table(RequestId(2))[..2]
        );
    }

    #[test]
    fn decoded_tokens_fill_blocks_that_later_requests_hit() {
        let mut kv = manager(8);
        let mut tokens = prompt(0, 3);
        admit(&mut kv, 1, &tokens).expect("fits");
        for (num_computed, output) in (3..6).zip([40, 41, 42]) {
            tokens.push(output);
            let alloc = AllocationRequest {
                token_ids: &tokens,
                num_computed_tokens: num_computed,
                num_new_tokens: 1,
                new_computed_blocks: &[],
            };
            kv.allocate_slots(RequestId(1), alloc).expect("fits");
            kv.check_invariants().expect("manager invariants hold");
        }
        assert_eq!(kv.block_table(RequestId(1)).len(), 2);
        assert_eq!(kv.computed_blocks(&[0, 1, 2, 40, 7]).1, 4);
        assert_eq!(kv.computed_blocks(&[0, 1, 2, 41, 7]).1, 0);
    }

    #[test]
    fn preempted_request_gets_its_blocks_back_from_the_prefix_cache() {
        let mut kv = manager(6);
        let tokens = prompt(0, 14);
        admit(&mut kv, 1, &tokens).expect("fits");
        let table = kv.block_table(RequestId(1)).to_vec();
        kv.free(RequestId(1));
        assert_eq!(kv.usage(), 0.0);
        assert_eq!(admit(&mut kv, 1, &tokens), Some(12));
        assert_eq!(kv.block_table(RequestId(1))[..3], table[..3]);
    }

    #[test]
    fn disabled_prefix_caching_never_hits_or_counts() {
        let config = KvCacheConfig {
            num_blocks: 8,
            block_size: BLOCK_SIZE,
            enable_prefix_caching: false,
        };
        let mut kv = KvCacheManager::new(config);
        admit(&mut kv, 1, &prompt(0, 9)).expect("fits");
        kv.free(RequestId(1));
        assert_eq!(admit(&mut kv, 2, &prompt(0, 9)), Some(0));
        assert_eq!(kv.stats(), PrefixCacheStats::default());
    }

    #[test]
    fn a_fork_shares_full_blocks_and_copies_the_partial_one() {
        for enable_prefix_caching in [true, false] {
            let mut kv = KvCacheManager::new(KvCacheConfig {
                num_blocks: 6,
                block_size: BLOCK_SIZE,
                enable_prefix_caching,
            });
            admit(&mut kv, 1, &prompt(0, 10)).expect("fits");
            let parent = kv.block_table(RequestId(1)).to_vec();
            let copy = kv
                .fork(RequestId(1), RequestId(2), 10)
                .expect("a block is free");
            let child = kv.block_table(RequestId(2)).to_vec();
            assert_eq!(child[..2], parent[..2], "full blocks are shared");
            assert_eq!(
                copy,
                Some(BlockCopy {
                    src: parent[2],
                    dst: child[2]
                })
            );
            assert_ne!(child[2], parent[2]);
            assert_eq!(kv.num_free_blocks(), 6 - 4);
            kv.check_invariants().expect("manager invariants hold");
            // The parent leaves first: the child keeps the shared blocks.
            kv.free(RequestId(1));
            assert_eq!(kv.num_free_blocks(), 6 - 3);
            kv.check_invariants().expect("manager invariants hold");
            kv.free(RequestId(2));
            assert_eq!(kv.num_free_blocks(), 6);
        }
    }

    #[test]
    fn a_fork_at_a_block_boundary_copies_nothing_and_a_full_pool_refuses_a_copy() {
        let mut kv = manager(3);
        admit(&mut kv, 1, &prompt(0, 8)).expect("fits");
        assert_eq!(kv.fork(RequestId(1), RequestId(2), 8), Some(None));
        assert_eq!(kv.block_table(RequestId(2)), kv.block_table(RequestId(1)));
        kv.free(RequestId(2));
        admit(&mut kv, 3, &prompt(100, 3)).expect("the last block");
        assert_eq!(kv.num_free_blocks(), 0);
        // Request 3 fits in one block, partial: its fork needs a fresh one and none is free.
        assert_eq!(kv.fork(RequestId(3), RequestId(4), 3), None);
        assert!(kv.block_table(RequestId(4)).is_empty());
        kv.check_invariants().expect("manager invariants hold");
    }

    #[test]
    fn freeing_twice_or_an_unknown_request_does_nothing() {
        let mut kv = manager(4);
        admit(&mut kv, 1, &prompt(0, 5)).expect("fits");
        kv.free(RequestId(1));
        kv.free(RequestId(1));
        kv.free(RequestId(9));
        assert_eq!(kv.num_free_blocks(), 4);
        kv.check_invariants().expect("manager invariants hold");
    }

    #[test]
    fn blocks_needed_rounds_up_and_can_ever_fit_compares_with_the_pool() {
        let kv = manager(3);
        assert_eq!(
            (
                kv.blocks_needed(0),
                kv.blocks_needed(4),
                kv.blocks_needed(5)
            ),
            (0, 1, 2)
        );
        assert!(kv.can_ever_fit(12));
        assert!(!kv.can_ever_fit(13));
    }

    #[test]
    fn reset_prefix_cache_waits_for_every_request_to_leave() {
        let mut kv = manager(4);
        admit(&mut kv, 1, &prompt(0, 5)).expect("fits");
        assert!(!kv.reset_prefix_cache());
        kv.free(RequestId(1));
        assert!(kv.reset_prefix_cache());
        assert_eq!(admit(&mut kv, 2, &prompt(0, 5)), Some(0));
    }
}
