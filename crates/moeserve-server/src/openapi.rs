//! `GET /openapi.json`: the OpenAPI 3.1 document of every route, generated with utoipa from the
//! request and response types the handlers parse and serialize (and the `#[utoipa::path]`
//! attributes beside each handler), so it cannot drift from the code. CI fuzzes the running
//! server against it with schemathesis (scripts/schemathesis.sh).

use axum::Json;
use axum::extract::State;
use serde::Deserialize;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi, ToSchema};

use crate::openai::SamplingFields;
use crate::openai::chat::ChatRequest;
use crate::openai::completions::CompletionRequest;
use crate::openai::structured::StructuredFields;
use crate::state::AppState;

/// The body of `POST /v1/completions`: one JSON object holding the endpoint's fields, the
/// sampling fields and the output-constraint fields (the handler reads it as each of these).
#[derive(Deserialize, ToSchema)]
#[allow(dead_code)] // Describes the body; the handler parses the parts.
pub struct CompletionBody {
    #[serde(flatten)]
    request: CompletionRequest,
    #[serde(flatten)]
    sampling: SamplingFields,
    #[serde(flatten)]
    structured: StructuredFields,
}

/// The body of `POST /v1/chat/completions`, as [`CompletionBody`].
#[derive(Deserialize, ToSchema)]
#[allow(dead_code)]
pub struct ChatBody {
    #[serde(flatten)]
    request: ChatRequest,
    #[serde(flatten)]
    sampling: SamplingFields,
    #[serde(flatten)]
    structured: StructuredFields,
}

/// `Authorization: Bearer KEY` (needed when the server runs with `--api-key`).
struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "api_key",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

#[derive(OpenApi)]
#[openapi(
    info(title = "moeserve", description = "An OpenAI-compatible server for mixture-of-experts models."),
    paths(
        crate::openai::completions::create,
        crate::openai::chat::create,
        crate::openai::models::list,
        crate::openai::tokenize::tokenize,
        crate::openai::tokenize::detokenize,
        crate::moe::load,
        crate::dashboard::stats::stats,
        crate::app::health,
        crate::app::version,
        crate::metrics::scrape,
        crate::dashboard::page,
        openapi_json,
    ),
    modifiers(&BearerAuth)
)]
pub struct ApiDoc;

/// The OpenAPI document (this one), with `model` narrowed to the one name this server answers
/// to (any other is a 404).
#[utoipa::path(get, path = "/openapi.json", tag = "server",
    responses((status = 200, description = "The OpenAPI 3.1 document", body = serde_json::Value)))]
pub async fn openapi_json(State(state): State<AppState>) -> Json<serde_json::Value> {
    Json(document(state.served_model_name()))
}

/// The document for a server that serves `model`.
pub fn document(model: &str) -> serde_json::Value {
    let mut doc = serde_json::to_value(ApiDoc::openapi()).expect("the document serializes");
    let schemas = &mut doc["components"]["schemas"];
    for request in [
        "CompletionRequest",
        "ChatRequest",
        "TokenizeRequest",
        "DetokenizeRequest",
    ] {
        if let Some(field) = schemas[request]["properties"].get_mut("model") {
            *field = serde_json::json!({
                "type": ["string", "null"],
                "enum": [model, null],
                "description": "The served model's name (`--served-model-name`)"
            });
        }
    }
    doc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_route_is_described() {
        let doc = document("tiny");
        assert_eq!(
            doc["components"]["schemas"]["ChatRequest"]["properties"]["model"]["enum"][0],
            "tiny"
        );
        let paths = doc["paths"].as_object().unwrap();
        for path in [
            "/v1/completions",
            "/v1/chat/completions",
            "/v1/models",
            "/tokenize",
            "/detokenize",
            "/v1/moe/load",
            "/v1/stats",
            "/health",
            "/version",
            "/metrics",
            "/dashboard",
            "/openapi.json",
        ] {
            assert!(paths.contains_key(path), "{path} is missing");
        }
        // The request bodies hold the fields of every part the handler reads.
        let schemas = &doc["components"]["schemas"];
        let body = serde_json::to_string(&schemas["CompletionBody"]).unwrap();
        for part in ["CompletionRequest", "SamplingFields", "StructuredFields"] {
            assert!(body.contains(part), "{body}");
        }
        assert!(schemas["SamplingFields"]["properties"]["logit_bias"].is_object());
        // Every status ApiError gives a POST route is documented, in OpenAI's error shape.
        let responses = &doc["paths"]["/v1/chat/completions"]["post"]["responses"];
        for status in [
            "400", "401", "404", "408", "413", "415", "429", "500", "503", "504",
        ] {
            let schema = &responses[status]["content"]["application/json"]["schema"]["$ref"];
            assert_eq!(schema, "#/components/schemas/ErrorBody", "{status}");
        }
        assert!(schemas["ChatRequest"]["properties"]["tools"].is_object());
    }
}
