//! `POST /v1/chat/completions`: messages rendered with the model's chat template, answered as a
//! `chat.completion` or streamed as `chat.completion.chunk`s (the first carries `delta.role`).
//! Without `max_tokens` / `max_completion_tokens` the answer may fill the rest of the context,
//! as in vLLM. GPT-OSS's replies are split by their harmony channels: the analysis goes to
//! `reasoning_content`, the rest to `content` (vLLM's fields for reasoning models).

use axum::Json;
use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use moeserve_core::MAX_LOGPROBS;
use moeserve_engine::output::TokenUpdate;
use moeserve_engine::request::{ChatPrompt, FinishReason, GenerateOutput, Prompt};
use moeserve_engine::sampler::SampleOutput;
use moeserve_text::chat_template::{ChatMessage, ReasoningEffort};
use moeserve_text::harmony::{ChannelText, HarmonyParser, HarmonyTokens};
use moeserve_text::tokenizer::Tokenizer;
use serde::{Deserialize, Serialize};

use super::logprobs::{ChatLogprobs, TokenLogprob, TokenStrings};
use super::stream::{ChunkMaker, json_event, sse_response};
use super::structured::{StructuredFields, StructuredRequest};
use super::tool_reply::{CallReader, SpecialText, StreamedCalls, harmony_calls};
use super::tools::{ToolCall, ToolCallParser, ToolChoice, ToolDef, ToolRequest};
use super::unsupported::{Endpoint, refuse_unsupported};
use super::{
    JsonBody, ResponseMeta, SamplingFields, StreamOptions, Usage, choice_requests, parse_json,
};
use crate::error::{ApiError, PostErrors};
use crate::generation::{Generation, Target};
use crate::state::AppState;

/// Where GPT-OSS's answer begins: a response format constrains the reply from here.
const FINAL_CHANNEL: &str = "<|channel|>final<|message|>";

/// One message as sent: `content` is text or a list of text parts.
#[derive(Clone, Debug, Deserialize, utoipa::ToSchema)]
pub struct WireMessage {
    #[schema(value_type = Role)]
    pub role: String,
    pub content: Option<MessageContent>,
    /// A `tool` message answers the call with this id.
    pub tool_call_id: Option<String>,
    /// An `assistant` message may carry calls instead of content.
    pub tool_calls: Option<serde_json::Value>,
}

/// A message's `role` (documented as this enum; read as a string so that another is refused
/// with a message naming it).
#[derive(utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
#[allow(dead_code)]
pub enum Role {
    System,
    Developer,
    User,
    Assistant,
    Tool,
}

/// The roles OpenAI's chat API takes; anything else (`"function"`, made-up roles) is refused,
/// not rendered into the template verbatim.
const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

impl WireMessage {
    /// Checks the role and what it requires, as OpenAI does: `system`, `developer`, `user` and
    /// `tool` messages need non-empty content, `tool` a `tool_call_id`, `assistant` content or
    /// `tool_calls`.
    fn validate(&self, index: usize) -> Result<(), ApiError> {
        let field = |name: &str| format!("messages[{index}].{name}");
        let invalid = |name: &str, why: String| {
            let f = field(name);
            Err(ApiError::invalid(&f, format!("invalid `{f}`: {why}")))
        };
        let role = self.role.as_str();
        if !ROLES.contains(&role) {
            return invalid(
                "role",
                format!("unknown role {role:?} (one of {})", ROLES.join(", ")),
            );
        }
        let empty = match &self.content {
            None => true,
            Some(MessageContent::Text(text)) => text.is_empty(),
            Some(MessageContent::Parts(parts)) => parts.is_empty(),
        };
        if role == "assistant" {
            if self.content.is_none() && self.tool_calls.is_none() {
                return invalid(
                    "content",
                    "an assistant message needs `content` or `tool_calls`".into(),
                );
            }
        } else if empty {
            return invalid(
                "content",
                format!("a {role} message needs non-empty `content`"),
            );
        }
        if role == "tool" && self.tool_call_id.as_deref().is_none_or(str::is_empty) {
            return invalid(
                "tool_call_id",
                "a tool message needs the `tool_call_id` it answers".into(),
            );
        }
        Ok(())
    }
}

#[derive(Clone, Debug, Deserialize, utoipa::ToSchema)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Clone, Debug, Deserialize, utoipa::ToSchema)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

/// The fields of a chat request besides [`SamplingFields`].
#[derive(Clone, Debug, Deserialize, utoipa::ToSchema)]
pub struct ChatRequest {
    pub model: Option<String>,
    /// Required (absent: a 400 naming it).
    #[schema(required = true)]
    pub messages: Option<Vec<WireMessage>>,
    pub max_tokens: Option<usize>,
    /// OpenAI's newer name of `max_tokens`; wins when both are given.
    pub max_completion_tokens: Option<usize>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<usize>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// `low`, `medium` or `high`: passed to the chat template (GPT-OSS's states it in its
    /// system message).
    pub reasoning_effort: Option<String>,
    pub tools: Option<Vec<ToolDef>>,
    pub tool_choice: Option<serde_json::Value>,
    pub parallel_tool_calls: Option<bool>,
}

impl ChatRequest {
    pub(crate) fn chat_messages(&self) -> Result<Vec<ChatMessage>, ApiError> {
        let messages = self
            .messages
            .as_ref()
            .ok_or_else(|| ApiError::invalid("messages", "`messages` is required"))?;
        messages
            .iter()
            .enumerate()
            .map(|(i, m)| {
                m.validate(i)?;
                let content = match &m.content {
                    None => String::new(),
                    Some(MessageContent::Text(text)) => text.clone(),
                    Some(MessageContent::Parts(parts)) => text_of_parts(parts, i)?,
                };
                let mut message = ChatMessage::new(m.role.clone(), content);
                message.tool_call_id = m.tool_call_id.clone();
                message.tool_calls = m.tool_calls.as_ref().map(template_tool_calls);
                Ok(message)
            })
            .collect()
    }

    pub(crate) fn reasoning_effort(&self) -> Result<Option<ReasoningEffort>, ApiError> {
        let Some(name) = self.reasoning_effort.as_deref() else {
            return Ok(None);
        };
        ReasoningEffort::from_name(name).map(Some).ok_or_else(|| {
            ApiError::invalid(
                "reasoning_effort",
                format!(
                    "invalid `reasoning_effort`: {name:?} (one of {})",
                    ReasoningEffort::NAMES
                ),
            )
        })
    }

    /// How many alternatives per token, if logprobs were asked for.
    fn num_logprobs(&self) -> Result<Option<usize>, ApiError> {
        match (self.logprobs, self.top_logprobs) {
            (_, Some(k)) if k > MAX_LOGPROBS => Err(ApiError::invalid(
                "top_logprobs",
                format!("invalid `top_logprobs`: must be at most {MAX_LOGPROBS}, got {k}"),
            )),
            (Some(true), k) => Ok(Some(k.unwrap_or(0))),
            (_, Some(_)) => Err(ApiError::invalid(
                "top_logprobs",
                "`top_logprobs` needs `logprobs: true`",
            )),
            _ => Ok(None),
        }
    }
}

/// An assistant turn's `tool_calls` as templates read them: the `arguments` (a JSON text on
/// the wire) parsed into an object, as vLLM hands them to transformers' templates.
fn template_tool_calls(calls: &serde_json::Value) -> serde_json::Value {
    let mut calls = calls.clone();
    for call in calls.as_array_mut().into_iter().flatten() {
        if let Some(args) = call.pointer_mut("/function/arguments")
            && let Some(parsed) = args
                .as_str()
                .and_then(|text| serde_json::from_str::<serde_json::Value>(text).ok())
        {
            *args = parsed;
        }
    }
    calls
}

fn text_of_parts(parts: &[ContentPart], index: usize) -> Result<String, ApiError> {
    let texts = parts.iter().map(|part| match (&*part.kind, &part.text) {
        ("text", Some(text)) => Ok(text.as_str()),
        (kind, _) => Err(ApiError::invalid(
            &format!("messages[{index}].content"),
            format!(
                "invalid `messages[{index}].content`: content parts of type {kind:?} are not \
                 supported (only \"text\")"
            ),
        )),
    });
    Ok(texts.collect::<Result<Vec<_>, _>>()?.join("\n"))
}

/// `chat.completion`.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct ChatCompletion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
}

#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct ChatChoice {
    pub index: usize,
    pub message: AssistantMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: ChatFinishReason,
    /// `return_routed_experts`: `[generated token][layer][k]`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub routed_experts: Option<Vec<Vec<Vec<u32>>>>,
    /// `return_routed_experts: "prompt"`: `[prompt position][layer][k]`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_routed_experts: Option<Vec<Vec<Vec<u32>>>>,
}

/// Chat's `finish_reason`: the engine's, or `tool_calls` when the reply called tools.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ChatFinishReason {
    Stop,
    Length,
    ToolCalls,
}

impl ChatFinishReason {
    fn of(reason: FinishReason, called: bool) -> ChatFinishReason {
        match (reason, called) {
            (_, true) => ChatFinishReason::ToolCalls,
            (FinishReason::Stop, false) => ChatFinishReason::Stop,
            (FinishReason::Length, false) => ChatFinishReason::Length,
        }
    }
}

#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct AssistantMessage {
    pub role: &'static str,
    /// `null` when the reply is tool calls only.
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
}

/// `chat.completion.chunk`.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct ChatChunk {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChunkChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct ChunkChoice {
    pub index: usize,
    pub delta: Delta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<ChatFinishReason>,
    /// This chunk's token's routed experts, `[1][layer][k]`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub routed_experts: Option<Vec<Vec<Vec<u32>>>>,
    /// In the first token's chunk, with `return_routed_experts: "prompt"`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_routed_experts: Option<Vec<Vec<Vec<u32>>>>,
}

#[derive(Clone, Debug, Default, Serialize, utoipa::ToSchema)]
pub struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// Calls as OpenAI streams them: a call's first entry has its `index`, `id` and name, the
    /// later ones (with the same `index`) the next pieces of its arguments.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
}

/// A chat request read and checked as far as it can be without the model.
pub struct ParsedChat {
    pub request: ChatRequest,
    pub fields: SamplingFields,
    pub chat: ChatPrompt,
    pub num_logprobs: Option<usize>,
    pub structured: Option<StructuredRequest>,
    pub tools: Option<ToolRequest>,
    /// `n`: the choices returned.
    pub n: usize,
}

/// Reads and checks a chat request body: every field a client sends is checked here (the
/// fuzz target `openai_request` drives this), except what needs the model.
pub fn parse_request(body: &[u8]) -> Result<ParsedChat, ApiError> {
    let request: ChatRequest = parse_json(body)?;
    let fields: SamplingFields = parse_json(body)?;
    let mut structured = parse_json::<StructuredFields>(body)?.to_request()?;
    refuse_unsupported(body, Endpoint::Chat)?;
    let tools = ToolRequest::from_fields(
        request.tools.as_deref(),
        request.tool_choice.as_ref(),
        request.parallel_tool_calls,
    )?;
    if let Some(output) = tools.as_ref().and_then(ToolRequest::constraint) {
        if structured.is_some() {
            return Err(ApiError::invalid(
                "tool_choice",
                "a required or named `tool_choice` constrains the reply already: it cannot be \
                 combined with `response_format` or another output constraint",
            ));
        }
        structured = Some(StructuredRequest {
            output,
            field: "tools",
        });
    }
    let chat = ChatPrompt {
        messages: request.chat_messages()?,
        reasoning_effort: request.reasoning_effort()?,
        tools: tools.as_ref().map(ToolRequest::template_tools),
    };
    let num_logprobs = request.num_logprobs()?;
    // The sampling fields are checked before any work; the output limit may depend on the
    // prompt's length, so the parameters are made again once it is known.
    if request.max_completion_tokens == Some(0) {
        return Err(ApiError::invalid(
            "max_completion_tokens",
            "invalid `max_completion_tokens`: must be at least 1",
        ));
    }
    let max_tokens = request.max_completion_tokens.or(request.max_tokens);
    fields.to_params(max_tokens.unwrap_or(1), num_logprobs)?;
    let n = fields.choices()?;
    Ok(ParsedChat {
        n,
        request,
        fields,
        chat,
        num_logprobs,
        structured,
        tools,
    })
}

#[utoipa::path(post, path = "/v1/chat/completions", tag = "openai",
    request_body = crate::openapi::ChatBody,
    security((), ("api_key" = [])),
    responses(
        (status = 200, description = "The chat completion, or with `stream` its chunks as server-sent events",
            content((ChatCompletion = "application/json"), (String = "text/event-stream"))),
        PostErrors,
    ))]
pub async fn create(State(state): State<AppState>, body: JsonBody) -> Result<Response, ApiError> {
    let ParsedChat {
        request,
        fields,
        chat,
        num_logprobs,
        structured,
        tools,
        n,
    } = parse_request(body.bytes())?;
    state.check_model(request.model.as_deref())?;
    // What reads the calls out of the reply, if anything does.
    let calls = match &tools {
        None => None,
        Some(t) => match t.choice {
            ToolChoice::None => None,
            ToolChoice::Required | ToolChoice::Named(_) => Some(CallReader::Constrained(t.clone())),
            ToolChoice::Auto => match state.auto_tool_parser() {
                Some(parser) => Some(CallReader::Parsed(parser)),
                None => {
                    return Err(ApiError::invalid(
                        "tool_choice",
                        "\"auto\" tool choice (the default when `tools` are given) needs the \
                         server started with --enable-auto-tool-choice and --tool-call-parser; \
                         or send tool_choice \"required\", \"none\" or a named function",
                    ));
                }
            },
        },
    };
    let target = Target::new(&state)?;
    let tokenized = target.tokenize(Prompt::Chat(chat)).await?;
    let mut grammar = target.compile_grammar(structured).await?;
    // With no limit the answer may fill the context; a full prompt is refused by the engine.
    let max_tokens = request
        .max_completion_tokens
        .or(request.max_tokens)
        .unwrap_or(tokenized.room.max(1));
    let defaults = state.sampling_defaults(target.assets());
    let params = fields.to_params_with(max_tokens, num_logprobs, &defaults)?;
    let strings = TokenStrings::new(target.assets().tokenizer.clone());
    // GPT-OSS reasons first: a response format applies from its final channel on (as vLLM's
    // reasoning parser has it), and the reply is split by channels as any other. A tool
    // constraint is the reply's text from its first token, without channel headers.
    let tool_constrained = matches!(calls, Some(CallReader::Constrained(_)));
    let harmony = target
        .assets()
        .harmony
        .zip(target.assets().tokenizer.clone())
        .filter(|_| grammar.is_none() || !tool_constrained);
    // (A let chain: the grammar is taken only for a harmony reply.)
    if let Some((_, tokenizer)) = &harmony
        && let Some(g) = grammar.take()
    {
        let trigger = tokenizer
            .encode_with_special_tokens(FINAL_CHANNEL)
            .map_err(|e| ApiError::Internal(format!("encoding {FINAL_CHANNEL}: {e}")))?;
        grammar = Some(g.after(trigger));
    }
    // GPT-OSS's calls are harmony messages, which only the harmony parser reads; the text
    // parsers read the other families' replies.
    let harmony_calls = matches!(calls, Some(CallReader::Parsed(ToolCallParser::Openai)));
    let calls = calls.filter(|_| harmony.is_none() && !harmony_calls);
    let specials = SpecialText::new(target.assets());
    let generations = target
        .submit_all(choice_requests(
            tokenized.ids,
            params,
            grammar,
            fields.routed_experts()?,
            n,
        ))
        .await?;
    let meta = ResponseMeta::new("chatcmpl", state.served_model_name());
    let want_logprobs = num_logprobs.is_some();
    if request.stream == Some(true) {
        let include_usage = request.stream_options.is_some_and(|o| o.include_usage);
        let makers = (0..generations.len())
            .map(|index| ChatChunks {
                meta: meta.clone(),
                index,
                strings: strings.clone(),
                harmony: harmony
                    .clone()
                    .map(|(tokens, tokenizer)| HarmonyParser::new(tokens, tokenizer)),
                want_logprobs,
                include_usage,
                calls: calls
                    .clone()
                    .map(|reader| StreamedCalls::new(reader, specials.clone())),
                harmony_calls,
                harmony_calls_sent: 0,
                called: false,
            })
            .collect();
        return Ok(sse_response(generations, makers));
    }
    let outputs = Generation::collect_all(generations).await?;
    let reply = Reply {
        strings: &strings,
        want_logprobs,
        harmony: harmony.as_ref(),
        calls: calls.as_ref(),
        harmony_calls,
        specials: &specials,
    };
    let choices = outputs
        .iter()
        .enumerate()
        .map(|(index, output)| reply.choice(index, output))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Json(ChatCompletion {
        id: meta.id,
        object: "chat.completion",
        created: meta.created,
        model: meta.model,
        choices,
        usage: Usage::of_all(&outputs.iter().collect::<Vec<_>>()),
    })
    .into_response())
}

/// What turns a finished output into a choice of the non-streamed response.
struct Reply<'a> {
    strings: &'a TokenStrings,
    want_logprobs: bool,
    harmony: Option<&'a (HarmonyTokens, Tokenizer)>,
    calls: Option<&'a CallReader>,
    /// GPT-OSS's harmony calls become `tool_calls` (`--tool-call-parser openai`).
    harmony_calls: bool,
    specials: &'a SpecialText,
}

impl Reply<'_> {
    fn choice(&self, index: usize, output: &GenerateOutput) -> Result<ChatChoice, ApiError> {
        let logprobs = self.want_logprobs.then(|| {
            let mut lp = ChatLogprobs::default();
            for (i, &token_id) in output.token_ids.iter().enumerate() {
                let top = output.top_logprobs.get(i).map_or(&[][..], Vec::as_slice);
                let logprob = output.logprobs[i];
                lp.push(
                    self.strings,
                    TokenLogprob {
                        token_id,
                        logprob,
                        top,
                    },
                );
            }
            lp
        });
        let (content, reasoning_content, tool_calls) = match self.harmony {
            Some((tokens, tokenizer)) => {
                let split = HarmonyParser::parse(*tokens, tokenizer.clone(), &output.token_ids)
                    .map_err(|e| ApiError::Internal(format!("cannot decode the reply: {e}")))?;
                let (content, calls) =
                    harmony_calls(split.content, &split.calls, self.harmony_calls);
                let content = match calls.is_empty() {
                    true => Some(content),
                    false => non_empty(content),
                };
                (content, non_empty(split.reasoning), calls)
            }
            None => {
                let (content, calls) = match self.calls {
                    Some(reader) => {
                        reader.read(&output.text, &self.specials.text(&output.token_ids))
                    }
                    None => (Some(output.text.clone()), Vec::new()),
                };
                (content, None, calls)
            }
        };
        Ok(ChatChoice {
            index,
            message: AssistantMessage {
                role: "assistant",
                content,
                reasoning_content,
                tool_calls: (!tool_calls.is_empty()).then_some(tool_calls.clone()),
            },
            logprobs,
            finish_reason: ChatFinishReason::of(output.finish_reason, !tool_calls.is_empty()),
            routed_experts: output.routed_experts.as_ref().map(|r| r.generated.clone()),
            prompt_routed_experts: output
                .routed_experts
                .as_ref()
                .and_then(|r| r.prompt.clone()),
        })
    }
}

pub(super) fn non_empty(text: String) -> Option<String> {
    (!text.is_empty()).then_some(text)
}

/// Streamed `chat.completion.chunk`s.
struct ChatChunks {
    meta: ResponseMeta,
    /// The choice this maker streams.
    index: usize,
    strings: TokenStrings,
    /// Splits a GPT-OSS reply by channel as it streams.
    harmony: Option<HarmonyParser>,
    want_logprobs: bool,
    include_usage: bool,
    /// The calls of a tool request, read as the reply streams.
    calls: Option<StreamedCalls>,
    /// GPT-OSS's harmony calls become `tool_calls` (`--tool-call-parser openai`).
    harmony_calls: bool,
    /// Harmony calls sent so far (the next one's `index`).
    harmony_calls_sent: usize,
    /// Whether any call went out (the finish reason is then `tool_calls`).
    called: bool,
}

impl ChatChunks {
    fn chunk(&self, choices: Vec<ChunkChoice>, usage: Option<Usage>) -> Event {
        json_event(&ChatChunk {
            id: self.meta.id.clone(),
            object: "chat.completion.chunk",
            created: self.meta.created,
            model: self.meta.model.clone(),
            choices,
            usage,
        })
    }
}

impl ChunkMaker for ChatChunks {
    fn start(&mut self) -> Vec<Event> {
        let delta = Delta {
            role: Some("assistant"),
            content: Some(String::new()),
            ..Delta::default()
        };
        let choice = ChunkChoice {
            index: self.index,
            delta,
            logprobs: None,
            finish_reason: None,
            routed_experts: None,
            prompt_routed_experts: None,
        };
        vec![self.chunk(vec![choice], None)]
    }

    fn token(&mut self, sample: &SampleOutput, update: &TokenUpdate) -> Option<Event> {
        let text = match self.harmony.as_mut() {
            Some(parser) => {
                // A token the tokenizer cannot decode would have failed the request already.
                let mut split = parser.push(sample.token_id).unwrap_or_default();
                if update.finished.is_some() {
                    split.append(parser.finish().unwrap_or_default());
                }
                split
            }
            None => ChannelText {
                content: update.text.clone(),
                ..ChannelText::default()
            },
        };
        let (text, calls) = match (self.harmony.is_some(), self.calls.as_mut()) {
            (true, _) => {
                let (content, calls) = harmony_calls(text.content, &text.calls, self.harmony_calls);
                let deltas = calls
                    .iter()
                    .enumerate()
                    .map(|(i, c)| c.delta(self.harmony_calls_sent + i))
                    .collect::<Vec<_>>();
                self.harmony_calls_sent += calls.len();
                self.called |= !calls.is_empty();
                let text = ChannelText {
                    reasoning: text.reasoning,
                    content,
                    calls: Vec::new(),
                };
                (text, deltas)
            }
            (false, Some(calls)) => {
                let (content, deltas) =
                    calls.push(sample.token_id, &text.content, update.finished.is_some());
                self.called |= calls.called();
                let text = ChannelText {
                    reasoning: text.reasoning,
                    content,
                    calls: Vec::new(),
                };
                (text, deltas)
            }
            (false, None) => (text, Vec::new()),
        };
        if text.is_empty()
            && calls.is_empty()
            && !self.want_logprobs
            && update.finished.is_none()
            && update.routed_experts.is_none()
        {
            return None;
        }
        let logprobs = self.want_logprobs.then(|| {
            let mut lp = ChatLogprobs::default();
            let token = TokenLogprob {
                token_id: sample.token_id,
                logprob: sample.logprob,
                top: &sample.top_logprobs,
            };
            lp.push(&self.strings, token);
            lp
        });
        let finish_reason = update
            .finished
            .map(|reason| ChatFinishReason::of(reason, self.called));
        let tool_calls = (!calls.is_empty()).then_some(calls);
        let delta = Delta {
            role: None,
            content: non_empty(text.content),
            reasoning_content: non_empty(text.reasoning),
            tool_calls,
        };
        let choice = ChunkChoice {
            index: self.index,
            delta,
            logprobs,
            finish_reason,
            routed_experts: update.routed_experts.clone().map(|token| vec![token]),
            prompt_routed_experts: update.prompt_routed_experts.clone(),
        };
        Some(self.chunk(vec![choice], None))
    }

    fn usage(&self, usage: Usage) -> Option<Event> {
        self.include_usage
            .then(|| self.chunk(Vec::new(), Some(usage)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(json: &str) -> ChatRequest {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn text_parts_are_joined_and_other_parts_refused() {
        let r = request(
            r#"{"messages": [{"role": "user", "content": [
                {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}"#,
        );
        assert_eq!(r.chat_messages().unwrap()[0].content, "a\nb");
        let r = request(r#"{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}"#);
        let err = r.chat_messages().unwrap_err();
        assert_eq!(err.body().param.as_deref(), Some("messages[0].content"));
    }

    #[test]
    fn top_logprobs_needs_logprobs_and_a_small_count() {
        assert_eq!(request("{}").num_logprobs().unwrap(), None);
        let r = request(r#"{"logprobs": true}"#);
        assert_eq!(r.num_logprobs().unwrap(), Some(0));
        let r = request(r#"{"logprobs": true, "top_logprobs": 3}"#);
        assert_eq!(r.num_logprobs().unwrap(), Some(3));
        let err = request(r#"{"top_logprobs": 3}"#)
            .num_logprobs()
            .unwrap_err();
        assert_eq!(err.body().param.as_deref(), Some("top_logprobs"));
        let r = request(r#"{"logprobs": true, "top_logprobs": 21}"#);
        assert!(r.num_logprobs().is_err());
    }

    #[test]
    fn roles_and_what_they_need_are_checked_naming_the_message_and_field() {
        let refused = [
            (
                r#"[{"role": "wizard", "content": "hi"}]"#,
                "messages[0].role",
            ),
            (
                r#"[{"role": "function", "content": "hi"}]"#,
                "messages[0].role",
            ),
            (
                r#"[{"role": "user", "content": "q"}, {"role": "tool", "content": "42"}]"#,
                "messages[1].tool_call_id",
            ),
            (r#"[{"role": "user"}]"#, "messages[0].content"),
            (
                r#"[{"role": "user", "content": ""}]"#,
                "messages[0].content",
            ),
            (
                r#"[{"role": "system", "content": []}]"#,
                "messages[0].content",
            ),
            (r#"[{"role": "assistant"}]"#, "messages[0].content"),
        ];
        for (messages, param) in refused {
            let r = request(&format!(r#"{{"messages": {messages}}}"#));
            let err = r.chat_messages().unwrap_err();
            assert_eq!(err.body().param.as_deref(), Some(param), "{messages}");
            assert_eq!(err.status(), axum::http::StatusCode::BAD_REQUEST);
        }
        let accepted = r#"{"messages": [{"role": "developer", "content": "be brief"},
            {"role": "user", "content": "q"}, {"role": "assistant", "content": ""},
            {"role": "assistant", "content": null, "tool_calls": []},
            {"role": "tool", "tool_call_id": "call_1", "content": "42"}]}"#;
        assert_eq!(request(accepted).chat_messages().unwrap().len(), 5);
    }

    #[test]
    fn reasoning_effort_is_one_of_three_names() {
        assert_eq!(request("{}").reasoning_effort().unwrap(), None);
        let r = request(r#"{"reasoning_effort": "high"}"#);
        assert_eq!(r.reasoning_effort().unwrap(), Some(ReasoningEffort::High));
        let err = request(r#"{"reasoning_effort": "max"}"#)
            .reasoning_effort()
            .unwrap_err();
        assert_eq!(err.body().param.as_deref(), Some("reasoning_effort"));
        assert!(err.body().message.contains("low, medium, high"));
    }

    #[test]
    fn missing_messages_are_named() {
        let err = request("{}").chat_messages().unwrap_err();
        assert_eq!(err.body().param.as_deref(), Some("messages"));
    }
}
