//! A real headless Chromium driven over WebDriver: Debian's `chromedriver` (package
//! `chromium-driver`) and `chromium`, found on `PATH` (or `MOESERVE_CHROMEDRIVER` /
//! `MOESERVE_CHROMIUM`). The W3C WebDriver protocol is plain JSON over HTTP, so the few
//! commands the tests need are sent with reqwest; the session, driver and browser end on drop.

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine as _;
use serde_json::{Value, json};

/// Chromium flags for a closed network and a throwaway profile: no first-run UI, no
/// background requests (updates, sync, QUIC probes) that fail or stall without internet.
const CHROMIUM_FLAGS: &[&str] = &[
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
];

/// Finds `name` on `PATH` (or the path in `env_var`), failing with how to install it.
pub fn find_tool(env_var: &str, name: &str, package: &str) -> PathBuf {
    if let Some(path) = std::env::var_os(env_var) {
        return PathBuf::from(path);
    }
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "`{name}` is not installed: `apt-get install -y {package}` (.ci/run installs it), \
                 or set {env_var}"
            )
        })
}

/// A free loopback port (bound and released; the tools below take a port, not a socket).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind a loopback port")
        .port()
}

/// One browser session.
pub struct Browser {
    driver: Child,
    port: u16,
    session: String,
    http: reqwest::Client,
    _profile: tempfile::TempDir,
}

impl Browser {
    /// Starts chromedriver and a headless Chromium with a fresh profile and a window of
    /// `width` × `height` CSS pixels.
    pub async fn start(width: u32, height: u32) -> Browser {
        let driver_bin = find_tool("MOESERVE_CHROMEDRIVER", "chromedriver", "chromium-driver");
        let chromium = find_tool("MOESERVE_CHROMIUM", "chromium", "chromium");
        let port = free_port();
        let driver = Command::new(driver_bin)
            .arg(format!("--port={port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver");
        let profile = tempfile::Builder::new()
            .prefix("moeserve-chromium-")
            .tempdir()
            .expect("profile dir");
        let http = crate::client();
        let mut browser = Browser {
            driver,
            port,
            session: String::new(),
            http,
            _profile: profile,
        };
        browser.wait_driver_ready().await;
        let mut args: Vec<String> = CHROMIUM_FLAGS.iter().map(|s| s.to_string()).collect();
        args.push(format!(
            "--user-data-dir={}",
            browser._profile.path().display()
        ));
        args.push(format!("--window-size={width},{height}"));
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {"binary": chromium, "args": args},
        }}});
        let created = browser.command("POST", "/session", Some(caps)).await;
        browser.session = created["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no session id in {created}"))
            .to_string();
        browser
    }

    async fn wait_driver_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let url = format!("http://127.0.0.1:{}/status", self.port);
            if let Ok(r) = self.http.get(&url).send().await
                && let Ok(body) = r.json::<Value>().await
                && body["value"]["ready"] == true
            {
                return;
            }
            assert!(Instant::now() < deadline, "chromedriver did not start");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Sends one WebDriver command and returns its `value`; a WebDriver error panics with it.
    async fn command(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let url = format!("http://127.0.0.1:{}{path}", self.port);
        let request = match method {
            "GET" => self.http.get(&url),
            "POST" => self
                .http
                .post(&url)
                .json(&body.unwrap_or_else(|| json!({}))),
            "DELETE" => self.http.delete(&url),
            other => panic!("unsupported method {other}"),
        };
        let response = request.send().await.expect("WebDriver request sent");
        let status = response.status();
        let body: Value = response.json().await.expect("WebDriver JSON answer");
        assert!(
            status.is_success(),
            "WebDriver {method} {path}: {status} {body}"
        );
        body["value"].clone()
    }

    fn session_path(&self, rest: &str) -> String {
        format!("/session/{}{rest}", self.session)
    }

    /// Opens `url` and waits for its load event.
    pub async fn goto(&self, url: &str) {
        self.command(
            "POST",
            &self.session_path("/url"),
            Some(json!({ "url": url })),
        )
        .await;
    }

    /// Runs `script` (a function body; `arguments` holds `args`) in the page and returns what
    /// it returns, as JSON.
    pub async fn execute(&self, script: &str, args: Value) -> Value {
        let body = json!({ "script": script, "args": args });
        self.command("POST", &self.session_path("/execute/sync"), Some(body))
            .await
    }

    /// Re-runs `script` until it returns something other than `null`/`false` (bounded).
    pub async fn wait_for(&self, what: &str, script: &str, timeout: Duration) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            let value = self.execute(script, json!([])).await;
            if !value.is_null() && value != false {
                return value;
            }
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Resizes the window (CSS pixels).
    pub async fn set_window_size(&self, width: u32, height: u32) {
        let body = json!({ "width": width, "height": height });
        self.command("POST", &self.session_path("/window/rect"), Some(body))
            .await;
    }

    /// A PNG of the viewport.
    pub async fn screenshot(&self) -> Vec<u8> {
        let value = self
            .command("GET", &self.session_path("/screenshot"), None)
            .await;
        let encoded = value.as_str().expect("screenshot is base64 text");
        base64::engine::general_purpose::STANDARD
            .decode(encoded)
            .expect("screenshot base64")
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // Ending the session closes Chromium; a plain request, as drop cannot await.
        if !self.session.is_empty()
            && let Ok(mut stream) = TcpStream::connect(("127.0.0.1", self.port))
        {
            let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
            let request = format!(
                "DELETE /session/{} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nConnection: close\r\n\r\n",
                self.session, self.port
            );
            if stream.write_all(request.as_bytes()).is_ok() {
                let _ = std::io::Read::read(&mut stream, &mut [0u8; 256]);
            }
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}
