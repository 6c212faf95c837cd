//! The async engine handle (after TGI's `Queue` handle around its state): the engine core runs
//! on its own thread; callers submit requests and read each request's events from a stream.
//! Dropping a stream cancels its request, whose blocks are freed before the next step runs.
//!
//! A panic inside the engine (a bug in a kernel, the sampler, a re-placement) kills it for good:
//! every request in flight and queued ends with `Failed` saying so, new ones are refused, and
//! [`Engine::failure`] / [`Engine::failed`] tell the server, which reports itself unhealthy and
//! exits non-zero so a supervisor restarts it (vLLM's behaviour when its engine core dies).

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use moeserve_core::RequestId;
use tokio::sync::{mpsc, oneshot, watch};

use crate::assets::ModelAssets;
use crate::engine_core::{EngineConfig, EngineCore, RequestEvent};
use crate::moe::MoeStats;
use crate::request::GenerateRequest;
use crate::stats::EngineStats;
use crate::{EngineError, Result};

/// Requests to queue together: one, or the choices of one prompt (forked from the first).
enum Command {
    Add {
        requests: Vec<GenerateRequest>,
        events: Vec<mpsc::UnboundedSender<RequestEvent>>,
        reply: oneshot::Sender<Result<Vec<RequestId>>>,
    },
}

/// A running engine; cheap to share behind an `Arc`.
pub struct Engine {
    commands: mpsc::UnboundedSender<Command>,
    stats: Arc<Mutex<EngineStats>>,
    moe: Arc<Mutex<MoeStats>>,
    assets: Arc<ModelAssets>,
    /// The panic message once the engine thread died.
    failure: watch::Receiver<Option<String>>,
    thread: Option<JoinHandle<()>>,
}

/// `MOESERVE_TEST_PANIC_AT_STEP=N`: the engine thread panics in its N-th step (0-based). A test
/// hook for the engine-failure path (tests/e2e/tests/faults.rs); unset in production.
const PANIC_AT_STEP_ENV: &str = "MOESERVE_TEST_PANIC_AT_STEP";

/// The events of one request, in order, ending with `Finished` or `Failed`.
pub struct RequestStream {
    pub id: RequestId,
    events: mpsc::UnboundedReceiver<RequestEvent>,
}

impl RequestStream {
    /// The next event; `None` once the request is over.
    pub async fn next(&mut self) -> Option<RequestEvent> {
        self.events.recv().await
    }
}

impl Engine {
    /// Builds the engine core (config errors are returned here) and starts its thread.
    pub fn start(assets: Arc<ModelAssets>, config: &EngineConfig) -> Result<Engine> {
        let core = EngineCore::new(assets.clone(), config)?;
        let stats = Arc::new(Mutex::new(core.stats().clone()));
        let moe = Arc::new(Mutex::new(core.moe_stats()));
        let (commands, rx) = mpsc::unbounded_channel();
        let (failed, failure) = watch::channel(None);
        let shared = SharedStats {
            stats: stats.clone(),
            moe: moe.clone(),
            failed,
        };
        let panic_at_step = std::env::var(PANIC_AT_STEP_ENV)
            .ok()
            .and_then(|s| s.parse::<u64>().ok());
        let thread = std::thread::Builder::new()
            .name("moeserve-engine".into())
            .spawn(move || run_loop(core, rx, shared, panic_at_step))
            .map_err(|e| {
                EngineError::RequestFailed(format!("cannot start the engine thread: {e}"))
            })?;
        Ok(Engine {
            commands,
            stats,
            moe,
            assets,
            failure,
            thread: Some(thread),
        })
    }

    /// Why the engine died (its panic message), or `None` while it runs.
    pub fn failure(&self) -> Option<String> {
        self.failure.borrow().clone()
    }

    /// Resolves with the panic message once the engine has died.
    pub async fn failed(&self) -> String {
        let mut failure = self.failure.clone();
        let found = failure
            .wait_for(Option::is_some)
            .await
            .map(|message| message.clone().unwrap_or_default());
        match found {
            Ok(message) => message,
            // The thread returned without failing (the engine was dropped): never resolve.
            Err(_) => std::future::pending().await,
        }
    }

    pub fn assets(&self) -> &Arc<ModelAssets> {
        &self.assets
    }

    /// Queues a request; refused requests (bad params, too long) fail here.
    pub async fn submit(&self, request: GenerateRequest) -> Result<RequestStream> {
        let mut streams = self.submit_group(vec![request]).await?;
        Ok(streams.pop().expect("one request in, one stream out"))
    }

    /// Queues the choices of one prompt (`n` > 1) together, all or none: the first computes the
    /// prompt and the others are forked from its KV blocks ([`EngineCore::add_group`]).
    pub async fn submit_group(&self, requests: Vec<GenerateRequest>) -> Result<Vec<RequestStream>> {
        if let Some(message) = self.failure() {
            return Err(EngineError::Failed { message });
        }
        let stopped = || match self.failure() {
            Some(message) => EngineError::Failed { message },
            None => EngineError::RequestFailed("the engine has stopped".to_string()),
        };
        let (events, receivers): (Vec<_>, Vec<_>) =
            requests.iter().map(|_| mpsc::unbounded_channel()).unzip();
        let (reply, answer) = oneshot::channel();
        self.commands
            .send(Command::Add {
                requests,
                events,
                reply,
            })
            .map_err(|_| stopped())?;
        let ids = answer.await.map_err(|_| stopped())??;
        Ok(ids
            .into_iter()
            .zip(receivers)
            .map(|(id, events)| RequestStream { id, events })
            .collect())
    }

    /// The latest statistics (updated after every step).
    pub fn stats(&self) -> EngineStats {
        self.stats
            .lock()
            .expect("stats lock is never poisoned: writers do not panic")
            .clone()
    }

    /// The latest MoE snapshot (updated after every step): routing totals, loads, imbalance,
    /// devices, placement and re-placements.
    pub fn moe_snapshot(&self) -> MoeStats {
        self.moe
            .lock()
            .expect("stats lock is never poisoned: writers do not panic")
            .clone()
    }
}

/// Where the engine thread publishes its statistics, and its death.
struct SharedStats {
    stats: Arc<Mutex<EngineStats>>,
    moe: Arc<Mutex<MoeStats>>,
    failed: watch::Sender<Option<String>>,
}

impl Drop for Engine {
    fn drop(&mut self) {
        // Closing the command channel ends the loop once in-flight requests are done or dropped.
        let (closed, _) = mpsc::unbounded_channel();
        self.commands = closed;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn run_loop(
    mut core: EngineCore,
    mut commands: mpsc::UnboundedReceiver<Command>,
    shared: SharedStats,
    panic_at_step: Option<u64>,
) {
    let mut streams: HashMap<RequestId, mpsc::UnboundedSender<RequestEvent>> = HashMap::new();
    let mut step = 0u64;
    loop {
        // A panic leaves the core in an unknown state: it is never stepped again.
        let iteration = std::panic::catch_unwind(AssertUnwindSafe(|| {
            let fault = panic_at_step == Some(step);
            step += 1;
            iterate(&mut core, &mut commands, &mut streams, &shared, fault)
        }));
        match iteration {
            Ok(true) => continue,
            Ok(false) => return,
            Err(payload) => {
                let message = panic_message(payload.as_ref());
                die(&message, &mut streams, &mut commands, &shared);
                return;
            }
        }
    }
}

/// One turn of the loop: admit, cancel, step, publish, dispatch. `false` once the command
/// channel is closed and nothing is left to run.
fn iterate(
    core: &mut EngineCore,
    commands: &mut mpsc::UnboundedReceiver<Command>,
    streams: &mut HashMap<RequestId, mpsc::UnboundedSender<RequestEvent>>,
    shared: &SharedStats,
    fault: bool,
) -> bool {
    if !core.has_unfinished() {
        match commands.blocking_recv() {
            Some(command) => admit(core, streams, command),
            None => return false,
        }
    }
    while let Ok(command) = commands.try_recv() {
        admit(core, streams, command);
    }
    // Cancel requests whose caller went away: their blocks are freed before this step.
    streams.retain(|id, tx| {
        let open = !tx.is_closed();
        if !open {
            core.abort(*id);
        }
        open
    });
    if fault {
        panic!("{PANIC_AT_STEP_ENV} asked the engine to panic in this step");
    }
    let result = core.step();
    // Publish the snapshot before the events, so a client that saw its request finish
    // also sees the step in the statistics.
    *shared.stats.lock().expect("stats lock is never poisoned") = core.stats().clone();
    *shared.moe.lock().expect("stats lock is never poisoned") = core.moe_stats();
    match result {
        Ok(events) => dispatch(streams, events),
        Err(e) => {
            for (id, tx) in streams.drain() {
                core.abort(id);
                let _ = tx.send(RequestEvent::Failed {
                    id,
                    error: e.to_string(),
                });
            }
        }
    }
    true
}

/// The engine died with `message`: every request in flight and queued fails saying so, the
/// commands still waiting are refused, and the failure is published.
fn die(
    message: &str,
    streams: &mut HashMap<RequestId, mpsc::UnboundedSender<RequestEvent>>,
    commands: &mut mpsc::UnboundedReceiver<Command>,
    shared: &SharedStats,
) {
    let error = EngineError::Failed {
        message: message.to_string(),
    };
    // Published first: a caller that sees its request fail also sees the engine failed.
    shared.failed.send_replace(Some(message.to_string()));
    for (id, tx) in streams.drain() {
        let _ = tx.send(RequestEvent::Failed {
            id,
            error: error.to_string(),
        });
    }
    commands.close();
    while let Ok(Command::Add { reply, .. }) = commands.try_recv() {
        let _ = reply.send(Err(EngineError::Failed {
            message: message.to_string(),
        }));
    }
}

/// The text a panic was raised with.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_string())
}

fn admit(
    core: &mut EngineCore,
    streams: &mut HashMap<RequestId, mpsc::UnboundedSender<RequestEvent>>,
    command: Command,
) {
    let Command::Add {
        requests,
        events,
        reply,
    } = command;
    let result = core.add_group(requests);
    if let Ok(ids) = &result {
        streams.extend(ids.iter().copied().zip(events));
    }
    let _ = reply.send(result);
}

fn dispatch(
    streams: &mut HashMap<RequestId, mpsc::UnboundedSender<RequestEvent>>,
    events: Vec<RequestEvent>,
) {
    for event in events {
        let (id, last) = match &event {
            RequestEvent::Token { id, .. } => (*id, false),
            RequestEvent::Finished { id, .. } | RequestEvent::Failed { id, .. } => (*id, true),
        };
        if let Some(tx) = streams.get(&id) {
            let _ = tx.send(event);
        }
        if last {
            streams.remove(&id);
        }
    }
}
