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
}

/// Why a sequence stopped, named as in OpenAI's `finish_reason`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
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
