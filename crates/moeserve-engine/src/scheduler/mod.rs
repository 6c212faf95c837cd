//! Continuous batching, one step at a time (after vLLM v1's scheduler, at nano-vllm's size).
//!
//! Each step: running requests first, in admission order, get the tokens they still need
//! (decodes get one; a prompt being prefilled in chunks gets the next chunk) within the token
//! budget; when the cache has no block for one, the most recently admitted running request is
//! preempted (its blocks freed, to be recomputed later) until it fits. Then waiting requests are
//! admitted first-come first-served, reusing cached prefix blocks, while sequences, budget and
//! blocks last. A request that can never fit is refused when it is added.
//!
//! The other choices of an `n` > 1 request are *held* beside the first: in neither queue until
//! the first has computed the prompt, then forked from its blocks ([`Scheduler::fork_children`])
//! and running at once; a choice that cannot be forked then (no free block for its copy of the
//! partial last block, or no sequence left under `--max-num-seqs`) waits as any request does.

mod output;
mod request;

use std::collections::{HashMap, VecDeque};

use moeserve_core::{BlockId, RequestId, SchedulerConfig};

pub use output::{ScheduledRequest, SchedulerOutput};
pub use request::SchedRequest;

use crate::kv_cache::{AllocationRequest, BlockCopy, KvCacheManager};

/// Why a request was refused at admission.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmissionError {
    #[error(
        "this model's maximum context length is {max_model_len} tokens, but the request has \
         {prompt_len} prompt tokens and asks for {max_tokens} more ({} in all)",
        prompt_len.saturating_add(*max_tokens)
    )]
    ContextTooLong {
        max_model_len: usize,
        prompt_len: usize,
        max_tokens: usize,
    },
    /// Known from the prompt's length in bytes, before tokenizing it.
    #[error(
        "this model's maximum context length is {max_model_len} tokens, but the prompt is \
         {bytes} bytes of text, which this tokenizer makes into at least {fewest_tokens} tokens"
    )]
    PromptTextTooLong {
        max_model_len: usize,
        bytes: usize,
        fewest_tokens: usize,
    },
    #[error(
        "the request needs {needed} KV blocks for {tokens} tokens but the cache has only {available}"
    )]
    CacheTooSmall {
        tokens: usize,
        needed: usize,
        available: usize,
    },
    #[error(
        "the request may need {tokens} tokens in one step (its prompt and max_tokens, as after \
         a preemption), but without chunked prefill a step takes at most \
         {max_num_batched_tokens} (--max-num-batched-tokens)"
    )]
    PromptOverStepBudget {
        tokens: usize,
        max_num_batched_tokens: usize,
    },
    #[error("request {0} is already known")]
    DuplicateId(RequestId),
}

/// Scheduler settings with the model's limits resolved.
#[derive(Clone, Debug)]
pub struct SchedulerLimits {
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub enable_chunked_prefill: bool,
    pub max_model_len: usize,
}

impl SchedulerLimits {
    pub fn new(config: &SchedulerConfig, model_context_len: usize) -> Self {
        SchedulerLimits {
            max_num_seqs: config.max_num_seqs,
            max_num_batched_tokens: config.max_num_batched_tokens,
            enable_chunked_prefill: config.enable_chunked_prefill,
            max_model_len: config
                .max_model_len
                .unwrap_or(model_context_len)
                .min(model_context_len),
        }
    }
}

/// Why a configuration could leave an admissible request waiting forever.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unservable {
    /// One sequence of the maximum model length does not fit the whole cache.
    CacheShorterThanMaxLen { cache_tokens: usize },
    /// Without chunked prefill, the longest prompt does not fit one step.
    StepBudgetShorterThanMaxLen { budget: usize },
}

impl SchedulerLimits {
    /// Whether every request admission accepts can run under these limits and a cache of
    /// `num_blocks` blocks of `block_size`: the precondition of the scheduler's liveness
    /// (every admitted request finishes, see the property test), checked at start-up.
    pub fn check_servable(&self, num_blocks: usize, block_size: usize) -> Result<(), Unservable> {
        let cache_tokens = num_blocks * block_size;
        if cache_tokens < self.max_model_len {
            return Err(Unservable::CacheShorterThanMaxLen { cache_tokens });
        }
        if !self.enable_chunked_prefill && self.max_num_batched_tokens < self.max_model_len {
            return Err(Unservable::StepBudgetShorterThanMaxLen {
                budget: self.max_num_batched_tokens,
            });
        }
        Ok(())
    }
}

/// Waiting and running requests and the KV blocks they hold.
pub struct Scheduler {
    limits: SchedulerLimits,
    kv: KvCacheManager,
    requests: HashMap<RequestId, SchedRequest>,
    /// Front is served first; preempted requests go back to the front.
    waiting: VecDeque<RequestId>,
    /// In admission order; the back is preempted first.
    running: Vec<RequestId>,
    num_preemptions: u64,
}

/// A choice forked from its first sibling's prompt: it runs from the next step, its first token
/// sampled from the sibling's logits of this one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Forked {
    pub id: RequestId,
    /// The partial last block to copy into the choice's own before the next step.
    pub copy: Option<BlockCopy>,
}

impl Scheduler {
    pub fn new(limits: SchedulerLimits, kv: KvCacheManager) -> Self {
        Scheduler {
            limits,
            kv,
            requests: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            num_preemptions: 0,
        }
    }

    /// Queues a request, or refuses it when it could never be served.
    pub fn add_request(
        &mut self,
        id: RequestId,
        prompt_ids: Vec<u32>,
        max_tokens: usize,
    ) -> Result<(), AdmissionError> {
        self.check_admissible(id, prompt_ids.len(), max_tokens)?;
        self.requests
            .insert(id, SchedRequest::new(id, prompt_ids, max_tokens));
        self.waiting.push_back(id);
        Ok(())
    }

    /// Adds another choice of `parent`'s prompt, held until `parent` has computed it and then
    /// forked from its blocks; queued as an ordinary request when `parent` is not waiting for
    /// its prompt (unknown, already generating) or `prompt_ids` is not its prompt.
    pub fn add_fork(
        &mut self,
        id: RequestId,
        parent: RequestId,
        prompt_ids: Vec<u32>,
        max_tokens: usize,
    ) -> Result<(), AdmissionError> {
        let holdable = self.requests.get(&parent).is_some_and(|p| {
            p.forked_from.is_none() && p.num_output_tokens() == 0 && p.token_ids == prompt_ids
        });
        if !holdable {
            return self.add_request(id, prompt_ids, max_tokens);
        }
        self.check_admissible(id, prompt_ids.len(), max_tokens)?;
        let mut child = SchedRequest::new(id, prompt_ids, max_tokens);
        child.forked_from = Some(parent);
        self.requests.insert(id, child);
        self.requests
            .get_mut(&parent)
            .expect("checked above")
            .forks
            .push(id);
        Ok(())
    }

    fn check_admissible(
        &self,
        id: RequestId,
        prompt_len: usize,
        max_tokens: usize,
    ) -> Result<(), AdmissionError> {
        if self.requests.contains_key(&id) {
            return Err(AdmissionError::DuplicateId(id));
        }
        let max_model_len = self.limits.max_model_len;
        // Saturating: a client's `max_tokens` may be as large as usize::MAX.
        if prompt_len.saturating_add(max_tokens) > max_model_len {
            return Err(AdmissionError::ContextTooLong {
                max_model_len,
                prompt_len,
                max_tokens,
            });
        }
        // Without chunked prefill a prompt (and, after a preemption, the prompt with its
        // output) must fit one step, or it would wait at the head of the queue forever.
        let budget = self.limits.max_num_batched_tokens;
        if !self.limits.enable_chunked_prefill && prompt_len + max_tokens > budget {
            return Err(AdmissionError::PromptOverStepBudget {
                tokens: prompt_len + max_tokens,
                max_num_batched_tokens: budget,
            });
        }
        let tokens = prompt_len + max_tokens;
        if !self.kv.can_ever_fit(tokens) {
            return Err(AdmissionError::CacheTooSmall {
                tokens,
                needed: self.kv.blocks_needed(tokens),
                available: self.kv.num_blocks(),
            });
        }
        Ok(())
    }

    /// Whether choices wait to be forked from `id` (they sample from its logits row).
    pub fn has_forks(&self, id: RequestId) -> bool {
        self.requests.get(&id).is_some_and(|r| !r.forks.is_empty())
    }

    /// Forks the choices held for `parent` once its prompt is computed (call after
    /// [`Self::update_from_output`], before its first token is appended): each shares its
    /// prompt blocks and runs from the next step. Those that cannot be forked now wait at the
    /// front of the queue instead, in order. Empty when `parent` holds none or is not there.
    pub fn fork_children(&mut self, parent: RequestId) -> Vec<Forked> {
        let Some(req) = self.requests.get_mut(&parent) else {
            return Vec::new();
        };
        let ready = req.num_output_tokens() == 0 && req.num_uncomputed_tokens() == 0;
        if req.forks.is_empty() || !ready {
            return Vec::new();
        }
        let children = std::mem::take(&mut req.forks);
        let num_tokens = req.num_computed_tokens;
        let mut forked = Vec::with_capacity(children.len());
        let mut unforked = Vec::new();
        for child in children {
            let copy = match self.running.len() < self.limits.max_num_seqs {
                true => self.kv.fork(parent, child, num_tokens),
                false => None,
            };
            let req = self
                .requests
                .get_mut(&child)
                .expect("held request is known");
            req.forked_from = None;
            match copy {
                Some(copy) => {
                    req.num_computed_tokens = num_tokens;
                    self.running.push(child);
                    forked.push(Forked { id: child, copy });
                }
                None => unforked.push(child),
            }
        }
        for child in unforked.into_iter().rev() {
            self.waiting.push_front(child);
        }
        forked
    }

    /// Decides the next step.
    pub fn schedule(&mut self) -> SchedulerOutput {
        let mut out = SchedulerOutput::default();
        let mut budget = self.limits.max_num_batched_tokens;
        self.schedule_running(&mut budget, &mut out);
        if out.preempted.is_empty() {
            self.schedule_waiting(&mut budget, &mut out);
        }
        out
    }

    fn schedule_running(&mut self, budget: &mut usize, out: &mut SchedulerOutput) {
        let mut index = 0;
        while index < self.running.len() && *budget > 0 {
            let id = self.running[index];
            let req = &self.requests[&id];
            let num_new = req.num_uncomputed_tokens().min(*budget);
            if num_new == 0 {
                index += 1;
                continue;
            }
            let allocation = AllocationRequest {
                token_ids: &req.token_ids,
                num_computed_tokens: req.num_computed_tokens,
                num_new_tokens: num_new,
                new_computed_blocks: &[],
            };
            if self.kv.allocate_slots(id, allocation).is_some() {
                out.scheduled.push(self.scheduled(id, num_new));
                *budget -= num_new;
                index += 1;
                continue;
            }
            // No room: preempt from the back (the most recently admitted) and retry this one.
            let victim = self
                .running
                .pop()
                .expect("running holds at least the current request");
            self.preempt(victim);
            out.preempted.push(victim);
            if victim == id {
                break;
            }
        }
    }

    fn schedule_waiting(&mut self, budget: &mut usize, out: &mut SchedulerOutput) {
        while let Some(&id) = self.waiting.front() {
            if *budget == 0 || self.running.len() >= self.limits.max_num_seqs {
                break;
            }
            let req = &self.requests[&id];
            let (cached_blocks, num_cached) = match req.use_prefix_cache {
                true => self.kv.computed_blocks(&req.token_ids),
                false => (Vec::new(), 0),
            };
            let remaining = req.token_ids.len() - num_cached;
            if !self.limits.enable_chunked_prefill && remaining > *budget {
                break;
            }
            let num_new = remaining.min(*budget);
            let allocation = AllocationRequest {
                token_ids: &req.token_ids,
                num_computed_tokens: num_cached,
                num_new_tokens: num_new,
                new_computed_blocks: &cached_blocks,
            };
            if self.kv.allocate_slots(id, allocation).is_none() {
                break;
            }
            self.waiting.pop_front();
            self.requests
                .get_mut(&id)
                .expect("waiting request is known")
                .num_computed_tokens = num_cached;
            self.running.push(id);
            out.scheduled.push(self.scheduled(id, num_new));
            *budget -= num_new;
        }
    }

    fn scheduled(&self, id: RequestId, num_new_tokens: usize) -> ScheduledRequest {
        let req = &self.requests[&id];
        ScheduledRequest {
            id,
            num_computed_tokens: req.num_computed_tokens,
            num_new_tokens,
            samples: req.num_computed_tokens + num_new_tokens == req.token_ids.len(),
        }
    }

    fn preempt(&mut self, id: RequestId) {
        self.kv.free(id);
        let req = self
            .requests
            .get_mut(&id)
            .expect("preempted request is known");
        req.num_computed_tokens = 0;
        req.num_preemptions += 1;
        self.num_preemptions += 1;
        self.waiting.push_front(id);
    }

    /// Marks the step's tokens as computed (their keys and values are now in the cache).
    pub fn update_from_output(&mut self, out: &SchedulerOutput) {
        for s in &out.scheduled {
            if let Some(req) = self.requests.get_mut(&s.id) {
                req.num_computed_tokens = s.num_computed_tokens + s.num_new_tokens;
            }
        }
    }

    /// Keeps the request's prompt out of the prefix cache's hits (it is computed in full).
    pub fn bypass_prefix_cache(&mut self, id: RequestId) {
        if let Some(req) = self.requests.get_mut(&id) {
            req.use_prefix_cache = false;
        }
    }

    /// Appends a sampled token to a running request.
    pub fn append_token(&mut self, id: RequestId, token: u32) {
        if let Some(req) = self.requests.get_mut(&id) {
            req.token_ids.push(token);
        }
    }

    /// Removes a request (finished or cancelled) and frees its blocks at once. The choices
    /// it held for forking wait as ordinary requests from then on.
    pub fn finish(&mut self, id: RequestId) -> Option<SchedRequest> {
        let mut req = self.requests.remove(&id)?;
        self.running.retain(|r| *r != id);
        self.waiting.retain(|r| *r != id);
        self.kv.free(id);
        if let Some(parent) = req.forked_from.and_then(|p| self.requests.get_mut(&p)) {
            parent.forks.retain(|c| *c != id);
        }
        let held = std::mem::take(&mut req.forks);
        for child in held.into_iter().rev() {
            if let Some(c) = self.requests.get_mut(&child) {
                c.forked_from = None;
                self.waiting.push_front(child);
            }
        }
        Some(req)
    }

    pub fn request(&self, id: RequestId) -> Option<&SchedRequest> {
        self.requests.get(&id)
    }

    pub fn block_table(&self, id: RequestId) -> &[BlockId] {
        self.kv.block_table(id)
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Requests not running: queued, and held to be forked.
    pub fn num_waiting(&self) -> usize {
        let held: usize = self.requests.values().map(|r| r.forks.len()).sum();
        self.waiting.len() + held
    }

    pub fn has_unfinished(&self) -> bool {
        !self.requests.is_empty()
    }

    pub fn num_preemptions(&self) -> u64 {
        self.num_preemptions
    }

    pub fn kv(&self) -> &KvCacheManager {
        &self.kv
    }

    pub fn limits(&self) -> &SchedulerLimits {
        &self.limits
    }
}

#[cfg(test)]
mod tests;
