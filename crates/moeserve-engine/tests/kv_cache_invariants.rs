//! Seeded random operation sequences against `KvCacheManager`, checked after every operation;
//! the approach of TGI's `radix.rs` tests.
//!
//! A small simulated engine admits prompts drawn from a few shared prefixes, steps running
//! requests a few tokens at a time (chunked prefill, then decode), finishes, cancels and preempts
//! them. Besides `check_invariants()`, a shadow of the KV storage records, for every slot, a
//! fingerprint of the whole prefix whose last token was written there; every computed position
//! of every running request must keep its own fingerprint, so a prefix hit that returned a
//! foreign block, or a shared block written twice, would be caught.

use std::collections::VecDeque;

use moeserve_core::{BlockId, RequestId};
use moeserve_engine::kv_cache::{AllocationRequest, BlockHasher, KvCacheConfig, KvCacheManager};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const NUM_BLOCKS: usize = 48;
const BLOCK_SIZE: usize = 4;
const NUM_OPS: usize = 4000;
const VOCAB: u32 = 6;

struct SimRequest {
    id: RequestId,
    tokens: Vec<u32>,
    /// `fingerprints[p]` names the prefix `tokens[..=p]`.
    fingerprints: Vec<u64>,
    num_computed: usize,
    max_len: usize,
}

impl SimRequest {
    fn push_token(&mut self, token: u32) {
        let parent = self
            .fingerprints
            .last()
            .copied()
            .unwrap_or(0x9e37_79b9_7f4a_7c15);
        self.fingerprints.push(mix(
            parent ^ u64::from(token).wrapping_mul(0xff51_afd7_ed55_8ccd)
        ));
        self.tokens.push(token);
    }
}

/// SplitMix64's finaliser.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn slot(table: &[BlockId], position: usize) -> usize {
    table[position / BLOCK_SIZE].0 as usize * BLOCK_SIZE + position % BLOCK_SIZE
}

struct Sim {
    kv: KvCacheManager,
    rng: ChaCha8Rng,
    prefixes: Vec<Vec<u32>>,
    waiting: VecDeque<SimRequest>,
    running: Vec<SimRequest>,
    /// Per slot: the fingerprint of the prefix whose last token's K/V was written there.
    shadow: Vec<Option<u64>>,
    next_id: u64,
    num_finished: usize,
    num_preempted: usize,
}

impl Sim {
    fn new(seed: u64, kv: KvCacheManager) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let prefixes = (0..3)
            .map(|_| (0..20).map(|_| rng.random_range(0..VOCAB)).collect())
            .collect();
        let shadow = vec![None; kv.num_blocks() * BLOCK_SIZE];
        Sim {
            kv,
            rng,
            prefixes,
            waiting: VecDeque::new(),
            running: Vec::new(),
            shadow,
            next_id: 0,
            num_finished: 0,
            num_preempted: 0,
        }
    }

    fn run(&mut self, num_ops: usize) {
        for op in 0..num_ops {
            match self.rng.random_range(0..100) {
                0..20 => self.add_request(),
                20..45 => self.admit_front(),
                45..85 => self.step_one(),
                85..90 => self.cancel_one(),
                _ => self.preempt_one(),
            }
            if let Err(e) = self.check() {
                panic!("after operation {op}: {e}");
            }
        }
    }

    fn add_request(&mut self) {
        let prefix = &self.prefixes[self.rng.random_range(0..self.prefixes.len())];
        let cut = self.rng.random_range(0..=prefix.len());
        let suffix_len = self.rng.random_range(1..12);
        let mut req = SimRequest {
            id: RequestId(self.next_id),
            tokens: Vec::new(),
            fingerprints: Vec::new(),
            num_computed: 0,
            max_len: 0,
        };
        self.next_id += 1;
        for &token in &prefix[..cut] {
            req.push_token(token);
        }
        for _ in 0..suffix_len {
            req.push_token(self.rng.random_range(0..VOCAB));
        }
        req.max_len = req.tokens.len() + self.rng.random_range(1..24);
        assert!(
            self.kv.can_ever_fit(req.max_len),
            "the driver only makes requests that fit"
        );
        self.waiting.push_back(req);
    }

    /// Admission as the scheduler does it: prefix lookup, then the first chunk.
    fn admit_front(&mut self) {
        let Some(mut req) = self.waiting.pop_front() else {
            return;
        };
        let (hits, num_hit_tokens) = self.kv.computed_blocks(&req.tokens);
        assert!(
            num_hit_tokens < req.tokens.len(),
            "a hit never covers the whole prompt"
        );
        for p in 0..num_hit_tokens {
            assert_eq!(
                self.shadow[slot(&hits, p)],
                Some(req.fingerprints[p]),
                "prefix hit at position {p} is foreign"
            );
        }
        let num_new = (req.tokens.len() - num_hit_tokens).min(self.rng.random_range(1..16));
        let alloc = AllocationRequest {
            token_ids: &req.tokens,
            num_computed_tokens: num_hit_tokens,
            num_new_tokens: num_new,
            new_computed_blocks: &hits,
        };
        if self.kv.allocate_slots(req.id, alloc).is_none() {
            self.waiting.push_front(req);
            return;
        }
        req.num_computed = num_hit_tokens;
        self.compute(&mut req, num_new);
        self.after_step(req);
    }

    /// One step of a random running request: a prefill chunk or one decode token.
    fn step_one(&mut self) {
        if self.running.is_empty() {
            return;
        }
        let index = self.rng.random_range(0..self.running.len());
        let mut req = self.running.swap_remove(index);
        let num_new = (req.tokens.len() - req.num_computed).min(self.rng.random_range(1..16));
        let alloc = AllocationRequest {
            token_ids: &req.tokens,
            num_computed_tokens: req.num_computed,
            num_new_tokens: num_new,
            new_computed_blocks: &[],
        };
        if self.kv.allocate_slots(req.id, alloc).is_none() {
            self.preempt(req);
            return;
        }
        self.compute(&mut req, num_new);
        self.after_step(req);
    }

    /// Writes the step's tokens into the shadow storage through the block table.
    fn compute(&mut self, req: &mut SimRequest, num_new: usize) {
        let table = self.kv.block_table(req.id);
        assert!(
            table.len() * BLOCK_SIZE >= req.num_computed + num_new,
            "{} table too short",
            req.id
        );
        for p in req.num_computed..req.num_computed + num_new {
            self.shadow[slot(table, p)] = Some(req.fingerprints[p]);
        }
        req.num_computed += num_new;
    }

    /// Samples a token once the request has caught up; finishes it at its length limit.
    fn after_step(&mut self, mut req: SimRequest) {
        if req.num_computed == req.tokens.len() {
            req.push_token(self.rng.random_range(0..VOCAB));
        }
        if req.tokens.len() >= req.max_len {
            self.kv.free(req.id);
            self.num_finished += 1;
        } else {
            self.running.push(req);
        }
    }

    fn cancel_one(&mut self) {
        let num_all = self.running.len() + self.waiting.len();
        if num_all == 0 {
            return;
        }
        let index = self.rng.random_range(0..num_all);
        let req = match index.checked_sub(self.running.len()) {
            None => self.running.swap_remove(index),
            Some(w) => self.waiting.remove(w).expect("index is in range"),
        };
        self.kv.free(req.id);
    }

    fn preempt_one(&mut self) {
        if let Some(req) = self.running.pop() {
            self.preempt(req);
        }
    }

    fn preempt(&mut self, mut req: SimRequest) {
        self.kv.free(req.id);
        req.num_computed = 0;
        self.waiting.push_front(req);
        self.num_preempted += 1;
    }

    fn check(&self) -> Result<(), String> {
        self.kv.check_invariants()?;
        for req in &self.waiting {
            if !self.kv.block_table(req.id).is_empty() {
                return Err(format!("waiting {} holds blocks", req.id));
            }
        }
        for req in &self.running {
            let table = self.kv.block_table(req.id);
            if table.len() != self.kv.blocks_needed(req.num_computed) {
                return Err(format!(
                    "{} holds {} blocks for {} tokens",
                    req.id,
                    table.len(),
                    req.num_computed
                ));
            }
            if let Some(p) = (0..req.num_computed)
                .find(|&p| self.shadow[slot(table, p)] != Some(req.fingerprints[p]))
            {
                return Err(format!(
                    "{}: K/V at position {p} was overwritten or is foreign",
                    req.id
                ));
            }
        }
        Ok(())
    }

    /// Ends every request and checks that every block came back.
    fn drain(&mut self) {
        for req in self.running.drain(..).chain(self.waiting.drain(..)) {
            self.kv.free(req.id);
        }
        self.kv
            .check_invariants()
            .expect("invariants hold after draining");
        assert_eq!(self.kv.usage(), 0.0);
        assert_eq!(self.kv.num_free_blocks(), NUM_BLOCKS);
    }
}

fn manager(enable_prefix_caching: bool, hasher: BlockHasher) -> KvCacheManager {
    let config = KvCacheConfig {
        num_blocks: NUM_BLOCKS,
        block_size: BLOCK_SIZE,
        enable_prefix_caching,
    };
    KvCacheManager::with_block_hasher(config, hasher)
}

#[test]
fn random_operations_keep_invariants_and_return_every_block() {
    for seed in 0..8 {
        let mut sim = Sim::new(seed, manager(true, BlockHasher::default()));
        sim.run(NUM_OPS);
        let stats = sim.kv.stats();
        assert!(
            stats.hits > 0 && stats.hits < stats.queries,
            "seed {seed}: {stats:?}"
        );
        assert!(
            sim.num_finished > 20 && sim.num_preempted > 20,
            "seed {seed}: too little happened"
        );
        sim.drain();
    }
}

#[test]
fn colliding_hashes_never_give_foreign_blocks_under_random_operations() {
    for seed in 100..104 {
        let mut sim = Sim::new(
            seed,
            manager(
                true,
                BlockHasher::from_fn(|_, tokens| u64::from(tokens[0] % 2)),
            ),
        );
        sim.run(NUM_OPS);
        assert!(
            sim.kv.stats().hits > 0,
            "seed {seed}: collisions must not stop true hits"
        );
        sim.drain();
    }
}

#[test]
fn random_operations_without_prefix_caching_never_hit() {
    for seed in 200..204 {
        let mut sim = Sim::new(seed, manager(false, BlockHasher::default()));
        sim.run(NUM_OPS);
        assert_eq!(sim.kv.stats().hits, 0);
        assert!(sim.num_finished > 20, "seed {seed}: too little happened");
        sim.drain();
    }
}
