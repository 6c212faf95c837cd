//! Latencies of the requests that finished in the last few minutes (TTFT, TPOT, end to end) and
//! their percentiles, for the dashboard's stats JSON (`GET /v1/stats`).
//!
//! NOTE: Prometheus histograms answer "p95 over the last 5 minutes" only with a query engine over
//! their buckets; the dashboard is served by the binary alone, so the server keeps the raw
//! samples of a short window instead (bounded in count, oldest dropped first) and sorts them on
//! demand, which is exact and cheap at the rates one engine serves.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::Serialize;

/// How far back the dashboard's latency percentiles look.
pub const LATENCY_WINDOW: Duration = Duration::from_secs(300);
/// At most this many requests are kept, whatever their age.
pub const MAX_LATENCY_SAMPLES: usize = 20_000;

/// One finished request's latencies, in seconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RequestLatency {
    pub time_to_first_token: f64,
    /// `None` for a request with a single output token (no decode gap to average).
    pub time_per_output_token: Option<f64>,
    pub e2e: f64,
}

/// Percentiles of one latency over the window (nearest rank); `None` fields when it is empty.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Percentiles {
    pub count: usize,
    pub p50: Option<f64>,
    pub p90: Option<f64>,
    pub p95: Option<f64>,
    pub p99: Option<f64>,
    pub max: Option<f64>,
}

impl Percentiles {
    fn of(mut values: Vec<f64>) -> Percentiles {
        values.sort_unstable_by(f64::total_cmp);
        let rank = |q: f64| nearest_rank(&values, q);
        Percentiles {
            count: values.len(),
            p50: rank(0.50),
            p90: rank(0.90),
            p95: rank(0.95),
            p99: rank(0.99),
            max: values.last().copied(),
        }
    }
}

/// The `q` quantile of sorted `values` by nearest rank: the smallest value with at least
/// `q · n` values at or below it.
fn nearest_rank(sorted: &[f64], q: f64) -> Option<f64> {
    let n = sorted.len();
    if n == 0 {
        return None;
    }
    let rank = ((q * n as f64).ceil() as usize).clamp(1, n);
    Some(sorted[rank - 1])
}

/// What the window holds now.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct LatencySummary {
    pub window_seconds: f64,
    /// Requests finished within the window.
    pub num_requests: usize,
    pub time_to_first_token_seconds: Percentiles,
    pub time_per_output_token_seconds: Percentiles,
    pub e2e_request_latency_seconds: Percentiles,
}

/// Recent requests' latencies, oldest first. Shared by every handler (a short lock per
/// finished request and per dashboard poll).
#[derive(Debug)]
pub struct LatencyWindow {
    window: Duration,
    max_samples: usize,
    samples: Mutex<VecDeque<(Instant, RequestLatency)>>,
}

impl Default for LatencyWindow {
    fn default() -> Self {
        LatencyWindow::new(LATENCY_WINDOW, MAX_LATENCY_SAMPLES)
    }
}

impl LatencyWindow {
    pub fn new(window: Duration, max_samples: usize) -> LatencyWindow {
        LatencyWindow {
            window,
            max_samples: max_samples.max(1),
            samples: Mutex::new(VecDeque::new()),
        }
    }

    /// Records a request that finished now.
    pub fn record(&self, latency: RequestLatency) {
        self.record_at(Instant::now(), latency);
    }

    fn record_at(&self, at: Instant, latency: RequestLatency) {
        let mut samples = self.lock();
        if samples.len() == self.max_samples {
            samples.pop_front();
        }
        samples.push_back((at, latency));
        Self::evict(&mut samples, at, self.window);
    }

    /// Percentiles over the requests finished within the window before now.
    pub fn summary(&self) -> LatencySummary {
        self.summary_at(Instant::now())
    }

    fn summary_at(&self, now: Instant) -> LatencySummary {
        let mut samples = self.lock();
        Self::evict(&mut samples, now, self.window);
        let column = |f: fn(&RequestLatency) -> Option<f64>| {
            Percentiles::of(samples.iter().filter_map(|(_, l)| f(l)).collect())
        };
        LatencySummary {
            window_seconds: self.window.as_secs_f64(),
            num_requests: samples.len(),
            time_to_first_token_seconds: column(|l| Some(l.time_to_first_token)),
            time_per_output_token_seconds: column(|l| l.time_per_output_token),
            e2e_request_latency_seconds: column(|l| Some(l.e2e)),
        }
    }

    fn evict(samples: &mut VecDeque<(Instant, RequestLatency)>, now: Instant, window: Duration) {
        while samples
            .front()
            .is_some_and(|(at, _)| now.saturating_duration_since(*at) > window)
        {
            samples.pop_front();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<(Instant, RequestLatency)>> {
        self.samples
            .lock()
            .expect("latency window lock is never poisoned: holders do not panic")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn latency(ttft: f64) -> RequestLatency {
        RequestLatency {
            time_to_first_token: ttft,
            time_per_output_token: (ttft > 0.5).then_some(ttft / 10.0),
            e2e: ttft * 2.0,
        }
    }

    #[test]
    fn nearest_rank_percentiles_of_one_to_a_hundred() {
        let window = LatencyWindow::new(Duration::from_secs(60), 1000);
        let now = Instant::now();
        for i in (1..=100).rev() {
            window.record_at(now, latency(i as f64));
        }
        let s = window.summary_at(now);
        assert_eq!(s.num_requests, 100);
        let ttft = s.time_to_first_token_seconds;
        assert_eq!(
            (ttft.p50, ttft.p90, ttft.p95, ttft.p99, ttft.max),
            (Some(50.0), Some(90.0), Some(95.0), Some(99.0), Some(100.0))
        );
        assert_eq!(s.e2e_request_latency_seconds.p50, Some(100.0));
    }

    #[test]
    fn requests_without_a_decode_have_no_tpot() {
        let window = LatencyWindow::default();
        window.record(latency(0.1));
        window.record(latency(2.0));
        let s = window.summary();
        assert_eq!(s.time_to_first_token_seconds.count, 2);
        assert_eq!(s.time_per_output_token_seconds.count, 1);
        assert_eq!(s.time_per_output_token_seconds.p99, Some(0.2));
    }

    #[test]
    fn old_requests_leave_the_window() {
        let window = LatencyWindow::new(Duration::from_secs(60), 1000);
        let start = Instant::now();
        window.record_at(start, latency(9.0));
        window.record_at(start + Duration::from_secs(30), latency(1.0));
        let later = window.summary_at(start + Duration::from_secs(61));
        assert_eq!(later.num_requests, 1);
        assert_eq!(later.time_to_first_token_seconds.max, Some(1.0));
        let empty = window.summary_at(start + Duration::from_secs(200));
        assert_eq!(empty.num_requests, 0);
        assert_eq!(empty.time_to_first_token_seconds, Percentiles::default());
    }

    #[test]
    fn the_sample_count_is_bounded() {
        let window = LatencyWindow::new(Duration::from_secs(60), 3);
        let now = Instant::now();
        for i in 1..=5 {
            window.record_at(now, latency(i as f64));
        }
        let s = window.summary_at(now);
        assert_eq!(s.num_requests, 3);
        assert_eq!(s.time_to_first_token_seconds.p50, Some(4.0));
    }
}
