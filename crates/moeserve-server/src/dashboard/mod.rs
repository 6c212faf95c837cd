//! `GET /dashboard`: a live per-expert load page, one self-contained HTML file (inline CSS and
//! JavaScript, no external assets: serving machines often have no internet) embedded in the
//! binary. The page polls `GET /v1/moe/load` and `GET /v1/stats` ([`stats`]) about once a second.
//!
//! NOTE: the page itself carries no data and is served without the API key, so a browser can
//! open it; it asks for the key (or reads it from the URL fragment, `#key=...`, which browsers
//! never send to the server) and sends it as `Authorization: Bearer` on those JSON endpoints,
//! which stay behind the key like the rest of `/v1`.

pub mod stats;

use axum::Router;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;

use crate::state::AppState;

/// The page: markup, styles and script in one file.
const PAGE: &str = include_str!("dashboard.html");

/// Only inline code and same-origin requests: the page can neither load nor send anything
/// elsewhere.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'unsafe-inline'; \
     style-src 'unsafe-inline'; img-src data:; connect-src 'self'; base-uri 'none'; \
     form-action 'none'; frame-ancestors 'none'";

/// `GET /dashboard` (no key needed; see the module note).
pub fn router() -> Router<AppState> {
    Router::new().route("/dashboard", get(page))
}

#[utoipa::path(get, path = "/dashboard", tag = "moe",
    responses((status = 200, description = "The live dashboard page", body = String, content_type = "text/html")))]
pub async fn page() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-store"),
            (header::CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::REFERRER_POLICY, "no-referrer"),
        ],
        PAGE,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::ApiKey;
    use crate::metrics::ServerMetrics;
    use crate::state::AppOptions;
    use axum::body::Body;
    use axum::http::{Request, StatusCode};
    use tower::ServiceExt;

    /// A server with an API key whose model has not loaded.
    fn keyed_app() -> Router {
        let options = AppOptions {
            served_model_name: "m".to_string(),
            api_key: Some(ApiKey::new("k3y").unwrap()),
            max_request_bytes: 1024,
            max_waiting_requests: 1,
            ..AppOptions::default()
        };
        crate::app(AppState::new(options, ServerMetrics::unexported("m")))
    }

    async fn get(path: &str, key: Option<&str>) -> axum::response::Response {
        let mut request = Request::get(path);
        if let Some(key) = key {
            request = request.header(header::AUTHORIZATION, format!("Bearer {key}"));
        }
        keyed_app()
            .oneshot(request.body(Body::empty()).unwrap())
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn the_page_needs_no_key_but_its_data_does() {
        let page = get("/dashboard", None).await;
        assert_eq!(page.status(), StatusCode::OK);
        assert_eq!(
            page.headers()[header::CONTENT_TYPE],
            "text/html; charset=utf-8"
        );
        assert!(page.headers().contains_key(header::CONTENT_SECURITY_POLICY));
        assert_eq!(
            get("/v1/stats", None).await.status(),
            StatusCode::UNAUTHORIZED
        );
        let loading = get("/v1/stats", Some("k3y")).await;
        assert_eq!(loading.status(), StatusCode::SERVICE_UNAVAILABLE);
    }

    #[test]
    fn the_page_loads_nothing_from_elsewhere() {
        // The SVG namespace is a name, not an address the page fetches.
        let page = PAGE.replace("http://www.w3.org/2000/svg", "");
        for external in ["http://", "https://", "<link", "src=\"", "@import", "url("] {
            assert!(!page.contains(external), "the page references {external}");
        }
        assert!(PAGE.contains("/v1/moe/load") && PAGE.contains("/v1/stats"));
    }
}
