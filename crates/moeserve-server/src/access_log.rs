//! One access-log line per request, written when its response has been sent (or the client
//! went away): request id, method, path, status, prompt and output tokens, queue / TTFT / total
//! seconds, finish reason, and whether the client disconnected.
//!
//! The request id is the client's `x-request-id` (when it is a short printable token) or a new
//! one; it is returned in the response's `x-request-id` and is a field of the `request` span
//! every log line of the handler runs in. The API key is never logged: no header is.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::Body;
use axum::extract::Request;
use axum::http::{HeaderValue, Method};
use axum::middleware::Next;
use axum::response::Response;
use http_body::{Body as _, Frame, SizeHint};
use moeserve_engine::request::{FinishReason, GenerateOutput};
use tracing::Instrument;

use crate::metrics::ErrorCause;

pub const REQUEST_ID: &str = "x-request-id";

/// Longest client-given request id taken as is.
const MAX_ID_LEN: usize = 128;

tokio::task_local! {
    static CURRENT: RequestLog;
}

/// The access record of one request, shared by the middleware, the response body and the
/// request's generations; the line is written when the last of them lets go.
#[derive(Clone)]
pub struct RequestLog(Arc<Entry>);

struct Entry {
    id: String,
    method: Method,
    path: String,
    started: Instant,
    record: Mutex<Record>,
}

#[derive(Default)]
struct Record {
    status: Option<u16>,
    prompt_tokens: Option<usize>,
    output_tokens: usize,
    queue_seconds: Option<f64>,
    ttft_seconds: Option<f64>,
    finish_reason: Option<&'static str>,
    client_disconnected: bool,
}

impl RequestLog {
    /// The record of the request this task serves, if it is one (not in unit tests).
    pub fn current() -> Option<RequestLog> {
        CURRENT.try_with(RequestLog::clone).ok()
    }

    pub fn id(&self) -> &str {
        &self.0.id
    }

    fn update(&self, f: impl FnOnce(&mut Record)) {
        f(&mut self.0.record.lock().unwrap_or_else(|e| e.into_inner()));
    }

    /// A choice finished: its tokens and times (the earliest queue and first-token times of
    /// the choices are kept).
    pub fn finished(&self, output: &GenerateOutput) {
        self.update(|r| {
            r.prompt_tokens = Some(output.prompt_ids.len());
            r.output_tokens += output.token_ids.len();
            let t = &output.timings;
            r.queue_seconds = Some(
                r.queue_seconds
                    .map_or(t.queue_seconds, |q| q.min(t.queue_seconds)),
            );
            let ttft = t.time_to_first_token_seconds;
            r.ttft_seconds = Some(r.ttft_seconds.map_or(ttft, |f| f.min(ttft)));
            r.finish_reason.get_or_insert(match output.finish_reason {
                FinishReason::Stop => "stop",
                FinishReason::Length => "length",
            });
        });
    }

    /// A choice ended before finishing (`cause`), with `tokens` generated and its first token
    /// after `ttft` seconds if it had one.
    pub fn ended_early(&self, cause: ErrorCause, tokens: usize, ttft: Option<f64>) {
        self.update(|r| {
            r.output_tokens += tokens;
            if let Some(ttft) = ttft {
                r.ttft_seconds = Some(r.ttft_seconds.map_or(ttft, |f| f.min(ttft)));
            }
            r.finish_reason = Some(cause.label());
            r.client_disconnected |= cause == ErrorCause::ClientDisconnect;
        });
    }

    /// The prompt's length, once tokenized (a request that fails later still shows it).
    pub fn prompt_tokens(&self, tokens: usize) {
        self.update(|r| {
            r.prompt_tokens.get_or_insert(tokens);
        });
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        let r = self.record.get_mut().unwrap_or_else(|e| e.into_inner());
        tracing::info!(
            target: "moeserve::access",
            request_id = %self.id,
            method = %self.method,
            path = %self.path,
            status = r.status,
            prompt_tokens = r.prompt_tokens,
            output_tokens = r.output_tokens,
            queue_seconds = r.queue_seconds,
            ttft_seconds = r.ttft_seconds,
            total_seconds = self.started.elapsed().as_secs_f64(),
            finish_reason = r.finish_reason,
            client_disconnected = r.client_disconnected,
            "{} {} {}",
            self.method,
            self.path,
            r.status.map_or("-".to_string(), |s| s.to_string()),
        );
    }
}

/// The client's request id when it is a short run of visible ASCII, else a new random one.
fn request_id(request: &Request) -> String {
    let given = request
        .headers()
        .get(REQUEST_ID)
        .and_then(|v| v.to_str().ok());
    match given {
        Some(id)
            if !id.is_empty()
                && id.len() <= MAX_ID_LEN
                && id.bytes().all(|b| b.is_ascii_graphic()) =>
        {
            id.to_string()
        }
        _ => format!("{:032x}", rand::random::<u128>()),
    }
}

/// The outermost layer: gives the request its id and record, runs it in its span, and writes
/// the line once the response body is done.
pub async fn layer(request: Request, next: Next) -> Response {
    let id = request_id(&request);
    let log = RequestLog(Arc::new(Entry {
        id: id.clone(),
        method: request.method().clone(),
        path: request.uri().path().to_string(),
        started: Instant::now(),
        record: Mutex::default(),
    }));
    let span = tracing::info_span!("request", request_id = %id);
    let mut response = CURRENT
        .scope(log.clone(), next.run(request))
        .instrument(span)
        .await;
    let status = response.status().as_u16();
    log.update(|r| r.status = Some(status));
    let id = HeaderValue::from_str(&id).expect("request ids are visible ASCII");
    response.headers_mut().insert(REQUEST_ID, id);
    let (parts, body) = response.into_parts();
    let done = body.is_end_stream();
    let body = LoggedBody {
        inner: body,
        log,
        done,
    };
    Response::from_parts(parts, Body::new(body))
}

/// The response body, holding the request's record until it has been sent; dropped before its
/// end, the client went away.
struct LoggedBody {
    // Dropped first: a streaming body's generations record how they ended before the line.
    inner: Body,
    log: RequestLog,
    done: bool,
}

impl http_body::Body for LoggedBody {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None)) || self.inner.is_end_stream() {
            self.done = true;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for LoggedBody {
    fn drop(&mut self) {
        if !self.done {
            self.log.update(|r| r.client_disconnected = true);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_id(value: &str) -> Request {
        Request::builder()
            .header(REQUEST_ID, value)
            .body(Body::empty())
            .unwrap()
    }

    #[test]
    fn a_clients_request_id_is_kept_and_a_strange_one_replaced() {
        assert_eq!(request_id(&with_id("abc-123_X")), "abc-123_X");
        for bad in ["", "has space", &"x".repeat(129)] {
            let id = request_id(&with_id(bad));
            assert_eq!(id.len(), 32, "{bad:?} → {id}");
        }
        let a = request_id(&Request::new(Body::empty()));
        let b = request_id(&Request::new(Body::empty()));
        assert_ne!(a, b);
    }
}
