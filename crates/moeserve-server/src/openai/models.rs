//! `GET /v1/models`: the one model this server serves, under its served name.

use axum::Json;
use axum::extract::State;
use serde::Serialize;

use crate::state::AppState;

#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}

#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    /// The context length, once the model is loaded (a vLLM extension).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_model_len: Option<usize>,
}

#[utoipa::path(get, path = "/v1/models", tag = "openai",
    security((), ("api_key" = [])),
    responses(
        (status = 200, description = "The served model", body = ModelList),
        (status = 401, description = "Missing or wrong API key", body = crate::error::ErrorBody),
    ))]
pub async fn list(State(state): State<AppState>) -> Json<ModelList> {
    let max_model_len = state.loaded_engine().map(|e| e.stats().max_model_len);
    Json(ModelList {
        object: "list",
        data: vec![ModelCard {
            id: state.served_model_name().to_string(),
            object: "model",
            created: state.started_at(),
            owned_by: "moeserve",
            max_model_len,
        }],
    })
}
