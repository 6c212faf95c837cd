//! The synchronous engine loop body: admit requests, run one scheduled step as one batched
//! forward pass over all its tokens, sample per request, report what happened.
//!
//! Everything here is plain data and functions; the async [`crate::handle::Engine`] drives it
//! from its own thread, the offline [`crate::offline::LlmEngine`] from the caller's.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use moeserve_backend::device::Device;
use moeserve_core::{BlockId, CacheConfig, MoeConfig, RequestId, SamplingParams, SchedulerConfig};
use moeserve_model::batch::{ForwardBatch, SequenceSlice};
use moeserve_model::kv_cache::KvDtype;
use moeserve_model::models::{ForwardOptions, Greedy, GreedyRows};
use moeserve_model::moe::MoeStepRecord;
use moeserve_structured::Grammar;

use crate::assets::ModelAssets;
use crate::executor::Executor;
use crate::kv_cache::{KvCacheConfig, KvCacheManager};
use crate::moe::{MoeRequestCounts, MoeRuntime, MoeStats};
use crate::output::{OutputContext, SequenceOutput, TokenUpdate};
use crate::request::{GenerateOutput, GenerateRequest, RequestTimings, RoutedExpertsMode};
use crate::routing_capture::RoutingCapture;
use crate::sampler::{SampleOutput, SamplerError, SamplerState, needs_only_greedy};
use crate::scheduler::{Forked, Scheduler, SchedulerLimits, SchedulerOutput, Unservable};
use crate::stats::EngineStats;
use crate::{EngineError, Result};

/// Settings of one engine.
#[derive(Clone, Debug, Default)]
pub struct EngineConfig {
    pub cache: CacheConfig,
    pub scheduler: SchedulerConfig,
    pub moe: MoeConfig,
    /// Where the forward runs (`--device`, resolved at start-up).
    pub device: Device,
}

/// What happened to one request in a step.
#[derive(Clone, Debug)]
pub enum RequestEvent {
    /// A new token (its text may be empty while a character or stop string is incomplete).
    Token {
        id: RequestId,
        sample: SampleOutput,
        update: TokenUpdate,
    },
    /// The request is done; its blocks are already free.
    Finished {
        id: RequestId,
        output: GenerateOutput,
    },
    /// The request failed on its own (e.g. NaN logits); others are unaffected.
    Failed { id: RequestId, error: String },
}

struct RequestState {
    params: SamplingParams,
    sampler: SamplerState,
    output: SequenceOutput,
    clock: RequestClock,
    /// Pairs the capacity limit changed, when a capacity factor is set.
    moe: Option<MoeRequestCounts>,
    /// The output constraint, advanced by every sampled token.
    grammar: Option<Grammar>,
    /// The routers' choices at its positions, when asked for.
    routing: Option<RoutingCapture>,
}

/// A constrained sequence's grammar, taken out of its state for the step's mask.
struct StepGrammar {
    /// Its logits row (its index among the step's scheduled sequences).
    row: usize,
    id: RequestId,
    grammar: Grammar,
    mask: std::result::Result<(), String>,
}

/// When a request reached each phase.
struct RequestClock {
    arrived: Instant,
    first_scheduled: Option<Instant>,
    first_token: Option<Instant>,
}

impl RequestClock {
    fn timings(&self, finished: Instant) -> RequestTimings {
        let scheduled = self.first_scheduled.unwrap_or(finished);
        let first_token = self.first_token.unwrap_or(finished);
        let secs = |a: Instant, b: Instant| b.saturating_duration_since(a).as_secs_f64();
        RequestTimings {
            queue_seconds: secs(self.arrived, scheduled),
            prefill_seconds: secs(scheduled, first_token),
            decode_seconds: secs(first_token, finished),
            time_to_first_token_seconds: secs(self.arrived, first_token),
            e2e_seconds: secs(self.arrived, finished),
        }
    }
}

/// Model, KV storage, scheduler and per-request state.
pub struct EngineCore {
    assets: Arc<ModelAssets>,
    executor: Executor,
    scheduler: Scheduler,
    states: HashMap<RequestId, RequestState>,
    next_id: u64,
    stats: EngineStats,
    moe: MoeRuntime,
    /// The last step's per-layer routing, kept for its buffers.
    record: MoeStepRecord,
    /// `[sampled sequences, vocab]`: the last step's logits, kept for the buffer.
    logits: Vec<f32>,
    /// The last step's token ids, kept for the buffer.
    step_tokens: Vec<u32>,
    /// Which of the step's logits rows only need their greedy token (reduced on the GPU), and
    /// what the GPU made of them.
    greedy: GreedyRows,
}

impl EngineCore {
    pub fn new(assets: Arc<ModelAssets>, config: &EngineConfig) -> Result<Self> {
        config.cache.validate().map_err(config_error)?;
        config.scheduler.validate().map_err(config_error)?;
        let model = &assets.model;
        let moe = MoeRuntime::new(model, &config.moe)?;
        let limits =
            SchedulerLimits::new(&config.scheduler, model.config().max_position_embeddings);
        let block_size = config.cache.block_size;
        let unit = model.kv_layout(1, block_size);
        let kv_dtype = kv_dtype(config, model.weight_dtype())?;
        let (bytes_per_block, budget) = match &config.device {
            Device::Cpu => (
                unit.bytes_per_token_in(kv_dtype.size_in_bytes()) * block_size,
                config
                    .cache
                    .kv_cache_memory
                    .unwrap_or_else(default_kv_cache_bytes),
            ),
            // On the GPU keys and values are in the weights' dtype, and the default budget is
            // what `--gpu-memory-utilization` leaves after the weights.
            Device::Cuda(info) => {
                let element = model.weight_dtype().size_in_bytes();
                let per_block = unit.bytes_per_token_in(element) * block_size;
                let budget = match config.cache.kv_cache_memory {
                    Some(bytes) => bytes,
                    None => gpu_kv_cache_bytes(
                        info.total_memory_bytes,
                        config.cache.gpu_memory_utilization,
                        model.weight_bytes() as u64,
                    )
                    .ok_or_else(|| EngineError::InvalidRequest {
                        field: "gpu_memory_utilization",
                        message: format!(
                            "{:.1} GB of weights leave no KV cache room in {} of {info}",
                            model.weight_bytes() as f64 / 1e9,
                            config.cache.gpu_memory_utilization
                        ),
                    })?,
                };
                (per_block, budget)
            }
        };
        // More blocks than every sequence at full length could use would be wasted memory.
        let useful = limits.max_num_seqs * limits.max_model_len.div_ceil(block_size);
        let num_blocks = ((budget / bytes_per_block as u64) as usize).min(useful);
        if num_blocks == 0 {
            return Err(EngineError::InvalidRequest {
                field: "kv_cache_memory",
                message: format!("{budget} bytes hold no block of {bytes_per_block} bytes"),
            });
        }
        check_servable(&ServableCheck {
            requested_max_model_len: config.scheduler.max_model_len,
            context_len: model.config().max_position_embeddings,
            limits: &limits,
            num_blocks,
            block_size,
            bytes_per_block,
        })?;
        let kv = KvCacheManager::new(KvCacheConfig {
            num_blocks,
            block_size,
            enable_prefix_caching: config.cache.enable_prefix_caching,
        });
        let stats = EngineStats {
            num_kv_blocks: num_blocks,
            kv_cache_bytes: (num_blocks * bytes_per_block) as u64,
            max_concurrency_at_max_len: num_blocks as f64
                / limits.max_model_len.div_ceil(block_size) as f64,
            max_model_len: limits.max_model_len,
            kv_cache_dtype: match config.device {
                Device::Cpu => kv_dtype.name().to_string(),
                Device::Cuda(_) => model.weight_dtype().safetensors_name().to_ascii_lowercase(),
            },
            ..EngineStats::default()
        };
        Ok(EngineCore {
            executor: Executor::new(
                model,
                &config.device,
                (model.kv_layout(num_blocks, block_size), kv_dtype),
                &config.moe,
                &limits,
            )?,
            scheduler: Scheduler::new(limits, kv),
            assets,
            states: HashMap::new(),
            next_id: 0,
            stats,
            moe,
            record: MoeStepRecord::default(),
            logits: Vec::new(),
            step_tokens: Vec::new(),
            greedy: GreedyRows::default(),
        })
    }

    pub fn assets(&self) -> &Arc<ModelAssets> {
        &self.assets
    }

    /// Validates and queues a request; refuses it at once when it could never be served.
    pub fn add_request(&mut self, request: GenerateRequest) -> Result<RequestId> {
        self.add_choice(request, None)
    }

    /// Queues the choices of one prompt (`n` > 1, `best_of`), all or none: the first as any
    /// request, the others held and forked from its KV blocks in the step that computes its
    /// prompt, each sampling its first token from the same logits. The prompt is computed once,
    /// with or without prefix caching (a choice that cannot be forked then is queued instead,
    /// and computes what the prefix cache does not give it).
    pub fn add_group(&mut self, requests: Vec<GenerateRequest>) -> Result<Vec<RequestId>> {
        let mut ids: Vec<RequestId> = Vec::with_capacity(requests.len());
        for request in requests {
            match self.add_choice(request, ids.first().copied()) {
                Ok(id) => ids.push(id),
                Err(e) => {
                    ids.into_iter().for_each(|id| self.abort(id));
                    return Err(e);
                }
            }
        }
        Ok(ids)
    }

    /// Queues `request`; with `fork_of`, held to be forked from that request's prompt.
    fn add_choice(
        &mut self,
        request: GenerateRequest,
        fork_of: Option<RequestId>,
    ) -> Result<RequestId> {
        request.params.validate()?;
        self.assets.check_token_ids(&request.params)?;
        let max_model_len = self.scheduler.limits().max_model_len;
        let prompt_ids = self.assets.prompt_ids(&request.prompt, max_model_len)?;
        let id = RequestId(self.next_id);
        self.next_id += 1;
        let ctx = OutputContext {
            tokenizer: self.assets.tokenizer.as_ref(),
            eos_token_ids: &self.assets.generation_config.eos_token_ids,
            max_new_tokens: max_model_len.saturating_sub(prompt_ids.len()),
        };
        let output = SequenceOutput::new(prompt_ids.clone(), &request.params, &ctx)?;
        let max_tokens = request.params.max_tokens;
        match fork_of {
            None => self.scheduler.add_request(id, prompt_ids, max_tokens)?,
            Some(parent) => self
                .scheduler
                .add_fork(id, parent, prompt_ids, max_tokens)?,
        }
        let sampler = SamplerState::new(&request.params);
        let routing = match request.routed_experts {
            RoutedExpertsMode::Off => None,
            mode => {
                let with_prompt = mode == RoutedExpertsMode::WithPrompt;
                if with_prompt {
                    self.scheduler.bypass_prefix_cache(id);
                }
                let config = self.assets.model.config();
                Some(RoutingCapture {
                    first: if with_prompt {
                        0
                    } else {
                        output.prompt_ids().len() - 1
                    },
                    stride: config.num_moe_layers() * config.num_experts_per_tok,
                    top_k: config.num_experts_per_tok,
                    flat: Vec::new(),
                })
            }
        };
        self.states.insert(
            id,
            RequestState {
                params: request.params,
                sampler,
                output,
                clock: RequestClock {
                    arrived: Instant::now(),
                    first_scheduled: None,
                    first_token: None,
                },
                moe: self.moe.counts_requests().then(MoeRequestCounts::default),
                grammar: request.grammar,
                routing,
            },
        );
        Ok(id)
    }

    /// Drops a request (cancelled or disconnected); its blocks are freed at once.
    pub fn abort(&mut self, id: RequestId) {
        self.scheduler.finish(id);
        self.states.remove(&id);
    }

    pub fn has_unfinished(&self) -> bool {
        self.scheduler.has_unfinished()
    }

    /// Runs one step. Returns no events when nothing could be scheduled.
    pub fn step(&mut self) -> Result<Vec<RequestEvent>> {
        let started = Instant::now();
        let plan = self.scheduler.schedule();
        self.stats.num_preemptions += plan.preempted.len() as u64;
        if plan.is_empty() {
            self.refresh_stats();
            return Ok(Vec::new());
        }
        for s in &plan.scheduled {
            let clock = &mut self
                .states
                .get_mut(&s.id)
                .expect("scheduled request has state")
                .clock;
            clock.first_scheduled.get_or_insert(started);
        }
        let mut record = std::mem::take(&mut self.record);
        record.clear();
        let mut logits = std::mem::take(&mut self.logits);
        let mut grammars = self.take_grammars(&plan);
        self.mark_greedy_rows(&plan, &grammars);
        let forwarded = self.forward_while_masking(&plan, &mut record, &mut logits, &mut grammars);
        if forwarded.is_ok() {
            self.account_moe(&plan, &record);
        }
        self.record = record;
        if let Err(e) = forwarded {
            self.return_grammars(grammars);
            return Err(e);
        }
        self.scheduler.update_from_output(&plan);
        let mut events = Vec::new();
        self.apply_masks(grammars, &mut logits, &mut events);
        let forked = self.fork_choices(&plan)?;
        for (id, sampled) in self.sample_all(&plan, &forked, &logits) {
            self.take_sample(id, sampled, &mut events);
        }
        self.logits = logits;
        self.stats.num_steps += 1;
        self.stats.num_batched_tokens += plan.num_batched_tokens() as u64;
        self.stats.last_step_seconds = started.elapsed().as_secs_f64();
        self.refresh_stats();
        Ok(events)
    }

    /// Charges each request its pairs of the step, then books the step's MoE layers.
    fn account_moe(&mut self, plan: &SchedulerOutput, record: &MoeStepRecord) {
        let mut row = 0;
        for s in &plan.scheduled {
            if let Some(capture) = self.states.get_mut(&s.id).and_then(|r| r.routing.as_mut()) {
                let positions = s.num_computed_tokens..s.num_computed_tokens + s.num_new_tokens;
                capture.record(record, row, positions);
            }
            row += s.num_new_tokens;
        }
        if self.moe.counts_requests() {
            let mut start = 0;
            for s in &plan.scheduled {
                let tokens = start..start + s.num_new_tokens;
                start = tokens.end;
                let step = self.moe.request_step_counts(record, tokens);
                if let Some(total) = self.states.get_mut(&s.id).and_then(|r| r.moe.as_mut()) {
                    total.accumulate(&step);
                }
            }
        }
        self.moe
            .finish_step(self.stats.num_steps, record, &self.assets);
    }

    /// On a GPU, the logits rows that need at most the greedy token: sequences that sample
    /// greedily with nothing else to do on the row (no bias, penalties, top logprobs or
    /// grammar, and no choices forked from them), and prompt chunks that sample nothing. The
    /// device reduces those to two numbers instead of copying the row back.
    fn mark_greedy_rows(&mut self, plan: &SchedulerOutput, grammars: &[StepGrammar]) {
        self.greedy.wanted.clear();
        self.greedy.reduced.clear();
        if !self.executor.is_cuda() {
            return;
        }
        for (row, s) in plan.scheduled.iter().enumerate() {
            let greedy_only = !grammars.iter().any(|g| g.row == row)
                && !self.scheduler.has_forks(s.id)
                && self
                    .states
                    .get(&s.id)
                    .is_some_and(|r| needs_only_greedy(&r.params));
            self.greedy.wanted.push(!s.samples || greedy_only);
        }
    }

    /// The grammars of the step's constrained sequences that sample a token.
    fn take_grammars(&mut self, plan: &SchedulerOutput) -> Vec<StepGrammar> {
        let mut grammars = Vec::new();
        for (row, s) in plan.scheduled.iter().enumerate() {
            if !s.samples {
                continue;
            }
            let state = self
                .states
                .get_mut(&s.id)
                .expect("scheduled request has state");
            if let Some(grammar) = state.grammar.take() {
                grammars.push(StepGrammar {
                    row,
                    id: s.id,
                    grammar,
                    mask: Ok(()),
                });
            }
        }
        grammars
    }

    fn return_grammars(&mut self, grammars: Vec<StepGrammar>) {
        for g in grammars {
            if let Some(state) = self.states.get_mut(&g.id) {
                state.grammar = Some(g.grammar);
            }
        }
    }

    /// The forward pass, with the constrained sequences' token masks computed on another
    /// thread meanwhile, so they cost the step nothing while they take less than the forward
    /// (llguidance's masks take tens to hundreds of microseconds per sequence).
    fn forward_while_masking(
        &mut self,
        plan: &SchedulerOutput,
        record: &mut MoeStepRecord,
        logits: &mut Vec<f32>,
        grammars: &mut [StepGrammar],
    ) -> Result<()> {
        if grammars.is_empty() {
            return self.forward(plan, record, logits);
        }
        let (forwarded, mask_seconds, wait_seconds) = std::thread::scope(|scope| {
            let masking = scope.spawn(|| {
                let started = Instant::now();
                for g in grammars.iter_mut() {
                    g.mask = g.grammar.compute_mask().map_err(|e| e.to_string());
                }
                started.elapsed().as_secs_f64()
            });
            let forwarded = self.forward(plan, record, logits);
            let forward_done = Instant::now();
            let mask_seconds = masking.join();
            (
                forwarded,
                mask_seconds,
                forward_done.elapsed().as_secs_f64(),
            )
        });
        let mask_seconds = match mask_seconds {
            Ok(seconds) => seconds,
            // A panic inside llguidance fails the constrained sequences, not the engine.
            Err(_) => {
                for g in grammars.iter_mut() {
                    g.mask = Err("computing the token mask panicked".to_string());
                }
                0.0
            }
        };
        self.stats.structured_masks += grammars.len() as u64;
        self.stats.structured_mask_seconds += mask_seconds;
        self.stats.structured_wait_seconds += wait_seconds;
        forwarded
    }

    /// Sets what each constrained sequence's grammar forbids to -inf in its logits row, before
    /// any sampling parameter applies (so logprobs are those of the constrained distribution,
    /// as vLLM reports them); a sequence whose mask failed fails alone.
    fn apply_masks(
        &mut self,
        grammars: Vec<StepGrammar>,
        logits: &mut [f32],
        events: &mut Vec<RequestEvent>,
    ) {
        let vocab = self.assets.model.config().vocab_size;
        for mut g in grammars {
            let row = &mut logits[g.row * vocab..(g.row + 1) * vocab];
            let masked = g
                .mask
                .and_then(|()| g.grammar.apply_mask(row).map_err(|e| e.to_string()));
            match masked {
                Ok(()) => {
                    let state = self
                        .states
                        .get_mut(&g.id)
                        .expect("masked request has state");
                    state.grammar = Some(g.grammar);
                }
                Err(error) => {
                    self.abort(g.id);
                    events.push(RequestEvent::Failed { id: g.id, error });
                }
            }
        }
    }

    /// Forks the choices held for each sequence whose prompt this step completed: their blocks
    /// (the partial one copied on the device), their routing so far and their clocks come from
    /// it. Returns each forked choice with its logits row (the sequence's).
    fn fork_choices(&mut self, plan: &SchedulerOutput) -> Result<Vec<(RequestId, usize)>> {
        let mut rows = Vec::new();
        for (row, s) in plan.scheduled.iter().enumerate() {
            if !s.samples || !self.states.contains_key(&s.id) {
                continue;
            }
            for Forked { id, copy } in self.scheduler.fork_children(s.id) {
                if let Some(copy) = copy {
                    self.executor.copy_block(copy)?;
                }
                let parent = &self.states[&s.id];
                let (first_scheduled, routing) =
                    (parent.clock.first_scheduled, parent.routing.clone());
                let child = self.states.get_mut(&id).expect("forked request has state");
                child.clock.first_scheduled = first_scheduled;
                if child.routing.is_some() {
                    child.routing = routing;
                }
                rows.push((id, row));
            }
        }
        Ok(rows)
    }

    /// One forward pass over every scheduled token of the step; its logits go to `logits`.
    fn forward(
        &mut self,
        plan: &SchedulerOutput,
        record: &mut MoeStepRecord,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        let token_ids = &mut self.step_tokens;
        token_ids.clear();
        let mut sequences: Vec<SequenceSlice> = Vec::with_capacity(plan.scheduled.len());
        for s in &plan.scheduled {
            let req = self
                .scheduler
                .request(s.id)
                .expect("scheduled request is known");
            sequences.push(SequenceSlice {
                query_start: token_ids.len(),
                query_len: s.num_new_tokens,
                context_len: s.num_computed_tokens + s.num_new_tokens,
                // The scheduler's table itself, viewed as raw ids (no copy).
                block_table: BlockId::raw_table(self.scheduler.block_table(s.id)),
            });
            token_ids.extend_from_slice(
                &req.token_ids[s.num_computed_tokens..s.num_computed_tokens + s.num_new_tokens],
            );
        }
        let batch = ForwardBatch {
            token_ids,
            sequences: &sequences,
        };
        let greedy = (!self.greedy.wanted.is_empty()).then_some(&mut self.greedy);
        let opts = ForwardOptions {
            moe: self.moe.options(record),
            greedy,
            ..Default::default()
        };
        self.executor
            .forward(&self.assets.model, &batch, opts, logits)
    }

    /// Samples every sequence of the step that needs a token, in parallel (each sequence has
    /// its own sampler state and seed, so the order does not matter); results in plan order.
    fn sample_all(
        &mut self,
        plan: &SchedulerOutput,
        forked: &[(RequestId, usize)],
        logits: &[f32],
    ) -> Vec<(RequestId, std::result::Result<SampleOutput, String>)> {
        use rayon::prelude::*;
        let vocab = self.assets.model.config().vocab_size;
        // Logits rows are the scheduled sequences in plan order (less those failed already);
        // a choice forked this step samples its sibling's row.
        let rows: HashMap<RequestId, usize> = plan
            .scheduled
            .iter()
            .enumerate()
            .filter(|(_, s)| s.samples && self.states.contains_key(&s.id))
            .map(|(row, s)| (s.id, row))
            .chain(forked.iter().copied())
            .collect();
        let mut jobs: Vec<(usize, RequestId, &mut RequestState)> = self
            .states
            .iter_mut()
            .filter_map(|(id, state)| rows.get(id).map(|row| (*row, *id, state)))
            .collect();
        debug_assert_eq!(jobs.len(), rows.len(), "every sampling request has state");
        jobs.sort_unstable_by_key(|(row, id, _)| (*row, *id));
        let reduced = &self.greedy.reduced;
        jobs.par_iter_mut()
            .map(|(row, id, state)| {
                // A row the GPU reduced to its greedy token is not in the logits.
                match reduced.get(*row) {
                    Some(Greedy::Token {
                        id: token_id,
                        logprob,
                    }) => {
                        let sample = SampleOutput {
                            token_id: *token_id,
                            logprob: *logprob,
                            top_logprobs: Vec::new(),
                        };
                        return (*id, Ok(sample));
                    }
                    Some(Greedy::NotFinite) => {
                        let error = SamplerError::InvalidLogits {
                            message: "a logit is NaN or +inf, or all are -inf".into(),
                        };
                        return (*id, Err(error.to_string()));
                    }
                    Some(Greedy::Logits) | None => {}
                }
                let sampled = state
                    .sampler
                    .sample(
                        &logits[*row * vocab..(*row + 1) * vocab],
                        &state.params,
                        state.output.prompt_ids(),
                        state.output.token_ids(),
                    )
                    .map_err(|e| e.to_string());
                (*id, sampled)
            })
            .collect()
    }

    /// Appends one sampled token to its request: events, stop checks, finishing.
    fn take_sample(
        &mut self,
        id: RequestId,
        sampled: std::result::Result<SampleOutput, String>,
        events: &mut Vec<RequestEvent>,
    ) {
        let state = self
            .states
            .get_mut(&id)
            .expect("scheduled request has state");
        let sampled = sampled.and_then(|sample| {
            // The grammar advances first: a token it refuses fails the request.
            let grammar_done = match state.grammar.as_mut() {
                Some(grammar) => {
                    grammar.accept(sample.token_id).map_err(|e| e.to_string())?;
                    grammar.is_finished()
                }
                None => false,
            };
            let update = state
                .output
                .push_ending(sample.clone(), grammar_done)
                .map_err(|e| e.to_string())?;
            Ok((sample, update))
        });
        let (sample, update) = match sampled {
            Ok(done) => done,
            Err(error) => {
                self.abort(id);
                events.push(RequestEvent::Failed { id, error });
                return;
            }
        };
        self.stats.generation_tokens += 1;
        let mut update = update;
        if let Some(capture) = &state.routing {
            // The forward that produced it ran at the sequence's last position.
            let position = state.output.prompt_ids().len() + state.output.token_ids().len() - 2;
            update.routed_experts = Some(capture.at(position));
            if capture.first == 0 && state.output.token_ids().len() == 1 {
                update.prompt_routed_experts = Some((0..position).map(|p| capture.at(p)).collect());
            }
        }
        state.clock.first_token.get_or_insert_with(Instant::now);
        self.scheduler.append_token(id, sample.token_id);
        let finished = update.finished;
        events.push(RequestEvent::Token { id, sample, update });
        if let Some(reason) = finished {
            self.scheduler.finish(id);
            let state = self.states.remove(&id).expect("finished request has state");
            let mut output = state
                .output
                .into_output(reason, state.clock.timings(Instant::now()));
            output.moe = state.moe;
            output.routed_experts = state
                .routing
                .as_ref()
                .map(|c| c.finish(output.prompt_ids.len(), output.token_ids.len()));
            events.push(RequestEvent::Finished { id, output });
        }
    }

    fn refresh_stats(&mut self) {
        let kv = self.scheduler.kv();
        self.stats.num_running = self.scheduler.num_running();
        self.stats.num_waiting = self.scheduler.num_waiting();
        self.stats.kv_cache_usage = kv.usage();
        let prefix = kv.stats();
        self.stats.prefix_cache_queries = prefix.queries;
        self.stats.prefix_cache_hits = prefix.hits;
    }

    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// The MoE runtime: placement, load tracker.
    pub fn moe(&self) -> &MoeRuntime {
        &self.moe
    }

    /// A snapshot of the MoE state for metrics and load reports.
    pub fn moe_stats(&self) -> MoeStats {
        self.moe.snapshot()
    }
}

pub(crate) fn config_error(e: moeserve_core::ConfigError) -> EngineError {
    EngineError::InvalidRequest {
        field: e.field,
        message: e.message,
    }
}

/// What start-up knows when it checks that every admissible request can run.
struct ServableCheck<'a> {
    requested_max_model_len: Option<usize>,
    /// The model's `max_position_embeddings`.
    context_len: usize,
    limits: &'a SchedulerLimits,
    num_blocks: usize,
    block_size: usize,
    bytes_per_block: usize,
}

/// Refuses, as vLLM does, an engine under which an admissible request could never be
/// scheduled (it would wait forever at the head of the queue): a `--max-model-len` beyond the
/// model's context, and what [`SchedulerLimits::check_servable`] refuses (a cache or, without
/// chunked prefill, a step budget smaller than one sequence), with the flags that fix it.
fn check_servable(c: &ServableCheck<'_>) -> Result<()> {
    let unservable = |message: String| Err(EngineError::Unservable { message });
    if let Some(asked) = c.requested_max_model_len
        && asked > c.context_len
    {
        return unservable(format!(
            "--max-model-len {asked} is longer than the model's context of {} tokens \
             (max_position_embeddings in config.json); use at most {}",
            c.context_len, c.context_len
        ));
    }
    let max_len = c.limits.max_model_len;
    match c.limits.check_servable(c.num_blocks, c.block_size) {
        Ok(()) => Ok(()),
        Err(Unservable::CacheShorterThanMaxLen { cache_tokens }) => {
            let needed = max_len.div_ceil(c.block_size) * c.bytes_per_block;
            unservable(format!(
                "the KV cache holds {cache_tokens} tokens ({} blocks of {}, {}), fewer than \
                 the maximum model length of {max_len}: a request that long could never run. \
                 Use --max-model-len {cache_tokens} (the longest that fits) or \
                 --kv-cache-memory {} (what holds {max_len} tokens)",
                c.num_blocks,
                c.block_size,
                size_flag(c.num_blocks * c.bytes_per_block),
                size_flag(needed)
            ))
        }
        Err(Unservable::StepBudgetShorterThanMaxLen { budget }) => unservable(format!(
            "without chunked prefill a prompt must fit one step, but --max-num-batched-tokens \
             ({budget}) is below the maximum model length ({max_len}): a longer prompt would \
             wait forever. Use --max-num-batched-tokens {max_len}, --max-model-len {budget}, \
             or --enable-chunked-prefill"
        )),
    }
}

/// `bytes` rounded up to whole KiB or MiB, as `--kv-cache-memory` reads it.
fn size_flag(bytes: usize) -> String {
    match bytes {
        b if b < 1 << 20 => format!("{}KiB", b.div_ceil(1 << 10)),
        b => format!("{}MiB", b.div_ceil(1 << 20)),
    }
}

/// Without `--kv-cache-memory`: a quarter of the available memory, at most 4 GiB (vLLM's CPU
/// backend defaults to 4 GiB).
/// Activations, cuBLAS workspaces and the CUDA context beside weights and KV cache.
const GPU_ACTIVATION_RESERVE: u64 = 2 << 30;

/// The KV cache a GPU of `total` bytes holds at `utilization` beside `weights` bytes of weights
/// and [`GPU_ACTIVATION_RESERVE`]; `None` when nothing is left.
fn gpu_kv_cache_bytes(total: u64, utilization: f32, weights: u64) -> Option<u64> {
    let usable = (total as f64 * utilization as f64) as u64;
    usable
        .checked_sub(weights + GPU_ACTIVATION_RESERVE)
        .filter(|b| *b > 0)
}

/// The CPU cache's element type for `--kv-cache-dtype`. On CUDA the cache holds the weights'
/// dtype: any other dtype asked for there is refused at start-up rather than ignored.
fn kv_dtype(config: &EngineConfig, weights: moeserve_core::DType) -> Result<KvDtype> {
    use moeserve_core::{DType, KvCacheDtype};
    let asked = config.cache.kv_cache_dtype;
    match (&config.device, asked) {
        (Device::Cpu, _) => Ok(KvDtype::on_cpu(asked)),
        // On CUDA the value returned is not used: the device cache is built in the weights'
        // dtype, which these arms only check the request against.
        (Device::Cuda(_), KvCacheDtype::Auto) => Ok(KvDtype::F32),
        (Device::Cuda(_), KvCacheDtype::Float32) if weights == DType::F32 => Ok(KvDtype::F32),
        (Device::Cuda(_), KvCacheDtype::Bfloat16) if weights == DType::BF16 => Ok(KvDtype::Bf16),
        (Device::Cuda(_), _) => Err(EngineError::InvalidRequest {
            field: "kv_cache_dtype",
            message: format!(
                "{} asked for; on CUDA the KV cache holds the weights' dtype ({}): use auto, \
                 or --device cpu",
                asked.name(),
                weights.safetensors_name()
            ),
        }),
    }
}

fn default_kv_cache_bytes() -> u64 {
    const CAP: u64 = 4 << 30;
    let available = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("MemAvailable:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
                .map(|kib| kib * 1024)
        });
    available.map_or(CAP, |bytes| (bytes / 4).min(CAP))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_kv_cache_is_what_the_utilization_leaves_after_weights_and_reserve() {
        const GIB: u64 = 1 << 30;
        // An H200 (141 GiB) at 0.9 with 93 GiB of weights: 126.9 - 93 - 2 GiB.
        let bytes = gpu_kv_cache_bytes(141 * GIB, 0.9, 93 * GIB).unwrap();
        let usable = (141.0 * GIB as f64 * f64::from(0.9f32)) as u64;
        assert_eq!(bytes, usable - 95 * GIB);
        // Weights that do not fit leave nothing.
        assert_eq!(gpu_kv_cache_bytes(80 * GIB, 0.9, 93 * GIB), None);
        assert_eq!(gpu_kv_cache_bytes(100 * GIB, 0.5, 48 * GIB), None);
    }
}
