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
