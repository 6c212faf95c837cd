//! Harness of the end-to-end tests in `tests/`: each test starts the real `moeserve serve`
//! binary on 127.0.0.1 (port 0, address read from its log) with a real tiny model, talks to it
//! over HTTP, and kills it at the end (a drop guard). No fake engine, loopback only, and every
//! wait is bounded. `Browser` drives a real headless Chromium over WebDriver; `Prometheus` runs
//! a real Prometheus server.

mod browser;
mod client;
mod prometheus;
mod server;

pub use browser::{Browser, find_tool, free_port};
pub use client::{
    JsonResponse, REQUEST_TIMEOUT, Sample, SseData, SseReader, client, engine_idle, metric_sum,
    parse_metrics, post_json, post_stream, scrape, scrape_until, send, status_of,
};
pub use prometheus::{Prometheus, promtool};
pub use server::{
    Server, demo_model_dir, moeserve_bin, repo_root, run_to_exit, run_with_output, tiny_model,
    tiny_model_path,
};
