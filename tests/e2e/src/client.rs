//! Client side of the end-to-end tests: JSON requests, a server-sent-events reader that checks
//! the framing as it goes, and a Prometheus text parser.

use std::time::Duration;

use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use serde_json::Value;

/// Bound on any single request of the tests.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);

/// An HTTP client for loopback servers (no proxy, bounded time).
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(REQUEST_TIMEOUT)
        .build()
        .expect("HTTP client")
}

/// A response as status, headers and JSON body.
pub struct JsonResponse {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub body: Value,
}

impl JsonResponse {
    /// The `error` object of an OpenAI error body.
    pub fn error(&self) -> &Value {
        let error = &self.body["error"];
        assert!(error.is_object(), "not an error body: {}", self.body);
        error
    }

    pub fn error_message(&self) -> String {
        self.error()["message"]
            .as_str()
            .expect("error message is a string")
            .to_string()
    }
}

/// POSTs `body` as JSON and reads a JSON answer (any status).
/// Sends `request` and returns only its HTTP status (auth and routing checks).
pub async fn status_of(request: reqwest::RequestBuilder) -> u16 {
    request
        .send()
        .await
        .expect("request sent")
        .status()
        .as_u16()
}

pub async fn post_json(url: &str, body: &Value) -> JsonResponse {
    let request = client().post(url).json(body);
    send(request).await
}

/// Sends a request and reads its JSON answer (any status).
pub async fn send(request: reqwest::RequestBuilder) -> JsonResponse {
    let response = request.send().await.expect("request sent");
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let text = response.text().await.expect("response body");
    let body = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("status {status}: body is not JSON ({e}): {text:?}"));
    JsonResponse {
        status,
        headers,
        body,
    }
}

/// Reads `data:` payloads of a `text/event-stream`, checking OpenAI's framing: every event is
/// one `data: ...` line followed by a blank line.
pub struct SseReader {
    body: BoxStream<'static, reqwest::Result<bytes::Bytes>>,
    buffer: Vec<u8>,
}

/// One event's payload.
#[derive(Debug, Clone, PartialEq)]
pub enum SseData {
    Json(Value),
    Done,
}

impl SseReader {
    pub fn new(response: reqwest::Response) -> SseReader {
        assert_eq!(response.status(), 200, "streaming request refused");
        let content_type = response.headers()[reqwest::header::CONTENT_TYPE]
            .to_str()
            .expect("content type")
            .to_string();
        assert!(
            content_type.starts_with("text/event-stream"),
            "{content_type}"
        );
        SseReader {
            body: response.bytes_stream().boxed(),
            buffer: Vec::new(),
        }
    }

    /// The next event, `None` at the end of the body.
    pub async fn next(&mut self) -> Option<SseData> {
        loop {
            if let Some(end) = find(&self.buffer, b"\n\n") {
                let event: Vec<u8> = self.buffer.drain(..end + 2).collect();
                let text = std::str::from_utf8(&event[..end]).expect("UTF-8 event");
                let data = text
                    .strip_prefix("data: ")
                    .unwrap_or_else(|| panic!("event is not `data: ...`: {text:?}"));
                assert!(!data.contains('\n'), "one data line per event: {text:?}");
                return Some(match data {
                    "[DONE]" => SseData::Done,
                    json => SseData::Json(serde_json::from_str(json).expect("chunk JSON")),
                });
            }
            match self.body.next().await {
                Some(chunk) => self.buffer.extend_from_slice(&chunk.expect("body chunk")),
                None => {
                    assert!(self.buffer.is_empty(), "trailing bytes: {:?}", self.buffer);
                    return None;
                }
            }
        }
    }

    /// Every JSON chunk up to `[DONE]`, checking that `[DONE]` is last.
    pub async fn collect(mut self) -> Vec<Value> {
        let mut chunks = Vec::new();
        loop {
            match self.next().await {
                Some(SseData::Json(chunk)) => chunks.push(chunk),
                Some(SseData::Done) => break,
                None => panic!("stream ended without [DONE] after {chunks:?}"),
            }
        }
        assert_eq!(self.next().await, None, "nothing may follow [DONE]");
        chunks
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// POSTs a streaming request and returns its event reader.
pub async fn post_stream(url: &str, body: &Value) -> SseReader {
    let response = client()
        .post(url)
        .json(body)
        .send()
        .await
        .expect("request sent");
    SseReader::new(response)
}

/// One sample line of the Prometheus text format.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    /// `key="value"` pairs as written.
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

/// Parses the Prometheus text exposition (comments skipped).
pub fn parse_metrics(text: &str) -> Vec<Sample> {
    text.lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|line| {
            let (series, value) = line.rsplit_once(' ').expect("`series value`");
            let value: f64 = value.parse().expect("sample value");
            let (name, labels) = match series.split_once('{') {
                None => (series.to_string(), Vec::new()),
                Some((name, rest)) => {
                    let body = rest.strip_suffix('}').expect("closing brace");
                    let labels = body
                        .split("\",")
                        .filter(|p| !p.is_empty())
                        .map(|pair| {
                            let (k, v) = pair.split_once("=\"").expect("label pair");
                            (k.to_string(), v.trim_end_matches('"').to_string())
                        })
                        .collect();
                    (name.to_string(), labels)
                }
            };
            Sample {
                name,
                labels,
                value,
            }
        })
        .collect()
}

/// Sum of every sample called `name` (all label sets); `None` if there is none.
pub fn metric_sum(samples: &[Sample], name: &str) -> Option<f64> {
    let values: Vec<f64> = samples
        .iter()
        .filter(|s| s.name == name)
        .map(|s| s.value)
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

/// `GET /metrics`, parsed.
pub async fn scrape(url: &str) -> Vec<Sample> {
    let response = client().get(url).send().await.expect("scrape");
    assert_eq!(response.status(), 200);
    parse_metrics(&response.text().await.expect("metrics text"))
}

/// Scrapes until `settled` holds (bounded): the engine publishes its statistics right after the
/// step that finished a request, so a scrape may briefly trail the last response.
pub async fn scrape_until(url: &str, settled: impl Fn(&[Sample]) -> bool) -> Vec<Sample> {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let samples = scrape(url).await;
        if settled(&samples) || std::time::Instant::now() >= deadline {
            return samples;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Whether the engine is idle: nothing running or waiting, no KV block in use.
pub fn engine_idle(samples: &[Sample]) -> bool {
    [
        "moeserve:num_requests_running",
        "moeserve:num_requests_waiting",
        "moeserve:kv_cache_usage_perc",
    ]
    .iter()
    .all(|name| metric_sum(samples, name) == Some(0.0))
}
