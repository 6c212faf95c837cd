//! SIGTERM drains, end to end: from the signal on, new requests and `/health` get 503 while the
//! requests in flight finish; those still running after `--shutdown-timeout` are cancelled with
//! a 503 chunk; then the process exits 0.

use std::time::{Duration, Instant};

use moeserve_e2e::{
    Server, SseData, client, metric_sum, post_json, post_stream, scrape_until, tiny_model,
    tiny_model_path,
};
use serde_json::{Value, json};

async fn status_and_body(request: reqwest::RequestBuilder) -> (u16, Value) {
    let response = request.send().await.expect("request sent");
    let status = response.status().as_u16();
    (status, response.json().await.expect("JSON body"))
}

/// Checks that a draining server refuses new work with 503 but still answers.
async fn assert_refusing(server: &Server) {
    let c = client();
    let (status, body) = status_and_body(c.get(server.url("/health"))).await;
    assert_eq!(status, 503, "{body}");
    let request = c
        .post(server.url("/v1/completions"))
        .json(&json!({"prompt": "new", "max_tokens": 2}));
    let (status, body) = status_and_body(request).await;
    assert_eq!(status, 503, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("shutting down"),
        "{body}"
    );
}

fn start_args(path: &str, shutdown_timeout: &str) -> Vec<String> {
    [
        "--model",
        path,
        "--kv-cache-memory",
        "64MiB",
        "--shutdown-timeout",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([shutdown_timeout.to_string()])
    .collect()
}

#[tokio::test]
async fn sigterm_lets_requests_in_flight_finish_then_exits_0() {
    let model = tiny_model(Some(8192));
    let path = tiny_model_path(&model);
    let args = start_args(path.to_str().unwrap(), "60");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut server = Server::start(&args).await;
    let max_tokens = 2000;
    let url = server.url("/v1/completions");
    let body = json!({"prompt": "drain", "max_tokens": max_tokens, "ignore_eos": true,
                      "stream": true, "stream_options": {"include_usage": true}});
    let mut stream = post_stream(&url, &body).await;
    assert!(matches!(stream.next().await, Some(SseData::Json(_))));
    server.terminate();
    assert!(
        server.log_shows("draining: 1 requests in flight", Duration::from_secs(10)),
        "{}",
        server.logs()
    );
    assert_refusing(&server).await;
    // The request in flight runs to its end.
    let chunks = stream.collect().await;
    let usage = &chunks.last().expect("usage chunk")["usage"];
    assert_eq!(usage["completion_tokens"], max_tokens, "{usage}");
    let status = server
        .wait_exit(Duration::from_secs(30))
        .unwrap_or_else(|| panic!("did not exit:\n{}", server.logs()));
    assert!(status.success(), "{status}\n{}", server.logs());
    assert!(server.logs().contains("drained: every request finished"));
}

#[tokio::test]
async fn requests_still_running_at_shutdown_timeout_are_cancelled_then_exits_0() {
    let model = tiny_model(Some(32768));
    let path = tiny_model_path(&model);
    let args = start_args(path.to_str().unwrap(), "1");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut server = Server::start(&args).await;
    let url = server.url("/v1/completions");
    let endless = json!({"prompt": "on and on", "max_tokens": 30000, "ignore_eos": true});
    let mut streamed = endless.clone();
    streamed["stream"] = json!(true);
    let mut stream = post_stream(&url, &streamed).await;
    assert!(matches!(stream.next().await, Some(SseData::Json(_))));
    let plain = tokio::spawn({
        let url = url.clone();
        async move { post_json(&url, &endless).await }
    });
    // Both run before the signal.
    let samples = scrape_until(&server.url("/metrics"), |s| {
        metric_sum(s, "moeserve:num_requests_running") == Some(2.0)
    })
    .await;
    assert_eq!(
        metric_sum(&samples, "moeserve:num_requests_running"),
        Some(2.0)
    );
    let signalled = Instant::now();
    server.terminate();
    assert!(
        server.log_shows("draining: 2 requests in flight", Duration::from_secs(10)),
        "{}",
        server.logs()
    );
    assert_refusing(&server).await;
    // The stream ends with the shutdown error, then [DONE].
    let chunks = stream.collect().await;
    let last = chunks.last().expect("chunks");
    assert!(
        last["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("shutting down")),
        "{last}"
    );
    let plain = plain.await.expect("plain request");
    assert_eq!(plain.status, 503, "{}", plain.body);
    let status = server
        .wait_exit(Duration::from_secs(30))
        .unwrap_or_else(|| panic!("did not exit:\n{}", server.logs()));
    assert!(status.success(), "{status}\n{}", server.logs());
    let took = signalled.elapsed();
    assert!(took < Duration::from_secs(10), "shutdown took {took:?}");
    assert!(
        server.logs().contains("cancelling 2 requests"),
        "{}",
        server.logs()
    );
}
