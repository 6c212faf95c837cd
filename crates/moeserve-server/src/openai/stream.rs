//! Server-sent events for `stream: true`: one `data: {chunk}` per token that adds something,
//! the `n` choices' chunks interleaved as their tokens come, an optional usage chunk (summed
//! over the choices), then `data: [DONE]` (OpenAI's framing).
//!
//! The SSE body owns the [`Generation`]; when the client goes away hyper drops the body, which
//! drops the request stream and so cancels the request in the engine.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;

use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, SelectAll, Stream, StreamExt};
use moeserve_engine::engine_core::RequestEvent;
use moeserve_engine::output::TokenUpdate;
use moeserve_engine::request::GenerateOutput;
use moeserve_engine::sampler::SampleOutput;
use serde::Serialize;

use super::Usage;
use crate::error::ApiError;
use crate::generation::Generation;

/// Turns one choice's events into the endpoint's chunk objects (one maker per choice, each
/// knowing its `index`).
pub trait ChunkMaker: Send + 'static {
    /// Chunks before any token (chat: the assistant role).
    fn start(&mut self) -> Vec<Event>;
    /// The chunk for one token, or `None` when it adds nothing to send.
    fn token(&mut self, sample: &SampleOutput, update: &TokenUpdate) -> Option<Event>;
    /// The usage chunk after every choice has finished, when the client asked for it.
    fn usage(&self, usage: Usage) -> Option<Event>;
}

/// One SSE event holding `value` as JSON.
pub fn json_event(value: &impl Serialize) -> Event {
    let json = serde_json::to_string(value).expect("chunk types serialize to JSON");
    Event::default().data(json)
}

type ChoiceEvents = Pin<Box<dyn Stream<Item = (usize, Result<RequestEvent, ApiError>)> + Send>>;

/// One choice's events, ending after its last (a finished output or an error).
fn choice_events(index: usize, generation: Generation) -> ChoiceEvents {
    Box::pin(stream::unfold(
        Some(generation),
        move |generation| async move {
            let mut generation = generation?;
            let event = generation.next().await;
            let more = matches!(event, Ok(RequestEvent::Token { .. }));
            Some(((index, event), more.then_some(generation)))
        },
    ))
}

struct StreamState<M> {
    /// Every choice's events, interleaved as they come (OpenAI interleaves choices too).
    events: SelectAll<ChoiceEvents>,
    makers: Vec<M>,
    outputs: Vec<Option<GenerateOutput>>,
    queued: VecDeque<Event>,
    done: bool,
}

impl<M: ChunkMaker> StreamState<M> {
    /// Reads events until there is something to send (or the request is over).
    async fn fill(&mut self) {
        while self.queued.is_empty() && !self.done {
            let error = match self.events.next().await {
                Some((i, Ok(RequestEvent::Token { sample, update, .. }))) => {
                    self.queued.extend(self.makers[i].token(&sample, &update));
                    continue;
                }
                Some((i, Ok(RequestEvent::Finished { output, .. }))) => {
                    self.outputs[i] = Some(output);
                    continue;
                }
                // `next` turns failures into errors; this arm is never taken.
                Some((_, Ok(RequestEvent::Failed { error, .. }))) => {
                    Some(ApiError::Internal(error))
                }
                Some((_, Err(error))) => Some(error),
                // Every choice has finished.
                None => None,
            };
            match error {
                // Headers are gone already: the error travels as a chunk, as vLLM sends it.
                // Dropping the state cancels the other choices.
                Some(error) => self
                    .queued
                    .push_back(json_event(&serde_json::json!({ "error": error.body() }))),
                None => {
                    let outputs: Vec<&GenerateOutput> = self
                        .outputs
                        .iter()
                        .map(|o| o.as_ref().expect("finished"))
                        .collect();
                    self.queued
                        .extend(self.makers[0].usage(Usage::of_all(&outputs)));
                }
            }
            self.queued.push_back(Event::default().data("[DONE]"));
            self.done = true;
        }
    }
}

/// The `text/event-stream` response of one request's choices, `makers[i]` making choice i's
/// chunks from `generations[i]`.
pub fn sse_response<M: ChunkMaker>(generations: Vec<Generation>, mut makers: Vec<M>) -> Response {
    assert_eq!(
        generations.len(),
        makers.len(),
        "one chunk maker per choice"
    );
    let queued: VecDeque<Event> = makers.iter_mut().flat_map(|m| m.start()).collect();
    let state = StreamState {
        outputs: (0..generations.len()).map(|_| None).collect(),
        events: stream::select_all(
            generations
                .into_iter()
                .enumerate()
                .map(|(i, g)| choice_events(i, g)),
        ),
        makers,
        queued,
        done: false,
    };
    let events = stream::unfold(state, |mut state| async move {
        state.fill().await;
        let event = state.queued.pop_front()?;
        Some((Ok::<_, Infallible>(event), state))
    });
    Sse::new(events).into_response()
}
