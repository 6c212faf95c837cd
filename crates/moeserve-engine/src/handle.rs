//! The async engine handle (after TGI's `Queue` handle around its state): the engine core runs
//! on its own thread; callers submit requests and read each request's events from a stream.
//! Dropping a stream cancels its request, whose blocks are freed before the next step runs.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use moeserve_core::RequestId;
use tokio::sync::{mpsc, oneshot};

use crate::assets::ModelAssets;
use crate::engine_core::{EngineConfig, EngineCore, RequestEvent};
use crate::moe::MoeStats;
use crate::request::GenerateRequest;
use crate::stats::EngineStats;
use crate::{EngineError, Result};

enum Command {
    Add {
        request: GenerateRequest,
        events: mpsc::UnboundedSender<RequestEvent>,
        reply: oneshot::Sender<Result<RequestId>>,
    },
}

/// A running engine; cheap to share behind an `Arc`.
pub struct Engine {
    commands: mpsc::UnboundedSender<Command>,
    stats: Arc<Mutex<EngineStats>>,
    moe: Arc<Mutex<MoeStats>>,
    assets: Arc<ModelAssets>,
    thread: Option<JoinHandle<()>>,
}

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
        let shared = SharedStats {
            stats: stats.clone(),
            moe: moe.clone(),
        };
        let thread = std::thread::Builder::new()
            .name("moeserve-engine".into())
            .spawn(move || run_loop(core, rx, shared))
            .map_err(|e| {
                EngineError::RequestFailed(format!("cannot start the engine thread: {e}"))
            })?;
        Ok(Engine {
            commands,
            stats,
            moe,
            assets,
            thread: Some(thread),
        })
    }

    pub fn assets(&self) -> &Arc<ModelAssets> {
        &self.assets
    }

    /// Queues a request; refused requests (bad params, too long) fail here.
    pub async fn submit(&self, request: GenerateRequest) -> Result<RequestStream> {
        let (events, rx) = mpsc::unbounded_channel();
        let (reply, answer) = oneshot::channel();
        let stopped = || EngineError::RequestFailed("the engine has stopped".to_string());
        self.commands
            .send(Command::Add {
                request,
                events,
                reply,
            })
            .map_err(|_| stopped())?;
        let id = answer.await.map_err(|_| stopped())??;
        Ok(RequestStream { id, events: rx })
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

/// Where the engine thread publishes its statistics.
struct SharedStats {
    stats: Arc<Mutex<EngineStats>>,
    moe: Arc<Mutex<MoeStats>>,
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
) {
    let mut streams: HashMap<RequestId, mpsc::UnboundedSender<RequestEvent>> = HashMap::new();
    loop {
        if !core.has_unfinished() {
            match commands.blocking_recv() {
                Some(command) => admit(&mut core, &mut streams, command),
                None => return,
            }
        }
        while let Ok(command) = commands.try_recv() {
            admit(&mut core, &mut streams, command);
        }
        // Cancel requests whose caller went away: their blocks are freed before this step.
        streams.retain(|id, tx| {
            let open = !tx.is_closed();
            if !open {
                core.abort(*id);
            }
            open
        });
        let result = core.step();
        // Publish the snapshot before the events, so a client that saw its request finish
        // also sees the step in the statistics.
        *shared.stats.lock().expect("stats lock is never poisoned") = core.stats().clone();
        *shared.moe.lock().expect("stats lock is never poisoned") = core.moe_stats();
        match result {
            Ok(events) => dispatch(&mut streams, events),
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
    }
}

fn admit(
    core: &mut EngineCore,
    streams: &mut HashMap<RequestId, mpsc::UnboundedSender<RequestEvent>>,
    command: Command,
) {
    let Command::Add {
        request,
        events,
        reply,
    } = command;
    let result = core.add_request(request);
    if let Ok(id) = result {
        streams.insert(id, events);
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
