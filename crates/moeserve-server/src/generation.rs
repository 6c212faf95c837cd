//! One request's trip through the engine, as the HTTP handlers see it: a place in the waiting
//! queue (429 when full), submission (refusals become [`ApiError`]s), and the event stream with
//! per-request metrics observed on the way (inter-token gaps are measured here).
//!
//! Dropping a [`Generation`] drops its `RequestStream`, which cancels the request: the engine
//! frees its blocks before the next step. A client that disconnects drops it with the response.

use std::sync::Arc;
use std::time::Instant;

use moeserve_engine::assets::ModelAssets;
use moeserve_engine::engine_core::RequestEvent;
use moeserve_engine::handle::{Engine, RequestStream};
use moeserve_engine::request::{GenerateOutput, GenerateRequest, Prompt};

use crate::error::ApiError;
use crate::state::{AppState, WaitingSlot};

/// A prompt turned into token ids, with the room it leaves for the output.
pub struct TokenizedPrompt {
    pub ids: Vec<u32>,
    /// Tokens the context holds after the prompt (0 when the prompt fills it).
    pub room: usize,
}

/// The engine a request runs on, taken once per request (503 while loading or shutting down).
pub struct Target {
    state: AppState,
    engine: Arc<Engine>,
}

impl Target {
    pub fn new(state: &AppState) -> Result<Target, ApiError> {
        Ok(Target {
            state: state.clone(),
            engine: state.engine()?,
        })
    }

    pub fn assets(&self) -> &Arc<ModelAssets> {
        self.engine.assets()
    }

    /// Tokenizes (chat: renders the template first) and checks the ids, as the engine would.
    pub fn tokenize(&self, prompt: &Prompt) -> Result<TokenizedPrompt, ApiError> {
        let ids = self.assets().prompt_ids(prompt)?;
        let max_model_len = self.engine.stats().max_model_len;
        Ok(TokenizedPrompt {
            room: max_model_len.saturating_sub(ids.len()),
            ids,
        })
    }

    /// Queues the request; 429 when too many wait already, 400 when the engine refuses it.
    pub async fn submit(self, request: GenerateRequest) -> Result<Generation, ApiError> {
        let slot = self.state.reserve_waiting_slot()?;
        let prompt_len = match &request.prompt {
            Prompt::TokenIds(ids) => ids.len(),
            Prompt::Text(_) | Prompt::Chat(_) => 0,
        };
        let stream = self.engine.submit(request).await?;
        Ok(Generation {
            stream,
            state: self.state,
            slot,
            prompt_len,
            last_token_at: None,
        })
    }
}

/// A submitted request's events.
pub struct Generation {
    stream: RequestStream,
    state: AppState,
    /// Held until the first token: until then the request counts as waiting.
    slot: WaitingSlot,
    prompt_len: usize,
    last_token_at: Option<Instant>,
}

impl Generation {
    /// The next event (`None` if the engine went away), observed for the metrics.
    pub async fn next(&mut self) -> Option<RequestEvent> {
        let event = self.stream.next().await;
        let metrics = self.state.metrics();
        match &event {
            Some(RequestEvent::Token { .. }) => {
                let now = Instant::now();
                match self.last_token_at {
                    Some(previous) => {
                        metrics.observe_inter_token(now.duration_since(previous).as_secs_f64())
                    }
                    None => {
                        self.slot.release();
                        metrics.observe_prefilled(self.prompt_len);
                    }
                }
                self.last_token_at = Some(now);
            }
            Some(RequestEvent::Finished { output, .. }) => metrics.observe_finished(output),
            Some(RequestEvent::Failed { .. }) | None => self.slot.release(),
        }
        event
    }

    /// Waits for the whole output (non-streaming responses).
    pub async fn collect(mut self) -> Result<GenerateOutput, ApiError> {
        loop {
            match self.next().await {
                Some(RequestEvent::Token { .. }) => {}
                Some(RequestEvent::Finished { output, .. }) => return Ok(output),
                Some(RequestEvent::Failed { error, .. }) => return Err(ApiError::Internal(error)),
                None => return Err(engine_gone()),
            }
        }
    }
}

/// The stream ended without a result: the engine stopped under the request.
pub fn engine_gone() -> ApiError {
    ApiError::Internal("the engine stopped before the request finished".to_string())
}
