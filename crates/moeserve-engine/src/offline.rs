//! The offline batch API (like vLLM's `LLM.generate`): many prompts in, all outputs back in
//! input order, run together through the same engine core the server uses.

use std::sync::Arc;

use moeserve_core::RequestId;

use crate::assets::ModelAssets;
use crate::engine_core::{EngineConfig, EngineCore, RequestEvent};
use crate::request::{GenerateOutput, GenerateRequest};
use crate::{EngineError, Result};

/// An engine driven synchronously by its caller.
pub struct LlmEngine {
    core: EngineCore,
}

impl LlmEngine {
    pub fn new(assets: Arc<ModelAssets>, config: &EngineConfig) -> Result<Self> {
        Ok(LlmEngine {
            core: EngineCore::new(assets, config)?,
        })
    }

    pub fn core(&self) -> &EngineCore {
        &self.core
    }

    /// Runs every request to completion, continuously batched. A request that is refused or
    /// fails gets its own error; the others still finish. `on_finish(done, total)` reports
    /// progress.
    pub fn generate(
        &mut self,
        requests: Vec<GenerateRequest>,
        mut on_finish: impl FnMut(usize, usize),
    ) -> Vec<Result<GenerateOutput>> {
        let total = requests.len();
        let mut results: Vec<Option<Result<GenerateOutput>>> = (0..total).map(|_| None).collect();
        let mut slot_of: std::collections::HashMap<RequestId, usize> = Default::default();
        for (i, request) in requests.into_iter().enumerate() {
            match self.core.add_request(request) {
                Ok(id) => {
                    slot_of.insert(id, i);
                }
                Err(e) => results[i] = Some(Err(e)),
            }
        }
        let mut done = results.iter().filter(|r| r.is_some()).count();
        while self.core.has_unfinished() {
            let events = match self.core.step() {
                Ok(events) => events,
                Err(e) => {
                    // A failed forward pass fails every request still in flight.
                    let message = e.to_string();
                    for (id, i) in slot_of.drain() {
                        self.core.abort(id);
                        results[i] = Some(Err(EngineError::RequestFailed(message.clone())));
                    }
                    break;
                }
            };
            for event in events {
                let (id, result) = match event {
                    RequestEvent::Token { .. } => continue,
                    RequestEvent::Finished { id, output } => (id, Ok(output)),
                    RequestEvent::Failed { id, error } => {
                        (id, Err(EngineError::RequestFailed(error)))
                    }
                };
                if let Some(i) = slot_of.remove(&id) {
                    results[i] = Some(result);
                    done += 1;
                    on_finish(done, total);
                }
            }
        }
        results
            .into_iter()
            .map(|r| r.expect("every request finished, failed or was refused"))
            .collect()
    }
}

/// One request run alone through a fresh engine: the reference that batched runs must equal.
pub fn generate_one(assets: Arc<ModelAssets>, request: GenerateRequest) -> Result<GenerateOutput> {
    let mut config = EngineConfig::default();
    config.scheduler.max_num_seqs = 1;
    let mut engine = LlmEngine::new(assets, &config)?;
    engine
        .generate(vec![request], |_, _| {})
        .pop()
        .expect("one request in, one result out")
}
