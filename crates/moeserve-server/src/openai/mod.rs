//! OpenAI wire types and handlers, one module per endpoint; this module holds what they share:
//! the JSON body extractor, the sampling fields common to completions and chat, `usage` (with
//! the `usage.moe` extension: the request's dropped / rerouted pairs under a capacity factor).
//!
//! Unknown fields are ignored, as OpenAI does; known ones that moeserve does not implement are
//! refused ([`unsupported`]). Each body is read twice, once as the endpoint's
//! own fields and once as [`SamplingFields`], so both keep exact field paths in their errors.

pub mod call_stream;
pub mod chat;
pub mod completions;
pub mod logprobs;
pub mod models;
pub mod stream;
pub mod structured;
pub mod tokenize;
pub mod tool_reply;
pub mod tools;
pub mod unsupported;

use std::sync::atomic::{AtomicU64, Ordering};

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use moeserve_core::{SamplingDefaults, SamplingParams};
use moeserve_engine::moe::MoeRequestCounts;
use moeserve_engine::request::{GenerateOutput, RoutedExpertsMode};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::ApiError;
use crate::state::AppState;

/// A request body, read within `--max-request-bytes` (413 beyond, at once when the declared
/// `Content-Length` says so) and within
/// `--request-read-timeout` (408 beyond: a client that trickles its body holds no task forever).
pub struct JsonBody(Bytes);

impl FromRequest<AppState> for JsonBody {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &AppState) -> Result<Self, ApiError> {
        check_json_content_type(request.headers())?;
        // A declared length over the limit is answered at once from the header, before any of
        // the body is waited for.
        let declared = request
            .headers()
            .get(axum::http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok());
        let max = state.max_request_bytes();
        if declared.is_some_and(|len| len > max as u64) {
            return Err(ApiError::PayloadTooLarge { limit: max });
        }
        let limit = state.time_limits().read;
        let read = tokio::time::timeout(limit, Bytes::from_request(request, state)).await;
        let bytes = read
            .map_err(|_| ApiError::BodyTimeout {
                seconds: limit.as_secs_f64(),
            })?
            .map_err(|r| ApiError::from_body_rejection(r, state.max_request_bytes()))?;
        Ok(JsonBody(bytes))
    }
}

/// `Content-Type: application/json` (parameters such as `charset` allowed, and `+json` types).
/// Anything else is 415: a form or `text/plain` POST is what a web page may send to a local
/// server without a CORS preflight, so it must never start a generation.
fn check_json_content_type(headers: &axum::http::HeaderMap) -> Result<(), ApiError> {
    let given = headers
        .get(axum::http::header::CONTENT_TYPE)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    let essence = given.as_deref().map(|t| {
        t.split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase()
    });
    match essence.as_deref() {
        Some("application/json") => Ok(()),
        Some(t) if t.starts_with("application/") && t.ends_with("+json") => Ok(()),
        _ => Err(ApiError::UnsupportedMediaType { got: given }),
    }
}

impl JsonBody {
    /// The body as `T`; a bad field is named in the error's `param`.
    pub fn parse<T: DeserializeOwned>(&self) -> Result<T, ApiError> {
        parse_json(&self.0)
    }

    pub fn bytes(&self) -> &[u8] {
        &self.0
    }
}

/// `body` as `T`, every byte of it; a bad field is named in the error's `param`. Unknown fields
/// are ignored; nesting deeper than serde_json's limit (128) is an error, not a stack overflow.
pub fn parse_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let value = serde_path_to_error::deserialize(&mut de).map_err(ApiError::from_json_error)?;
    de.end().map_err(|e| ApiError::BadRequest {
        message: format!("the body is not valid JSON for this endpoint: {e}"),
        param: None,
        code: None,
    })?;
    Ok(value)
}

/// `stop`: one string or a list.
#[derive(Clone, Debug, Deserialize, PartialEq, utoipa::ToSchema)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Clone, Copy, Debug, Default, Deserialize, utoipa::ToSchema)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Most choices one request may ask for (`n`, `best_of`), as OpenAI's limit.
pub const MAX_CHOICES: usize = 128;

/// The engine requests of `count` choices of one prompt: the same prompt ids (the later ones
/// find its full blocks in the prefix cache instead of computing them again), each its own
/// grammar state, and with a `seed` the seeds `seed`, `seed + 1`, … (as vLLM derives them).
pub fn choice_requests(
    prompt_ids: Vec<u32>,
    params: SamplingParams,
    grammar: Option<moeserve_structured::Grammar>,
    routed_experts: RoutedExpertsMode,
    count: usize,
) -> Vec<moeserve_engine::request::GenerateRequest> {
    (0..count)
        .map(|i| moeserve_engine::request::GenerateRequest {
            prompt: moeserve_engine::request::Prompt::TokenIds(prompt_ids.clone()),
            params: SamplingParams {
                seed: params.seed.map(|s| s.wrapping_add(i as u64)),
                ..params.clone()
            },
            grammar: grammar.clone(),
            routed_experts,
        })
        .collect()
}

/// Sampling fields shared by `/v1/completions` and `/v1/chat/completions` (vLLM's extras
/// `top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `stop_token_ids` included).
#[derive(Clone, Debug, Default, Deserialize, utoipa::ToSchema)]
pub struct SamplingFields {
    #[schema(minimum = 0)]
    pub temperature: Option<f32>,
    #[schema(exclusive_minimum = 0, maximum = 1)]
    pub top_p: Option<f32>,
    /// vLLM takes -1 (and 0) as "off".
    #[schema(minimum = -1)]
    pub top_k: Option<i64>,
    #[schema(minimum = 0, maximum = 1)]
    pub min_p: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Option<StopField>,
    pub stop_token_ids: Option<Vec<u32>>,
    #[schema(minimum = -2, maximum = 2)]
    pub presence_penalty: Option<f32>,
    #[schema(minimum = -2, maximum = 2)]
    pub frequency_penalty: Option<f32>,
    #[schema(exclusive_minimum = 0)]
    pub repetition_penalty: Option<f32>,
    pub ignore_eos: Option<bool>,
    #[schema(minimum = 1, maximum = 128)]
    pub n: Option<u64>,
    /// Token id (as a string, as OpenAI sends it) → bias added to its logit, in [-100, 100].
    pub logit_bias: Option<std::collections::BTreeMap<String, f32>>,
    /// `true`: each choice carries the experts the routers chose for each generated token;
    /// `"prompt"`: for the prompt's tokens too.
    pub return_routed_experts: Option<serde_json::Value>,
    /// Accepted and ignored (OpenAI uses it for abuse monitoring).
    pub user: Option<String>,
}

impl SamplingFields {
    /// `return_routed_experts`: `false` / absent, `true`, or `"prompt"`.
    pub fn routed_experts(&self) -> Result<RoutedExpertsMode, ApiError> {
        match &self.return_routed_experts {
            None | Some(serde_json::Value::Null | serde_json::Value::Bool(false)) => {
                Ok(RoutedExpertsMode::Off)
            }
            Some(serde_json::Value::Bool(true)) => Ok(RoutedExpertsMode::Generated),
            Some(serde_json::Value::String(s)) if s == "prompt" => {
                Ok(RoutedExpertsMode::WithPrompt)
            }
            Some(other) => Err(ApiError::invalid(
                "return_routed_experts",
                format!("invalid `return_routed_experts`: true, false or \"prompt\", got {other}"),
            )),
        }
    }

    /// How many choices (`n`, 1 to [`MAX_CHOICES`]).
    pub fn choices(&self) -> Result<usize, ApiError> {
        match self.n {
            None => Ok(1),
            Some(n) if (1..=MAX_CHOICES as u64).contains(&n) => Ok(n as usize),
            Some(n) => Err(ApiError::invalid(
                "n",
                format!("invalid `n`: must be in 1..={MAX_CHOICES}, got {n}"),
            )),
        }
    }

    /// Engine parameters; absent fields take vLLM's defaults (temperature 1).
    pub fn to_params(
        &self,
        max_tokens: usize,
        logprobs: Option<usize>,
    ) -> Result<SamplingParams, ApiError> {
        self.to_params_with(max_tokens, logprobs, &SamplingDefaults::default())
    }

    /// Engine parameters; absent fields take `defaults` (the model's generation config), then
    /// vLLM's. The model's `max_tokens` caps `max_tokens`, as vLLM's does.
    pub fn to_params_with(
        &self,
        max_tokens: usize,
        logprobs: Option<usize>,
        model: &SamplingDefaults,
    ) -> Result<SamplingParams, ApiError> {
        let max_tokens = model
            .max_tokens
            .map_or(max_tokens, |m| max_tokens.min(m.max(1)));
        let top_k = match self.top_k {
            None => model.top_k.unwrap_or(0),
            Some(-1) | Some(0) => 0,
            Some(k) if k > 0 => k as usize,
            Some(k) => {
                return Err(ApiError::invalid(
                    "top_k",
                    format!("invalid `top_k`: must be -1 (off) or at least 1, got {k}"),
                ));
            }
        };
        let stop = match &self.stop {
            None => Vec::new(),
            Some(StopField::One(s)) => vec![s.clone()],
            Some(StopField::Many(list)) => list.clone(),
        };
        let logit_bias = self
            .logit_bias
            .iter()
            .flatten()
            .map(|(key, &bias)| match key.trim().parse::<u32>() {
                Ok(id) => Ok((id, bias)),
                Err(_) => Err(ApiError::invalid(
                    "logit_bias",
                    format!("invalid `logit_bias`: keys are token ids, got {key:?}"),
                )),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let defaults = SamplingParams::default();
        let params = SamplingParams {
            temperature: self
                .temperature
                .or(model.temperature)
                .unwrap_or(defaults.temperature),
            top_p: self.top_p.or(model.top_p).unwrap_or(defaults.top_p),
            top_k,
            min_p: self.min_p.or(model.min_p).unwrap_or(defaults.min_p),
            seed: self.seed,
            max_tokens,
            ignore_eos: self.ignore_eos.unwrap_or(false),
            logprobs,
            stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
            stop,
            repetition_penalty: self
                .repetition_penalty
                .or(model.repetition_penalty)
                .unwrap_or(defaults.repetition_penalty),
            presence_penalty: self.presence_penalty.unwrap_or(defaults.presence_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(defaults.frequency_penalty),
            logit_bias,
        };
        params
            .validate()
            .map_err(|e| ApiError::invalid(e.field, e.to_string()))?;
        Ok(params)
    }
}

/// Token counts of one request; `moe` (an extension) only when a capacity factor is set.
#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq, utoipa::ToSchema)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub moe: Option<MoeUsage>,
}

/// What the expert capacity limit did to one request's (token, expert) pairs, over all its
/// steps and MoE layers.
#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq, utoipa::ToSchema)]
pub struct MoeUsage {
    /// Pairs the router chose: tokens run × top_k × MoE layers.
    pub routed_pairs: u64,
    pub dropped_pairs: u64,
    pub rerouted_pairs: u64,
    pub spilled_pairs: u64,
}

impl From<&MoeRequestCounts> for MoeUsage {
    fn from(c: &MoeRequestCounts) -> Self {
        MoeUsage {
            routed_pairs: c.pairs,
            dropped_pairs: c.dropped,
            rerouted_pairs: c.rerouted,
            spilled_pairs: c.spilled,
        }
    }
}

impl Usage {
    pub fn new(prompt_tokens: usize, completion_tokens: usize) -> Usage {
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            moe: None,
        }
    }

    /// The usage of a finished request, with its MoE counts when the engine kept them.
    pub fn of(output: &GenerateOutput) -> Usage {
        Usage::of_all(&[output])
    }

    /// The usage of a request's choices: the prompt counted once (they share it), the
    /// completions and MoE counts summed.
    pub fn of_all(outputs: &[&GenerateOutput]) -> Usage {
        let prompt = outputs.first().map_or(0, |o| o.prompt_ids.len());
        let completion = outputs.iter().map(|o| o.token_ids.len()).sum();
        let moe = outputs
            .iter()
            .filter_map(|o| o.moe.as_ref().map(MoeUsage::from))
            .reduce(|a, b| MoeUsage {
                routed_pairs: a.routed_pairs + b.routed_pairs,
                dropped_pairs: a.dropped_pairs + b.dropped_pairs,
                rerouted_pairs: a.rerouted_pairs + b.rerouted_pairs,
                spilled_pairs: a.spilled_pairs + b.spilled_pairs,
            });
        Usage {
            moe,
            ..Usage::new(prompt, completion)
        }
    }
}

/// `id`, `created` and `model` of one response and all its chunks.
#[derive(Clone, Debug)]
pub struct ResponseMeta {
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl ResponseMeta {
    /// A fresh id with `prefix` (`cmpl`, `chatcmpl`), created now, for `model`.
    pub fn new(prefix: &str, model: &str) -> ResponseMeta {
        ResponseMeta {
            id: response_id(prefix),
            created: crate::state::unix_now(),
            model: model.to_string(),
        }
    }
}

/// A response id like `cmpl-1a2b...`: unique within the process and across restarts.
pub fn response_id(prefix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    format!("{prefix}-{nanos:016x}{n:08x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(json: &str) -> SamplingFields {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn absent_fields_take_vllm_defaults() {
        let p = fields("{}").to_params(16, None).unwrap();
        assert_eq!(p.temperature, 1.0);
        assert_eq!((p.top_p, p.top_k, p.max_tokens), (1.0, 0, 16));
    }

    #[test]
    fn the_models_defaults_fill_what_the_request_leaves_out() {
        let model = SamplingDefaults {
            temperature: Some(0.6),
            top_p: Some(0.95),
            top_k: Some(20),
            repetition_penalty: Some(1.1),
            max_tokens: Some(8),
            ..Default::default()
        };
        let p = fields("{}").to_params_with(16, None, &model).unwrap();
        assert_eq!((p.temperature, p.top_p, p.top_k), (0.6, 0.95, 20));
        assert_eq!((p.repetition_penalty, p.min_p, p.max_tokens), (1.1, 0.0, 8));
        let p = fields(r#"{"temperature": 0, "top_k": -1, "top_p": 1}"#)
            .to_params_with(4, None, &model)
            .unwrap();
        assert_eq!(
            (p.temperature, p.top_k, p.top_p, p.max_tokens),
            (0.0, 0, 1.0, 4)
        );
    }

    #[test]
    fn stop_takes_a_string_or_a_list() {
        let p = fields(r#"{"stop": "x"}"#).to_params(1, None).unwrap();
        assert_eq!(p.stop, vec!["x"]);
        let p = fields(r#"{"stop": ["a", "b"], "top_k": -1}"#)
            .to_params(1, None)
            .unwrap();
        assert_eq!((p.stop.len(), p.top_k), (2, 0));
    }

    #[test]
    fn n_beyond_its_range_and_bad_ranges_name_their_field() {
        assert_eq!(fields(r#"{"n": 3}"#).choices().unwrap(), 3);
        for bad in [r#"{"n": 0}"#, r#"{"n": 129}"#] {
            let err = fields(bad).choices().unwrap_err();
            assert_eq!(err.body().param.as_deref(), Some("n"));
        }
        let err = fields(r#"{"top_p": 0}"#).to_params(1, None).unwrap_err();
        assert_eq!(err.body().param.as_deref(), Some("top_p"));
        let err = fields(r#"{"top_k": -3}"#).to_params(1, None).unwrap_err();
        assert_eq!(err.body().param.as_deref(), Some("top_k"));
        let err = fields("{}").to_params(0, None).unwrap_err();
        assert_eq!(err.body().param.as_deref(), Some("max_tokens"));
    }

    #[test]
    fn logit_bias_takes_token_id_keys_within_a_hundred() {
        let p = fields(r#"{"logit_bias": {"7": -100, "3": 2.5}}"#)
            .to_params(1, None)
            .unwrap();
        assert_eq!(p.logit_bias, vec![(3, 2.5), (7, -100.0)]);
        for bad in [
            r#"{"logit_bias": {"x": 1}}"#,
            r#"{"logit_bias": {"1": 101}}"#,
        ] {
            let err = fields(bad).to_params(1, None).unwrap_err();
            assert_eq!(err.body().param.as_deref(), Some("logit_bias"), "{bad}");
        }
    }

    #[test]
    fn usage_has_moe_counts_only_when_the_engine_kept_them() {
        let plain = serde_json::to_value(Usage::new(3, 4)).unwrap();
        assert_eq!(plain["total_tokens"], 7);
        assert!(plain.get("moe").is_none());
        let counts = MoeRequestCounts {
            pairs: 28,
            dropped: 2,
            rerouted: 1,
            spilled: 0,
        };
        let usage = Usage {
            moe: Some(MoeUsage::from(&counts)),
            ..Usage::new(3, 4)
        };
        let json = serde_json::to_value(usage).unwrap();
        assert_eq!(json["moe"]["routed_pairs"], 28);
        assert_eq!(json["moe"]["dropped_pairs"], 2);
        assert_eq!(json["moe"]["rerouted_pairs"], 1);
        assert_eq!(json["moe"]["spilled_pairs"], 0);
    }

    #[test]
    fn response_ids_are_unique() {
        assert_ne!(response_id("cmpl"), response_id("cmpl"));
        assert!(response_id("chatcmpl").starts_with("chatcmpl-"));
    }
}
