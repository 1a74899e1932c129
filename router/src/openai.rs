//! The OpenAI-compatible endpoints. Each endpoint parses and validates its request into a
//! [`Job`] and a [`Format`]; the rest (start the backend, stream or collect, errors) is
//! shared here.
//!
//! Unknown top-level fields are rejected (400, `unknown_parameter`), except this allow-list
//! of harmless fields clients send, which are accepted and ignored: `user`,
//! `stream_options` (read only when `stream` is true), `response_format` when it is
//! `{"type": "text"}`, and `parallel_tool_calls` (chat; there are no tools). Real OpenAI
//! features this server lacks (`tools`, `functions`, `suffix`, ...) get a 400
//! `unsupported_parameter` naming them; `null` counts as absent.

pub(crate) mod chat;
pub(crate) mod completions;
pub(crate) mod models;
mod params;
mod types;

use std::time::{SystemTime, UNIX_EPOCH};

use axum::http::header;
use axum::response::{IntoResponse, Response};
use futures::Stream;
use kvmesh_common::{FinishReason, TokenEvent, Usage};

use crate::error::ApiError;
use crate::generation::{self, Generation, Job, Update};
use crate::metrics::Outcome;
use crate::request_id::RequestContext;
use crate::server::AppState;
use crate::sse;
use types::ChoiceOutput;

/// How one endpoint shapes its responses.
pub(crate) trait Format: Send + 'static {
    /// Chunks streamed before any token (chat: the assistant role; completions: the echoed
    /// prompt).
    fn opening_chunks(&mut self, choices: usize) -> Vec<String>;
    /// A streamed chunk of choice `index`: new `text`, the token it came with (for
    /// logprobs), and the finish reason on the last one.
    fn chunk(
        &mut self,
        index: usize,
        text: &str,
        token: Option<&TokenEvent>,
        finish: Option<FinishReason>,
    ) -> String;
    /// The last chunk with `stream_options.include_usage`: no choices, the usage.
    fn usage_chunk(&mut self, usage: &Usage) -> String;
    /// The whole non-streaming response.
    fn complete(&mut self, choices: Vec<ChoiceOutput>, usage: &Usage) -> String;
    /// Whether logprobs were asked for (tokens are kept and sent even without text).
    fn logprobs(&self) -> bool;
}

/// What an endpoint hands to [`respond`].
pub(crate) struct Prepared<F> {
    pub(crate) job: Job,
    pub(crate) format: F,
    pub(crate) stream: bool,
    pub(crate) include_usage: bool,
}

/// Starts the generation and answers with SSE or one JSON body.
pub(crate) async fn respond<F: Format>(
    state: &AppState,
    ctx: &RequestContext,
    outcome: Outcome,
    prepared: Prepared<F>,
) -> Result<Response, ApiError> {
    let Prepared {
        job,
        format,
        stream,
        include_usage,
    } = prepared;
    // Every choice is prefilled: all of them queue.
    let own = (job.prompt.len() as u64).saturating_mul(job.n as u64);
    let ticket = state.admission.admit(own)?;
    let generation = generation::start(
        state.backend.as_ref(),
        job,
        ticket,
        ctx.received,
        state.config.retry_after_secs(),
        state.abort.subscribe(),
    )
    .await?;
    if stream {
        Ok(sse::response(
            stream_chunks(generation, format, include_usage),
            state.config.sse_keep_alive,
            ctx.span.clone(),
            outcome,
        ))
    } else {
        let body = collect(generation, format).await?;
        Ok(([(header::CONTENT_TYPE, "application/json")], body).into_response())
    }
}

/// The chunks of a streaming response (the SSE layer adds errors and `[DONE]`).
fn stream_chunks<F: Format>(
    mut generation: Generation,
    mut format: F,
    include_usage: bool,
) -> impl Stream<Item = Result<String, ApiError>> + Send {
    async_stream::stream! {
        for chunk in format.opening_chunks(generation.choices()) {
            yield Ok(chunk);
        }
        while let Some(update) = generation.next().await {
            match update {
                Ok(Update::Token { index, token }) => {
                    if !token.text.is_empty() || format.logprobs() {
                        yield Ok(format.chunk(index, &token.text, Some(&token), None));
                    }
                }
                Ok(Update::Finished { index, reason, text }) => {
                    yield Ok(format.chunk(index, &text, None, Some(reason)));
                }
                Err(e) => {
                    yield Err(e);
                    return;
                }
            }
        }
        if include_usage {
            yield Ok(format.usage_chunk(&generation.usage()));
        }
    }
}

/// Runs a generation to the end for a non-streaming response.
async fn collect<F: Format>(mut generation: Generation, mut format: F) -> Result<String, ApiError> {
    let keep_tokens = format.logprobs();
    let mut choices: Vec<ChoiceOutput> = (0..generation.choices())
        .map(|_| ChoiceOutput::default())
        .collect();
    while let Some(update) = generation.next().await {
        match update? {
            Update::Token { index, token } => {
                let choice = &mut choices[index];
                choice.text.push_str(&token.text);
                if keep_tokens {
                    choice.tokens.push(token);
                }
            }
            Update::Finished {
                index,
                reason,
                text,
            } => {
                let choice = &mut choices[index];
                choice.text.push_str(&text);
                choice.finish = Some(reason);
            }
        }
    }
    Ok(format.complete(choices, &generation.usage()))
}

/// `model` must name the served model (or be omitted).
pub(crate) fn check_model(state: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != state.config.model_name => Err(ApiError::ModelNotFound {
            model: m.to_string(),
            served: state.config.model_name.clone(),
        }),
        _ => Ok(()),
    }
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// `response_format` other than `{"type": "text"}` is unsupported.
pub(crate) fn check_response_format(value: Option<&serde_json::Value>) -> Result<(), ApiError> {
    match value {
        None | Some(serde_json::Value::Null) => Ok(()),
        Some(v) if v.get("type").and_then(|t| t.as_str()) == Some("text") => Ok(()),
        Some(_) => Err(ApiError::unsupported(
            "response_format",
            "only `{\"type\": \"text\"}` is supported for `response_format`",
        )),
    }
}
