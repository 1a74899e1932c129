//! The OpenAI-compatible endpoints. Each endpoint parses and validates its request into a
//! [`Job`] and a [`Format`]; the rest (start the backend, stream or collect, errors) is
//! shared here.
//!
//! Request fields (docs/api.md has the table): OpenAI fields that do not apply here
//! (`store`, `metadata`, `service_tier`, ...) and top-level fields this server does not know
//! are accepted with no effect and named in the `x-kvmesh-ignored-params` response header
//! and the log; with `strict_params` unknown ones get a 400 `unknown_parameter`. Real
//! OpenAI features this server lacks (`functions`, `suffix`, ...) get a 400
//! `unsupported_parameter` naming them; `null` counts as absent.

pub(crate) mod chat;
pub(crate) mod completions;
mod content;
pub(crate) mod models;
mod params;
pub(crate) mod responses;
mod structured;
pub(crate) mod tokenize;
mod tools;
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
use crate::sse::{self, Chunk, Framing};
use types::ChoiceOutput;

/// How one endpoint shapes its responses.
pub(crate) trait Format: Send + 'static {
    /// How the streamed chunks are framed as server-sent events.
    const FRAMING: Framing = Framing::Done;
    /// Chunks streamed before any token (chat: the assistant role; completions: the echoed
    /// prompt; Responses: `response.created`, `response.in_progress`).
    fn opening_chunks(&mut self, choices: usize) -> Vec<Chunk>;
    /// The streamed chunks of an update of choice `index` (none, one or several): new
    /// `text`, the token it came with (for logprobs), and the finish reason on the last one.
    fn chunk(
        &mut self,
        index: usize,
        text: &str,
        token: Option<&TokenEvent>,
        finish: Option<FinishReason>,
    ) -> Vec<Chunk>;
    /// The chunks after every choice finished (chat with `stream_options.include_usage`:
    /// the usage, no choices; Responses: `response.completed`).
    fn closing_chunks(&mut self, usage: &Usage) -> Vec<Chunk>;
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
            stream_chunks(generation, format),
            F::FRAMING,
            state.config.sse_keep_alive,
            ctx.span.clone(),
            outcome,
        ))
    } else {
        let body = collect(generation, format).await?;
        Ok(([(header::CONTENT_TYPE, "application/json")], body).into_response())
    }
}

/// The chunks of a streaming response (the SSE layer adds errors and the framing).
fn stream_chunks<F: Format>(
    mut generation: Generation,
    mut format: F,
) -> impl Stream<Item = Result<Chunk, ApiError>> + Send {
    async_stream::stream! {
        for chunk in format.opening_chunks(generation.choices()) {
            yield Ok(chunk);
        }
        while let Some(update) = generation.next().await {
            let chunks = match update {
                Ok(Update::Token { index, token }) => {
                    if token.text.is_empty() && !format.logprobs() {
                        continue;
                    }
                    format.chunk(index, &token.text, Some(&token), None)
                }
                Ok(Update::Finished { index, reason, text }) => {
                    format.chunk(index, &text, None, Some(reason))
                }
                Err(e) => {
                    yield Err(e);
                    return;
                }
            };
            for chunk in chunks {
                yield Ok(chunk);
            }
        }
        for chunk in format.closing_chunks(&generation.usage()) {
            yield Ok(chunk);
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

/// The response header naming request fields that had no effect.
pub(crate) const IGNORED_PARAMS_HEADER: &str = "x-kvmesh-ignored-params";

/// Names the request fields that had no effect in `response`'s header and the log.
pub(crate) fn name_ignored(mut response: Response, ignored: &[String]) -> Response {
    /// Enough for any real client; a body of thousands of junk fields gets a count.
    const SHOWN: usize = 32;
    if ignored.is_empty() {
        return response;
    }
    let mut list = ignored
        .iter()
        .take(SHOWN)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if ignored.len() > SHOWN {
        list.push_str(&format!(", and {} more", ignored.len() - SHOWN));
    }
    tracing::info!(params = %list, "request fields ignored (no effect here)");
    let value = axum::http::HeaderValue::from_str(&list)
        .unwrap_or_else(|_| axum::http::HeaderValue::from_static("(names not printable)"));
    response.headers_mut().insert(IGNORED_PARAMS_HEADER, value);
    response
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
