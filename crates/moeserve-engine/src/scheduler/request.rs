//! A request as the scheduler sees it: its tokens and how many of them are in the KV cache.

use moeserve_core::RequestId;

/// Scheduling state of one request. All tokens (prompt, then output) live in `token_ids`;
/// `num_computed_tokens` of them have keys and values in the cache. There is no prefill or
/// decode phase: each step computes some of the rest, as vLLM v1 does.
#[derive(Clone, Debug)]
pub struct SchedRequest {
    pub id: RequestId,
    pub token_ids: Vec<u32>,
    pub num_prompt_tokens: usize,
    pub num_computed_tokens: usize,
    /// Largest number of tokens the request may reach (prompt + max_tokens).
    pub max_total_tokens: usize,
    /// Times this request was preempted (its cache dropped, to be recomputed).
    pub num_preemptions: usize,
    /// Whether its prompt may be taken from the prefix cache (off when the request wants what
    /// only computing the prompt itself gives, e.g. the prompt's routed experts).
    pub use_prefix_cache: bool,
    /// Choices of the same prompt held back until this request's prompt is computed, then
    /// forked from its blocks (`n` > 1); in the order they were added.
    pub forks: Vec<RequestId>,
    /// The request this one waits to be forked from, while it is held.
    pub forked_from: Option<RequestId>,
}

impl SchedRequest {
    pub fn new(id: RequestId, prompt_ids: Vec<u32>, max_tokens: usize) -> Self {
        SchedRequest {
            id,
            num_prompt_tokens: prompt_ids.len(),
            max_total_tokens: prompt_ids.len() + max_tokens,
            token_ids: prompt_ids,
            num_computed_tokens: 0,
            num_preemptions: 0,
            use_prefix_cache: true,
            forks: Vec::new(),
            forked_from: None,
        }
    }

    /// Tokens not yet in the cache.
    pub fn num_uncomputed_tokens(&self) -> usize {
        self.token_ids.len() - self.num_computed_tokens
    }

    pub fn num_output_tokens(&self) -> usize {
        self.token_ids.len() - self.num_prompt_tokens
    }
}
