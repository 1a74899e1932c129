//! `GET /v1/models`: the one served model, in OpenAI's list format.

use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use serde_json::{json, Value};

use crate::server::AppState;

fn model_card(state: &AppState) -> Value {
    json!({
        "id": state.config.model_name,
        "object": "model",
        "created": state.started_unix,
        "owned_by": "kvmesh",
        "max_model_len": state.config.max_context,
    })
}

pub(crate) async fn list(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({ "object": "list", "data": [model_card(&state)] }))
}
