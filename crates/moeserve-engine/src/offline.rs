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
        on_finish: impl FnMut(usize, usize),
    ) -> Vec<Result<GenerateOutput>> {
        let groups = requests.into_iter().map(|r| vec![r]).collect();
        self.generate_groups(groups, on_finish)
            .into_iter()
            .map(|mut outputs| outputs.pop().expect("one request in, one result out"))
            .collect()
    }

    /// As [`Self::generate`], for groups of choices of one prompt each (`n` > 1: the first
    /// computes the prompt, the others are forked from it, see [`EngineCore::add_group`]).
    /// A refused group gets the error for each of its requests.
    pub fn generate_groups(
        &mut self,
        groups: Vec<Vec<GenerateRequest>>,
        mut on_finish: impl FnMut(usize, usize),
    ) -> Vec<Vec<Result<GenerateOutput>>> {
        let total = groups.iter().map(Vec::len).sum();
        let mut results: Vec<Vec<Option<Result<GenerateOutput>>>> = groups
            .iter()
            .map(|g| (0..g.len()).map(|_| None).collect())
            .collect();
        let mut slot_of: std::collections::HashMap<RequestId, (usize, usize)> = Default::default();
        for (g, group) in groups.into_iter().enumerate() {
            match self.core.add_group(group) {
                Ok(ids) => {
                    for (c, id) in ids.into_iter().enumerate() {
                        slot_of.insert(id, (g, c));
                    }
                }
                Err(e) => {
                    let message = e.to_string();
                    for slot in results[g].iter_mut().skip(1) {
                        *slot = Some(Err(EngineError::RequestFailed(message.clone())));
                    }
                    results[g][0] = Some(Err(e));
                }
            }
        }
        let mut done = results.iter().flatten().filter(|r| r.is_some()).count();
        while self.core.has_unfinished() {
            let events = match self.core.step() {
                Ok(events) => events,
                Err(e) => {
                    // A failed forward pass fails every request still in flight.
                    let message = e.to_string();
                    for (id, (g, c)) in slot_of.drain() {
                        self.core.abort(id);
                        results[g][c] = Some(Err(EngineError::RequestFailed(message.clone())));
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
                if let Some((g, c)) = slot_of.remove(&id) {
                    results[g][c] = Some(result);
                    done += 1;
                    on_finish(done, total);
                }
            }
        }
        results
            .into_iter()
            .map(|group| {
                group
                    .into_iter()
                    .map(|r| r.expect("every request finished, failed or was refused"))
                    .collect()
            })
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
