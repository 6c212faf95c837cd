//! Soak: 220 concurrent clients stream completions for a bounded time against a KV cache too
//! small for all of them (so admission waits and preempts), and walk away at random: before the
//! response starts, after a few chunks, or not at all; some send long chat prompts and walk
//! away while the server is still rendering and tokenizing them. Afterwards every KV block is free, no
//! request is running or waiting, the server still answers, and its resident memory after the
//! last round equals that after the one before within a bound (no per-request leak).
//!
//! The allocator keeps what the busiest moment needed, so resident memory climbs for a while
//! before it levels off (on a slow machine, well after a short warm-up): the leak check
//! compares the two halves of the measured time, not the measured time with the warm-up.
//!
//! `MOESERVE_SOAK_SECONDS` lengthens the measured time (default 40 s, in two rounds, after a
//! 12 s warm-up).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use moeserve_e2e::{
    Server, SseData, SseReader, client, engine_idle, metric_sum, post_json, scrape, scrape_until,
    tiny_model, tiny_model_path,
};
use serde_json::{Value, json};

const NUM_CLIENTS: usize = 220;
const WARM_UP: Duration = Duration::from_secs(12);
const DEFAULT_SOAK_SECONDS: u64 = 40;
/// Resident memory may grow this much over one of the two measured rounds (some 6,000–7,000
/// requests each on the CI machine: a leak of 1.3 KiB per request exceeds it in both). The
/// allocator's high-water mark can step up once, by 9–13 MiB, in either round (seen on the CI
/// machine, the other round then growing under 1 MiB), so a leak is growth in both rounds.
const MAX_RSS_GROWTH_BYTES: u64 = 8 << 20;

/// A small deterministic generator (xorshift64*), one per client.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }
}

/// What the clients did, over a round.
#[derive(Default)]
struct Tally {
    completed: AtomicU64,
    dropped_early: AtomicU64,
    dropped_mid_stream: AtomicU64,
    dropped_tokenizing: AtomicU64,
    refused: AtomicU64,
    tokens: AtomicU64,
}

impl Tally {
    fn line(&self) -> String {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        format!(
            "{} completed ({} tokens), {} dropped before the response, {} dropped mid-stream, \
             {} dropped while tokenizing, {} refused (429)",
            get(&self.completed),
            get(&self.tokens),
            get(&self.dropped_early),
            get(&self.dropped_mid_stream),
            get(&self.dropped_tokenizing),
            get(&self.refused),
        )
    }
}

fn request(rng: &mut Rng) -> Value {
    let words = 1 + rng.below(40) as usize;
    let prompt: Vec<String> = (0..words)
        .map(|i| format!("w{}", rng.below(50) + i as u64))
        .collect();
    json!({
        "prompt": prompt.join(" "),
        "max_tokens": 4 + rng.below(60),
        "temperature": rng.below(3) as f64 * 0.5,
        "ignore_eos": rng.below(2) == 0,
        "stream": true,
        "stream_options": {"include_usage": true},
    })
}

fn chat_url(completions_url: &str) -> String {
    completions_url.replace("/v1/completions", "/v1/chat/completions")
}

/// One client's loop until `deadline`.
async fn client_loop(url: String, seed: u64, deadline: Instant, tally: Arc<Tally>) {
    let mut rng = Rng(seed | 1);
    let http = client();
    while Instant::now() < deadline {
        if rng.below(8) == 0 {
            // A long chat prompt (some 15,000 tokens of this byte-level tokenizer: measured by
            // tokenizing it, then refused for the context), left while it is being tokenized.
            let content = "tokenize me ".repeat(1200 + rng.below(400) as usize);
            let body = json!({"messages": [{"role": "user", "content": content}]});
            let send = http.post(chat_url(&url)).json(&body).send();
            let wait = Duration::from_millis(2 + rng.below(20));
            let _ = tokio::time::timeout(wait, send).await;
            tally.dropped_tokenizing.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        let body = request(&mut rng);
        let send = http.post(&url).json(&body).send();
        if rng.below(6) == 0 {
            // Walk away before (or just as) the response starts: whatever arrived is dropped.
            let wait = Duration::from_millis(rng.below(40));
            let _ = tokio::time::timeout(wait, send).await;
            tally.dropped_early.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        let response = send.await.expect("request sent");
        if response.status() == 429 {
            tally.refused.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        }
        let mut reader = SseReader::new(response);
        if rng.below(3) == 0 {
            // Read a few chunks, then disconnect.
            for _ in 0..rng.below(6) {
                if reader.next().await.is_none() {
                    break;
                }
            }
            drop(reader);
            tally.dropped_mid_stream.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        let mut usage = None;
        loop {
            match reader.next().await {
                Some(SseData::Json(chunk)) => {
                    assert!(chunk.get("error").is_none(), "{chunk}");
                    if !chunk["usage"].is_null() {
                        usage = Some(chunk["usage"].clone());
                    }
                }
                Some(SseData::Done) => break,
                None => panic!("stream ended without [DONE]"),
            }
        }
        let usage = usage.expect("usage chunk");
        let tokens = usage["completion_tokens"].as_u64().unwrap();
        assert!(tokens >= 1 && tokens <= body["max_tokens"].as_u64().unwrap());
        tally.completed.fetch_add(1, Ordering::Relaxed);
        tally.tokens.fetch_add(tokens, Ordering::Relaxed);
    }
}

/// Runs every client for `length`, then checks nothing is left running.
async fn round(server: &Server, length: Duration, seed: u64) -> Tally {
    let tally = Arc::new(Tally::default());
    let deadline = Instant::now() + length;
    let url = server.url("/v1/completions");
    let clients: Vec<_> = (0..NUM_CLIENTS as u64)
        .map(|i| {
            tokio::spawn(client_loop(
                url.clone(),
                seed * 1000 + i,
                deadline,
                tally.clone(),
            ))
        })
        .collect();
    // Under load, the cache is full but never over-committed.
    let mut max_usage: f64 = 0.0;
    while Instant::now() < deadline {
        let samples = scrape(&server.url("/metrics")).await;
        let usage = metric_sum(&samples, "moeserve:kv_cache_usage_perc").unwrap();
        assert!((0.0..=1.0).contains(&usage), "KV usage {usage}");
        max_usage = max_usage.max(usage);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // No client is stuck: each one's last request ends within a bound.
    for client in clients {
        tokio::time::timeout(Duration::from_secs(60), client)
            .await
            .expect("a client is stuck")
            .expect("client task");
    }
    let samples = scrape_until(&server.url("/metrics"), engine_idle).await;
    assert!(
        engine_idle(&samples),
        "not idle after the round: {samples:?}"
    );
    eprintln!("round: {}; peak KV usage {max_usage:.2}", tally.line());
    Arc::try_unwrap(tally).unwrap_or_else(|_| panic!("clients are done"))
}

/// `VmRSS` of a process, in bytes.
fn resident_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS line");
    kib * 1024
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hundreds_of_streaming_clients_with_random_disconnects_leave_nothing_behind() {
    let soak = std::env::var("MOESERVE_SOAK_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_SOAK_SECONDS);
    let model = tiny_model(Some(2048));
    let path = tiny_model_path(&model);
    // 384 blocks of 16 tokens: far fewer than 220 clients want at once.
    let server = Server::start(&[
        "--model",
        path.to_str().unwrap(),
        "--kv-cache-memory",
        "3MiB",
        "--max-num-seqs",
        "128",
    ])
    .await;
    let pid = server.pid();
    let at_start = resident_bytes(pid);
    let warm = round(&server, WARM_UP, 1).await;
    let after_warm_up = resident_bytes(pid);
    let half = Duration::from_secs(soak).div_f64(2.0);
    let first = round(&server, half, 2).await;
    let after_first = resident_bytes(pid);
    let measured = round(&server, half, 3).await;
    let after_soak = resident_bytes(pid);
    let samples = scrape(&server.url("/metrics")).await;
    let preemptions = metric_sum(&samples, "moeserve:num_preemptions_total").unwrap_or(0.0);
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    eprintln!(
        "soak: {NUM_CLIENTS} clients, {} s warm-up + 2 × {:.0} s; RSS {:.1} MiB at start, \
         {:.1} MiB after warm-up, {:.1} MiB after the first half, {:.1} MiB after the second; \
         {preemptions} preemptions",
        WARM_UP.as_secs(),
        half.as_secs_f64(),
        mib(at_start),
        mib(after_warm_up),
        mib(after_first),
        mib(after_soak),
    );
    let served = |t: &Tally| t.completed.load(Ordering::Relaxed);
    assert!(served(&warm) > 0 && served(&first) > 0 && served(&measured) > 0);
    assert!(measured.dropped_mid_stream.load(Ordering::Relaxed) > 0);
    assert!(measured.dropped_early.load(Ordering::Relaxed) > 0);
    assert!(measured.dropped_tokenizing.load(Ordering::Relaxed) > 0);
    let growth = |from: u64, to: u64| to.saturating_sub(from);
    let least = growth(after_warm_up, after_first).min(growth(after_first, after_soak));
    assert!(
        least <= MAX_RSS_GROWTH_BYTES,
        "resident memory grew in both measured rounds: {:.1} → {:.1} → {:.1} MiB",
        mib(after_warm_up),
        mib(after_first),
        mib(after_soak)
    );
    // Still serving, with a clean slate.
    let ok = post_json(
        &server.url("/v1/completions"),
        &json!({"prompt": "after", "max_tokens": 4}),
    )
    .await;
    assert_eq!(ok.status, 200, "{}", ok.body);
    let health = client().get(server.url("/health")).send().await.unwrap();
    assert_eq!(health.status(), 200);
}
