//! A real Prometheus server (Debian's `prometheus`, on `PATH` or `MOESERVE_PROMETHEUS`) on a
//! free loopback port with its own storage in a temporary directory, killed on drop; and
//! `promtool` runs.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::browser::{find_tool, free_port};

/// A running `prometheus`.
pub struct Prometheus {
    child: Child,
    base: String,
    dir: tempfile::TempDir,
}

impl Prometheus {
    /// Writes `files` (name, text) into a fresh directory, starts Prometheus on the one called
    /// `prometheus.yml` and waits until it is ready.
    pub async fn start(files: &[(&str, String)]) -> Prometheus {
        let bin = find_tool("MOESERVE_PROMETHEUS", "prometheus", "prometheus");
        let dir = tempfile::Builder::new()
            .prefix("moeserve-prometheus-")
            .tempdir()
            .expect("temp dir");
        for (name, text) in files {
            std::fs::write(dir.path().join(name), text).expect("write a Prometheus file");
        }
        let port = free_port();
        let log = std::fs::File::create(dir.path().join("prometheus.log")).expect("log file");
        let child = Command::new(bin)
            .arg(format!(
                "--config.file={}",
                dir.path().join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start prometheus");
        let prometheus = Prometheus {
            child,
            base: format!("http://127.0.0.1:{port}"),
            dir,
        };
        prometheus.wait_ready().await;
        prometheus
    }

    async fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(r) = crate::client().get(self.url("/-/ready")).send().await
                && r.status() == 200
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "prometheus not ready in time:\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// What Prometheus logged so far.
    pub fn logs(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }

    /// `GET /api/v1/...` with `params`; returns `data`, panicking on an API error.
    pub async fn api(&self, path: &str, params: &[(&str, &str)]) -> Value {
        let query: Vec<String> = params
            .iter()
            .map(|(k, v)| format!("{k}={}", percent_encode(v)))
            .collect();
        let response = crate::client()
            .get(self.url(&format!("/api/v1/{path}?{}", query.join("&"))))
            .send()
            .await
            .expect("Prometheus API request");
        let body: Value = response.json().await.expect("Prometheus API JSON");
        assert_eq!(body["status"], "success", "{path} {params:?}: {body}");
        body["data"].clone()
    }

    /// An instant query's result vector.
    pub async fn query(&self, expr: &str) -> Vec<Value> {
        let data = self.api("query", &[("query", expr)]).await;
        data["result"].as_array().cloned().unwrap_or_default()
    }

    /// Re-runs an instant query until `done` holds for its result (bounded).
    pub async fn query_until(&self, expr: &str, done: impl Fn(&[Value]) -> bool) -> Vec<Value> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let result = self.query(expr).await;
            if done(&result) {
                return result;
            }
            assert!(
                Instant::now() < deadline,
                "`{expr}` never gave the expected result; last: {result:?}\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Percent-encodes a query parameter (every byte but RFC 3986's unreserved ones).
fn percent_encode(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Runs `promtool ARGS...` in `dir`; returns its combined output, panicking if it fails.
pub fn promtool(dir: &Path, args: &[&str]) -> String {
    let bin = find_tool("MOESERVE_PROMTOOL", "promtool", "prometheus");
    let out = Command::new(bin)
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run promtool");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?} failed:\n{text}");
    text
}
