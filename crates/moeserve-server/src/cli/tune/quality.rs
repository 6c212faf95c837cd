//! Quality of a capacity-limited run against the dropless run of the same prompts (greedy):
//! follows vLLM's `check_logprobs_close`. Tokens agree up to the first divergence; while they
//! agree the contexts are equal, so the logprobs of the dropless tokens compare directly; at the
//! divergence the dropless token's logprob is looked up in the other run's top logprobs. When it
//! is not among them its logprob is at most the lowest of them, so `dropless − lowest` (at
//! least 0) is counted: a lower bound, so that a run that diverges at once cannot look perfect.
//!
//! - greedy agreement: the matching prefix as a fraction of the dropless output, averaged over
//!   requests;
//! - mean |Δlogprob|: over every compared dropless token of every request.

use moeserve_engine::request::GenerateOutput;
use serde::Serialize;

/// How far a run strays from the dropless reference.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Quality {
    pub greedy_agreement: f64,
    /// Mean |Δlogprob| of the dropless tokens, nats; NaN when nothing compared.
    pub mean_abs_delta_logprob: f64,
    /// Dropless tokens compared.
    pub num_compared: usize,
    /// Divergences whose dropless token was outside the run's top logprobs (|Δ| bounded below).
    pub num_bounded: usize,
}

/// `runs[i]` against `reference[i]`.
pub fn compare(reference: &[GenerateOutput], runs: &[GenerateOutput]) -> Quality {
    let (mut agreement, mut deltas, mut num_bounded) = (0.0, Vec::new(), 0);
    for (base, run) in reference.iter().zip(runs) {
        let mut same = 0;
        for (i, (&want, &got)) in base.token_ids.iter().zip(&run.token_ids).enumerate() {
            if want == got {
                same += 1;
                deltas.push((base.logprobs[i] - run.logprobs[i]).abs());
                continue;
            }
            let alternatives = run.top_logprobs.get(i).map_or(&[][..], Vec::as_slice);
            if let Some((_, lp)) = alternatives.iter().find(|(id, _)| *id == want) {
                deltas.push((base.logprobs[i] - lp).abs());
            } else if let Some(lowest) = alternatives.iter().map(|(_, lp)| *lp).reduce(f32::min) {
                deltas.push((base.logprobs[i] - lowest).max(0.0));
                num_bounded += 1;
            }
            break;
        }
        agreement += same as f64 / base.token_ids.len().max(1) as f64;
    }
    let mean = if deltas.is_empty() {
        f64::NAN
    } else {
        deltas.iter().map(|d| f64::from(*d)).sum::<f64>() / deltas.len() as f64
    };
    Quality {
        greedy_agreement: agreement / reference.len().max(1) as f64,
        mean_abs_delta_logprob: mean,
        num_compared: deltas.len(),
        num_bounded,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use moeserve_engine::request::FinishReason;

    fn output(tokens: &[u32], logprobs: &[f32], top: Vec<Vec<(u32, f32)>>) -> GenerateOutput {
        GenerateOutput {
            prompt_ids: vec![1],
            token_ids: tokens.to_vec(),
            text: String::new(),
            logprobs: logprobs.to_vec(),
            top_logprobs: top,
            finish_reason: FinishReason::Length,
            timings: Default::default(),
            moe: None,
            routed_experts: None,
        }
    }

    #[test]
    fn identical_runs_agree_fully_with_zero_delta() {
        let a = output(&[5, 6], &[-0.5, -1.0], vec![]);
        let q = compare(std::slice::from_ref(&a), std::slice::from_ref(&a));
        assert_eq!((q.greedy_agreement, q.mean_abs_delta_logprob), (1.0, 0.0));
        assert_eq!(q.num_compared, 2);
    }

    #[test]
    fn comparison_stops_at_the_first_divergence_using_the_top_logprobs() {
        let base = output(&[5, 6, 7, 8], &[-0.5, -1.0, -0.2, -0.1], vec![]);
        // Agrees on token 0 (Δ 0.1), diverges at 1 where the dropless token 6 has -1.5 (Δ 0.5).
        let run = output(
            &[5, 9, 7, 8],
            &[-0.6, -0.9, -0.2, -0.1],
            vec![vec![], vec![(9, -0.9), (6, -1.5)], vec![], vec![]],
        );
        let q = compare(&[base], &[run]);
        assert_eq!(q.greedy_agreement, 0.25);
        assert_eq!(q.num_compared, 2);
        assert!((q.mean_abs_delta_logprob - 0.3).abs() < 1e-6);
        assert_eq!(q.num_bounded, 0);
    }

    #[test]
    fn a_dropless_token_outside_the_top_logprobs_counts_as_a_lower_bound() {
        let base = output(&[5, 6], &[-0.25, -1.0], vec![]);
        // Diverges at once; token 5 is not among the alternatives, whose lowest is -3.
        let run = output(
            &[7, 6],
            &[-0.5, -1.0],
            vec![vec![(7, -0.5), (8, -3.0)], vec![]],
        );
        let q = compare(&[base], &[run]);
        assert_eq!(
            (q.greedy_agreement, q.num_compared, q.num_bounded),
            (0.0, 1, 1)
        );
        assert_eq!(q.mean_abs_delta_logprob, 2.75);
    }
}
