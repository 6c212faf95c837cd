//! Bad input from clients, end to end: a catalogue of malformed, mistyped, out-of-range and
//! oversized requests, each answered in OpenAI's error shape naming the field at fault, while a
//! good request keeps being served between them; and clients that send too slowly or too much
//! at the HTTP level (408, 431, closed connections).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use moeserve_e2e::{JsonResponse, Server, client, post_json, send, tiny_model, tiny_model_path};
use serde_json::{Value, json};

/// One bad request: where it goes, its raw body, and the answer expected.
struct Case {
    path: &'static str,
    body: Vec<u8>,
    status: u16,
    /// The `param` the error must name (`None`: the body as a whole is at fault).
    param: Option<&'static str>,
}

fn case(
    path: &'static str,
    body: impl Into<Vec<u8>>,
    status: u16,
    param: Option<&'static str>,
) -> Case {
    Case {
        path,
        body: body.into(),
        status,
        param,
    }
}

const CMPL: &str = "/v1/completions";
const CHAT: &str = "/v1/chat/completions";

fn json_case(path: &'static str, body: Value, param: &'static str) -> Case {
    case(path, body.to_string(), 400, Some(param))
}

/// Every bad input tried; the closing note of the reliability issue lists these.
fn catalogue() -> Vec<Case> {
    let user = json!([{"role": "user", "content": "hi"}]);
    let many_stops: Vec<String> = (0..65).map(|i| format!("s{i}")).collect();
    vec![
        // Not JSON, or not the JSON of this endpoint.
        case(CMPL, "{not json", 400, None),
        case(CMPL, r#"{"prompt": "ab"#, 400, None),
        case(CMPL, "", 400, None),
        case(CMPL, "[]", 400, None),
        case(CMPL, "null", 400, None),
        case(CMPL, r#"{"prompt": "a"} trailing"#, 400, None),
        case(CMPL, r#"{"prompt": "a", "prompt": "b"}"#, 400, None),
        case(CMPL, r#"{"prompt": "hi", "temperature": NaN}"#, 400, None),
        case(CMPL, &b"{\"prompt\": \"\xff\xfe\"}"[..], 400, None),
        case(CMPL, r#"{"prompt": "\ud800"}"#, 400, None),
        // Wrong types.
        json_case(
            CMPL,
            json!({"prompt": "x", "temperature": "hot"}),
            "temperature",
        ),
        json_case(CMPL, json!({"prompt": "x", "stream": "yes"}), "stream"),
        json_case(CMPL, json!({"prompt": "x", "model": 7}), "model"),
        json_case(CMPL, json!({"prompt": [-1]}), "prompt"),
        json_case(CMPL, json!({"prompt": 5}), "prompt"),
        json_case(CMPL, json!({"prompt": "x", "stop": 5}), "stop"),
        json_case(CMPL, json!({"prompt": "x", "seed": -1}), "seed"),
        json_case(CHAT, json!({"messages": "hello"}), "messages"),
        json_case(CHAT, json!({"messages": [{"content": "x"}]}), "messages[0]"),
        json_case(
            CHAT,
            json!({"messages": [{"role": "user", "content": 5}]}),
            "messages[0].content",
        ),
        json_case(
            CHAT,
            json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
            "messages[0].content",
        ),
        // max_tokens: negative, zero, fractional, huge.
        json_case(CMPL, json!({"prompt": "x", "max_tokens": -1}), "max_tokens"),
        json_case(CMPL, json!({"prompt": "x", "max_tokens": 0}), "max_tokens"),
        json_case(
            CMPL,
            json!({"prompt": "x", "max_tokens": 2.5}),
            "max_tokens",
        ),
        json_case(
            CMPL,
            json!({"prompt": "x", "max_tokens": 1e30}),
            "max_tokens",
        ),
        json_case(
            CHAT,
            json!({"messages": user, "max_tokens": 0}),
            "max_tokens",
        ),
        json_case(
            CHAT,
            json!({"messages": user, "max_completion_tokens": 0}),
            "max_completion_tokens",
        ),
        // Empty prompt or messages; token ids out of the vocabulary.
        json_case(CMPL, json!({"max_tokens": 3}), "prompt"),
        json_case(CMPL, json!({"prompt": ""}), "prompt"),
        json_case(CMPL, json!({"prompt": []}), "prompt"),
        json_case(CMPL, json!({"prompt": [[]]}), "prompt"),
        json_case(CMPL, json!({"prompt": ["a", "b"]}), "prompt"),
        json_case(CMPL, json!({"prompt": [1, 99999]}), "prompt"),
        json_case(CMPL, json!({"prompt": [4294967295u32]}), "prompt"),
        json_case(CHAT, json!({"max_tokens": 2}), "messages"),
        json_case(CHAT, json!({"messages": []}), "messages"),
        // Stop strings and ids.
        json_case(CMPL, json!({"prompt": "x", "stop": ""}), "stop"),
        json_case(CMPL, json!({"prompt": "x", "stop": ["a", ""]}), "stop"),
        json_case(CMPL, json!({"prompt": "x", "stop": many_stops}), "stop"),
        json_case(
            CMPL,
            json!({"prompt": "x", "stop": "y".repeat(2000)}),
            "stop",
        ),
        json_case(
            CMPL,
            json!({"prompt": "x", "stop_token_ids": [999999]}),
            "stop_token_ids",
        ),
        // Out-of-range sampling fields (1e39 overflows f32 to infinity).
        json_case(
            CMPL,
            json!({"prompt": "x", "temperature": -0.5}),
            "temperature",
        ),
        json_case(
            CMPL,
            json!({"prompt": "x", "temperature": 1e39}),
            "temperature",
        ),
        json_case(CMPL, json!({"prompt": "x", "top_p": 0}), "top_p"),
        json_case(CMPL, json!({"prompt": "x", "top_p": 1.5}), "top_p"),
        json_case(CMPL, json!({"prompt": "x", "top_p": -1e39}), "top_p"),
        json_case(CMPL, json!({"prompt": "x", "top_k": -3}), "top_k"),
        json_case(CMPL, json!({"prompt": "x", "min_p": 2}), "min_p"),
        json_case(
            CMPL,
            json!({"prompt": "x", "presence_penalty": 3}),
            "presence_penalty",
        ),
        json_case(
            CMPL,
            json!({"prompt": "x", "frequency_penalty": -3}),
            "frequency_penalty",
        ),
        json_case(
            CMPL,
            json!({"prompt": "x", "repetition_penalty": 0}),
            "repetition_penalty",
        ),
        json_case(CMPL, json!({"prompt": "x", "logprobs": 21}), "logprobs"),
        json_case(
            CHAT,
            json!({"messages": user, "logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
        json_case(
            CHAT,
            json!({"messages": user, "top_logprobs": 2}),
            "top_logprobs",
        ),
        // n / best_of out of range, echo.
        json_case(CMPL, json!({"prompt": "x", "n": 129}), "n"),
        json_case(CMPL, json!({"prompt": "x", "n": 0}), "n"),
        json_case(
            CMPL,
            json!({"prompt": "x", "n": 4, "best_of": 3}),
            "best_of",
        ),
        json_case(
            CMPL,
            json!({"prompt": "x", "best_of": 2, "stream": true}),
            "best_of",
        ),
        json_case(CMPL, json!({"prompt": "x", "echo": true}), "echo"),
        json_case(CHAT, json!({"messages": user, "n": 200}), "n"),
        // Unknown model.
        case(
            CMPL,
            json!({"prompt": "x", "model": "gpt-4"}).to_string(),
            404,
            Some("model"),
        ),
    ]
}

fn assert_error(r: &JsonResponse, status: u16, param: Option<&str>, what: &str) {
    assert_eq!(r.status, status, "{what}: {}", r.body);
    let error = r.error();
    let message = error["message"].as_str().unwrap_or_default();
    assert!(!message.is_empty(), "{what}: {error}");
    assert!(error["type"].is_string(), "{what}: {error}");
    assert!(error.get("code").is_some(), "{what}: {error}");
    assert_eq!(
        error["param"],
        param.map_or(Value::Null, Value::from),
        "{what}: {error}"
    );
    if let Some(param) = param {
        // The message names the field too, for clients that only show the message.
        let field = param.split(['[', '.']).next().unwrap_or(param);
        assert!(message.contains(field), "{what}: {message}");
    }
}

#[tokio::test]
async fn every_bad_input_is_an_openai_error_naming_the_field_and_the_server_keeps_serving() {
    let model = tiny_model(None);
    let server = Server::start(&["--model", tiny_model_path(&model).to_str().unwrap()]).await;
    let good = json!({"prompt": "fine", "max_tokens": 2});
    let cases = catalogue();
    for (i, c) in cases.iter().enumerate() {
        let what = format!("case {i}: {}", String::from_utf8_lossy(&c.body));
        let request = client()
            .post(server.url(c.path))
            .header("content-type", "application/json")
            .body(c.body.clone());
        let r = send(request).await;
        assert_error(&r, c.status, c.param, &what);
        if i % 8 == 0 {
            let ok = post_json(&server.url(CMPL), &good).await;
            assert_eq!(ok.status, 200, "after {what}: {}", ok.body);
        }
    }
    eprintln!("{} bad inputs refused with the field named", cases.len());
    let ok = post_json(&server.url(CMPL), &good).await;
    assert_eq!(ok.status, 200, "{}", ok.body);
}

#[tokio::test]
async fn accepted_oddities_are_served() {
    let model = tiny_model(None);
    let server = Server::start(&["--model", tiny_model_path(&model).to_str().unwrap()]).await;
    let deep = format!(
        r#"{{"prompt": "x", "max_tokens": 1, "extra": {}{}}}"#,
        "[".repeat(5000),
        "]".repeat(5000)
    );
    let bodies = [
        // Unknown fields are ignored, as OpenAI does, however deeply nested.
        json!({"prompt": "x", "max_tokens": 1, "user": "u", "foo": {"bar": [1, 2]}}).to_string(),
        deep,
        // An empty stop list, top_k beyond the vocabulary, best_of 1, a list of one prompt.
        json!({"prompt": "x", "max_tokens": 1, "stop": [], "top_k": 100000000, "best_of": 1})
            .to_string(),
        json!({"prompt": [[5, 6]], "max_tokens": 1}).to_string(),
    ];
    for body in bodies {
        let request = client()
            .post(server.url(CMPL))
            .header("content-type", "application/json")
            .body(body.clone());
        let r = send(request).await;
        assert_eq!(r.status, 200, "{}: {}", &body[..body.len().min(80)], r.body);
    }
}

#[tokio::test]
async fn a_max_tokens_near_usize_max_is_refused_not_wrapped_around() {
    let model = tiny_model(None);
    let server = Server::start(&["--model", tiny_model_path(&model).to_str().unwrap()]).await;
    for max_tokens in [u64::MAX, u64::MAX - 1, 1 << 63] {
        let body = format!(r#"{{"prompt": "hi", "max_tokens": {max_tokens}}}"#);
        let request = client()
            .post(server.url(CMPL))
            .header("content-type", "application/json")
            .body(body);
        let r = send(request).await;
        assert_eq!(r.status, 400, "{max_tokens}: {}", r.body);
        assert_eq!(r.error()["code"], "context_length_exceeded");
    }
}

/// Opens a raw connection to the server.
fn connect(server: &Server) -> TcpStream {
    let address = server.url("").trim_start_matches("http://").to_string();
    let stream = TcpStream::connect(address).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("read timeout");
    stream
}

/// Reads until the server closes the connection (or the read times out).
fn read_all(stream: &mut TcpStream) -> String {
    let mut out = Vec::new();
    let _ = stream.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test]
async fn slow_heads_and_bodies_time_out_and_oversized_heads_are_431() {
    let model = tiny_model(None);
    let path = tiny_model_path(&model);
    let server = Server::start(&[
        "--model",
        path.to_str().unwrap(),
        "--request-read-timeout",
        "1",
        "--max-header-bytes",
        "8KiB",
    ])
    .await;
    // A head that never ends: the connection is closed after the timeout, without an answer.
    let mut slow_head = connect(&server);
    slow_head
        .write_all(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        .unwrap();
    let started = Instant::now();
    let answer = read_all(&mut slow_head);
    let waited = started.elapsed();
    assert!(answer.is_empty(), "{answer}");
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(10),
        "{waited:?}"
    );
    // A body that stops half way: 408 in OpenAI's shape.
    let mut slow_body = connect(&server);
    slow_body
        .write_all(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
              Content-Length: 100\r\n\r\n{\"prompt\"",
        )
        .unwrap();
    let answer = read_all(&mut slow_body);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("did not arrive within 1 s"), "{answer}");
    // A head over --max-header-bytes: 431.
    let mut big_head = connect(&server);
    let header = format!(
        "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: {}\r\n\r\n",
        "a".repeat(10_000)
    );
    big_head.write_all(header.as_bytes()).unwrap();
    let answer = read_all(&mut big_head);
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");
    // Everyone else is still served.
    let ok = post_json(&server.url(CMPL), &json!({"prompt": "x", "max_tokens": 1})).await;
    assert_eq!(ok.status, 200, "{}", ok.body);
}

#[tokio::test]
async fn connections_beyond_the_limit_wait_until_one_closes() {
    let model = tiny_model(None);
    let path = tiny_model_path(&model);
    let server =
        Server::start(&["--model", path.to_str().unwrap(), "--max-connections", "2"]).await;
    // The harness's health checks used a client that is gone now; let the server see its
    // connection close. Then these two take both places.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut first = connect(&server);
    let mut second = connect(&server);
    for stream in [&mut first, &mut second] {
        stream
            .write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            .unwrap();
        let mut buf = [0u8; 64];
        let n = stream.read(&mut buf).unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
    }
    // A third connection is not served while the two stay open...
    let mut third = connect(&server);
    third
        .set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    third
        .write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut buf = [0u8; 64];
    assert!(third.read(&mut buf).is_err(), "served beyond the limit");
    // ...and is once one of them closes.
    drop(first);
    third
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let answer = read_all(&mut third);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

#[tokio::test]
async fn a_request_past_request_timeout_is_cancelled_with_504() {
    let model = tiny_model(Some(32768));
    let path = tiny_model_path(&model);
    let server = Server::start(&[
        "--model",
        path.to_str().unwrap(),
        "--request-timeout",
        "1",
        "--kv-cache-memory",
        "64MiB",
    ])
    .await;
    let long = json!({"prompt": "run", "max_tokens": 30000, "ignore_eos": true});
    let started = Instant::now();
    let r = post_json(&server.url(CMPL), &long).await;
    assert_eq!(r.status, 504, "{}", r.body);
    assert_eq!(r.error()["code"], "request_timeout");
    assert!(started.elapsed() < Duration::from_secs(10));
    // Streamed: the error arrives as the last chunk before [DONE].
    let mut body = long.clone();
    body["stream"] = json!(true);
    let chunks = moeserve_e2e::post_stream(&server.url(CMPL), &body)
        .await
        .collect()
        .await;
    let last = chunks.last().expect("chunks");
    assert_eq!(last["error"]["code"], "request_timeout", "{last}");
    // Short requests are unaffected, and the cancelled ones left no blocks behind.
    let ok = post_json(&server.url(CMPL), &json!({"prompt": "x", "max_tokens": 2})).await;
    assert_eq!(ok.status, 200, "{}", ok.body);
    let samples =
        moeserve_e2e::scrape_until(&server.url("/metrics"), moeserve_e2e::engine_idle).await;
    assert!(moeserve_e2e::engine_idle(&samples));
}

/// A client that half-closes its side after sending a complete request (`shutdown(SHUT_WR)`,
/// as `nc -N` does) gets its full answer: the read-side EOF is not a disconnect.
#[tokio::test]
async fn a_half_closed_client_still_gets_its_answer() {
    let model = tiny_model(None);
    let server = Server::start(&["--model", tiny_model_path(&model).to_str().unwrap()]).await;
    let address = server.url("").trim_start_matches("http://").to_string();
    let body = r#"{"prompt": "hello", "max_tokens": 4, "ignore_eos": true}"#;
    let mut socket = std::net::TcpStream::connect(address.trim_end_matches('/')).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    socket.write_all(request.as_bytes()).unwrap();
    socket.shutdown(std::net::Shutdown::Write).unwrap();
    let mut answer = String::new();
    socket.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer:?}");
    assert!(answer.contains("\"completion_tokens\":4"), "{answer}");
}
