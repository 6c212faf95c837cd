//! One concurrency level of the benchmark: at most `concurrency` requests in flight, sent
//! back-to-back (a closed loop) or at Poisson arrivals of `request_rate` per second (an open
//! loop capped at `concurrency`, as vLLM's `--max-concurrency`). A sampler task records how many
//! requests are in flight every few milliseconds, the measured `L` of Little's law.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use indicatif::ProgressBar;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::{Semaphore, watch};

use crate::client::Endpoint;
use crate::dataset::BenchPrompt;
use crate::stats::RequestTiming;

/// How often the in-flight count is sampled.
const SAMPLE_INTERVAL: Duration = Duration::from_millis(5);

/// How requests of a level are sent.
#[derive(Clone, Copy, Debug)]
pub struct LevelConfig {
    /// Most requests in flight.
    pub concurrency: usize,
    /// Poisson arrivals per second; `None` sends the next request as soon as one finishes.
    pub request_rate: Option<f64>,
    /// Seeds the inter-arrival times.
    pub seed: u64,
}

/// How many prompts each level sends.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum NumPrompts {
    Fixed(usize),
    /// `k` per unit of concurrency (`--num-prompts 4x`), so every level runs `k` rounds.
    PerClient(usize),
}

impl NumPrompts {
    pub fn for_concurrency(self, concurrency: usize) -> usize {
        match self {
            NumPrompts::Fixed(n) => n,
            NumPrompts::PerClient(k) => k * concurrency,
        }
    }
}

impl std::str::FromStr for NumPrompts {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad =
            || format!("{s:?} is not a count like 64 or a multiple of the concurrency like 4x");
        let (number, per_client) = match s.strip_suffix('x') {
            Some(n) => (n, true),
            None => (s, false),
        };
        let n: usize = number.trim().parse().map_err(|_| bad())?;
        if n == 0 {
            return Err(bad());
        }
        Ok(match per_client {
            true => NumPrompts::PerClient(n),
            false => NumPrompts::Fixed(n),
        })
    }
}

/// What one level measured.
#[derive(Debug, Default)]
pub struct LevelOutcome {
    pub timings: Vec<RequestTiming>,
    /// One line per failed request.
    pub errors: Vec<String>,
    /// First send → last completion, seconds.
    pub duration_s: f64,
    /// Time-average of requests in flight (sampled).
    pub sampled_mean_in_flight: f64,
}

/// Runs `prompts` against `endpoint` under `config`, ticking `progress` per finished request.
pub async fn run_level(
    endpoint: &Endpoint,
    prompts: &[BenchPrompt],
    config: LevelConfig,
    progress: &ProgressBar,
) -> LevelOutcome {
    let permits = Arc::new(Semaphore::new(config.concurrency.max(1)));
    let in_flight = Arc::new(AtomicUsize::new(0));
    let (stop_tx, stop_rx) = watch::channel(false);
    let sampler = tokio::spawn(sample_in_flight(in_flight.clone(), stop_rx));
    let mut arrivals = StdRng::seed_from_u64(config.seed);
    let start = Instant::now();
    let mut next_arrival = 0.0;
    let mut tasks = Vec::with_capacity(prompts.len());
    for prompt in prompts {
        if let Some(rate) = config.request_rate {
            let at = start + Duration::from_secs_f64(next_arrival);
            tokio::time::sleep_until(at.into()).await;
            // Exponential inter-arrival times: -ln(U) / λ with U in (0, 1].
            let u: f64 = 1.0 - arrivals.random::<f64>();
            next_arrival += -u.ln() / rate;
        }
        let permit = permits
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        let (endpoint, prompt) = (endpoint.clone(), prompt.clone());
        let (in_flight, progress) = (in_flight.clone(), progress.clone());
        in_flight.fetch_add(1, Ordering::SeqCst);
        tasks.push(tokio::spawn(async move {
            let result = endpoint.run(&prompt, start).await;
            in_flight.fetch_sub(1, Ordering::SeqCst);
            progress.inc(1);
            drop(permit);
            result
        }));
    }
    let mut outcome = LevelOutcome::default();
    for task in tasks {
        match task.await {
            Ok(Ok(timing)) => outcome.timings.push(timing),
            Ok(Err(error)) => outcome.errors.push(error),
            Err(join) => outcome.errors.push(format!("request task failed: {join}")),
        }
    }
    outcome.duration_s = start.elapsed().as_secs_f64();
    stop_tx.send(true).expect("the sampler holds the receiver");
    outcome.sampled_mean_in_flight = sampler.await.expect("the sampler does not panic");
    outcome
}

/// Samples `in_flight` every [`SAMPLE_INTERVAL`] until told to stop; returns the mean.
async fn sample_in_flight(in_flight: Arc<AtomicUsize>, mut stop: watch::Receiver<bool>) -> f64 {
    let mut ticker = tokio::time::interval(SAMPLE_INTERVAL);
    let (mut sum, mut count) = (0u64, 0u64);
    loop {
        tokio::select! {
            _ = ticker.tick() => {
                sum += in_flight.load(Ordering::SeqCst) as u64;
                count += 1;
            }
            _ = stop.changed() => break,
        }
    }
    if count == 0 {
        0.0
    } else {
        sum as f64 / count as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_counts_are_fixed_or_per_client() {
        assert_eq!("64".parse(), Ok(NumPrompts::Fixed(64)));
        assert_eq!("4x".parse(), Ok(NumPrompts::PerClient(4)));
        assert_eq!(NumPrompts::PerClient(4).for_concurrency(16), 64);
        assert_eq!(NumPrompts::Fixed(10).for_concurrency(16), 10);
        assert!("0".parse::<NumPrompts>().is_err());
        assert!("x".parse::<NumPrompts>().is_err());
    }
}
