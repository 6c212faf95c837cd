//! Server-sent events for `stream: true`: one `data: {chunk}` per token that adds something,
//! an optional usage chunk, then `data: [DONE]` (OpenAI's framing).
//!
//! The SSE body owns the [`Generation`]; when the client goes away hyper drops the body, which
//! drops the request stream and so cancels the request in the engine.

use std::collections::VecDeque;
use std::convert::Infallible;

use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream;
use moeserve_engine::engine_core::RequestEvent;
use moeserve_engine::output::TokenUpdate;
use moeserve_engine::request::GenerateOutput;
use moeserve_engine::sampler::SampleOutput;
use serde::Serialize;

use crate::error::ApiError;
use crate::generation::Generation;

/// Turns one request's events into the endpoint's chunk objects.
pub trait ChunkMaker: Send + 'static {
    /// Chunks before any token (chat: the assistant role).
    fn start(&mut self) -> Vec<Event>;
    /// The chunk for one token, or `None` when it adds nothing to send.
    fn token(&mut self, sample: &SampleOutput, update: &TokenUpdate) -> Option<Event>;
    /// Chunks after the last token (the usage chunk, when asked for).
    fn finish(&mut self, output: &GenerateOutput) -> Vec<Event>;
}

/// One SSE event holding `value` as JSON.
pub fn json_event(value: &impl Serialize) -> Event {
    let json = serde_json::to_string(value).expect("chunk types serialize to JSON");
    Event::default().data(json)
}

struct StreamState<M> {
    generation: Generation,
    maker: M,
    queued: VecDeque<Event>,
    done: bool,
}

impl<M: ChunkMaker> StreamState<M> {
    /// Reads events until there is something to send (or the request is over).
    async fn fill(&mut self) {
        while self.queued.is_empty() && !self.done {
            let error = match self.generation.next().await {
                Ok(RequestEvent::Token { sample, update, .. }) => {
                    self.queued.extend(self.maker.token(&sample, &update));
                    continue;
                }
                Ok(RequestEvent::Finished { output, .. }) => {
                    self.queued.extend(self.maker.finish(&output));
                    None
                }
                // `next` turns failures into errors; this arm is never taken.
                Ok(RequestEvent::Failed { error, .. }) => Some(ApiError::Internal(error)),
                Err(error) => Some(error),
            };
            if let Some(error) = error {
                // Headers are gone already: the error travels as a chunk, as vLLM sends it.
                self.queued
                    .push_back(json_event(&serde_json::json!({ "error": error.body() })));
            }
            self.queued.push_back(Event::default().data("[DONE]"));
            self.done = true;
        }
    }
}

/// The `text/event-stream` response of one generation.
pub fn sse_response<M: ChunkMaker>(generation: Generation, mut maker: M) -> Response {
    let state = StreamState {
        generation,
        queued: maker.start().into(),
        maker,
        done: false,
    };
    let events = stream::unfold(state, |mut state| async move {
        state.fill().await;
        let event = state.queued.pop_front()?;
        Some((Ok::<_, Infallible>(event), state))
    });
    Sse::new(events).into_response()
}
