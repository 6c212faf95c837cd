//! Paged KV cache bookkeeping: which blocks belong to whom, and the prefix cache; design follows
//! vLLM v1 (`BlockPool`, `FreeKVCacheBlockQueue`, `KVCacheManager`). The K/V rows themselves
//! live in `moeserve_model::kv_cache::PagedKvCache`, at slot `block_id * block_size + offset`.
//!
//! - `block_hash`: exact prefix-cache keys of full blocks (a chained hash plus verification).
//! - `free_block_queue`: free blocks in eviction order, O(1) removal from the middle.
//! - `block_pool`: reference counts, allocation with eviction, the prefix cache.
//! - `kv_cache_manager`: per-request block tables; prefix lookup, `allocate_slots`, `free`.
//!
//! **Invariant:** running out of blocks is `None` (preempt or wait), not an error.

mod block_hash;
mod block_pool;
mod free_block_queue;
mod kv_cache_manager;

pub use block_hash::{BlockHash, BlockHashFn, BlockHasher, CacheEntryId, ParentLink};
pub use block_pool::{BlockPool, PrefixCaching};
pub use kv_cache_manager::{
    AllocationRequest, BlockCopy, KvCacheConfig, KvCacheManager, PrefixCacheStats,
};
