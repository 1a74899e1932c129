//! `POST /tokenize` and `POST /detokenize` (as vLLM has them): prompt budgeting without
//! generating. A chat prompt is tokenized as `/v1/chat/completions` would (template and
//! all), a text prompt as `/v1/completions` would.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::Json;
use kvmesh_common::TokenId;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::chat::{messages, MessageIn};
use super::check_model;
use crate::error::ApiError;
use crate::json::{parse_body, FieldPolicy, Parsed};
use crate::server::AppState;

const POLICY: FieldPolicy = FieldPolicy {
    ignored: &[],
    unsupported: &[],
};

/// A request body under [`POLICY`], naming this server's model (or none).
fn parse<T: DeserializeOwned>(
    state: &AppState,
    body: Result<Bytes, BytesRejection>,
    model: impl Fn(&T) -> &Option<String>,
) -> Result<T, ApiError> {
    let Parsed { request, .. } = parse_body::<T>(
        body,
        state.config.max_body_bytes,
        &POLICY,
        state.config.strict_params,
    )?;
    check_model(state, model(&request).as_deref())?;
    Ok(request)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenizeRequest {
    model: Option<String>,
    /// A completion prompt (text).
    prompt: Option<String>,
    /// A conversation, rendered with the chat template up to the assistant's turn.
    messages: Option<Vec<MessageIn>>,
}

#[derive(Debug, Serialize)]
pub(crate) struct Tokenized {
    tokens: Vec<TokenId>,
    count: usize,
    /// The context window: prompt plus `max_tokens` must fit in it.
    max_model_len: usize,
}

pub(crate) async fn tokenize(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Tokenized>, ApiError> {
    let request: TokenizeRequest = parse(&state, body, |r: &TokenizeRequest| &r.model)?;
    let tokens = match (request.prompt, request.messages) {
        (Some(prompt), None) => state.prompts.text(&prompt)?,
        (None, Some(m)) => state.prompts.chat(&messages(m)?)?,
        _ => {
            return Err(ApiError::invalid(
                "prompt",
                "give exactly one of `prompt` (text) and `messages` (a conversation)",
            ))
        }
    };
    Ok(Json(Tokenized {
        count: tokens.len(),
        tokens,
        max_model_len: state.config.max_context,
    }))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DetokenizeRequest {
    model: Option<String>,
    tokens: Vec<i64>,
}

#[derive(Debug, Serialize)]
pub(crate) struct Detokenized {
    prompt: String,
}

pub(crate) async fn detokenize(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Detokenized>, ApiError> {
    let request: DetokenizeRequest = parse(&state, body, |r: &DetokenizeRequest| &r.model)?;
    let tokenizer = state.prompts.tokenizer();
    let vocab = tokenizer.vocab_size();
    let ids = request
        .tokens
        .iter()
        .map(|&id| {
            u32::try_from(id)
                .ok()
                .filter(|&id| (id as usize) < vocab)
                .ok_or_else(|| {
                    ApiError::invalid(
                        "tokens",
                        format!("token id {id} is outside the vocabulary of {vocab} tokens"),
                    )
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Json(Detokenized {
        prompt: tokenizer.decode(&ids, false),
    }))
}
