//! The result file of `moeserve bench serve`: what was run, and per concurrency level the
//! throughputs, latency percentiles and the Little's-law check. The planner and the plotter read
//! it back; field names follow vLLM's `benchmark_serving.py` JSON where the concept is the same.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::load::{LevelConfig, LevelOutcome};
use crate::stats::{LatencySummary, LittlesLaw};
use crate::{BenchError, Result};

/// What a benchmark run was asked to do.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct BenchSetup {
    /// The completions URL requests went to.
    pub url: String,
    pub model: String,
    /// `random` (token ids) or the dataset file.
    pub dataset: String,
    /// Prompt and output lengths asked for (random prompts) or their means (a dataset).
    pub prompt_len: f64,
    pub output_len: f64,
    pub request_rate: Option<f64>,
    pub seed: u64,
}

/// One concurrency level.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LevelReport {
    /// Most requests in flight (the batch the server sees, when it fits `--max-num-seqs`).
    pub concurrency: usize,
    pub request_rate: Option<f64>,
    pub num_requests: usize,
    pub completed: usize,
    pub failed: usize,
    pub duration_s: f64,
    pub total_input_tokens: usize,
    pub total_output_tokens: usize,
    /// Completed requests per second.
    pub request_throughput: f64,
    /// Output tokens per second.
    pub output_throughput: f64,
    /// Input and output tokens per second.
    pub total_token_throughput: f64,
    /// Latencies in milliseconds.
    pub ttft_ms: LatencySummary,
    pub tpot_ms: LatencySummary,
    pub itl_ms: LatencySummary,
    pub e2e_ms: LatencySummary,
    pub littles_law: LittlesLaw,
    /// The first few failures, one line each.
    pub errors: Vec<String>,
}

impl LevelReport {
    pub fn new(config: &LevelConfig, outcome: &LevelOutcome) -> Self {
        let t = &outcome.timings;
        let seconds = |f: &dyn Fn(&crate::stats::RequestTiming) -> f64| -> Vec<f64> {
            t.iter().map(f).collect()
        };
        let e2e = seconds(&|r| r.e2e);
        let itl: Vec<f64> = t.iter().flat_map(|r| r.itl.iter().copied()).collect();
        let tpot: Vec<f64> = t.iter().filter_map(|r| r.tpot()).collect();
        let input: usize = t.iter().map(|r| r.prompt_tokens).sum();
        let output: usize = t.iter().map(|r| r.output_tokens).sum();
        let per_second = |n: f64| {
            if outcome.duration_s > 0.0 {
                n / outcome.duration_s
            } else {
                0.0
            }
        };
        let mean_e2e = if e2e.is_empty() {
            0.0
        } else {
            e2e.iter().sum::<f64>() / e2e.len() as f64
        };
        LevelReport {
            concurrency: config.concurrency,
            request_rate: config.request_rate,
            num_requests: t.len() + outcome.errors.len(),
            completed: t.len(),
            failed: outcome.errors.len(),
            duration_s: outcome.duration_s,
            total_input_tokens: input,
            total_output_tokens: output,
            request_throughput: per_second(t.len() as f64),
            output_throughput: per_second(output as f64),
            total_token_throughput: per_second((input + output) as f64),
            ttft_ms: LatencySummary::from_seconds(&seconds(&|r| r.ttft)),
            tpot_ms: LatencySummary::from_seconds(&tpot),
            itl_ms: LatencySummary::from_seconds(&itl),
            e2e_ms: LatencySummary::from_seconds(&e2e),
            littles_law: LittlesLaw::new(
                t.len(),
                mean_e2e,
                outcome.duration_s,
                outcome.sampled_mean_in_flight,
            ),
            errors: outcome.errors.iter().take(5).cloned().collect(),
        }
    }
}

/// A whole `bench serve` run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct BenchResult {
    /// `moeserve bench serve` and its version.
    pub tool: String,
    /// UTC, `YYYY-MM-DDTHH:MM:SSZ`.
    pub date: String,
    pub setup: BenchSetup,
    /// In the order run (ascending concurrency as given).
    pub levels: Vec<LevelReport>,
}

impl BenchResult {
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| BenchError::io(path, e))?;
        serde_json::from_str(&text).map_err(|e| BenchError::Parse {
            origin: path.display().to_string(),
            message: format!("not a `moeserve bench serve` result: {e}"),
        })
    }

    pub fn save(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self).expect("results serialize to JSON");
        std::fs::write(path, text + "\n").map_err(|e| BenchError::io(path, e))
    }

    /// A fixed-width table of the levels, for the terminal.
    pub fn table(&self) -> String {
        let mut out = format!(
            "{:>5} {:>8} {:>9} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>7} {:>7}\n",
            "conc",
            "req/s",
            "out tok/s",
            "TTFT p50",
            "TTFT p99",
            "TPOT p50",
            "TPOT p99",
            "ITL p99",
            "e2e p50",
            "L",
            "λ·W"
        );
        for l in &self.levels {
            out.push_str(&format!(
                "{:>5} {:>8.2} {:>9.1} {:>8.0}ms {:>8.0}ms {:>8.1}ms {:>8.1}ms {:>8.1}ms {:>8.0}ms {:>7.2} {:>7.2}{}\n",
                l.concurrency,
                l.request_throughput,
                l.output_throughput,
                l.ttft_ms.p50,
                l.ttft_ms.p99,
                l.tpot_ms.p50,
                l.tpot_ms.p99,
                l.itl_ms.p99,
                l.e2e_ms.p50,
                l.littles_law.measured_mean_concurrency,
                l.littles_law.lambda_w,
                match l.failed {
                    0 => String::new(),
                    n => format!("  ({n} failed)"),
                }
            ));
        }
        out
    }
}

/// The current UTC time as `YYYY-MM-DDTHH:MM:SSZ`.
pub fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    utc_timestamp(secs)
}

fn utc_timestamp(unix_secs: u64) -> String {
    let (days, rem) = ((unix_secs / 86_400) as i64, unix_secs % 86_400);
    // Howard Hinnant's days-to-civil algorithm.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::RequestTiming;

    #[test]
    fn timestamps_are_utc_calendar_dates() {
        assert_eq!(utc_timestamp(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc_timestamp(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(utc_timestamp(1_798_502_582), "2026-12-29T00:03:02Z");
    }

    #[test]
    fn a_level_counts_tokens_failures_and_throughput() {
        let timing = |start: f64| RequestTiming {
            start,
            ttft: 0.1,
            itl: vec![0.05; 4],
            e2e: 0.3,
            prompt_tokens: 16,
            output_tokens: 5,
        };
        let outcome = LevelOutcome {
            timings: vec![timing(0.0), timing(0.3)],
            errors: vec!["HTTP 500".into()],
            duration_s: 0.6,
            sampled_mean_in_flight: 1.0,
        };
        let config = LevelConfig {
            concurrency: 1,
            request_rate: None,
            seed: 0,
        };
        let l = LevelReport::new(&config, &outcome);
        assert_eq!((l.num_requests, l.completed, l.failed), (3, 2, 1));
        assert_eq!((l.total_input_tokens, l.total_output_tokens), (32, 10));
        assert!((l.output_throughput - 10.0 / 0.6).abs() < 1e-9);
        assert!((l.tpot_ms.p50 - 50.0).abs() < 1e-9);
        assert_eq!(l.itl_ms.count, 8);
        assert!((l.littles_law.lambda_w - 1.0).abs() < 1e-9);
        let result = BenchResult {
            levels: vec![l],
            ..BenchResult::default()
        };
        let back: BenchResult =
            serde_json::from_str(&serde_json::to_string(&result).unwrap()).unwrap();
        assert_eq!(back, result);
        assert!(result.table().contains("(1 failed)"));
    }
}
