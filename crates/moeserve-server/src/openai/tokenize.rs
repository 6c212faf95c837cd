//! `POST /tokenize` and `POST /detokenize`, with vLLM's request and response shapes: a prompt
//! (tokenized as `/v1/completions` tokenizes it) or chat messages (rendered with the chat
//! template as `/v1/chat/completions` renders them), so `count` is the `prompt_tokens` a
//! request with the same input is charged; and token ids back to text.

use axum::Json;
use axum::extract::State;
use moeserve_engine::request::ChatPrompt;
use moeserve_text::tokenizer::SpecialTokens;
use serde::{Deserialize, Serialize};

use super::chat::ChatRequest;
use super::{JsonBody, parse_json};
use crate::error::{ApiError, PostErrors};
use crate::state::AppState;

/// `/tokenize`: `prompt`, or `messages` (with the chat fields that shape the rendering).
#[derive(Clone, Debug, Deserialize, utoipa::ToSchema)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    pub prompt: Option<String>,
    /// Post-processor tokens (a leading BOS): by default as the endpoint the input belongs to
    /// adds them — yes for a prompt, no for rendered messages (vLLM's defaults).
    pub add_special_tokens: Option<bool>,
    /// Opens the assistant's turn after the messages (default true).
    pub add_generation_prompt: Option<bool>,
    /// Adds `token_strs`: each token as the vocabulary spells it.
    pub return_token_strs: Option<bool>,
}

#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct TokenizeResponse {
    pub count: usize,
    pub max_model_len: usize,
    pub tokens: Vec<u32>,
    pub token_strs: Option<Vec<String>>,
}

#[derive(Clone, Debug, Deserialize, utoipa::ToSchema)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    /// Required (absent: a 400 naming it).
    #[schema(required = true)]
    pub tokens: Option<Vec<u32>>,
}

#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct DetokenizeResponse {
    pub prompt: String,
}

/// What to tokenize, read and checked from a `/tokenize` body.
enum Input {
    Prompt(String),
    Chat(ChatPrompt),
}

fn parse_tokenize(body: &[u8]) -> Result<(TokenizeRequest, Input), ApiError> {
    let request: TokenizeRequest = parse_json(body)?;
    let chat: ChatRequest = parse_json(body)?;
    let input = match (&request.prompt, &chat.messages) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                "messages",
                "give `prompt` or `messages`, not both",
            ));
        }
        (Some(prompt), None) => Input::Prompt(prompt.clone()),
        (None, Some(_)) => Input::Chat(ChatPrompt {
            messages: chat.chat_messages()?,
            reasoning_effort: chat.reasoning_effort()?,
            tools: chat
                .tools
                .as_ref()
                .map(|tools| serde_json::to_value(tools).expect("tool definitions serialize")),
        }),
        (None, None) => {
            return Err(ApiError::invalid(
                "prompt",
                "`prompt` or `messages` is required",
            ));
        }
    };
    Ok((request, input))
}

#[utoipa::path(post, path = "/tokenize", tag = "vllm",
    request_body = TokenizeRequest,
    security((), ("api_key" = [])),
    responses(
        (status = 200, description = "The token ids (vLLM's shape)", body = TokenizeResponse),
        PostErrors,
    ))]
pub async fn tokenize(
    State(state): State<AppState>,
    body: JsonBody,
) -> Result<Json<TokenizeResponse>, ApiError> {
    let (request, input) = parse_tokenize(body.bytes())?;
    state.check_model(request.model.as_deref())?;
    let engine = state.engine()?;
    let max_model_len = engine.stats().max_model_len;
    let assets = engine.assets().clone();
    let permit = state.text_work_permit().await;
    let with_strs = request.return_token_strs == Some(true);
    let tokenized = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        let ids = match &input {
            Input::Prompt(text) => {
                let tokenizer = assets.tokenizer_for("prompt")?;
                match request.add_special_tokens.unwrap_or(true) {
                    true => tokenizer.encode_with_special_tokens(text)?,
                    false => tokenizer.encode(text)?,
                }
            }
            Input::Chat(chat) => {
                let text =
                    assets.render_chat_turn(chat, request.add_generation_prompt.unwrap_or(true))?;
                let tokenizer = assets.tokenizer_for("messages")?;
                match request.add_special_tokens.unwrap_or(false) {
                    true => tokenizer.encode_with_special_tokens(&text)?,
                    false => tokenizer.encode(&text)?,
                }
            }
        };
        let strs = with_strs.then(|| {
            let tokenizer = assets.tokenizer.as_ref().expect("encoded with it");
            ids.iter()
                .map(|&id| tokenizer.id_to_token(id).unwrap_or_default())
                .collect()
        });
        Ok::<_, moeserve_engine::EngineError>((ids, strs))
    })
    .await
    .map_err(|e| ApiError::Internal(format!("tokenization failed: {e}")))?;
    let (tokens, token_strs) = tokenized?;
    Ok(Json(TokenizeResponse {
        count: tokens.len(),
        max_model_len,
        tokens,
        token_strs,
    }))
}

#[utoipa::path(post, path = "/detokenize", tag = "vllm",
    request_body = DetokenizeRequest,
    security((), ("api_key" = [])),
    responses(
        (status = 200, description = "The text of the tokens", body = DetokenizeResponse),
        PostErrors,
    ))]
pub async fn detokenize(
    State(state): State<AppState>,
    body: JsonBody,
) -> Result<Json<DetokenizeResponse>, ApiError> {
    let request: DetokenizeRequest = body.parse()?;
    state.check_model(request.model.as_deref())?;
    let tokens = request
        .tokens
        .ok_or_else(|| ApiError::invalid("tokens", "`tokens` is required"))?;
    let engine = state.engine()?;
    let assets = engine.assets().clone();
    let vocab = assets.model.config().vocab_size;
    if let Some(bad) = tokens.iter().find(|&&id| id as usize >= vocab) {
        return Err(ApiError::invalid(
            "tokens",
            format!("token id {bad} is out of the vocabulary (size {vocab})"),
        ));
    }
    let permit = state.text_work_permit().await;
    let text = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        let tokenizer = assets.tokenizer_for("tokens")?;
        // vLLM's detokenize keeps special tokens in the text.
        Ok::<_, moeserve_engine::EngineError>(tokenizer.decode(&tokens, SpecialTokens::Keep)?)
    })
    .await
    .map_err(|e| ApiError::Internal(format!("detokenization failed: {e}")))??;
    Ok(Json(DetokenizeResponse { prompt: text }))
}
