//! `--allowed-hosts` and `--allowed-origins`: which `Host` a request may name (against DNS
//! rebinding: a web page whose name resolves to 127.0.0.1 still sends its own name as `Host`)
//! and which browser `Origin` may call the API (CORS, with the preflight answered).
//!
//! Safe defaults for a loopback bind: only `localhost`, `127.0.0.1` and `[::1]` (any port) as
//! hosts and as origins' hosts; any host and origin for other binds (a server exposed on
//! purpose, where the API key is the guard, as vLLM's `--allowed-origins` defaults to `*`).

use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::state::AppState;

/// The loopback names a local server answers to by default.
const LOOPBACK_HOSTS: [&str; 3] = ["localhost", "127.0.0.1", "[::1]"];

/// Allowed hosts or origins: anything (`*`), or a list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Allowed {
    Any,
    /// Host names (lower case, IPv6 in brackets, no port), or origins (`scheme://host[:port]`).
    List(Vec<String>),
}

impl Allowed {
    /// `*` or a comma-separated list, as the flags take it.
    pub fn parse(text: &str) -> Allowed {
        let items: Vec<String> = text
            .split(',')
            .map(|s| s.trim().trim_end_matches('/').to_ascii_lowercase())
            .filter(|s| !s.is_empty())
            .collect();
        if items.iter().any(|s| s == "*") {
            Allowed::Any
        } else {
            Allowed::List(items)
        }
    }
}

/// The hosts and origins a server accepts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OriginPolicy {
    pub hosts: Allowed,
    /// `None`: origins whose host is an allowed host (any scheme and port).
    pub origins: Option<Allowed>,
}

impl OriginPolicy {
    /// The defaults for a server bound to `bind_host`: loopback names only on a loopback bind.
    pub fn defaults_for(bind_host: &str) -> OriginPolicy {
        let loopback = matches!(bind_host, "127.0.0.1" | "localhost" | "::1" | "[::1]")
            || bind_host.starts_with("127.");
        OriginPolicy {
            hosts: if loopback {
                Allowed::List(LOOPBACK_HOSTS.map(String::from).to_vec())
            } else {
                Allowed::Any
            },
            origins: None,
        }
    }

    fn host_allowed(&self, host: &str) -> bool {
        match &self.hosts {
            Allowed::Any => true,
            Allowed::List(hosts) => hosts.iter().any(|h| *h == host),
        }
    }

    /// Anything: what the HTTP layer's own tests and a deliberately open server use.
    pub fn any() -> OriginPolicy {
        OriginPolicy {
            hosts: Allowed::Any,
            origins: Some(Allowed::Any),
        }
    }

    fn origin_allowed(&self, origin: &str) -> bool {
        match &self.origins {
            Some(Allowed::Any) => true,
            Some(Allowed::List(origins)) => origins.iter().any(|o| o == origin),
            None => origin_host(origin).is_some_and(|h| self.host_allowed(&h)),
        }
    }
}

/// `host` of a `Host` header value: lower case, the port dropped, IPv6 kept in brackets.
fn host_name(value: &str) -> String {
    let value = value.trim().to_ascii_lowercase();
    match value.strip_prefix('[') {
        Some(rest) => match rest.find(']') {
            Some(end) => format!("[{}]", &rest[..end]),
            None => value,
        },
        None => value.split(':').next().unwrap_or("").to_string(),
    }
}

/// The host of an origin `scheme://host[:port]`.
fn origin_host(origin: &str) -> Option<String> {
    let (_, rest) = origin.split_once("://")?;
    Some(host_name(rest))
}

fn forbidden(message: String) -> Response {
    let body = serde_json::json!({"error": {
        "message": message, "type": "forbidden_error", "param": null, "code": "forbidden"}});
    (StatusCode::FORBIDDEN, axum::Json(body)).into_response()
}

/// Middleware for every route: 403 for a `Host` or an `Origin` not allowed; CORS headers for
/// an allowed origin, and the preflight (`OPTIONS` with `Access-Control-Request-Method`)
/// answered here.
pub async fn check_origin(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let policy = state.origin_policy();
    let headers = request.headers();
    let host = headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(host_name)
        .unwrap_or_default();
    if !policy.host_allowed(&host) {
        return forbidden(format!(
            "the Host {host:?} is not allowed (--allowed-hosts)"
        ));
    }
    let origin = headers
        .get(header::ORIGIN)
        .and_then(|v| v.to_str().ok())
        .map(|o| o.trim().to_ascii_lowercase());
    let Some(origin) = origin else {
        return next.run(request).await;
    };
    // `null` (sandboxed frames, file:// pages) passes only where any origin does.
    if !policy.origin_allowed(&origin) {
        return forbidden(format!(
            "the Origin {origin:?} is not allowed (--allowed-origins)"
        ));
    }
    let preflight = request.method() == Method::OPTIONS
        && headers.contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
    let mut response = if preflight {
        let mut r = StatusCode::NO_CONTENT.into_response();
        let h = r.headers_mut();
        h.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static("GET, POST, OPTIONS"),
        );
        h.insert(
            header::ACCESS_CONTROL_ALLOW_HEADERS,
            HeaderValue::from_static("authorization, content-type"),
        );
        h.insert(
            header::ACCESS_CONTROL_MAX_AGE,
            HeaderValue::from_static("600"),
        );
        r
    } else {
        next.run(request).await
    };
    allow_origin(response.headers_mut(), &origin);
    response
}

fn allow_origin(headers: &mut HeaderMap, origin: &str) {
    if let Ok(value) = HeaderValue::from_str(origin) {
        headers.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, value);
        headers.insert(header::VARY, HeaderValue::from_static("Origin"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_names_drop_the_port_and_keep_ipv6_brackets() {
        assert_eq!(host_name("LocalHost:8000"), "localhost");
        assert_eq!(host_name("127.0.0.1"), "127.0.0.1");
        assert_eq!(host_name("[::1]:8000"), "[::1]");
        assert_eq!(
            origin_host("http://127.0.0.1:8000").as_deref(),
            Some("127.0.0.1")
        );
    }

    #[test]
    fn a_loopback_bind_allows_loopback_hosts_and_their_origins_only() {
        let p = OriginPolicy::defaults_for("127.0.0.1");
        assert!(p.host_allowed("localhost") && p.host_allowed("[::1]"));
        assert!(!p.host_allowed("evil.example"));
        assert!(p.origin_allowed("http://localhost:3000"));
        assert!(!p.origin_allowed("http://evil.example"));
        let open = OriginPolicy::defaults_for("0.0.0.0");
        assert!(open.host_allowed("anything") && open.origin_allowed("https://app.example"));
        let listed = OriginPolicy {
            origins: Some(Allowed::parse(
                "https://app.example, http://localhost:5173/",
            )),
            ..OriginPolicy::defaults_for("127.0.0.1")
        };
        assert!(listed.origin_allowed("https://app.example"));
        assert!(listed.origin_allowed("http://localhost:5173"));
        assert!(!listed.origin_allowed("http://localhost:3000"));
        assert_eq!(Allowed::parse("a, *"), Allowed::Any);
    }
}
