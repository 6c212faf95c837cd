//! `POST /v1/completions` (OpenAI's legacy completions): a text or token-id prompt, plain or
//! streamed as `text_completion` chunks. `max_tokens` defaults to 16, as OpenAI's.

use axum::Json;
use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use moeserve_core::SamplingParams;
use moeserve_engine::output::TokenUpdate;
use moeserve_engine::request::{FinishReason, GenerateOutput, Prompt};
use moeserve_engine::sampler::SampleOutput;
use serde::{Deserialize, Serialize};

use super::logprobs::{CompletionLogprobs, TokenLogprob, TokenStrings};
use super::stream::{ChunkMaker, json_event, sse_response};
use super::structured::{StructuredFields, StructuredRequest};
use super::unsupported::{Endpoint, refuse_unsupported};
use super::{
    JsonBody, MAX_CHOICES, ResponseMeta, SamplingFields, StreamOptions, Usage, choice_requests,
    parse_json,
};
use crate::error::{ApiError, PostErrors};
use crate::generation::{Generation, Target};
use crate::state::AppState;

/// OpenAI's default `max_tokens` for completions.
pub const DEFAULT_MAX_TOKENS: usize = 16;

/// `prompt`: text or token ids; a list of one prompt is accepted too.
#[derive(Clone, Debug, Deserialize, PartialEq, utoipa::ToSchema)]
#[serde(untagged)]
pub enum PromptField {
    Text(String),
    TokenIds(Vec<u32>),
    Texts(Vec<String>),
    TokenIdLists(Vec<Vec<u32>>),
}

impl PromptField {
    pub fn into_prompt(self) -> Result<Prompt, ApiError> {
        let batched = |n: usize| {
            ApiError::invalid(
                "prompt",
                format!("{n} prompts in one request are not supported; send one per request"),
            )
        };
        match self {
            PromptField::Text(text) => Ok(Prompt::Text(text)),
            PromptField::TokenIds(ids) => Ok(Prompt::TokenIds(ids)),
            PromptField::Texts(mut texts) if texts.len() == 1 => Ok(Prompt::Text(texts.remove(0))),
            PromptField::TokenIdLists(mut lists) if lists.len() == 1 => {
                Ok(Prompt::TokenIds(lists.remove(0)))
            }
            PromptField::Texts(texts) => Err(batched(texts.len())),
            PromptField::TokenIdLists(lists) => Err(batched(lists.len())),
        }
    }
}

/// The fields of a completions request besides [`SamplingFields`].
#[derive(Clone, Debug, Deserialize, utoipa::ToSchema)]
pub struct CompletionRequest {
    pub model: Option<String>,
    /// Required (absent: a 400 naming it).
    #[schema(required = true)]
    pub prompt: Option<PromptField>,
    #[schema(minimum = 1)]
    pub max_tokens: Option<usize>,
    /// How many alternatives to report per token (0–20).
    #[schema(maximum = 20)]
    pub logprobs: Option<usize>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub echo: Option<bool>,
    /// Only 1 (or absent): one completion per request.
    pub best_of: Option<u64>,
}

/// A `text_completion` object: the whole response, or one streamed chunk.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct Completion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct CompletionChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<FinishReason>,
    /// `return_routed_experts`: `[generated token][layer][k]` (streamed: this chunk's token).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub routed_experts: Option<Vec<Vec<Vec<u32>>>>,
    /// `return_routed_experts: "prompt"`: `[prompt position][layer][k]` (streamed: in the
    /// first token's chunk).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_routed_experts: Option<Vec<Vec<Vec<u32>>>>,
}

impl Completion {
    fn new(meta: &ResponseMeta, choices: Vec<CompletionChoice>, usage: Option<Usage>) -> Self {
        Completion {
            id: meta.id.clone(),
            object: "text_completion",
            created: meta.created,
            model: meta.model.clone(),
            choices,
            usage,
        }
    }
}

/// A completions request read and checked as far as it can be without the model.
pub struct ParsedCompletion {
    pub request: CompletionRequest,
    pub prompt: Prompt,
    pub fields: SamplingFields,
    /// Checked with vLLM's defaults; made again with the model's once it is known.
    pub params: SamplingParams,
    pub structured: Option<StructuredRequest>,
    /// `n`: the choices returned.
    pub n: usize,
    /// `best_of`: the sequences generated, of which the `n` likeliest are returned.
    pub best_of: usize,
}

/// Reads and checks a completions request body: every field a client sends is checked here
/// (the fuzz target `openai_request` drives this), except what needs the model.
pub fn parse_request(body: &[u8]) -> Result<ParsedCompletion, ApiError> {
    let mut request: CompletionRequest = parse_json(body)?;
    let fields: SamplingFields = parse_json(body)?;
    let structured = parse_json::<StructuredFields>(body)?.to_request()?;
    refuse_unsupported(body, Endpoint::Completions)?;
    if request.echo == Some(true) {
        return Err(ApiError::invalid("echo", "echo is not supported"));
    }
    let n = fields.choices()?;
    let best_of = match request.best_of {
        None => n,
        Some(b) if (n as u64..=MAX_CHOICES as u64).contains(&b) => b as usize,
        Some(b) => {
            return Err(ApiError::invalid(
                "best_of",
                format!(
                    "invalid `best_of`: must be at least n ({n}) and at most {MAX_CHOICES}, got {b}"
                ),
            ));
        }
    };
    if best_of > n && request.stream == Some(true) {
        return Err(ApiError::invalid(
            "best_of",
            "`best_of` greater than `n` cannot be streamed (the best are known only at the end)",
        ));
    }
    let prompt = request
        .prompt
        .take()
        .ok_or_else(|| ApiError::invalid("prompt", "`prompt` is required"))?
        .into_prompt()?;
    let max_tokens = request.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS);
    let params = fields.to_params(max_tokens, request.logprobs)?;
    Ok(ParsedCompletion {
        request,
        prompt,
        fields,
        params,
        structured,
        n,
        best_of,
    })
}

#[utoipa::path(post, path = "/v1/completions", tag = "openai",
    request_body = crate::openapi::CompletionBody,
    security((), ("api_key" = [])),
    responses(
        (status = 200, description = "The completion, or with `stream` its chunks as server-sent events",
            content((Completion = "application/json"), (String = "text/event-stream"))),
        PostErrors,
    ))]
pub async fn create(State(state): State<AppState>, body: JsonBody) -> Result<Response, ApiError> {
    let ParsedCompletion {
        request,
        prompt,
        fields,
        params: _,
        structured,
        n,
        best_of,
    } = parse_request(body.bytes())?;
    state.check_model(request.model.as_deref())?;
    let target = Target::new(&state)?;
    let max_tokens = request.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS);
    let defaults = state.sampling_defaults(target.assets());
    let params = fields.to_params_with(max_tokens, request.logprobs, &defaults)?;
    let tokenized = target.tokenize(prompt).await?;
    let grammar = target.compile_grammar(structured).await?;
    let strings = TokenStrings::new(target.assets().tokenizer.clone());
    let generations = target
        .submit_all(choice_requests(
            tokenized.ids,
            params,
            grammar,
            fields.routed_experts()?,
            best_of,
        ))
        .await?;
    let meta = ResponseMeta::new("cmpl", state.served_model_name());
    let want_logprobs = request.logprobs.is_some();
    if request.stream == Some(true) {
        let include_usage = request.stream_options.is_some_and(|o| o.include_usage);
        let makers = (0..generations.len())
            .map(|index| CompletionChunks {
                meta: meta.clone(),
                index,
                strings: strings.clone(),
                want_logprobs,
                include_usage,
                offset: 0,
            })
            .collect();
        return Ok(sse_response(generations, makers));
    }
    let outputs = Generation::collect_all(generations).await?;
    // Usage counts every sequence generated, the ones `best_of` drops too (as OpenAI bills).
    let usage = Usage::of_all(&outputs.iter().collect::<Vec<_>>());
    let choices = best_first(&outputs, n)
        .into_iter()
        .enumerate()
        .map(|(index, output)| choice(index, output, want_logprobs.then_some(&strings)))
        .collect();
    Ok(Json(Completion::new(&meta, choices, Some(usage))).into_response())
}

/// The `n` outputs of the highest total logprob, in that order, when `best_of` made more; all
/// of them in order otherwise.
fn best_first(outputs: &[GenerateOutput], n: usize) -> Vec<&GenerateOutput> {
    let mut ranked: Vec<&GenerateOutput> = outputs.iter().collect();
    if outputs.len() > n {
        let total = |o: &GenerateOutput| o.logprobs.iter().map(|&l| f64::from(l)).sum::<f64>();
        ranked.sort_by(|a, b| total(b).total_cmp(&total(a)));
        ranked.truncate(n);
    }
    ranked
}

/// One choice of the non-streamed response.
fn choice(
    index: usize,
    output: &GenerateOutput,
    logprobs: Option<&TokenStrings>,
) -> CompletionChoice {
    let logprobs = logprobs.map(|strings| {
        let mut lp = CompletionLogprobs::default();
        let mut offset = 0;
        for (i, &token_id) in output.token_ids.iter().enumerate() {
            let token = TokenLogprob {
                token_id,
                logprob: output.logprobs[i],
                top: output.top_logprobs.get(i).map_or(&[], Vec::as_slice),
            };
            lp.push(strings, token, &mut offset);
        }
        lp
    });
    let routed = output.routed_experts.as_ref();
    CompletionChoice {
        index,
        text: output.text.clone(),
        logprobs,
        finish_reason: Some(output.finish_reason),
        routed_experts: routed.map(|r| r.generated.clone()),
        prompt_routed_experts: routed.and_then(|r| r.prompt.clone()),
    }
}

/// Streamed `text_completion` chunks.
struct CompletionChunks {
    meta: ResponseMeta,
    /// The choice this maker streams.
    index: usize,
    strings: TokenStrings,
    want_logprobs: bool,
    include_usage: bool,
    /// Text offset of the next token (for `logprobs.text_offset`).
    offset: usize,
}

impl ChunkMaker for CompletionChunks {
    fn start(&mut self) -> Vec<Event> {
        Vec::new()
    }

    fn token(&mut self, sample: &SampleOutput, update: &TokenUpdate) -> Option<Event> {
        if update.text.is_empty()
            && !self.want_logprobs
            && update.finished.is_none()
            && update.routed_experts.is_none()
        {
            return None;
        }
        let logprobs = self.want_logprobs.then(|| {
            let mut lp = CompletionLogprobs::default();
            let token = TokenLogprob {
                token_id: sample.token_id,
                logprob: sample.logprob,
                top: &sample.top_logprobs,
            };
            lp.push(&self.strings, token, &mut self.offset);
            lp
        });
        let choice = CompletionChoice {
            index: self.index,
            text: update.text.clone(),
            logprobs,
            finish_reason: update.finished,
            routed_experts: update.routed_experts.clone().map(|token| vec![token]),
            prompt_routed_experts: update.prompt_routed_experts.clone(),
        };
        Some(json_event(&Completion::new(&self.meta, vec![choice], None)))
    }

    fn usage(&self, usage: Usage) -> Option<Event> {
        self.include_usage
            .then(|| json_event(&Completion::new(&self.meta, Vec::new(), Some(usage))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(json: &str) -> Result<Prompt, ApiError> {
        serde_json::from_str::<PromptField>(json)
            .unwrap()
            .into_prompt()
    }

    #[test]
    fn prompts_are_text_or_token_ids_alone_or_in_a_list_of_one() {
        assert!(matches!(prompt(r#""hi""#), Ok(Prompt::Text(t)) if t == "hi"));
        assert!(matches!(prompt("[1, 2]"), Ok(Prompt::TokenIds(ids)) if ids == [1, 2]));
        assert!(matches!(prompt(r#"["hi"]"#), Ok(Prompt::Text(_))));
        assert!(matches!(prompt("[[3]]"), Ok(Prompt::TokenIds(ids)) if ids == [3]));
        let err = prompt(r#"["a", "b"]"#).unwrap_err();
        assert_eq!(err.body().param.as_deref(), Some("prompt"));
    }
}
