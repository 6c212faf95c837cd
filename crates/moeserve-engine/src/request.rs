//! What a caller asks the engine for, and what it gets back.

use moeserve_core::SamplingParams;
use moeserve_structured::Grammar;
use moeserve_text::chat_template::{ChatMessage, ReasoningEffort};
use serde::Serialize;

use crate::moe::MoeRequestCounts;

/// A prompt as a client gives it.
#[derive(Clone, Debug)]
pub enum Prompt {
    Text(String),
    TokenIds(Vec<u32>),
    /// Rendered with the model's chat template (assistant turn opened).
    Chat(ChatPrompt),
}

impl Prompt {
    /// Chat messages with the template's defaults.
    pub fn chat(messages: Vec<ChatMessage>) -> Prompt {
        Prompt::Chat(ChatPrompt {
            messages,
            reasoning_effort: None,
            tools: None,
        })
    }
}

/// Chat messages, and what the chat template takes besides them.
#[derive(Clone, Debug)]
pub struct ChatPrompt {
    pub messages: Vec<ChatMessage>,
    /// The template's `reasoning_effort` (GPT-OSS's "Reasoning: …" line).
    pub reasoning_effort: Option<ReasoningEffort>,
    /// OpenAI's `tools` definitions, passed to the template as transformers passes them.
    pub tools: Option<serde_json::Value>,
}

/// One generation request.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub prompt: Prompt,
    pub params: SamplingParams,
    /// A compiled output constraint (JSON schema, regex, grammar): each step's logits are masked
    /// to what it allows, and the request ends when it is complete.
    pub grammar: Option<Grammar>,
    /// Report the experts the routers chose for the request's tokens.
    pub routed_experts: RoutedExpertsMode,
}

/// Which tokens' routed experts a request gets back (`return_routed_experts`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RoutedExpertsMode {
    /// None (nothing is copied).
    #[default]
    Off,
    /// One entry per generated token: the experts of the forward that produced it.
    Generated,
    /// The prompt's positions too (the prompt is then computed in full, never taken from the
    /// prefix cache, so that every position was routed by this request).
    WithPrompt,
}

/// The experts every MoE layer's router chose (its top-k, best first, before any capacity
/// limit; logical expert ids) at consecutive positions of a request, flat
/// `[position][layer][k]`.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct RoutedExperts {
    /// `[prompt positions][layer][k]` for positions 0 .. prompt_len - 1 (the last prompt
    /// position is the first generated token's), with [`RoutedExpertsMode::WithPrompt`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt: Option<Vec<Vec<Vec<u32>>>>,
    /// `[generated token][layer][k]`: entry i is the routing of the forward that produced
    /// generated token i (its input was the token before it).
    pub generated: Vec<Vec<Vec<u32>>>,
}

/// Why a sequence stopped, named as in OpenAI's `finish_reason`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// An eos / stop token or a stop string.
    Stop,
    /// `max_tokens` or the model's context length.
    Length,
}

/// The result of one finished request.
#[derive(Clone, Debug, Serialize)]
pub struct GenerateOutput {
    pub prompt_ids: Vec<u32>,
    pub token_ids: Vec<u32>,
    pub text: String,
    /// Logprob of each chosen token under the model's full softmax.
    pub logprobs: Vec<f32>,
    /// Per generated position, the top alternatives `(id, logprob)` when logprobs were asked for.
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
    pub finish_reason: FinishReason,
    /// Where the request's time went (zero for paths that do not measure it).
    pub timings: RequestTimings,
    /// Its (token, expert) pairs that the capacity limit dropped, rerouted or spilled; `None`
    /// when routing is dropless.
    pub moe: Option<MoeRequestCounts>,
    /// The routers' choices, when asked for.
    pub routed_experts: Option<RoutedExperts>,
}

/// Phases of one request, in seconds, measured by the engine (vLLM's request metrics).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct RequestTimings {
    /// Arrival → first scheduled step.
    pub queue_seconds: f64,
    /// First scheduled step → first token.
    pub prefill_seconds: f64,
    /// First token → last token.
    pub decode_seconds: f64,
    /// Arrival → first token.
    pub time_to_first_token_seconds: f64,
    /// Arrival → finished.
    pub e2e_seconds: f64,
}
