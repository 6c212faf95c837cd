//! `--api-key`: the key a client must send as `Authorization: Bearer KEY` on `/v1/*` (as vLLM).
//!
//! The key is compared in constant time (`subtle`) and never printed: its `Debug` is redacted.

use std::str::FromStr;

use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::Response;
use subtle::ConstantTimeEq;

use crate::error::ApiError;
use crate::state::AppState;

/// A secret API key.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(String);

impl ApiKey {
    pub fn new(key: impl Into<String>) -> Result<ApiKey, String> {
        let key = key.into();
        if key.is_empty() {
            return Err("the API key must not be empty".to_string());
        }
        if key.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err("the API key must not contain whitespace".to_string());
        }
        Ok(ApiKey(key))
    }

    /// A key as given by a flag, the environment or the config file. One trailing newline
    /// (`\n` or `\r\n`, what a secrets file read whole leaves) is removed, as other servers
    /// do; the flag says whether it was. An invalid key is refused with a reason that never
    /// quotes the key.
    pub fn from_secret(raw: &str) -> Result<(ApiKey, bool), String> {
        let trimmed = raw
            .strip_suffix("\r\n")
            .or_else(|| raw.strip_suffix('\n'))
            .unwrap_or(raw);
        Ok((ApiKey::new(trimmed)?, trimmed.len() != raw.len()))
    }

    /// Whether an `Authorization` header value carries this key.
    pub fn accepts(&self, authorization: Option<&[u8]>) -> bool {
        let Some(token) = authorization.and_then(|v| v.strip_prefix(b"Bearer ")) else {
            return false;
        };
        token.ct_eq(self.0.as_bytes()).into()
    }
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

impl FromStr for ApiKey {
    type Err = String;

    fn from_str(s: &str) -> Result<ApiKey, String> {
        ApiKey::new(s)
    }
}

impl<'de> serde::Deserialize<'de> for ApiKey {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<ApiKey, D::Error> {
        let key = String::deserialize(d)?;
        ApiKey::new(key).map_err(serde::de::Error::custom)
    }
}

/// Middleware for `/v1/*`: answers 401 unless the request carries the key (when one is set).
pub async fn require_api_key(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    if !carries_key(&state, request.headers()) {
        return Err(ApiError::Unauthorized);
    }
    Ok(next.run(request).await)
}

/// Whether `headers` carry the API key (always, when none is set).
pub fn carries_key(state: &AppState, headers: &axum::http::HeaderMap) -> bool {
    let given = headers.get(header::AUTHORIZATION).map(|v| v.as_bytes());
    state.api_key().is_none_or(|key| key.accepts(given))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_exact_bearer_key_is_accepted() {
        let key = ApiKey::new("s3cret").unwrap();
        assert!(key.accepts(Some(b"Bearer s3cret")));
        assert!(!key.accepts(Some(b"Bearer s3cre")));
        assert!(!key.accepts(Some(b"Bearer s3crett")));
        assert!(!key.accepts(Some(b"s3cret")));
        assert!(!key.accepts(None));
    }

    #[test]
    fn debug_output_hides_the_key() {
        let key = ApiKey::new("s3cret").unwrap();
        assert!(!format!("{key:?}").contains("s3cret"));
    }

    #[test]
    fn empty_or_spaced_keys_are_refused() {
        assert!(ApiKey::new("").is_err());
        assert!(ApiKey::new("a b").is_err());
    }
}
