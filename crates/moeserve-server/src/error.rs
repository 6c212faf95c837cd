//! The server's one HTTP error type, rendered in OpenAI's shape
//! `{"error": {"message", "type", "param", "code"}}` (axum's `error-handling` example).
//!
//! Every status code is decided here: engine refusals through `From<EngineError>`, body and JSON
//! problems through [`ApiError::from_body_rejection`] and [`ApiError::from_json_error`].

use axum::Json;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use moeserve_engine::EngineError;
use moeserve_engine::scheduler::AdmissionError;
use moeserve_text::TextError;
use serde::Serialize;

/// Seconds a client is asked to wait after a 429.
pub const RETRY_AFTER_SECONDS: u32 = 1;

/// Everything a request can fail with.
#[derive(Debug, Clone, PartialEq)]
pub enum ApiError {
    /// 400: the request cannot be served as written; `param` names the field.
    BadRequest {
        message: String,
        param: Option<String>,
        code: Option<&'static str>,
    },
    /// 401: no `Authorization: Bearer` header, or the wrong key.
    Unauthorized,
    /// 404: `model` names a model this server does not serve.
    ModelNotFound { model: String },
    /// 404: no such route.
    RouteNotFound { method: String, path: String },
    /// 405: the route exists, with other methods.
    MethodNotAllowed,
    /// 408: the body did not arrive within `--request-read-timeout`.
    BodyTimeout { seconds: f64 },
    /// 413: the body is larger than `--max-request-bytes`.
    PayloadTooLarge { limit: usize },
    /// 415: a JSON route got a body that is not declared `application/json` (what a web page can
    /// send without a CORS preflight is refused this way).
    UnsupportedMediaType { got: Option<String> },
    /// 429: `--max-waiting-requests` requests already wait for their first token.
    QueueFull { max_waiting_requests: usize },
    /// 503: the model is still loading.
    NotReady,
    /// 503: the server is shutting down.
    ShuttingDown,
    /// 503: the engine died (its panic message); the server is exiting.
    EngineFailed { message: String },
    /// 500: the request failed inside the engine (other requests are unaffected).
    Internal(String),
    /// 504: the request did not finish within `--request-timeout`; it was cancelled.
    RequestTimeout { seconds: f64 },
}

impl ApiError {
    /// A 400 naming the field at fault.
    pub fn invalid(param: &str, message: impl Into<String>) -> ApiError {
        ApiError::BadRequest {
            message: message.into(),
            param: Some(param.to_string()),
            code: None,
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest { .. } => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::ModelNotFound { .. } | ApiError::RouteNotFound { .. } => {
                StatusCode::NOT_FOUND
            }
            ApiError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::BodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            ApiError::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::UnsupportedMediaType { .. } => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::QueueFull { .. } => StatusCode::TOO_MANY_REQUESTS,
            ApiError::NotReady | ApiError::ShuttingDown | ApiError::EngineFailed { .. } => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::RequestTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
        }
    }

    /// The body's `error` object.
    pub fn body(&self) -> ErrorDetail {
        let (message, kind, param, code) = match self {
            ApiError::BadRequest {
                message,
                param,
                code,
            } => (
                message.clone(),
                "invalid_request_error",
                param.clone(),
                code.map(str::to_string),
            ),
            ApiError::Unauthorized => (
                "invalid or missing API key: send `Authorization: Bearer <key>`".to_string(),
                "authentication_error",
                None,
                Some("invalid_api_key".to_string()),
            ),
            ApiError::ModelNotFound { model } => (
                format!("the model `{model}` does not exist"),
                "not_found_error",
                Some("model".to_string()),
                Some("model_not_found".to_string()),
            ),
            ApiError::RouteNotFound { method, path } => (
                format!("no route for {method} {path}"),
                "not_found_error",
                None,
                None,
            ),
            ApiError::MethodNotAllowed => (
                "method not allowed on this route".to_string(),
                "invalid_request_error",
                None,
                None,
            ),
            ApiError::BodyTimeout { seconds } => (
                format!("the request body did not arrive within {seconds} s"),
                "invalid_request_error",
                None,
                Some("request_timeout".to_string()),
            ),
            ApiError::PayloadTooLarge { limit } => (
                format!("the request body is larger than the limit of {limit} bytes"),
                "invalid_request_error",
                None,
                Some("request_too_large".to_string()),
            ),
            ApiError::UnsupportedMediaType { got } => (
                format!(
                    "the body must be sent as `Content-Type: application/json`, got {}",
                    got.as_deref()
                        .map_or("none".to_string(), |t| format!("{t:?}"))
                ),
                "invalid_request_error",
                None,
                Some("unsupported_media_type".to_string()),
            ),
            ApiError::QueueFull {
                max_waiting_requests,
            } => (
                format!(
                    "the server is busy: {max_waiting_requests} requests are already waiting; \
                     retry after {RETRY_AFTER_SECONDS} s"
                ),
                "rate_limit_error",
                None,
                Some("queue_full".to_string()),
            ),
            ApiError::NotReady => (
                "the model is still loading".to_string(),
                "service_unavailable_error",
                None,
                None,
            ),
            ApiError::ShuttingDown => (
                "the server is shutting down".to_string(),
                "service_unavailable_error",
                None,
                None,
            ),
            ApiError::EngineFailed { message } => (
                format!("the engine failed ({message}); the server is exiting"),
                "service_unavailable_error",
                None,
                Some("engine_failed".to_string()),
            ),
            ApiError::Internal(message) => (message.clone(), "internal_error", None, None),
            ApiError::RequestTimeout { seconds } => (
                format!(
                    "the request did not finish within {seconds} s (--request-timeout) and \
                     was cancelled"
                ),
                "timeout_error",
                None,
                Some("request_timeout".to_string()),
            ),
        };
        ErrorDetail {
            message,
            r#type: kind,
            param,
            code,
        }
    }

    /// A body that could not be read: too large (413) or broken off (400).
    pub fn from_body_rejection(rejection: BytesRejection, limit: usize) -> ApiError {
        match rejection.status() {
            StatusCode::PAYLOAD_TOO_LARGE => ApiError::PayloadTooLarge { limit },
            _ => ApiError::BadRequest {
                message: format!("cannot read the request body: {}", rejection.body_text()),
                param: None,
                code: None,
            },
        }
    }

    /// A body that is not the expected JSON; names the field when the JSON itself is valid.
    pub fn from_json_error(error: serde_path_to_error::Error<serde_json::Error>) -> ApiError {
        let path = error.path().to_string();
        let inner = error.into_inner();
        match (inner.classify(), path.as_str()) {
            (serde_json::error::Category::Data, p) if p != "." => {
                ApiError::invalid(p, format!("invalid `{p}`: {inner}"))
            }
            _ => ApiError::BadRequest {
                message: format!("the body is not valid JSON for this endpoint: {inner}"),
                param: None,
                code: None,
            },
        }
    }
}

/// OpenAI's error object.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ErrorDetail {
    pub message: String,
    pub r#type: &'static str,
    pub param: Option<String>,
    pub code: Option<String>,
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

/// The error responses of the POST routes that read a body and run the model, as
/// [`ApiError::status`] decides them (for the OpenAPI document).
#[derive(utoipa::IntoResponses)]
#[allow(dead_code)] // Describes responses; never built.
pub enum PostErrors {
    /// A field cannot be served (named in `param`), or a prompt longer than the context.
    #[response(status = 400)]
    BadRequest(ErrorBody),
    /// Missing or wrong API key.
    #[response(status = 401)]
    Unauthorized(ErrorBody),
    /// Unknown model.
    #[response(status = 404)]
    NotFound(ErrorBody),
    /// The body did not arrive within --request-read-timeout.
    #[response(status = 408)]
    BodyTimeout(ErrorBody),
    /// The body is larger than --max-request-bytes.
    #[response(status = 413)]
    TooLarge(ErrorBody),
    /// The body is not application/json.
    #[response(status = 415)]
    NotJson(ErrorBody),
    /// Too many requests waiting (Retry-After).
    #[response(status = 429)]
    QueueFull(ErrorBody),
    /// The request failed inside the engine.
    #[response(status = 500)]
    Internal(ErrorBody),
    /// Loading or shutting down.
    #[response(status = 503)]
    Unavailable(ErrorBody),
    /// --request-timeout ran out.
    #[response(status = 504)]
    Timeout(ErrorBody),
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, body) = (self.status(), self.body());
        // In the request's span, so the line carries its id. Only a failure of the server is
        // an error; refusals, 503 while loading and 504 are in the access line (debug here:
        // they may quote the client's input).
        if status == StatusCode::INTERNAL_SERVER_ERROR {
            tracing::error!(status = status.as_u16(), "{}", body.message);
        } else {
            tracing::debug!(status = status.as_u16(), "{}", body.message);
        }
        let mut response = (status, Json(ErrorBody { error: body })).into_response();
        if matches!(self, ApiError::QueueFull { .. }) {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_SECONDS));
        }
        if matches!(self, ApiError::Unauthorized) {
            // RFC 6750: a 401 names the scheme the client should use.
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

impl From<EngineError> for ApiError {
    fn from(error: EngineError) -> ApiError {
        let message = error.to_string();
        match error {
            EngineError::InvalidParams(e) => ApiError::invalid(e.field, message),
            EngineError::InvalidRequest { field, .. } => ApiError::invalid(field, message),
            EngineError::Admission(
                AdmissionError::ContextTooLong { .. } | AdmissionError::PromptTextTooLong { .. },
            ) => ApiError::BadRequest {
                message,
                param: None,
                code: Some("context_length_exceeded"),
            },
            EngineError::Admission(AdmissionError::CacheTooSmall { .. }) => ApiError::BadRequest {
                message,
                param: None,
                code: Some("kv_cache_too_small"),
            },
            EngineError::Admission(AdmissionError::PromptOverStepBudget { .. }) => {
                ApiError::BadRequest {
                    message,
                    param: None,
                    code: Some("step_budget_too_small"),
                }
            }
            // Prompts the tokenizer or the chat template cannot take are the client's input.
            // The tokenizer's message names its file on the server: keep only what went wrong.
            EngineError::Text(TextError::Tokenizer { message, .. }) => {
                ApiError::invalid("prompt", format!("cannot tokenize the prompt: {message}"))
            }
            EngineError::Text(TextError::ChatTemplate { .. }) => {
                ApiError::invalid("messages", message)
            }
            // Everything else (a duplicate id, a broken model, placement or trace files, a
            // stopped engine) is the server's failure, not the request's.
            _ => ApiError::Internal(message),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use moeserve_core::SamplingParamsError;

    #[test]
    fn engine_refusals_become_400_naming_the_field() {
        let e = ApiError::from(EngineError::InvalidParams(SamplingParamsError {
            field: "top_p",
            message: "must be in (0, 1], got 0".to_string(),
        }));
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        assert_eq!(e.body().param.as_deref(), Some("top_p"));
    }

    #[test]
    fn too_long_prompts_say_the_limit_and_the_length() {
        let e = ApiError::from(EngineError::Admission(AdmissionError::ContextTooLong {
            max_model_len: 1024,
            prompt_len: 1000,
            max_tokens: 100,
        }));
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        let body = e.body();
        assert!(body.message.contains("1024") && body.message.contains("1000"));
        assert_eq!(body.code.as_deref(), Some("context_length_exceeded"));
    }

    #[test]
    fn queue_full_carries_retry_after() {
        let response = ApiError::QueueFull {
            max_waiting_requests: 4,
        }
        .into_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(response.headers()[header::RETRY_AFTER], "1");
    }

    #[test]
    fn json_type_errors_name_the_field() {
        type Req = std::collections::BTreeMap<String, f32>;
        let mut de = serde_json::Deserializer::from_str(r#"{"temperature": "hot"}"#);
        let err = serde_path_to_error::deserialize::<_, Req>(&mut de).unwrap_err();
        let api = ApiError::from_json_error(err);
        assert_eq!(api.body().param.as_deref(), Some("temperature"));
        let mut de = serde_json::Deserializer::from_str("{not json");
        let err = serde_path_to_error::deserialize::<_, Req>(&mut de).unwrap_err();
        assert_eq!(ApiError::from_json_error(err).body().param, None);
    }
}
