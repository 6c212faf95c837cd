//! One request, start to finish, on its own KV cache: the reference path that batched serving
//! must reproduce token for token.

use moeserve_model::batch::{ForwardBatch, SequenceSlice};
use moeserve_model::kv_cache::PagedKvCache;
use moeserve_model::models::ForwardOptions;

use crate::assets::ModelAssets;
use crate::output::{OutputContext, SequenceOutput};
use crate::request::{GenerateOutput, GenerateRequest};
use crate::sampler::SamplerState;
use crate::{EngineError, Result};

/// Block size of the private cache; any size gives the same tokens.
const BLOCK_SIZE: usize = 16;

/// Generates for one request: prefill of the whole prompt, then one token per forward pass,
/// reading earlier tokens from the KV cache.
pub fn generate(assets: &ModelAssets, request: &GenerateRequest) -> Result<GenerateOutput> {
    request.params.validate()?;
    let prompt_ids = assets.prompt_ids(&request.prompt)?;
    let max_model_len = assets.model.config().max_position_embeddings;
    let total = prompt_ids.len() + request.params.max_tokens;
    if total > max_model_len {
        return Err(EngineError::ContextTooLong {
            max_model_len,
            prompt_len: prompt_ids.len(),
            max_tokens: request.params.max_tokens,
            total,
        });
    }
    let mut cache = PagedKvCache::new(assets.model.kv_layout(total.div_ceil(BLOCK_SIZE), BLOCK_SIZE));
    let block_table: Vec<u32> = (0..total.div_ceil(BLOCK_SIZE) as u32).collect();
    let ctx = OutputContext {
        tokenizer: assets.tokenizer.as_ref(),
        eos_token_ids: &assets.generation_config.eos_token_ids,
        max_new_tokens: max_model_len - prompt_ids.len(),
    };
    let mut output = SequenceOutput::new(prompt_ids.clone(), &request.params, &ctx)?;
    let mut sampler = SamplerState::new(&request.params);
    let mut context_len = 0;
    let mut step_tokens = prompt_ids;
    loop {
        context_len += step_tokens.len();
        let seqs = [SequenceSlice { query_start: 0, query_len: step_tokens.len(), context_len, block_table: &block_table }];
        let batch = ForwardBatch { token_ids: &step_tokens, sequences: &seqs };
        let logits = assets.model.forward(&batch, &mut cache, ForwardOptions::default())?;
        let sample = sampler
            .sample(&logits, &request.params, output.prompt_ids(), output.token_ids())
            .map_err(|e| EngineError::Sampling(e.to_string()))?;
        let token = sample.token_id;
        if let Some(reason) = output.push(sample)?.finished {
            return Ok(output.into_output(reason));
        }
        step_tokens = vec![token];
    }
}
