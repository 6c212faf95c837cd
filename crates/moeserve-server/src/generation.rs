//! One request's trip through the engine, as the HTTP handlers see it: a place in the waiting
//! queue (429 when full), submission (refusals become [`ApiError`]s), and the event stream with
//! per-request metrics observed on the way (inter-token gaps are measured here).
//!
//! Dropping a [`Generation`] drops its `RequestStream`, which cancels the request: the engine
//! frees its blocks before the next step. A client that disconnects drops it with the response;
//! so does a request past `--request-timeout` (504) or one cancelled by the shutdown drain (503).
//! From [`Target::new`] on, the request counts as in flight for the drain, and holds its place in
//! the waiting queue: `--max-waiting-requests` is checked before any costly work, and the
//! chat template and the tokenizer run on tokio's blocking pool, a bounded number at a time,
//! never on the runtime's workers (a few large prompts must not stall every connection).

use std::sync::Arc;
use std::time::{Duration, Instant};

use moeserve_engine::assets::ModelAssets;
use moeserve_engine::engine_core::RequestEvent;
use moeserve_engine::handle::{Engine, RequestStream};
use moeserve_engine::request::{GenerateOutput, GenerateRequest, Prompt};
use moeserve_structured::Grammar;
use tokio::sync::watch;

use crate::access_log::RequestLog;
use crate::drain::InFlight;
use crate::error::ApiError;
use crate::metrics::ErrorCause;
use crate::openai::structured::StructuredRequest;
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
    in_flight: InFlight,
    /// Its place in the waiting queue, taken first (429 before any work).
    slot: WaitingSlot,
    /// When the request arrived (its `--request-timeout` and an abort's times count from it).
    arrived: Instant,
    /// When `--request-timeout` runs out for this request, and the timeout.
    deadline: Option<(Instant, Duration)>,
    /// Its access-log record (none outside the HTTP stack).
    log: Option<RequestLog>,
}

impl Target {
    pub fn new(state: &AppState) -> Result<Target, ApiError> {
        // Counted before the shutdown check, so a drain that begins in between waits for it.
        let in_flight = state.drain().enter();
        let arrived = Instant::now();
        let deadline = state.time_limits().request.map(|d| (arrived + d, d));
        let engine = state.engine()?;
        let slot = state.reserve_waiting_slot().inspect_err(|_| {
            state.metrics().observe_rejected();
        })?;
        Ok(Target {
            state: state.clone(),
            engine,
            in_flight,
            slot,
            arrived,
            deadline,
            log: RequestLog::current(),
        })
    }

    pub fn assets(&self) -> &Arc<ModelAssets> {
        self.engine.assets()
    }

    /// Tokenizes (chat: renders the template first) and checks the ids, as the engine would,
    /// on the blocking pool.
    pub async fn tokenize(&self, prompt: Prompt) -> Result<TokenizedPrompt, ApiError> {
        let permit = self.state.text_work_permit().await;
        let assets = self.assets().clone();
        let max_model_len = self.engine.stats().max_model_len;
        let ids = tokio::task::spawn_blocking(move || {
            let _permit = permit;
            assets.prompt_ids(&prompt, max_model_len)
        })
        .await
        .map_err(|e| ApiError::Internal(format!("tokenization failed: {e}")))?
        // A prompt the template, the tokenizer or the context cannot take is refused here.
        .inspect_err(|_| self.state.metrics().observe_rejected())?;
        if let Some(log) = &self.log {
            log.prompt_tokens(ids.len());
        }
        Ok(TokenizedPrompt {
            room: max_model_len.saturating_sub(ids.len()),
            ids,
        })
    }

    /// Compiles the request's output constraint on the blocking pool (a large schema takes
    /// milliseconds); an invalid one is a 400 naming its field.
    pub async fn compile_grammar(
        &self,
        structured: Option<StructuredRequest>,
    ) -> Result<Option<Grammar>, ApiError> {
        let Some(structured) = structured else {
            return Ok(None);
        };
        let permit = self.state.text_work_permit().await;
        let assets = self.assets().clone();
        let grammar = tokio::task::spawn_blocking(move || {
            let _permit = permit;
            assets.compile_grammar(&structured.output, structured.field)
        })
        .await
        .map_err(|e| ApiError::Internal(format!("compiling the output constraint failed: {e}")))?
        .inspect_err(|_| self.state.metrics().observe_rejected())?;
        Ok(Some(grammar))
    }

    /// Queues the request; 429 when too many wait already, 400 when the engine refuses it.
    pub async fn submit(self, request: GenerateRequest) -> Result<Generation, ApiError> {
        let mut all = self.submit_all(vec![request]).await?;
        Ok(all.pop().expect("one request in, one generation out"))
    }

    /// Queues the choices of one request (`n` > 1) together, each holding its own place in
    /// the waiting queue; the engine computes the prompt once and forks the others from it.
    /// All or none are queued.
    pub async fn submit_all(
        self,
        requests: Vec<GenerateRequest>,
    ) -> Result<Vec<Generation>, ApiError> {
        let rejected = |e: ApiError| {
            self.state.metrics().observe_rejected();
            e
        };
        let mut slots = vec![self.slot];
        let mut in_flight = vec![self.in_flight];
        for _ in 1..requests.len() {
            slots.push(self.state.reserve_waiting_slot().map_err(rejected)?);
            in_flight.push(self.state.drain().enter());
        }
        let prompt_lens: Vec<usize> = requests
            .iter()
            .map(|request| match &request.prompt {
                Prompt::TokenIds(ids) => ids.len(),
                Prompt::Text(_) | Prompt::Chat(_) => 0,
            })
            .collect();
        let streams = self
            .engine
            .submit_group(requests)
            .await
            .map_err(|e| rejected(e.into()))?;
        let parts = streams
            .into_iter()
            .zip(slots)
            .zip(in_flight)
            .zip(prompt_lens);
        Ok(parts
            .map(|(((stream, slot), in_flight), prompt_len)| Generation {
                stream,
                cancelled: self.state.drain().cancelled(),
                state: self.state.clone(),
                slot,
                prompt_len,
                arrived: self.arrived,
                log: self.log.clone(),
                tokens: 0,
                first_token_at: None,
                last_token_at: None,
                ended: None,
                deadline: self.deadline,
                _in_flight: in_flight,
            })
            .collect())
    }
}

/// A submitted request's events.
pub struct Generation {
    stream: RequestStream,
    state: AppState,
    /// Held until the first token: until then the request counts as waiting.
    slot: WaitingSlot,
    prompt_len: usize,
    arrived: Instant,
    log: Option<RequestLog>,
    /// Tokens generated so far.
    tokens: usize,
    first_token_at: Option<Instant>,
    last_token_at: Option<Instant>,
    /// How the request ended, once it has: `None` (finished normally) or the cause. A
    /// generation dropped without an end is a client that went away.
    ended: Option<Option<ErrorCause>>,
    deadline: Option<(Instant, Duration)>,
    /// Turns `true` when the shutdown drain gives up waiting.
    cancelled: watch::Receiver<bool>,
    _in_flight: InFlight,
}

impl Generation {
    /// The next token or the final output, observed for the metrics. Everything that ends the
    /// request early is an error: a failure inside the engine (500), the engine gone (500),
    /// `--request-timeout` (504), the shutdown drain (503).
    pub async fn next(&mut self) -> Result<RequestEvent, ApiError> {
        let deadline = self.deadline;
        let cancelled = &mut self.cancelled;
        let event = tokio::select! {
            event = self.stream.next() => event,
            () = sleep_until(deadline.map(|(at, _)| at)) => {
                self.slot.release();
                self.ended.get_or_insert(Some(ErrorCause::Timeout));
                let seconds = deadline.map_or(0.0, |(_, limit)| limit.as_secs_f64());
                return Err(ApiError::RequestTimeout { seconds });
            }
            () = wait_cancelled(cancelled) => {
                self.slot.release();
                self.ended.get_or_insert(Some(ErrorCause::Shutdown));
                return Err(ApiError::ShuttingDown);
            }
        };
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
                        self.first_token_at = Some(now);
                    }
                }
                self.last_token_at = Some(now);
                self.tokens += 1;
            }
            Some(RequestEvent::Finished { output, .. }) => {
                metrics.observe_finished(output);
                if let Some(log) = &self.log {
                    log.finished(output);
                }
                self.ended.get_or_insert(None);
            }
            Some(RequestEvent::Failed { .. }) | None => {
                self.slot.release();
                self.ended.get_or_insert(Some(ErrorCause::EngineError));
            }
        }
        match event {
            Some(RequestEvent::Failed { error, .. }) => Err(ApiError::Internal(error)),
            Some(event) => Ok(event),
            None => Err(engine_gone()),
        }
    }

    /// Waits for the whole output (non-streaming responses).
    pub async fn collect(mut self) -> Result<GenerateOutput, ApiError> {
        loop {
            if let RequestEvent::Finished { output, .. } = self.next().await? {
                return Ok(output);
            }
        }
    }

    /// Waits for every choice's output, in order; the first error ends the wait (dropping the
    /// others cancels them).
    pub async fn collect_all(
        generations: Vec<Generation>,
    ) -> Result<Vec<GenerateOutput>, ApiError> {
        futures_util::future::try_join_all(generations.into_iter().map(Generation::collect)).await
    }
}

impl Drop for Generation {
    /// Counts a request that did not finish normally, whatever ended it; dropped before its
    /// end, the client went away (the stream's drop cancels it in the engine).
    fn drop(&mut self) {
        let cause = match self.ended {
            Some(None) => return,
            Some(Some(cause)) => cause,
            None => ErrorCause::ClientDisconnect,
        };
        let since = |t: Instant| t.duration_since(self.arrived).as_secs_f64();
        let ttft = self.first_token_at.map(since);
        self.state
            .metrics()
            .observe_aborted(cause, since(Instant::now()), ttft);
        if let Some(log) = &self.log {
            log.ended_early(cause, self.tokens, ttft);
        }
    }
}

/// Sleeps until `deadline`; forever without one.
async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

/// Resolves when the drain cancels requests in flight.
async fn wait_cancelled(cancelled: &mut watch::Receiver<bool>) {
    if cancelled.wait_for(|&c| c).await.is_err() {
        // The sender lives in the state this request holds; if it were gone, never cancel.
        std::future::pending::<()>().await;
    }
}

/// The stream ended without a result: the engine stopped under the request.
pub fn engine_gone() -> ApiError {
    ApiError::Internal("the engine stopped before the request finished".to_string())
}
