//! Statistics of one concurrency level: percentiles (linear interpolation between closest
//! ranks, numpy's default, as vLLM's `benchmark_serving.py` reports them), latency summaries and
//! the Little's-law check `L = λ·W`.
//!
//! Definitions follow vLLM's benchmark: TTFT is the time to the first chunk with content, ITL
//! the gaps between content chunks, TPOT `(e2e − TTFT) / (output_tokens − 1)` per request.

use serde::{Deserialize, Serialize};

/// The `p`-th percentile (0–100) of `values`, interpolating linearly between closest ranks;
/// `None` for no values.
pub fn percentile(values: &[f64], p: f64) -> Option<f64> {
    let mut sorted: Vec<f64> = values.iter().copied().filter(|v| v.is_finite()).collect();
    if sorted.is_empty() {
        return None;
    }
    sorted.sort_by(f64::total_cmp);
    Some(percentile_of_sorted(&sorted, p))
}

fn percentile_of_sorted(sorted: &[f64], p: f64) -> f64 {
    let rank = (p.clamp(0.0, 100.0) / 100.0) * (sorted.len() - 1) as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
}

/// Mean and percentiles of one latency, in milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencySummary {
    /// Number of values summarised.
    pub count: usize,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl LatencySummary {
    /// The summary of `seconds`, reported in milliseconds; all zero when empty.
    pub fn from_seconds(seconds: &[f64]) -> Self {
        let mut ms: Vec<f64> = seconds
            .iter()
            .filter(|v| v.is_finite())
            .map(|s| s * 1e3)
            .collect();
        if ms.is_empty() {
            return LatencySummary::default();
        }
        ms.sort_by(f64::total_cmp);
        LatencySummary {
            count: ms.len(),
            mean: ms.iter().sum::<f64>() / ms.len() as f64,
            p50: percentile_of_sorted(&ms, 50.0),
            p90: percentile_of_sorted(&ms, 90.0),
            p99: percentile_of_sorted(&ms, 99.0),
            max: ms[ms.len() - 1],
        }
    }

    /// The value named `p50`, `p90`, `p99`, `mean` or `max`.
    pub fn pick(&self, statistic: Statistic) -> f64 {
        match statistic {
            Statistic::Mean => self.mean,
            Statistic::P50 => self.p50,
            Statistic::P90 => self.p90,
            Statistic::P99 => self.p99,
            Statistic::Max => self.max,
        }
    }
}

/// Which statistic of a latency a target applies to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Statistic {
    Mean,
    #[default]
    P50,
    P90,
    P99,
    Max,
}

impl std::str::FromStr for Statistic {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "mean" => Ok(Statistic::Mean),
            "p50" | "median" => Ok(Statistic::P50),
            "p90" => Ok(Statistic::P90),
            "p99" => Ok(Statistic::P99),
            "max" => Ok(Statistic::Max),
            _ => Err(format!("{s:?} is not one of mean, p50, p90, p99, max")),
        }
    }
}

impl std::fmt::Display for Statistic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Statistic::Mean => "mean",
            Statistic::P50 => "p50",
            Statistic::P90 => "p90",
            Statistic::P99 => "p99",
            Statistic::Max => "max",
        })
    }
}

/// The timings of one finished request, in seconds from the start of its level.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RequestTiming {
    /// When the request was sent.
    pub start: f64,
    /// Send → first content chunk.
    pub ttft: f64,
    /// Gaps between consecutive content chunks.
    pub itl: Vec<f64>,
    /// Send → end of the stream.
    pub e2e: f64,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
}

impl RequestTiming {
    /// `(e2e − TTFT) / (output_tokens − 1)`; `None` for a single output token.
    pub fn tpot(&self) -> Option<f64> {
        (self.output_tokens > 1).then(|| (self.e2e - self.ttft) / (self.output_tokens - 1) as f64)
    }

    pub fn end(&self) -> f64 {
        self.start + self.e2e
    }
}

/// Little's law over one level: `L = λ·W`, with `L` measured independently of `λ` and `W` (the
/// time-average of requests in flight, sampled by the load generator while the level ran).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LittlesLaw {
    /// λ: completed requests per second over the level's duration.
    pub arrival_rate: f64,
    /// W: mean time in system (e2e) per request, seconds.
    pub mean_time_in_system_s: f64,
    /// λ·W.
    pub lambda_w: f64,
    /// L: the sampled mean number of requests in flight.
    pub measured_mean_concurrency: f64,
    /// `(λ·W − L) / L`; near 0 when the timings are consistent.
    pub relative_error: f64,
}

impl LittlesLaw {
    /// The check for `num_completed` requests of mean time in system `mean_e2e_s` over
    /// `duration_s`, against the sampled mean in-flight count `measured_l`.
    pub fn new(num_completed: usize, mean_e2e_s: f64, duration_s: f64, measured_l: f64) -> Self {
        let arrival_rate = if duration_s > 0.0 {
            num_completed as f64 / duration_s
        } else {
            0.0
        };
        let lambda_w = arrival_rate * mean_e2e_s;
        let relative_error = if measured_l > 0.0 {
            (lambda_w - measured_l) / measured_l
        } else {
            0.0
        };
        LittlesLaw {
            arrival_rate,
            mean_time_in_system_s: mean_e2e_s,
            lambda_w,
            measured_mean_concurrency: measured_l,
            relative_error,
        }
    }
}

/// Time-average of the number of requests in flight over `[0, duration]`, computed exactly from
/// the requests' intervals (the sampled value of a level should agree with it).
pub fn mean_in_flight(timings: &[RequestTiming], duration: f64) -> f64 {
    if duration <= 0.0 {
        return 0.0;
    }
    let busy: f64 = timings
        .iter()
        .map(|t| t.end().min(duration) - t.start.max(0.0))
        .filter(|d| *d > 0.0)
        .sum();
    busy / duration
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_between_closest_ranks_like_numpy() {
        let v = [1.0, 2.0, 3.0, 4.0];
        // numpy.percentile([1, 2, 3, 4], [0, 50, 90, 99, 100]) = 1, 2.5, 3.7, 3.97, 4
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        assert_eq!(percentile(&v, 50.0), Some(2.5));
        assert!((percentile(&v, 90.0).unwrap() - 3.7).abs() < 1e-12);
        assert!((percentile(&v, 99.0).unwrap() - 3.97).abs() < 1e-12);
        assert_eq!(percentile(&v, 100.0), Some(4.0));
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(percentile(&[7.0], 99.0), Some(7.0));
    }

    #[test]
    fn percentiles_ignore_input_order_and_non_finite_values() {
        let v = [9.0, f64::NAN, 1.0, 5.0, 3.0, 7.0];
        assert_eq!(percentile(&v, 50.0), Some(5.0));
    }

    #[test]
    fn summary_is_in_milliseconds_and_monotone() {
        // 1..=100 ms.
        let seconds: Vec<f64> = (1..=100).map(|i| i as f64 / 1e3).collect();
        let s = LatencySummary::from_seconds(&seconds);
        assert_eq!(s.count, 100);
        assert!((s.mean - 50.5).abs() < 1e-9);
        assert!((s.p50 - 50.5).abs() < 1e-9);
        assert!((s.p90 - 90.1).abs() < 1e-9);
        assert!((s.p99 - 99.01).abs() < 1e-9);
        assert_eq!(s.max, 100.0);
        assert!(s.p50 <= s.p90 && s.p90 <= s.p99 && s.p99 <= s.max);
        assert_eq!(LatencySummary::from_seconds(&[]), LatencySummary::default());
    }

    #[test]
    fn tpot_excludes_the_first_token() {
        let t = RequestTiming {
            ttft: 0.5,
            e2e: 1.5,
            output_tokens: 11,
            ..RequestTiming::default()
        };
        assert!((t.tpot().unwrap() - 0.1).abs() < 1e-12);
        let one = RequestTiming {
            output_tokens: 1,
            ..t
        };
        assert_eq!(one.tpot(), None);
    }

    /// A closed loop of `c` clients, each sending back-to-back requests of `w` seconds for
    /// `n` rounds: λ = c/w, W = w, so L = λ·W = c.
    fn closed_loop(c: usize, w: f64, n: usize) -> Vec<RequestTiming> {
        (0..c)
            .flat_map(|_| {
                (0..n).map(move |round| RequestTiming {
                    start: round as f64 * w,
                    e2e: w,
                    output_tokens: 2,
                    ..RequestTiming::default()
                })
            })
            .collect()
    }

    #[test]
    fn littles_law_holds_for_a_closed_loop() {
        let timings = closed_loop(4, 0.25, 8);
        let duration = 8.0 * 0.25;
        let l = mean_in_flight(&timings, duration);
        assert!((l - 4.0).abs() < 1e-12);
        let mean_e2e = timings.iter().map(|t| t.e2e).sum::<f64>() / timings.len() as f64;
        let law = LittlesLaw::new(timings.len(), mean_e2e, duration, l);
        assert!((law.arrival_rate - 16.0).abs() < 1e-12);
        assert!((law.lambda_w - 4.0).abs() < 1e-12);
        assert!(law.relative_error.abs() < 1e-12);
    }

    #[test]
    fn idle_gaps_lower_the_mean_concurrency_and_show_in_the_check() {
        // One request of 1 s in a 4 s window: L = 0.25; λ = 0.25/s, W = 1 s.
        let t = vec![RequestTiming {
            start: 1.0,
            e2e: 1.0,
            ..RequestTiming::default()
        }];
        assert!((mean_in_flight(&t, 4.0) - 0.25).abs() < 1e-12);
        // A sampler that saw 0.5 in flight on average disagrees with λ·W = 0.25 by −50 %.
        let law = LittlesLaw::new(1, 1.0, 4.0, 0.5);
        assert!((law.relative_error + 0.5).abs() < 1e-12);
    }
}
