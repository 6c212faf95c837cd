//! Starting the real `moeserve` binary: finding it, making a tiny model with it, and a guard that
//! runs `moeserve serve` on 127.0.0.1 with port 0 and kills it when dropped.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a server may take to print its address, and then to become healthy.
const START_TIMEOUT: Duration = Duration::from_secs(120);

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The demo model (`MOESERVE_DEMO_MODEL`, else models/smolmoe-8x135m); panics with how to
/// make it when it is missing.
pub fn demo_model_dir() -> PathBuf {
    let dir = std::env::var_os("MOESERVE_DEMO_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("models/smolmoe-8x135m"));
    assert!(
        dir.join("config.json").exists(),
        "{} is missing: run models/smolmoe-8x135m.sh",
        dir.display()
    );
    dir
}

/// The binary under test: `MOESERVE_BIN`, else `target/<profile>/moeserve` of this workspace
/// (`cargo test --workspace` builds it; scripts/test.sh builds it first explicitly).
pub fn moeserve_bin() -> PathBuf {
    if let Some(bin) = std::env::var_os("MOESERVE_BIN") {
        return PathBuf::from(bin);
    }
    let profile = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target"));
    let bin = target.join(profile).join("moeserve");
    assert!(
        bin.exists(),
        "{} is missing: run `cargo build --{profile} --bin moeserve` first (scripts/test.sh \
         does), or set MOESERVE_BIN",
        bin.display()
    );
    bin
}

/// A `mixtral-tiny` checkpoint (byte-level tokenizer, ChatML template) made by the binary in a
/// temporary directory. `context_len` raises `max_position_embeddings` (1024 in the preset), so
/// a request can run long enough to be interrupted (RoPE works at any position).
pub fn tiny_model(context_len: Option<usize>) -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix("moeserve-e2e-")
        .tempdir()
        .expect("temp dir");
    let out = dir.path().join("tiny");
    let status = Command::new(moeserve_bin())
        .args(["make-model", "--preset", "mixtral-tiny", "--out"])
        .arg(&out)
        .stderr(Stdio::null())
        .status()
        .expect("run moeserve make-model");
    assert!(status.success(), "moeserve make-model failed: {status}");
    if let Some(len) = context_len {
        let path = out.join("config.json");
        let text = std::fs::read_to_string(&path).expect("read config.json");
        let mut config: serde_json::Value = serde_json::from_str(&text).expect("config JSON");
        config["max_position_embeddings"] = len.into();
        std::fs::write(&path, config.to_string()).expect("write config.json");
    }
    dir
}

/// The model directory inside a [`tiny_model`] temp dir.
pub fn tiny_model_path(dir: &tempfile::TempDir) -> PathBuf {
    dir.path().join("tiny")
}

/// A running `moeserve serve`, killed on drop.
pub struct Server {
    child: Child,
    base: String,
    log: Arc<Mutex<Vec<String>>>,
}

impl Server {
    /// Starts `moeserve serve --host 127.0.0.1 --port 0 ARGS...` and waits until `/health` is 200.
    pub async fn start(args: &[&str]) -> Server {
        Server::start_with_env(args, &[]).await
    }

    /// Like [`Server::start`], with extra environment variables.
    pub async fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Server {
        let server = Server::spawn(args, env);
        server.wait_healthy().await;
        server
    }

    /// Starts the process and waits only for its `listening on` line.
    pub fn spawn(args: &[&str], env: &[(&str, &str)]) -> Server {
        let mut child = Command::new(moeserve_bin())
            .args(["serve", "--host", "127.0.0.1", "--port", "0"])
            .args(args)
            .env_remove("MOESERVE_API_KEY")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start moeserve serve");
        let stderr = child.stderr.take().expect("stderr is piped");
        let log = Arc::new(Mutex::new(Vec::new()));
        let (address_tx, address_rx) = mpsc::channel();
        let lines = log.clone();
        // Reads stderr to the end, so the server never blocks on a full pipe.
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(at) = line.find("listening on http://") {
                    // The address ends where the text line or the JSON string does.
                    let address = &line[at + "listening on ".len()..];
                    let end = address.find(['"', ' ']).unwrap_or(address.len());
                    let _ = address_tx.send(address[..end].to_string());
                }
                lines.lock().expect("log lock").push(line);
            }
        });
        let base = match address_rx.recv_timeout(START_TIMEOUT) {
            Ok(base) => base.trim().to_string(),
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                let log = log.lock().expect("log lock").join("\n");
                panic!("moeserve serve printed no address:\n{log}");
            }
        };
        Server { child, base, log }
    }

    async fn wait_healthy(&self) {
        let client = crate::client();
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Ok(r) = client.get(self.url("/health")).send().await
                && r.status() == 200
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "server not healthy in time:\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// `http://127.0.0.1:PORT` + `path`.
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// The server's process id (for signals and /proc).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends SIGTERM, as `docker stop` and Kubernetes do.
    pub fn terminate(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -TERM failed: {status}");
    }

    /// Everything the server printed on stderr so far.
    pub fn logs(&self) -> String {
        self.log.lock().expect("log lock").join("\n")
    }

    /// Whether the log shows `needle` within `timeout` (stderr is read by another thread, so a
    /// line may trail the event it reports).
    pub fn log_shows(&self, needle: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if self.logs().contains(needle) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits (bounded) for the process to exit by itself.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                // Let the reader thread take the last lines.
                std::thread::sleep(Duration::from_millis(50));
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `moeserve ARGS...` to completion (bounded), returning its status and stderr.
pub fn run_to_exit(args: &[&str], timeout: Duration) -> (ExitStatus, String) {
    let mut server = Server {
        child: Command::new(moeserve_bin())
            .args(args)
            .env_remove("MOESERVE_API_KEY")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start moeserve"),
        base: String::new(),
        log: Arc::new(Mutex::new(Vec::new())),
    };
    let stderr = server.child.stderr.take().expect("stderr is piped");
    let lines = server.log.clone();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            lines.lock().expect("log lock").push(line);
        }
    });
    let status = server
        .wait_exit(timeout)
        .unwrap_or_else(|| panic!("moeserve did not exit in time:\n{}", server.logs()));
    let _ = reader.join();
    (status, server.logs())
}

/// Runs `moeserve ARGS...` to completion within `timeout`, capturing stdout and stderr (the
/// command-line tools: `bench serve`, `plan`, `tune`).
pub fn run_with_output(args: &[&str], timeout: Duration) -> std::process::Output {
    let child = Command::new(moeserve_bin())
        .args(args)
        .env_remove("MOESERVE_API_KEY")
        .env_remove("OPENAI_API_KEY")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start moeserve");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    rx.recv_timeout(timeout)
        .unwrap_or_else(|_| panic!("moeserve {args:?} did not finish in {timeout:?}"))
        .expect("moeserve output")
}
