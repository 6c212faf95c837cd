//! Security defaults end to end: the default bind address is loopback, `--metrics-auth` puts
//! `/metrics` behind the API key (and needs one), and nothing a request names reaches the
//! filesystem (model names and paths are matched, never opened).

use std::time::Duration;

use moeserve_e2e::{Server, client, run_to_exit, send, status_of, tiny_model, tiny_model_path};
use serde_json::json;

const KEY: &str = "sk-e2e-Metrics-456";

#[tokio::test]
async fn the_default_bind_address_is_loopback() {
    // A model directory without weights: the server binds, prints its address, then stops.
    let model = tiny_model(None);
    let path = tiny_model_path(&model);
    std::fs::remove_file(path.join("model.safetensors")).unwrap();
    let (_, log) = run_to_exit(
        &["serve", "--model", path.to_str().unwrap(), "--port", "0"],
        Duration::from_secs(60),
    );
    assert!(log.contains("listening on http://127.0.0.1:"), "{log}");
}

#[tokio::test]
async fn metrics_auth_puts_metrics_behind_the_key() {
    let model = tiny_model(None);
    let path = tiny_model_path(&model);
    let server = Server::start(&[
        "--model",
        path.to_str().unwrap(),
        "--api-key",
        KEY,
        "--metrics-auth",
    ])
    .await;
    let c = client();
    let metrics = server.url("/metrics");
    let refused = send(c.get(&metrics)).await;
    assert_eq!(refused.status, 401, "{}", refused.body);
    assert_eq!(refused.error()["code"], "invalid_api_key");
    assert_eq!(
        status_of(c.get(&metrics).bearer_auth("sk-wrong")).await,
        401
    );
    assert_eq!(status_of(c.get(&metrics).bearer_auth(KEY)).await, 200);
    // Health stays open for load balancers; every /v1 route needs the key.
    assert_eq!(status_of(c.get(server.url("/health"))).await, 200);
    for path in ["/v1/models", "/v1/moe/load"] {
        assert_eq!(status_of(c.get(server.url(path))).await, 401, "{path}");
        assert_eq!(
            status_of(c.get(server.url(path)).bearer_auth(KEY)).await,
            200,
            "{path}"
        );
    }
    assert!(server.log_shows("/metrics", Duration::from_secs(5)));
    assert!(!server.logs().contains(KEY), "the key was logged");
}

#[tokio::test]
async fn metrics_auth_without_a_key_is_refused_at_start_up() {
    let model = tiny_model(None);
    let path = tiny_model_path(&model);
    let (status, log) = run_to_exit(
        &[
            "serve",
            "--model",
            path.to_str().unwrap(),
            "--port",
            "0",
            "--metrics-auth",
        ],
        Duration::from_secs(60),
    );
    assert!(!status.success());
    assert!(log.contains("--metrics-auth needs an API key"), "{log}");
    assert!(!log.contains("listening on"), "{log}");
}

#[tokio::test]
async fn paths_in_requests_never_reach_the_filesystem() {
    let model = tiny_model(None);
    let path = tiny_model_path(&model);
    let server = Server::start(&["--model", path.to_str().unwrap()]).await;
    let c = client();
    // A model name that is a path is a name like any other: not served, nothing opened.
    let dir = path.to_str().unwrap();
    for name in [dir, "../tiny", "/etc/passwd", "tiny/../../etc"] {
        let r = send(
            c.post(server.url("/v1/completions"))
                .json(&json!({"model": name, "prompt": "x", "max_tokens": 1})),
        )
        .await;
        assert_eq!(r.status, 404, "{name}: {}", r.body);
        assert_eq!(r.error()["code"], "model_not_found");
    }
    // Path tricks in the URL match no route.
    for url in [
        "/v1/../etc/passwd",
        "/%2e%2e/%2e%2e/etc/passwd",
        "/v1/models/../../config.json",
    ] {
        let r = send(c.get(server.url(url))).await;
        assert_eq!(r.status, 404, "{url}: {}", r.body);
    }
}

/// A JSON route takes only `Content-Type: application/json`: the form and `text/plain` POSTs a
/// web page can send to a local server without a CORS preflight never start a generation.
#[tokio::test]
async fn json_routes_refuse_bodies_not_declared_json_with_415() {
    let model = tiny_model(None);
    let path = tiny_model_path(&model);
    let server = Server::start(&["--model", path.to_str().unwrap()]).await;
    let c = client();
    let body = json!({"prompt": "x", "max_tokens": 2}).to_string();
    for route in ["/v1/completions", "/v1/chat/completions"] {
        for content_type in [
            Some("text/plain"),
            Some("application/x-www-form-urlencoded"),
            Some("multipart/form-data; boundary=x"),
            None,
        ] {
            let mut request = c.post(server.url(route)).body(body.clone());
            if let Some(t) = content_type {
                request = request.header("content-type", t);
            }
            let r = send(request).await;
            assert_eq!(r.status, 415, "{route} {content_type:?}: {}", r.body);
            assert_eq!(r.error()["code"], "unsupported_media_type");
        }
    }
    for content_type in ["application/json", "application/json; charset=utf-8"] {
        let request = c
            .post(server.url("/v1/completions"))
            .header("content-type", content_type)
            .body(body.clone());
        assert_eq!(status_of(request).await, 200, "{content_type}");
    }
    assert!(server.log_shows("ready", Duration::from_secs(1)));
}

/// Bound to loopback, the server answers only requests naming a loopback `Host` (a rebound DNS
/// name is refused) and only browser origins on a loopback host, whose CORS preflight it
/// answers; `--allowed-hosts` / `--allowed-origins` widen that.
#[tokio::test]
async fn a_loopback_server_refuses_foreign_hosts_and_origins() {
    let model = tiny_model(None);
    let path = tiny_model_path(&model);
    let server = Server::start(&["--model", path.to_str().unwrap()]).await;
    let c = client();
    let health = server.url("/health");
    assert_eq!(status_of(c.get(&health)).await, 200);
    let rebound = send(c.get(&health).header("host", "evil.example:8000")).await;
    assert_eq!(rebound.status, 403, "{}", rebound.body);
    assert!(rebound.error_message().contains("--allowed-hosts"));
    let completions = server.url("/v1/completions");
    let body = json!({"prompt": "x", "max_tokens": 2});
    let foreign = c
        .post(&completions)
        .header("origin", "http://evil.example")
        .json(&body);
    assert_eq!(status_of(foreign).await, 403);
    let local = send(
        c.post(&completions)
            .header("origin", "http://localhost:3000")
            .json(&body),
    )
    .await;
    assert_eq!(local.status, 200, "{}", local.body);
    assert_eq!(
        local.headers["access-control-allow-origin"],
        "http://localhost:3000"
    );
    let preflight = c
        .request(reqwest::Method::OPTIONS, &completions)
        .header("origin", "http://localhost:3000")
        .header("access-control-request-method", "POST")
        .send()
        .await
        .unwrap();
    assert_eq!(preflight.status(), 204);
    let allowed = preflight.headers()["access-control-allow-headers"]
        .to_str()
        .unwrap();
    assert!(allowed.contains("content-type") && allowed.contains("authorization"));
    drop(server);

    let server = Server::start(&[
        "--model",
        path.to_str().unwrap(),
        "--allowed-hosts",
        "models.internal, 127.0.0.1",
        "--allowed-origins",
        "https://app.example",
    ])
    .await;
    let health = server.url("/health");
    let named = c.get(&health).header("host", "models.internal");
    assert_eq!(status_of(named).await, 200);
    let from_app = c.get(&health).header("origin", "https://app.example");
    assert_eq!(status_of(from_app).await, 200);
    let from_localhost = c.get(&health).header("origin", "http://localhost:3000");
    assert_eq!(status_of(from_localhost).await, 403);
}
