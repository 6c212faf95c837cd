//! Per-request sampling of the next token from one row of logits, with vLLM's semantics.
//!
//! Order, as in vLLM's v1 sampler:
//! 1. logprobs come from the raw logits (log-softmax of the model output, before anything else);
//! 2. `logit_bias` added; repetition penalty (prompt and output tokens; positive logits divided, negative
//!    multiplied, as HF and vLLM), then frequency and presence penalties (output tokens only);
//! 3. temperature below 1e-5 is greedy: argmax, ties to the lowest id;
//! 4. otherwise temperature, min-p, top-k (ties at the k-th value kept), top-p (the smallest
//!    most-likely set whose mass reaches top_p), then a draw from the request's own ChaCha8 rng.
//!
//! Scratch buffers live in [`SamplerState`], so a call allocates nothing vocabulary-sized.

use std::collections::{HashMap, HashSet};

use moeserve_core::SamplingParams;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Temperatures below this mean greedy decoding (vLLM's `_SAMPLING_EPS`).
pub const GREEDY_TEMPERATURE_EPS: f32 = 1e-5;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplerError {
    /// The model produced a row no token can be drawn from (NaN, +inf, all -inf or empty).
    #[error("cannot sample from logits: {message}")]
    InvalidLogits { message: String },
    #[error("token id {token_id} in the {origin} is outside the vocabulary of {vocab_size} logits")]
    TokenOutOfRange {
        token_id: u32,
        origin: &'static str,
        vocab_size: usize,
    },
}

/// Whether sampling under `params` is the argmax of the raw logits and nothing else: greedy,
/// no logit bias, no penalties, no top logprobs. A backend may then reduce the row to that
/// token and its logprob where the logits are (the GPU) and copy back two numbers.
pub fn needs_only_greedy(params: &SamplingParams) -> bool {
    let repetition = params.repetition_penalty;
    let penalised = (repetition.is_finite() && repetition > 0.0 && repetition != 1.0)
        || params.frequency_penalty != 0.0
        || params.presence_penalty != 0.0;
    params.temperature < GREEDY_TEMPERATURE_EPS
        && params.logit_bias.is_empty()
        && !penalised
        && params.logprobs.unwrap_or(0) == 0
}

/// The chosen token with its log-probability under the raw model distribution.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleOutput {
    pub token_id: u32,
    pub logprob: f32,
    /// `params.logprobs` most likely tokens, most likely first (ties: lower id first); empty when
    /// logprobs were not requested.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// One request's sampling state: its random stream, token history and scratch buffers.
#[derive(Debug, Clone)]
pub struct SamplerState {
    seed: u64,
    rng: ChaCha8Rng,
    history: TokenHistory,
    /// Logits after penalties; then, when sampling, unnormalised probabilities.
    work: Vec<f32>,
    /// Token ids still in the running, for top-k / top-p.
    candidates: Vec<u32>,
}

impl SamplerState {
    /// Seeds the rng from `params.seed`, or from the OS when the request gave none.
    pub fn new(params: &SamplingParams) -> SamplerState {
        let seed = params.seed.unwrap_or_else(rand::random);
        SamplerState {
            seed,
            rng: ChaCha8Rng::seed_from_u64(seed),
            history: TokenHistory::default(),
            work: Vec::new(),
            candidates: Vec::new(),
        }
    }

    /// The seed actually used (reported so a random request can be replayed).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Chooses the next token. `prompt_ids` and `output_ids` are the request's tokens so far;
    /// between calls they may only grow (a shorter history, e.g. after a reset, is recounted).
    pub fn sample(
        &mut self,
        logits: &[f32],
        params: &SamplingParams,
        prompt_ids: &[u32],
        output_ids: &[u32],
    ) -> Result<SampleOutput, SamplerError> {
        let raw = LogSoftmax::of(logits)?;
        self.work.clear();
        self.work.extend_from_slice(logits);
        for &(id, bias) in &params.logit_bias {
            // In range: the engine checks the ids against the vocabulary at admission.
            if let Some(logit) = self.work.get_mut(id as usize) {
                *logit += bias;
            }
        }
        self.apply_penalties(params, prompt_ids, output_ids)?;
        let token_id = if params.temperature >= GREEDY_TEMPERATURE_EPS {
            self.draw(params)
        } else {
            argmax(&self.work)
        };
        let top_logprobs = match params.logprobs {
            Some(k) => top_logprobs(logits, k, &raw),
            None => Vec::new(),
        };
        Ok(SampleOutput {
            token_id,
            logprob: raw.logprob(logits[token_id as usize]),
            top_logprobs,
        })
    }

    fn apply_penalties(
        &mut self,
        params: &SamplingParams,
        prompt_ids: &[u32],
        output_ids: &[u32],
    ) -> Result<(), SamplerError> {
        let repetition = params.repetition_penalty;
        let use_repetition = repetition.is_finite() && repetition > 0.0 && repetition != 1.0;
        let use_additive = params.frequency_penalty != 0.0 || params.presence_penalty != 0.0;
        if !use_repetition && !use_additive {
            return Ok(());
        }
        self.history
            .update(prompt_ids, output_ids, self.work.len())?;
        if use_repetition {
            for &id in &self.history.seen {
                let logit = &mut self.work[id as usize];
                // Dividing by a tiny penalty may overflow; +inf would break the softmax.
                *logit = if *logit > 0.0 {
                    (*logit / repetition).min(f32::MAX)
                } else {
                    *logit * repetition
                };
            }
        }
        if use_additive {
            for (&id, &count) in &self.history.output_counts {
                self.work[id as usize] -=
                    params.frequency_penalty * count as f32 + params.presence_penalty;
            }
        }
        Ok(())
    }

    /// Random draw from `work` (processed logits) after temperature, min-p, top-k and top-p.
    fn draw(&mut self, params: &SamplingParams) -> u32 {
        let max = self.work.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let temperature = params.temperature;
        // Unnormalised probabilities: the most likely token gets exactly 1.
        for w in &mut self.work {
            // Masked tokens stay impossible even for an infinite temperature (-inf / inf is NaN).
            *w = if *w == f32::NEG_INFINITY {
                0.0
            } else {
                ((*w - max) / temperature).exp()
            };
        }
        if params.min_p > 0.0 {
            let threshold = params.min_p.min(1.0);
            for w in &mut self.work {
                if *w < threshold {
                    *w = 0.0;
                }
            }
        }
        let work = &self.work;
        if params.top_k == 0 && params.top_p >= 1.0 {
            let total: f64 = work.iter().map(|&w| f64::from(w)).sum();
            let target = self.rng.random::<f64>() * total;
            return pick(
                work,
                (0..work.len() as u32).filter(|&id| work[id as usize] > 0.0),
                target,
            );
        }
        let more_likely = |a: &u32, b: &u32| {
            work[*b as usize]
                .total_cmp(&work[*a as usize])
                .then(a.cmp(b))
        };
        let candidates = &mut self.candidates;
        candidates.clear();
        candidates.extend((0..work.len() as u32).filter(|&id| work[id as usize] > 0.0));
        let k = params.top_k;
        if k > 0 && k < candidates.len() {
            candidates.select_nth_unstable_by(k - 1, more_likely);
            let kth = work[candidates[k - 1] as usize];
            let mut kept = k;
            for i in k..candidates.len() {
                if work[candidates[i] as usize] >= kth {
                    candidates.swap(kept, i);
                    kept += 1;
                }
            }
            candidates.truncate(kept);
        }
        if params.top_p < 1.0 {
            candidates.sort_unstable_by(more_likely);
            let total: f64 = candidates
                .iter()
                .map(|&id| f64::from(work[id as usize]))
                .sum();
            let limit = f64::from(params.top_p) * total;
            let mut mass_before = 0.0;
            let mut kept = 0;
            for &id in candidates.iter() {
                if kept > 0 && mass_before >= limit {
                    break;
                }
                mass_before += f64::from(work[id as usize]);
                kept += 1;
            }
            candidates.truncate(kept);
        }
        let total: f64 = candidates
            .iter()
            .map(|&id| f64::from(work[id as usize]))
            .sum();
        let target = self.rng.random::<f64>() * total;
        pick(work, candidates.iter().copied(), target)
    }
}

/// The token where the running mass of `ids` first exceeds `target` (the last one if rounding
/// leaves the target unreached).
fn pick(weights: &[f32], ids: impl Iterator<Item = u32>, target: f64) -> u32 {
    let mut mass = 0.0;
    let mut last = 0;
    for id in ids {
        mass += f64::from(weights[id as usize]);
        last = id;
        if target < mass {
            return id;
        }
    }
    last
}

/// Index of the largest value, ties to the lowest index (as torch.argmax).
fn argmax(values: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] {
            best = i;
        }
    }
    best as u32
}

/// The raw distribution's normaliser: logprob(x) = x - log_sum_exp.
struct LogSoftmax {
    log_sum_exp: f32,
}

impl LogSoftmax {
    fn of(logits: &[f32]) -> Result<LogSoftmax, SamplerError> {
        let invalid = |message: String| Err(SamplerError::InvalidLogits { message });
        if logits.is_empty() || logits.len() > u32::MAX as usize {
            return invalid(format!("row has {} entries", logits.len()));
        }
        let mut max = f32::NEG_INFINITY;
        for (id, &x) in logits.iter().enumerate() {
            if x.is_nan() || x == f32::INFINITY {
                return invalid(format!("logit of token {id} is {x}"));
            }
            max = max.max(x);
        }
        if max == f32::NEG_INFINITY {
            return invalid(format!("all {} logits are -inf", logits.len()));
        }
        Ok(LogSoftmax {
            log_sum_exp: moeserve_backend::cpu::log_sum_exp(logits),
        })
    }

    fn logprob(&self, logit: f32) -> f32 {
        logit - self.log_sum_exp
    }
}

/// The `k` largest raw logits as logprobs, largest first, ties to the lower id.
fn top_logprobs(logits: &[f32], k: usize, raw: &LogSoftmax) -> Vec<(u32, f32)> {
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    if k == 0 {
        return top;
    }
    for (id, &x) in logits.iter().enumerate() {
        if top.len() == k && x <= top[k - 1].1 {
            continue;
        }
        let at = top.partition_point(|&(_, v)| v >= x);
        top.insert(at, (id as u32, x));
        top.truncate(k);
    }
    top.into_iter()
        .map(|(id, x)| (id, raw.logprob(x)))
        .collect()
}

/// Tokens seen so far, kept incrementally so penalties cost O(new tokens) per step.
#[derive(Debug, Clone, Default)]
struct TokenHistory {
    prompt_len: usize,
    output_len: usize,
    /// Prompt and output tokens (repetition penalty).
    seen: HashSet<u32>,
    /// Occurrences of each output token (frequency and presence penalties).
    output_counts: HashMap<u32, u32>,
}

impl TokenHistory {
    fn update(
        &mut self,
        prompt: &[u32],
        output: &[u32],
        vocab_size: usize,
    ) -> Result<(), SamplerError> {
        if prompt.len() < self.prompt_len || output.len() < self.output_len {
            *self = TokenHistory::default();
        }
        let check = |id: u32, origin| {
            if (id as usize) < vocab_size {
                Ok(id)
            } else {
                Err(SamplerError::TokenOutOfRange {
                    token_id: id,
                    origin,
                    vocab_size,
                })
            }
        };
        for &id in &prompt[self.prompt_len..] {
            self.seen.insert(check(id, "prompt")?);
        }
        for &id in &output[self.output_len..] {
            self.seen.insert(check(id, "output")?);
            *self.output_counts.entry(id).or_default() += 1;
        }
        self.prompt_len = prompt.len();
        self.output_len = output.len();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_greedy_sampling_may_be_reduced_on_the_device() {
        let greedy = SamplingParams::greedy(8);
        assert!(needs_only_greedy(&greedy));
        // The chosen token's logprob is part of the reduction; top logprobs are not.
        assert!(needs_only_greedy(&SamplingParams {
            logprobs: Some(0),
            ..greedy.clone()
        }));
        for other in [
            SamplingParams::default(),
            SamplingParams {
                logprobs: Some(1),
                ..greedy.clone()
            },
            SamplingParams {
                logit_bias: vec![(3, 1.0)],
                ..greedy.clone()
            },
            SamplingParams {
                repetition_penalty: 1.1,
                ..greedy.clone()
            },
            SamplingParams {
                presence_penalty: 0.5,
                ..greedy.clone()
            },
            SamplingParams {
                frequency_penalty: 0.5,
                ..greedy.clone()
            },
        ] {
            assert!(!needs_only_greedy(&other), "{other:?}");
        }
        // What the device computes is what the sampler computes for such a request.
        let logits = [0.5, 2.0, -1.0, 2.0];
        let out = SamplerState::new(&greedy)
            .sample(&logits, &greedy, &[], &[])
            .unwrap();
        assert_eq!(out.token_id, 1, "ties to the lower id");
        assert!(out.top_logprobs.is_empty());
    }

    fn params(temperature: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            seed: Some(7),
            ..Default::default()
        }
    }

    fn sample(logits: &[f32], p: &SamplingParams) -> SampleOutput {
        SamplerState::new(p)
            .sample(logits, p, &[], &[])
            .expect("valid logits")
    }

    fn sequence(p: &SamplingParams, logits: &[f32], n: usize) -> Vec<u32> {
        let mut state = SamplerState::new(p);
        (0..n)
            .map(|_| state.sample(logits, p, &[], &[]).unwrap().token_id)
            .collect()
    }

    const LOGITS: [f32; 6] = [0.5, 2.0, -1.0, 1.5, 2.0, 0.0];

    #[test]
    fn greedy_is_argmax_with_ties_to_the_lowest_id() {
        assert_eq!(sample(&LOGITS, &params(0.0)).token_id, 1);
        assert_eq!(sample(&[0.0, -3.0, 9.0], &params(1e-6)).token_id, 2);
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_seeds_differ() {
        let flat = [0.0f32; 16];
        let a = sequence(&params(1.0), &flat, 64);
        assert_eq!(a, sequence(&params(1.0), &flat, 64));
        let other = SamplingParams {
            seed: Some(8),
            ..params(1.0)
        };
        assert_ne!(a, sequence(&other, &flat, 64));
        let unseeded = SamplingParams {
            seed: None,
            ..params(1.0)
        };
        assert_ne!(
            SamplerState::new(&unseeded).seed(),
            SamplerState::new(&unseeded).seed()
        );
    }

    #[test]
    fn sampling_frequencies_follow_the_softmax() {
        let logits = [0.0, (2.0f32).ln(), (3.0f32).ln(), f32::NEG_INFINITY];
        let draws = sequence(&params(1.0), &logits, 30_000);
        for (id, expected) in [(0, 1.0 / 6.0), (1, 2.0 / 6.0), (2, 3.0 / 6.0), (3, 0.0)] {
            let share = draws.iter().filter(|&&t| t == id).count() as f64 / draws.len() as f64;
            assert!(
                (share - expected).abs() < 0.015,
                "token {id}: {share} vs {expected}"
            );
        }
    }

    #[test]
    fn masked_tokens_are_never_drawn_even_at_infinite_temperature() {
        let logits = [f32::NEG_INFINITY, 3.0, f32::NEG_INFINITY, -2.0];
        let drawn = sequence(&params(f32::INFINITY), &logits, 200);
        assert!(drawn.iter().all(|&t| t == 1 || t == 3) && drawn.contains(&3));
    }

    #[test]
    fn logit_bias_bans_and_forces_tokens_and_logprobs_stay_raw() {
        let logits = [0.3, 1.2, -0.7, 1.1];
        let banned = SamplingParams {
            logit_bias: vec![(1, -100.0)],
            ..SamplingParams::greedy(1)
        };
        assert!(sequence(&banned, &logits, 5).iter().all(|&t| t == 3));
        let forced = SamplingParams {
            logit_bias: vec![(2, 100.0)],
            ..params(1.0)
        };
        assert!(sequence(&forced, &logits, 200).iter().all(|&t| t == 2));
        let out = SamplerState::new(&forced)
            .sample(&logits, &forced, &[], &[])
            .unwrap();
        let raw = LogSoftmax::of(&logits).unwrap();
        assert_eq!(out.logprob, raw.logprob(-0.7));
    }

    #[test]
    fn top_k_one_and_tiny_top_p_equal_greedy() {
        let logits = [0.3, 1.2, -0.7, 1.1, 0.9];
        let top_k = SamplingParams {
            top_k: 1,
            ..params(1.5)
        };
        assert!(sequence(&top_k, &logits, 50).iter().all(|&t| t == 1));
        let top_p = SamplingParams {
            top_p: 1e-6,
            ..params(1.5)
        };
        assert!(sequence(&top_p, &logits, 50).iter().all(|&t| t == 1));
    }

    #[test]
    fn top_k_and_top_p_keep_only_the_most_likely_tokens() {
        // Probabilities 0.5, 0.3, 0.15, 0.05 (shuffled ids).
        let logits = [0.15f32.ln(), 0.5f32.ln(), 0.05f32.ln(), 0.3f32.ln()];
        let top_k = SamplingParams {
            top_k: 2,
            ..params(1.0)
        };
        let drawn = sequence(&top_k, &logits, 500);
        assert!(drawn.iter().all(|&t| t == 1 || t == 3) && drawn.contains(&3));
        // 0.5 < 0.7, 0.5 + 0.3 reaches it: the nucleus is {1, 3}.
        let top_p = SamplingParams {
            top_p: 0.7,
            ..params(1.0)
        };
        let drawn = sequence(&top_p, &logits, 500);
        assert!(drawn.iter().all(|&t| t == 1 || t == 3) && drawn.contains(&3));
    }

    #[test]
    fn min_p_drops_tokens_below_the_scaled_maximum() {
        let logits = [0.5f32.ln(), 0.3f32.ln(), 0.15f32.ln(), 0.05f32.ln()];
        // Threshold 0.4 × 0.5 = 0.2: only tokens 0 and 1 remain.
        let p = SamplingParams {
            min_p: 0.4,
            ..params(1.0)
        };
        let drawn = sequence(&p, &logits, 500);
        assert!(drawn.iter().all(|&t| t < 2) && drawn.contains(&1));
    }

    #[test]
    fn penalties_change_the_greedy_choice() {
        let logits = [2.0, 1.8, -1.0];
        let mut state = SamplerState::new(&params(0.0));
        let repetition = SamplingParams {
            repetition_penalty: 1.2,
            ..params(0.0)
        };
        // 2.0 / 1.2 < 1.8: token 0 seen in the prompt loses.
        assert_eq!(
            state
                .sample(&logits, &repetition, &[0], &[])
                .unwrap()
                .token_id,
            1
        );
        let presence = SamplingParams {
            presence_penalty: 0.5,
            ..params(0.0)
        };
        let mut state = SamplerState::new(&presence);
        assert_eq!(
            state
                .sample(&logits, &presence, &[0], &[])
                .unwrap()
                .token_id,
            0
        );
        assert_eq!(
            state
                .sample(&logits, &presence, &[0], &[0])
                .unwrap()
                .token_id,
            1
        );
        let frequency = SamplingParams {
            frequency_penalty: 0.15,
            ..params(0.0)
        };
        let mut state = SamplerState::new(&frequency);
        assert_eq!(
            state
                .sample(&logits, &frequency, &[], &[0, 1])
                .unwrap()
                .token_id,
            0
        );
        assert_eq!(
            state
                .sample(&logits, &frequency, &[], &[0, 1, 0, 0])
                .unwrap()
                .token_id,
            1
        );
        // Negative logits are multiplied, so repetition makes them less likely too.
        let negative = [-1.0, -1.1];
        let mut state = SamplerState::new(&repetition);
        assert_eq!(
            state
                .sample(&negative, &repetition, &[0], &[])
                .unwrap()
                .token_id,
            1
        );
    }

    #[test]
    fn logprobs_come_from_raw_logits_and_are_normalised() {
        let p = SamplingParams {
            logprobs: Some(3),
            repetition_penalty: 2.0,
            ..params(0.0)
        };
        let out = SamplerState::new(&p)
            .sample(&LOGITS, &p, &[1], &[])
            .unwrap();
        assert_eq!(out.token_id, 4, "the penalty moves the choice off token 1");
        let total: f32 = LOGITS.iter().map(|x| (x - LOGITS[4]).exp()).sum();
        assert!((out.logprob - (-total.ln())).abs() < 1e-6);
        let ids: Vec<u32> = out.top_logprobs.iter().map(|&(id, _)| id).collect();
        assert_eq!(ids, vec![1, 4, 3]);
        assert_eq!(out.top_logprobs[0].1, out.top_logprobs[1].1);
        let all = SamplingParams {
            logprobs: Some(20),
            ..params(0.0)
        };
        let out = sample(&LOGITS, &all);
        assert_eq!(out.top_logprobs.len(), LOGITS.len());
        let mass: f32 = out.top_logprobs.iter().map(|&(_, lp)| lp.exp()).sum();
        assert!((mass - 1.0).abs() < 1e-5, "{mass}");
        assert!(sample(&LOGITS, &params(0.0)).top_logprobs.is_empty());
    }

    #[test]
    fn broken_logits_are_errors_not_panics() {
        let p = params(1.0);
        let mut state = SamplerState::new(&p);
        for row in [
            vec![f32::NAN; 4],
            vec![0.0, f32::NAN],
            vec![f32::INFINITY, 0.0],
            vec![f32::NEG_INFINITY; 3],
            vec![],
        ] {
            let err = state.sample(&row, &p, &[], &[]).unwrap_err();
            assert!(
                matches!(err, SamplerError::InvalidLogits { .. }),
                "{row:?}: {err}"
            );
        }
        let penalised = SamplingParams {
            repetition_penalty: 1.1,
            ..p
        };
        let err = state
            .sample(&[0.0, 1.0], &penalised, &[5], &[])
            .unwrap_err();
        assert_eq!(
            err,
            SamplerError::TokenOutOfRange {
                token_id: 5,
                origin: "prompt",
                vocab_size: 2
            }
        );
    }

    #[test]
    fn scratch_buffers_are_reused_across_calls() {
        let p = SamplingParams {
            top_p: 0.9,
            ..params(1.0)
        };
        let mut state = SamplerState::new(&p);
        let logits: Vec<f32> = (0..1000).map(|i| (i % 17) as f32 * 0.1).collect();
        state.sample(&logits, &p, &[], &[]).unwrap();
        let (work, candidates) = (state.work.as_ptr(), state.candidates.as_ptr());
        state.sample(&logits, &p, &[], &[]).unwrap();
        assert_eq!(
            (work, candidates),
            (state.work.as_ptr(), state.candidates.as_ptr())
        );
    }
}
