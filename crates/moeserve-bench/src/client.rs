//! One streamed `POST /v1/completions` request, timed as vLLM's benchmark times it: TTFT at the
//! first chunk with text, ITL between text chunks, e2e at the end of the stream; output tokens
//! from the stream's `usage` chunk (`stream_options.include_usage`), else one per text chunk.
//!
//! NOTE: servers send a chunk only when a token adds text, and a token may add none (byte-level
//! tokenizers hold back partial UTF-8; a random model's tokens may decode to nothing). With
//! `stream_logprobs` the request asks for `logprobs: 1` (llama.cpp's server reads 0 as none), so
//! every token arrives in its own chunk and a chunk with a logprob counts as content even
//! without text.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::{Value, json};

use crate::dataset::BenchPrompt;
use crate::stats::RequestTiming;
use crate::{BenchError, Result};

/// Where and how requests are sent.
#[derive(Clone)]
pub struct Endpoint {
    client: reqwest::Client,
    /// The full `/v1/completions` URL.
    url: String,
    model: String,
    api_key: Option<String>,
    stream_logprobs: bool,
}

/// Settings of an [`Endpoint`].
pub struct EndpointConfig<'a> {
    /// The server's base URL (`http://host:port`), or its `/v1` or `/v1/completions` URL.
    pub url: &'a str,
    pub model: &'a str,
    pub api_key: Option<&'a str>,
    /// Bound on one whole request.
    pub request_timeout: Duration,
    /// Ask for `logprobs: 1` so that every token is seen (see the module note).
    pub stream_logprobs: bool,
}

impl Endpoint {
    pub fn new(config: &EndpointConfig) -> Result<Self> {
        if !config.url.starts_with("http://") {
            // NOTE: the client is built without TLS to keep the build small; benchmark an https
            // endpoint through its plain-HTTP address or a local proxy.
            return Err(BenchError::invalid(
                "url",
                format!("{:?}: only http:// URLs are supported", config.url),
            ));
        }
        let client = reqwest::Client::builder()
            .no_proxy()
            .timeout(config.request_timeout)
            .connect_timeout(Duration::from_secs(10))
            .build()?;
        Ok(Endpoint {
            client,
            url: completions_url(config.url),
            model: config.model.to_string(),
            api_key: config.api_key.map(str::to_string),
            stream_logprobs: config.stream_logprobs,
        })
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    /// Sends `prompt` and reads the stream to its end; `Err` holds a one-line reason. Times are
    /// measured from the send and placed on the level's clock by `level_start`.
    pub async fn run(
        &self,
        prompt: &BenchPrompt,
        level_start: Instant,
    ) -> std::result::Result<RequestTiming, String> {
        let mut body = json!({
            "model": self.model,
            "prompt": prompt.prompt,
            "max_tokens": prompt.max_tokens,
            "ignore_eos": true,
            "temperature": 0,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        if self.stream_logprobs {
            body["logprobs"] = json!(1);
        }
        let mut request = self.client.post(&self.url).json(&body);
        if let Some(key) = &self.api_key {
            request = request.bearer_auth(key);
        }
        let sent = Instant::now();
        let response = request.send().await.map_err(|e| e.to_string())?;
        let status = response.status();
        if !status.is_success() {
            let text = response.text().await.unwrap_or_default();
            return Err(format!("HTTP {status}: {}", error_message(&text)));
        }
        let mut events = SseEvents::default();
        let mut stream = response.bytes_stream();
        let mut timing = RequestTiming {
            start: sent.duration_since(level_start).as_secs_f64(),
            ..RequestTiming::default()
        };
        let (mut last_content, mut content_chunks, mut usage) = (None::<Instant>, 0, None);
        'read: while let Some(bytes) = stream.next().await {
            let bytes = bytes.map_err(|e| e.to_string())?;
            let now = Instant::now();
            events.push(&bytes);
            while let Some(data) = events.next_data() {
                if data == "[DONE]" {
                    break 'read;
                }
                let chunk: Value = serde_json::from_str(&data)
                    .map_err(|e| format!("bad stream chunk ({e}): {data}"))?;
                if let Some(error) = chunk.get("error") {
                    return Err(format!("stream error: {error}"));
                }
                if let Some(u) = chunk.get("usage").filter(|u| !u.is_null()) {
                    usage = Some(u.clone());
                }
                if !carries_a_token(&chunk["choices"][0]) {
                    continue;
                }
                content_chunks += 1;
                match last_content {
                    None => timing.ttft = now.duration_since(sent).as_secs_f64(),
                    Some(prev) => timing.itl.push(now.duration_since(prev).as_secs_f64()),
                }
                last_content = Some(now);
            }
        }
        timing.e2e = sent.elapsed().as_secs_f64();
        if last_content.is_none() {
            return Err(
                "the stream carried no text (tokens that decode to nothing? try --stream-logprobs)"
                    .into(),
            );
        }
        let count = |field: &str| {
            usage
                .as_ref()
                .and_then(|u| u[field].as_u64())
                .map(|n| n as usize)
        };
        timing.output_tokens = count("completion_tokens").unwrap_or(content_chunks);
        timing.prompt_tokens = count("prompt_tokens").unwrap_or(0);
        Ok(timing)
    }
}

/// Whether a streamed completion choice carries a token: text, or a logprob in either format
/// servers send — OpenAI's completions `logprobs.tokens` (vLLM, moeserve) or the chat-style
/// `logprobs.content` (llama.cpp's server).
fn carries_a_token(choice: &Value) -> bool {
    let non_empty = |v: &Value| v.as_array().is_some_and(|a| !a.is_empty());
    choice["text"].as_str().is_some_and(|t| !t.is_empty())
        || non_empty(&choice["logprobs"]["tokens"])
        || non_empty(&choice["logprobs"]["content"])
}

/// `http://host:port[/v1[/completions]]` → the completions URL.
fn completions_url(base: &str) -> String {
    let base = base.trim_end_matches('/');
    if base.ends_with("/v1/completions") {
        base.to_string()
    } else if base.ends_with("/v1") {
        format!("{base}/completions")
    } else {
        format!("{base}/v1/completions")
    }
}

/// The `error.message` of an OpenAI error body, else the body itself (shortened).
fn error_message(body: &str) -> String {
    serde_json::from_str::<Value>(body)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
        .unwrap_or_else(|| body.chars().take(200).collect())
}

/// Splits a `text/event-stream` body into the `data:` payloads of its events.
#[derive(Default)]
struct SseEvents {
    buffer: String,
}

impl SseEvents {
    fn push(&mut self, bytes: &[u8]) {
        self.buffer.push_str(&String::from_utf8_lossy(bytes));
        if self.buffer.contains('\r') {
            self.buffer = self.buffer.replace("\r\n", "\n");
        }
    }

    /// The data of the next complete event (its `data:` lines joined), if one has arrived.
    fn next_data(&mut self) -> Option<String> {
        loop {
            let end = self.buffer.find("\n\n")?;
            let event: String = self.buffer.drain(..end + 2).collect();
            let data: Vec<&str> = event
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            if !data.is_empty() {
                return Some(data.join("\n"));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_is_text_or_a_logprob_in_either_format() {
        let choice = |v: Value| carries_a_token(&v);
        assert!(choice(json!({"text": "a", "logprobs": null})));
        assert!(choice(
            json!({"text": "", "logprobs": {"tokens": [""], "token_logprobs": [-1.0]}})
        ));
        assert!(choice(
            json!({"text": "", "logprobs": {"content": [{"id": 7, "logprob": -1.0}]}})
        ));
        assert!(!choice(
            json!({"text": "", "logprobs": null, "finish_reason": "length"})
        ));
        assert!(!choice(json!({"text": "", "logprobs": {"tokens": []}})));
        assert!(!choice(json!(null)));
    }

    #[test]
    fn urls_are_completed_to_the_completions_endpoint() {
        for base in [
            "http://h:1",
            "http://h:1/",
            "http://h:1/v1",
            "http://h:1/v1/completions",
        ] {
            assert_eq!(completions_url(base), "http://h:1/v1/completions");
        }
    }

    #[test]
    fn sse_events_are_split_across_arbitrary_chunk_boundaries() {
        let mut sse = SseEvents::default();
        sse.push(b"data: {\"a\":1}\n\nda");
        assert_eq!(sse.next_data().as_deref(), Some("{\"a\":1}"));
        assert_eq!(sse.next_data(), None);
        sse.push(b"ta: [DONE]\r\n\r\n: comment\n\n");
        assert_eq!(sse.next_data().as_deref(), Some("[DONE]"));
        assert_eq!(sse.next_data(), None);
    }

    #[test]
    fn https_is_refused_with_a_clear_error() {
        let config = EndpointConfig {
            url: "https://example.com",
            model: "m",
            api_key: None,
            request_timeout: Duration::from_secs(1),
            stream_logprobs: false,
        };
        let err = Endpoint::new(&config).err().unwrap().to_string();
        assert!(err.contains("only http://"), "{err}");
    }
}
