//! Per-sequence output bookkeeping: tokens, logprobs, incremental text, stop conditions.
//!
//! Kept apart from scheduling so every path (one request, a batch, a stream) finishes sequences
//! by the same rules: eos ids unless `ignore_eos`, `stop_token_ids`, stop strings (the text is cut
//! before the stop string), `max_tokens`, and the context length.

use moeserve_core::SamplingParams;
use moeserve_text::tokenizer::{IncrementalDecoder, SpecialTokens, StopChecker, Tokenizer};

use crate::Result;
use crate::request::{FinishReason, GenerateOutput, RequestTimings};
use crate::sampler::SampleOutput;

/// The growing output of one sequence.
pub struct SequenceOutput {
    prompt_ids: Vec<u32>,
    token_ids: Vec<u32>,
    logprobs: Vec<f32>,
    top_logprobs: Vec<Vec<(u32, f32)>>,
    decoder: Option<IncrementalDecoder>,
    stop: StopChecker,
    /// Token ids that end the sequence (model eos ids unless ignored, plus `stop_token_ids`).
    stop_token_ids: Vec<u32>,
    max_tokens: usize,
    finish_reason: Option<FinishReason>,
}

/// What one new token added.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TokenUpdate {
    /// Text that became final with this token (may be empty).
    pub text: String,
    pub finished: Option<FinishReason>,
    /// `[layer][k]`: the experts of the forward that produced it, when asked for.
    pub routed_experts: Option<Vec<Vec<u32>>>,
    /// With the first token, when asked for: the prompt's positions but the last,
    /// `[position][layer][k]`.
    pub prompt_routed_experts: Option<Vec<Vec<Vec<u32>>>>,
}

/// What a sequence needs to know about the model to finish correctly.
pub struct OutputContext<'a> {
    pub tokenizer: Option<&'a Tokenizer>,
    pub eos_token_ids: &'a [u32],
    /// Room left in the context after the prompt.
    pub max_new_tokens: usize,
}

impl SequenceOutput {
    pub fn new(
        prompt_ids: Vec<u32>,
        params: &SamplingParams,
        ctx: &OutputContext<'_>,
    ) -> Result<Self> {
        let decoder = match ctx.tokenizer {
            Some(t) => Some(IncrementalDecoder::after_prompt(
                t.clone(),
                &prompt_ids,
                SpecialTokens::Skip,
            )?),
            None => None,
        };
        let mut stop_token_ids = params.stop_token_ids.clone();
        if !params.ignore_eos {
            stop_token_ids.extend_from_slice(ctx.eos_token_ids);
        }
        Ok(SequenceOutput {
            prompt_ids,
            token_ids: Vec::new(),
            logprobs: Vec::new(),
            top_logprobs: Vec::new(),
            decoder,
            stop: StopChecker::new(&params.stop),
            stop_token_ids,
            max_tokens: params.max_tokens.min(ctx.max_new_tokens),
            finish_reason: None,
        })
    }

    pub fn prompt_ids(&self) -> &[u32] {
        &self.prompt_ids
    }

    pub fn token_ids(&self) -> &[u32] {
        &self.token_ids
    }

    pub fn finish_reason(&self) -> Option<FinishReason> {
        self.finish_reason
    }

    /// Records a sampled token and checks every stop condition.
    pub fn push(&mut self, sample: SampleOutput) -> Result<TokenUpdate> {
        self.push_ending(sample, false)
    }

    /// [`SequenceOutput::push`] for a token after which the sequence must end (its grammar is
    /// complete): its text is kept, and the sequence stops.
    pub fn push_ending(&mut self, sample: SampleOutput, ends: bool) -> Result<TokenUpdate> {
        let token = sample.token_id;
        self.token_ids.push(token);
        self.logprobs.push(sample.logprob);
        self.top_logprobs.push(sample.top_logprobs);
        let stop_token = self.stop_token_ids.contains(&token);
        let mut update = TokenUpdate::default();
        // A stop token ends the text without appearing in it.
        if let Some(decoder) = self.decoder.as_mut() {
            let mut new_text = match stop_token {
                true => String::new(),
                false => decoder.push(token)?.unwrap_or_default(),
            };
            if stop_token || ends || self.token_ids.len() >= self.max_tokens {
                new_text.push_str(&decoder.flush()?.unwrap_or_default());
            }
            let stopped = self.stop.push(&new_text);
            update.text = stopped.emit;
            if stopped.matched_stop.is_some() {
                update.finished = Some(FinishReason::Stop);
            }
        }
        if stop_token || ends {
            update.finished = Some(FinishReason::Stop);
        }
        if update.finished.is_none() && self.token_ids.len() >= self.max_tokens {
            update.finished = Some(FinishReason::Length);
        }
        if update.finished.is_some() && self.stop.matched_stop().is_none() {
            update.text.push_str(&self.stop.finish());
        }
        self.finish_reason = update.finished;
        Ok(update)
    }

    /// The final result; `text` is everything emitted (cut before a stop string).
    pub fn into_output(
        self,
        finish_reason: FinishReason,
        timings: RequestTimings,
    ) -> GenerateOutput {
        GenerateOutput {
            text: self.stop.text().to_string(),
            prompt_ids: self.prompt_ids,
            token_ids: self.token_ids,
            logprobs: self.logprobs,
            top_logprobs: self.top_logprobs,
            finish_reason,
            timings,
            moe: None,
            routed_experts: None,
        }
    }
}
