//! What one scheduling step decided.

use moeserve_core::RequestId;

/// One request's share of a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScheduledRequest {
    pub id: RequestId,
    /// Tokens already in the cache before this step.
    pub num_computed_tokens: usize,
    /// Tokens this step computes (1 for a decode, up to a whole prompt for a prefill).
    pub num_new_tokens: usize,
    /// Whether this step reaches the request's last known token, so its logits are sampled
    /// (false for a prompt chunk that leaves more of the prompt for later steps).
    pub samples: bool,
}

/// The outcome of [`super::Scheduler::schedule`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SchedulerOutput {
    /// Running requests first (in admission order), then newly admitted ones.
    pub scheduled: Vec<ScheduledRequest>,
    /// Requests whose cache was dropped this step; they wait to be recomputed.
    pub preempted: Vec<RequestId>,
}

impl SchedulerOutput {
    pub fn num_batched_tokens(&self) -> usize {
        self.scheduled.iter().map(|s| s.num_new_tokens).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.scheduled.is_empty()
    }
}
