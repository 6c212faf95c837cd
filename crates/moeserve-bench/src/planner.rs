//! The capacity planner: from a measured latency curve, the largest batch `B` whose TPOT (and
//! optionally TTFT) stays within target and whose KV cache fits, then Little's law for the
//! system: a replica running `B` sequences with time in system `W` serves `B / W` requests per
//! second; an arrival rate `λ` keeps `L = λ·W` requests in the system, so it needs `⌈L / B⌉`
//! replicas.
//!
//! The curve is piecewise linear between the measured concurrency levels. `B` is the last point
//! before the curve first crosses the target (later dips below it, usually noise, are not
//! trusted), and never extrapolated past the largest level measured.

use serde::Serialize;

use crate::report::{BenchResult, LevelReport};
use crate::stats::Statistic;
use crate::{BenchError, Result};

/// KV cache figures of the serving engine.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct KvMemory {
    /// Bytes one token's keys and values take over all layers.
    pub bytes_per_token: u64,
    /// The cache size (`--kv-cache-memory`).
    pub cache_bytes: u64,
    /// Tokens per block (`--block-size`): a sequence holds whole blocks.
    pub block_size: usize,
}

/// What to plan for.
#[derive(Clone, Debug)]
pub struct PlanRequest {
    pub target_tpot_ms: f64,
    pub target_ttft_ms: Option<f64>,
    /// Which statistic of the measured latencies must meet the targets.
    pub statistic: Statistic,
    /// λ, requests per second.
    pub arrival_rate: Option<f64>,
    pub mean_prompt: f64,
    pub mean_output: f64,
    pub memory: Option<KvMemory>,
}

/// How large the batch may be under one constraint.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "batch")]
pub enum BatchBound {
    /// The curve crosses the target at this batch.
    Within(usize),
    /// Every measured level meets the target; the largest measured is this.
    AtLeast(usize),
    /// Even the smallest level measured misses the target.
    Infeasible,
    /// Not constrained (no target or no memory figures).
    Unconstrained,
}

impl BatchBound {
    fn limit(self) -> Option<usize> {
        match self {
            BatchBound::Within(b) | BatchBound::AtLeast(b) => Some(b),
            BatchBound::Infeasible => Some(0),
            BatchBound::Unconstrained => None,
        }
    }
}

/// The engine flags the plan recommends.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct RecommendedFlags {
    pub max_num_seqs: usize,
    /// Every running decode plus one mean prompt's prefill per step, rounded up to 64.
    pub max_num_batched_tokens: usize,
    /// What `max_num_seqs` sequences of mean length hold, rounded up to MiB.
    pub kv_cache_memory_bytes: Option<u64>,
}

/// The planner's answer.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Plan {
    pub max_batch: usize,
    /// `tpot`, `ttft`, `kv_cache` or `measured_range` (every level met the targets).
    pub limited_by: &'static str,
    pub by_tpot: BatchBound,
    pub by_ttft: BatchBound,
    pub by_kv_cache: BatchBound,
    /// Interpolated at `max_batch`, milliseconds.
    pub tpot_ms: f64,
    pub ttft_ms: f64,
    /// W = TTFT + (mean_output − 1) · TPOT, seconds.
    pub time_in_system_s: f64,
    /// B / W: requests per second one replica serves at `max_batch`.
    pub replica_request_rate: f64,
    /// L = λ·W.
    pub required_concurrency: Option<f64>,
    /// ⌈L / B⌉.
    pub replicas: Option<usize>,
    pub flags: RecommendedFlags,
}

/// Plans for `request` from the levels of `result`.
pub fn plan(result: &BenchResult, request: &PlanRequest) -> Result<Plan> {
    let mut levels: Vec<&LevelReport> = result.levels.iter().filter(|l| l.completed > 0).collect();
    levels.sort_by_key(|l| l.concurrency);
    if levels.is_empty() {
        return Err(BenchError::invalid(
            "bench result",
            "it holds no level with completed requests",
        ));
    }
    let curve = |pick: fn(&LevelReport) -> &crate::stats::LatencySummary| -> Vec<(f64, f64)> {
        levels
            .iter()
            .map(|l| (l.concurrency as f64, pick(l).pick(request.statistic)))
            .collect()
    };
    let (tpot, ttft) = (curve(|l| &l.tpot_ms), curve(|l| &l.ttft_ms));
    let by_tpot = max_batch_within(&tpot, request.target_tpot_ms);
    let by_ttft = request
        .target_ttft_ms
        .map_or(BatchBound::Unconstrained, |t| max_batch_within(&ttft, t));
    let by_kv_cache = request.memory.map_or(BatchBound::Unconstrained, |m| {
        match m.cache_bytes / bytes_per_sequence(&m, request) {
            0 => BatchBound::Infeasible,
            b => BatchBound::Within(b as usize),
        }
    });
    let bounds = [
        ("tpot", by_tpot),
        ("ttft", by_ttft),
        ("kv_cache", by_kv_cache),
    ];
    let (limited_by, max_batch) = bounds
        .iter()
        .filter_map(|(name, b)| b.limit().map(|l| (*name, l)))
        .min_by_key(|(_, l)| *l)
        .expect("the TPOT bound always limits");
    let limited_by = match bounds.iter().find(|(n, _)| *n == limited_by) {
        Some((_, BatchBound::AtLeast(_))) => "measured_range",
        _ => limited_by,
    };
    if max_batch == 0 {
        return Err(infeasible(&bounds, &levels, request));
    }
    let tpot_ms = interpolate(&tpot, max_batch as f64);
    let ttft_ms = interpolate(&ttft, max_batch as f64);
    let w = (ttft_ms + (request.mean_output - 1.0).max(0.0) * tpot_ms) / 1e3;
    let required = request.arrival_rate.map(|rate| rate * w);
    let tokens = request.mean_prompt.ceil() as usize + max_batch;
    Ok(Plan {
        max_batch,
        limited_by,
        by_tpot,
        by_ttft,
        by_kv_cache,
        tpot_ms,
        ttft_ms,
        time_in_system_s: w,
        replica_request_rate: max_batch as f64 / w,
        required_concurrency: required,
        replicas: required.map(|l| ((l / max_batch as f64).ceil() as usize).max(1)),
        flags: RecommendedFlags {
            max_num_seqs: max_batch,
            max_num_batched_tokens: tokens.div_ceil(64) * 64,
            kv_cache_memory_bytes: request.memory.map(|m| {
                (bytes_per_sequence(&m, request) * max_batch as u64).div_ceil(1 << 20) << 20
            }),
        },
    })
}

/// A sequence of mean length in whole blocks.
fn bytes_per_sequence(memory: &KvMemory, request: &PlanRequest) -> u64 {
    let tokens = (request.mean_prompt + request.mean_output).ceil() as usize;
    let block = memory.block_size.max(1);
    (tokens.div_ceil(block) * block) as u64 * memory.bytes_per_token
}

fn infeasible(
    bounds: &[(&'static str, BatchBound)],
    levels: &[&LevelReport],
    request: &PlanRequest,
) -> BenchError {
    let first = levels[0];
    let reasons: Vec<String> = bounds
        .iter()
        .filter(|(_, b)| *b == BatchBound::Infeasible)
        .map(|(name, _)| match *name {
            "tpot" => format!(
                "TPOT {} is {:.1} ms at concurrency {} (target {:.1} ms)",
                request.statistic,
                first.tpot_ms.pick(request.statistic),
                first.concurrency,
                request.target_tpot_ms
            ),
            "ttft" => format!(
                "TTFT {} is {:.1} ms at concurrency {} (target {:.1} ms)",
                request.statistic,
                first.ttft_ms.pick(request.statistic),
                first.concurrency,
                request.target_ttft_ms.unwrap_or_default()
            ),
            _ => "the KV cache does not hold one sequence of mean length".to_string(),
        })
        .collect();
    BenchError::invalid(
        "targets",
        format!("no batch meets them: {}", reasons.join("; ")),
    )
}

/// The largest batch before the piecewise-linear `curve` (ascending batch) first exceeds
/// `target`.
pub fn max_batch_within(curve: &[(f64, f64)], target: f64) -> BatchBound {
    let Some(&(b0, y0)) = curve.first() else {
        return BatchBound::Infeasible;
    };
    if y0 > target {
        return BatchBound::Infeasible;
    }
    for pair in curve.windows(2) {
        let ((b1, y1), (b2, y2)) = (pair[0], pair[1]);
        if y2 > target {
            let crossing = b1 + (target - y1) / (y2 - y1) * (b2 - b1);
            return BatchBound::Within((crossing + 1e-9).floor().max(b0) as usize);
        }
    }
    let last = curve.last().expect("the curve is not empty").0;
    BatchBound::AtLeast(last as usize)
}

/// The curve's value at `b`, linear between points, held flat beyond the ends.
pub fn interpolate(curve: &[(f64, f64)], b: f64) -> f64 {
    match curve {
        [] => f64::NAN,
        [(_, y)] => *y,
        _ if b <= curve[0].0 => curve[0].1,
        _ => curve
            .windows(2)
            .find(|p| b <= p[1].0)
            .map(|p| {
                let ((b1, y1), (b2, y2)) = (p[0], p[1]);
                y1 + (y2 - y1) * (b - b1) / (b2 - b1)
            })
            .unwrap_or(curve[curve.len() - 1].1),
    }
}

impl Plan {
    /// The human-readable report.
    pub fn render(&self, request: &PlanRequest) -> String {
        let bound = |b: BatchBound| match b {
            BatchBound::Within(n) => format!("{n}"),
            BatchBound::AtLeast(n) => format!("≥ {n} (every measured level meets it)"),
            BatchBound::Infeasible => "none".into(),
            BatchBound::Unconstrained => "not constrained".into(),
        };
        let mut out = format!(
            "max batch B = {} (limited by {})\n  by TPOT {} ≤ {:.1} ms: {}\n",
            self.max_batch,
            self.limited_by,
            request.statistic,
            request.target_tpot_ms,
            bound(self.by_tpot)
        );
        if let Some(t) = request.target_ttft_ms {
            out += &format!(
                "  by TTFT {} ≤ {t:.0} ms: {}\n",
                request.statistic,
                bound(self.by_ttft)
            );
        }
        out += &format!("  by KV cache: {}\n", bound(self.by_kv_cache));
        out += &format!(
            "at B = {}: TPOT {:.1} ms, TTFT {:.0} ms, W = TTFT + {:.0}·TPOT = {:.3} s, one replica serves B/W = {:.2} req/s\n",
            self.max_batch,
            self.tpot_ms,
            self.ttft_ms,
            (request.mean_output - 1.0).max(0.0),
            self.time_in_system_s,
            self.replica_request_rate
        );
        if let (Some(l), Some(r), Some(rate)) = (
            self.required_concurrency,
            self.replicas,
            request.arrival_rate,
        ) {
            out += &format!(
                "arrival rate λ = {rate} req/s needs L = λ·W = {l:.1} requests in the system: {r} replica(s) of B = {}\n",
                self.max_batch
            );
        }
        let f = &self.flags;
        out += &format!(
            "recommended flags: --max-num-seqs {} --max-num-batched-tokens {}",
            f.max_num_seqs, f.max_num_batched_tokens
        );
        if let Some(bytes) = f.kv_cache_memory_bytes {
            out += &format!(" --kv-cache-memory {}MiB", bytes >> 20);
        }
        // The curve was measured under the server's settings of the time; a smaller token
        // budget trades burst TTFT for steadier TPOT, so the plan is a hypothesis to re-measure.
        out += "\n(re-run `moeserve bench serve` against a server with these flags to confirm)\n";
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::LatencySummary;

    fn summary(v: f64) -> LatencySummary {
        LatencySummary {
            count: 1,
            mean: v,
            p50: v,
            p90: v * 1.2,
            p99: v * 1.5,
            max: v * 2.0,
        }
    }

    /// TPOT(B) = 20 + 2·B ms and TTFT(B) = 100·B ms, measured at B = 1, 4, 16, 64.
    fn synthetic() -> BenchResult {
        let levels = [1usize, 4, 16, 64]
            .into_iter()
            .map(|b| LevelReport {
                concurrency: b,
                completed: 2 * b,
                tpot_ms: summary(20.0 + 2.0 * b as f64),
                ttft_ms: summary(100.0 * b as f64),
                ..LevelReport::default()
            })
            .collect();
        BenchResult {
            levels,
            ..BenchResult::default()
        }
    }

    fn request(target_tpot_ms: f64) -> PlanRequest {
        PlanRequest {
            target_tpot_ms,
            target_ttft_ms: None,
            statistic: Statistic::P50,
            arrival_rate: None,
            mean_prompt: 512.0,
            mean_output: 128.0,
            memory: None,
        }
    }

    #[test]
    fn the_tpot_bound_is_where_the_linear_curve_crosses_the_target() {
        // 20 + 2B ≤ 50 ⇔ B ≤ 15; the measured segment 4 → 16 is exactly linear.
        let p = plan(&synthetic(), &request(50.0)).unwrap();
        assert_eq!(p.by_tpot, BatchBound::Within(15));
        assert_eq!((p.max_batch, p.limited_by), (15, "tpot"));
        assert!((p.tpot_ms - 50.0).abs() < 1e-9);
        assert!((p.ttft_ms - 1500.0).abs() < 1e-9);
        // W = 1.5 s + 127 · 50 ms = 7.85 s.
        assert!((p.time_in_system_s - 7.85).abs() < 1e-9);
        assert_eq!(p.flags.max_num_seqs, 15);
        assert_eq!(p.flags.max_num_batched_tokens, 576); // 512 + 15 → 576
    }

    #[test]
    fn percentile_targets_use_that_statistic() {
        let mut r = request(60.0);
        r.statistic = Statistic::P90; // 1.2 · (20 + 2B) ≤ 60 ⇔ B ≤ 15
        assert_eq!(plan(&synthetic(), &r).unwrap().max_batch, 15);
    }

    #[test]
    fn ttft_and_memory_bounds_take_the_minimum() {
        let mut r = request(50.0);
        r.target_ttft_ms = Some(1000.0); // 100·B ≤ 1000 ⇔ B ≤ 10
        let p = plan(&synthetic(), &r).unwrap();
        assert_eq!((p.max_batch, p.limited_by), (10, "ttft"));
        // 640 tokens = 40 blocks of 16 → 640 · 1 KiB = 640 KiB per sequence; 4 MiB holds 6.
        r.memory = Some(KvMemory {
            bytes_per_token: 1024,
            cache_bytes: 4 << 20,
            block_size: 16,
        });
        let p = plan(&synthetic(), &r).unwrap();
        assert_eq!((p.max_batch, p.limited_by), (6, "kv_cache"));
        assert_eq!(p.by_kv_cache, BatchBound::Within(6));
        assert_eq!(p.flags.kv_cache_memory_bytes, Some(4 << 20)); // 3.75 MiB → 4 MiB
    }

    #[test]
    fn littles_law_sizes_the_replicas() {
        let mut r = request(50.0);
        r.arrival_rate = Some(10.0);
        let p = plan(&synthetic(), &r).unwrap();
        // L = 10 req/s · 7.85 s = 78.5 in the system; B = 15 per replica → 6 replicas.
        assert!((p.required_concurrency.unwrap() - 78.5).abs() < 1e-9);
        assert_eq!(p.replicas, Some(6));
        assert!((p.replica_request_rate - 15.0 / 7.85).abs() < 1e-9);
        let text = p.render(&r);
        assert!(text.contains("6 replica(s)"), "{text}");
        assert!(text.contains("--max-num-seqs 15"), "{text}");
    }

    #[test]
    fn a_target_every_level_meets_is_bounded_by_the_measured_range() {
        let p = plan(&synthetic(), &request(500.0)).unwrap();
        assert_eq!(p.by_tpot, BatchBound::AtLeast(64));
        assert_eq!((p.max_batch, p.limited_by), (64, "measured_range"));
    }

    #[test]
    fn a_target_no_level_meets_is_an_error_naming_the_figures() {
        let err = plan(&synthetic(), &request(10.0)).unwrap_err().to_string();
        assert!(
            err.contains("TPOT p50 is 22.0 ms at concurrency 1"),
            "{err}"
        );
    }

    #[test]
    fn the_first_crossing_counts_even_if_the_curve_dips_later() {
        let curve = [(1.0, 10.0), (2.0, 30.0), (4.0, 20.0)];
        assert_eq!(max_batch_within(&curve, 25.0), BatchBound::Within(1));
        assert_eq!(interpolate(&curve, 3.0), 25.0);
        assert_eq!(interpolate(&curve, 8.0), 20.0);
        assert_eq!(interpolate(&curve, 0.5), 10.0);
    }
}
