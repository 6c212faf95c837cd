//! Scheduler policy tests: driven step by step without a model.

use moeserve_core::RequestId;

use super::*;
use crate::kv_cache::{KvCacheConfig, KvCacheManager};

fn scheduler(num_blocks: usize, limits: SchedulerLimits) -> Scheduler {
    let kv = KvCacheManager::new(KvCacheConfig {
        num_blocks,
        block_size: 4,
        enable_prefix_caching: true,
    });
    Scheduler::new(limits, kv)
}

fn limits(max_num_seqs: usize, max_num_batched_tokens: usize) -> SchedulerLimits {
    SchedulerLimits {
        max_num_seqs,
        max_num_batched_tokens,
        enable_chunked_prefill: true,
        max_model_len: 1000,
    }
}

/// Runs one step as the engine would: marks tokens computed and appends a token to every
/// request that sampled.
fn step(s: &mut Scheduler) -> SchedulerOutput {
    let out = s.schedule();
    s.update_from_output(&out);
    for r in out.scheduled.iter().filter(|r| r.samples) {
        s.append_token(r.id, 7);
    }
    out
}

fn prompt(len: usize, first: u32) -> Vec<u32> {
    (0..len as u32).map(|i| first + i).collect()
}

#[test]
fn chunked_prefill_respects_the_token_budget_and_samples_only_at_the_end() {
    let mut s = scheduler(64, limits(8, 32));
    s.add_request(RequestId(1), prompt(100, 0), 4).unwrap();
    let chunks: Vec<(usize, bool)> = (0..4)
        .map(|_| {
            let out = step(&mut s);
            (out.num_batched_tokens(), out.scheduled[0].samples)
        })
        .collect();
    assert_eq!(
        chunks,
        vec![(32, false), (32, false), (32, false), (4, true)]
    );
    assert_eq!(step(&mut s).scheduled[0].num_new_tokens, 1);
}

#[test]
fn running_decodes_come_before_new_prefills() {
    let mut s = scheduler(64, limits(8, 16));
    s.add_request(RequestId(1), prompt(8, 0), 4).unwrap();
    step(&mut s);
    s.add_request(RequestId(2), prompt(40, 100), 4).unwrap();
    let out = step(&mut s);
    assert_eq!(out.scheduled[0].id, RequestId(1));
    assert_eq!(out.scheduled[0].num_new_tokens, 1);
    assert_eq!(
        (out.scheduled[1].id, out.scheduled[1].num_new_tokens),
        (RequestId(2), 15)
    );
}

#[test]
fn max_num_seqs_bounds_the_running_set() {
    let mut s = scheduler(64, limits(2, 100));
    for i in 0..3 {
        s.add_request(RequestId(i), prompt(4, 10 * i as u32), 4)
            .unwrap();
    }
    let out = step(&mut s);
    assert_eq!(out.scheduled.len(), 2);
    assert_eq!((s.num_running(), s.num_waiting()), (2, 1));
}

#[test]
fn preemption_takes_the_most_recent_request_and_resumes_it_first() {
    // 4 blocks of 4 tokens: two requests of 8 prompt tokens fill the cache.
    let mut s = scheduler(4, limits(8, 64));
    s.add_request(RequestId(1), prompt(8, 0), 8).unwrap();
    s.add_request(RequestId(2), prompt(8, 100), 8).unwrap();
    assert_eq!(step(&mut s).scheduled.len(), 2);
    // Both now need a third block; only request 1 (admitted first) keeps running.
    let out = step(&mut s);
    assert_eq!(out.preempted, vec![RequestId(2)]);
    assert_eq!(
        out.scheduled.iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![RequestId(1)]
    );
    assert_eq!(s.request(RequestId(2)).unwrap().num_computed_tokens, 0);
    assert_eq!(s.num_preemptions(), 1);
    s.finish(RequestId(1));
    // Request 2 is recomputed from its prompt and its one output token.
    let out = step(&mut s);
    assert_eq!(out.scheduled[0].id, RequestId(2));
    assert_eq!(
        out.scheduled[0].num_computed_tokens + out.scheduled[0].num_new_tokens,
        9
    );
}

#[test]
fn never_fitting_requests_are_refused_at_admission() {
    let mut s = scheduler(4, limits(8, 64));
    let err = s.add_request(RequestId(1), prompt(10, 0), 20).unwrap_err();
    assert!(
        matches!(
            err,
            AdmissionError::CacheTooSmall {
                needed: 8,
                available: 4,
                ..
            }
        ),
        "{err}"
    );
    let mut s = scheduler(
        64,
        SchedulerLimits {
            max_model_len: 16,
            ..limits(8, 64)
        },
    );
    let err = s.add_request(RequestId(1), prompt(10, 0), 10).unwrap_err();
    assert!(
        err.to_string()
            .contains("maximum context length is 16 tokens"),
        "{err}"
    );
    // A `max_tokens` that would overflow the sum is refused too, not wrapped around.
    let err = s
        .add_request(RequestId(2), prompt(10, 0), usize::MAX)
        .unwrap_err();
    assert!(
        matches!(err, AdmissionError::ContextTooLong { .. }),
        "{err}"
    );
    assert!(!s.has_unfinished());
}

#[test]
fn without_chunked_prefill_a_prompt_waits_for_a_step_with_room() {
    let mut s = scheduler(
        64,
        SchedulerLimits {
            enable_chunked_prefill: false,
            ..limits(8, 16)
        },
    );
    s.add_request(RequestId(1), prompt(10, 0), 4).unwrap();
    s.add_request(RequestId(2), prompt(10, 50), 4).unwrap();
    let out = step(&mut s);
    assert_eq!(out.scheduled.len(), 1);
    assert_eq!(out.num_batched_tokens(), 10);
}

#[test]
fn finishing_frees_blocks_at_once() {
    let mut s = scheduler(8, limits(8, 64));
    s.add_request(RequestId(1), prompt(12, 0), 4).unwrap();
    step(&mut s);
    assert!(s.kv().usage() > 0.0);
    s.finish(RequestId(1));
    assert_eq!(s.kv().usage(), 0.0);
}

/// A seeded xorshift generator: the liveness property's random mixes, reproducible by seed.
struct Mix(u64);

impl Mix {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo + 1) as u64) as usize
    }

    /// A length near one of the limits (±1 around it, clamped to `1..=max`), or uniform.
    fn length(&mut self, boundaries: &[usize], max: usize) -> usize {
        let len = match self.range(0, 3) {
            0 => self.range(1, max),
            _ => {
                let b = boundaries[self.range(0, boundaries.len() - 1)] as isize;
                (b + self.range(0, 2) as isize - 1).max(1) as usize
            }
        };
        len.clamp(1, max)
    }
}

/// Liveness: under any engine configuration start-up accepts (a cache holding at least one
/// sequence of the maximum model length; without chunked prefill, a step budget at least that
/// long), every mix of admissible requests finishes — each step schedules tokens or preempts,
/// and the whole mix is done within a bounded number of steps. Prompt lengths sit at every
/// boundary: the step budget, the block size, the maximum model length, the cache capacity.
#[test]
fn every_admissible_mix_finishes_within_a_bounded_number_of_steps() {
    const MIXES: u64 = 1000;
    let (mut run, mut refused, mut seed) = (0, 0, 0u64);
    while run < MIXES {
        seed += 1;
        let mut rng = Mix(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let block_size = [1, 2, 4, 8, 16][rng.range(0, 4)];
        let max_model_len = rng.range(2, 64);
        let chunked = rng.range(0, 1) == 1;
        // Any configuration; those start-up refuses are skipped (and counted): the property
        // is that the ones it accepts never stall.
        let budget = rng.range(1, 80);
        let min_blocks = max_model_len.div_ceil(block_size);
        let num_blocks = rng.range(1, 3 * min_blocks);
        let limits = SchedulerLimits {
            max_num_seqs: rng.range(1, 8),
            max_num_batched_tokens: budget,
            enable_chunked_prefill: chunked,
            max_model_len,
        };
        if limits.check_servable(num_blocks, block_size).is_err() {
            refused += 1;
            continue;
        }
        let mut s = Scheduler::new(
            limits,
            KvCacheManager::new(KvCacheConfig {
                num_blocks,
                block_size,
                enable_prefix_caching: rng.range(0, 1) == 1,
            }),
        );
        let cache_tokens = num_blocks * block_size;
        let boundaries = [budget, block_size, max_model_len, cache_tokens, 1];
        let num_groups = rng.range(1, 12);
        // Some requests come with other choices of their prompt (`n` > 1), forked from them.
        let mut pending: Vec<(u64, usize, usize, usize)> = (0..num_groups)
            .map(|i| {
                let total = rng.length(&boundaries, max_model_len).max(2);
                let max_tokens = rng.range(1, total - 1);
                let choices = [1, 1, 2, 3][rng.range(0, 3)];
                (i as u64, total - max_tokens, max_tokens, choices)
            })
            .collect();
        let num_requests: usize = pending.iter().map(|p| p.3).sum();
        let work: usize = pending.iter().map(|(_, p, m, c)| (p + m) * c).sum();
        let mut generated = std::collections::HashMap::new();
        let mut finished = 0;
        // Each token is computed at most once per preemption, and a request is preempted only
        // by younger ones: a generous bound that an infinite wait still exceeds.
        let bound = 4 * work * (num_requests + 1) + 16;
        let mut steps = 0;
        while finished < num_requests {
            // Requests arrive over the first steps, not all at once.
            if let Some(&(id, prompt_len, max_tokens, choices)) = pending.last()
                && (steps % 3 == 0 || !s.has_unfinished())
            {
                pending.pop();
                let ids: Vec<u32> = (0..prompt_len as u32)
                    .map(|t| t + id as u32 * 100)
                    .collect();
                let first = RequestId(id * 8);
                for c in 0..choices as u64 {
                    let choice = RequestId(id * 8 + c);
                    let added = match c {
                        0 => s.add_request(choice, ids.clone(), max_tokens),
                        _ => s.add_fork(choice, first, ids.clone(), max_tokens),
                    };
                    added
                        .unwrap_or_else(|e| panic!("seed {seed}: admissible request refused: {e}"));
                    generated.insert(choice, (0, max_tokens));
                }
            }
            if !s.has_unfinished() {
                continue;
            }
            let out = s.schedule();
            assert!(
                !out.scheduled.is_empty() || !out.preempted.is_empty(),
                "seed {seed}: step {steps} neither scheduled nor preempted ({:?}, {} blocks of \
                 {block_size}, {} waiting, {} running)",
                s.limits(),
                num_blocks,
                s.num_waiting(),
                s.num_running()
            );
            s.update_from_output(&out);
            let mut sampled = Vec::new();
            for r in out.scheduled.iter().filter(|r| r.samples) {
                sampled.push(r.id);
                sampled.extend(s.fork_children(r.id).iter().map(|f| f.id));
            }
            s.kv()
                .check_invariants()
                .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
            for id in sampled {
                let (done, want) = generated.get_mut(&id).expect("known request");
                *done += 1;
                if *done == *want {
                    s.finish(id);
                    finished += 1;
                } else {
                    s.append_token(id, 7);
                }
            }
            steps += 1;
            assert!(
                steps <= bound,
                "seed {seed}: {steps} steps for {work} tokens of work"
            );
        }
        assert_eq!(
            s.kv().num_free_blocks(),
            num_blocks,
            "seed {seed}: blocks leaked"
        );
        run += 1;
    }
    // Both kinds of configuration were drawn.
    assert!(refused > 100, "{refused} refused of {seed}");
}

#[test]
fn held_choices_are_forked_when_the_prompt_is_computed_or_queued_when_they_cannot_be() {
    // Blocks of 4; a 10-token prompt: two shared blocks and a copied partial one per fork.
    let mut s = scheduler(8, limits(3, 4));
    s.add_request(RequestId(1), prompt(10, 0), 2).unwrap();
    for c in 2..=4 {
        s.add_fork(RequestId(c), RequestId(1), prompt(10, 0), 2)
            .unwrap();
    }
    assert_eq!(s.num_waiting(), 4);
    let out = s.schedule();
    s.update_from_output(&out);
    assert!(
        s.fork_children(RequestId(1)).is_empty(),
        "prompt not computed yet"
    );
    assert_eq!(s.num_waiting(), 3, "the first runs, the others are held");
    for _ in 0..2 {
        let out = s.schedule();
        s.update_from_output(&out);
    }
    let forked = s.fork_children(RequestId(1));
    // Three sequences at most: two choices are forked, the third waits at the queue's front.
    assert_eq!(
        forked.iter().map(|f| f.id).collect::<Vec<_>>(),
        [RequestId(2), RequestId(3)]
    );
    let parent = s.block_table(RequestId(1)).to_vec();
    for f in &forked {
        let table = s.block_table(f.id);
        assert_eq!(table[..2], parent[..2]);
        assert_eq!(f.copy.map(|c| (c.src, c.dst)), Some((parent[2], table[2])));
        assert_eq!(s.request(f.id).unwrap().num_computed_tokens, 10);
    }
    assert_eq!((s.num_running(), s.num_waiting()), (3, 1));
    s.kv().check_invariants().unwrap();
    // Forking happens once.
    assert!(s.fork_children(RequestId(1)).is_empty());
}

#[test]
fn finishing_a_request_queues_the_choices_it_held_and_a_held_choice_can_leave() {
    let mut s = scheduler(16, limits(8, 64));
    s.add_request(RequestId(1), prompt(6, 0), 2).unwrap();
    s.add_fork(RequestId(2), RequestId(1), prompt(6, 0), 2)
        .unwrap();
    s.add_fork(RequestId(3), RequestId(1), prompt(6, 0), 2)
        .unwrap();
    // Another prompt is not held: it is queued as any request.
    s.add_fork(RequestId(4), RequestId(1), prompt(6, 50), 2)
        .unwrap();
    assert_eq!(s.num_waiting(), 4);
    s.finish(RequestId(3));
    assert_eq!(s.num_waiting(), 3);
    s.finish(RequestId(1));
    assert_eq!(s.num_waiting(), 2);
    let out = s.schedule();
    let ids: Vec<_> = out.scheduled.iter().map(|r| r.id).collect();
    assert_eq!(
        ids,
        [RequestId(2), RequestId(4)],
        "the held choice now computes the prompt"
    );
}

#[test]
fn a_prompt_that_could_never_fit_a_step_is_refused_without_chunked_prefill() {
    let mut s = scheduler(
        64,
        SchedulerLimits {
            enable_chunked_prefill: false,
            ..limits(8, 16)
        },
    );
    let err = s.add_request(RequestId(1), prompt(12, 0), 5).unwrap_err();
    assert!(matches!(
        err,
        AdmissionError::PromptOverStepBudget {
            tokens: 17,
            max_num_batched_tokens: 16
        }
    ));
    s.add_request(RequestId(2), prompt(12, 0), 4).unwrap();
}
