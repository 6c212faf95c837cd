//! Logs as a log stack reads them: `--log-format json` writes one JSON object per line, one
//! access line per request carrying the client's `x-request-id` (returned in the response), and
//! a client that goes away mid-stream is logged as such.

use std::time::{Duration, Instant};

use moeserve_e2e::{Server, SseReader, client, send, tiny_model, tiny_model_path};
use serde_json::{Value, json};

/// The access line of `request_id`, once the server has written it.
async fn access_line(server: &Server, request_id: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let logs = server.logs();
        let found = logs.lines().find_map(|line| {
            let value: Value = serde_json::from_str(line).ok()?;
            (value["target"] == "moeserve::access" && value["request_id"] == request_id)
                .then_some(value)
        });
        if let Some(line) = found {
            return line;
        }
        assert!(
            Instant::now() < deadline,
            "no access line for {request_id}:\n{logs}"
        );
        // Not a blocking sleep: the client's connections live on this runtime.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn json_logs_have_one_access_line_per_request_with_its_id() {
    let model = tiny_model(None);
    let path = tiny_model_path(&model);
    let server = Server::start(&[
        "--model",
        path.to_str().unwrap(),
        "--log-format",
        "json",
        "--api-key",
        "sk-never-logged",
    ])
    .await;
    let body = json!({"prompt": [5, 6, 7], "max_tokens": 5, "ignore_eos": true});
    let response = send(
        client()
            .post(server.url("/v1/completions"))
            .bearer_auth("sk-never-logged")
            .header("x-request-id", "client-id-42")
            .json(&body),
    )
    .await;
    assert_eq!(response.status, 200, "{}", response.body);
    assert_eq!(response.headers["x-request-id"], "client-id-42");
    let line = access_line(&server, "client-id-42").await;
    assert_eq!(line["level"], "INFO");
    assert_eq!(
        (line["method"].as_str(), line["path"].as_str()),
        (Some("POST"), Some("/v1/completions"))
    );
    assert_eq!(line["status"], 200);
    assert_eq!(
        (
            line["prompt_tokens"].as_u64(),
            line["output_tokens"].as_u64()
        ),
        (Some(3), Some(5))
    );
    assert_eq!(line["finish_reason"], "length");
    assert_eq!(line["client_disconnected"], false);
    let total = line["total_seconds"].as_f64().unwrap();
    let ttft = line["ttft_seconds"].as_f64().unwrap();
    let queue = line["queue_seconds"].as_f64().unwrap();
    assert!(0.0 <= queue && queue <= ttft && ttft <= total, "{line}");

    // Without a client id the server makes one, and refusals are logged too.
    let refused = send(client().post(server.url("/v1/completions")).json(&body)).await;
    assert_eq!(refused.status, 401);
    let id = refused.headers["x-request-id"]
        .to_str()
        .unwrap()
        .to_string();
    assert_eq!(id.len(), 32, "{id}");
    assert_eq!(access_line(&server, &id).await["status"], 401);

    // Every line the server wrote is a JSON object, and none holds the key.
    let logs = server.logs();
    assert!(!logs.contains("sk-never-logged"), "{logs}");
    for line in logs.lines() {
        let value: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        assert!(
            value["message"].is_string() && value["timestamp"].is_string(),
            "{line}"
        );
    }
}

#[tokio::test]
async fn a_client_that_leaves_mid_stream_is_logged_as_disconnected() {
    // Long enough (a minute of tokens) that it cannot finish before the client leaves.
    let model = tiny_model(Some(1 << 20));
    let path = tiny_model_path(&model);
    let server = Server::start(&["--model", path.to_str().unwrap(), "--log-format", "json"]).await;
    let request = client()
        .post(server.url("/v1/completions"))
        .header("x-request-id", "leaves-early")
        .json(
            &json!({"prompt": [5, 6], "max_tokens": 500_000, "ignore_eos": true, "stream": true}),
        );
    let response = request.send().await.unwrap();
    assert_eq!(response.headers()["x-request-id"], "leaves-early");
    let mut events = SseReader::new(response);
    assert!(events.next().await.is_some(), "a first event");
    drop(events);
    let line = access_line(&server, "leaves-early").await;
    assert_eq!(line["client_disconnected"], true, "{line}");
    assert_eq!(line["finish_reason"], "client_disconnect", "{line}");
    assert_eq!(line["status"], 200);
}
