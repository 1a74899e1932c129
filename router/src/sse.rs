//! Server-sent events for streaming responses, framed one of two ways ([`Framing`]): chat
//! and completions send `data: {json}\n\n` per chunk, an error as `data: {"error": {...}}`
//! (the same body as a non-streaming error) and always a final `data: [DONE]`; the
//! Responses API names every event (`event: response.output_text.delta`), numbers them
//! (`sequence_number`), reports an error as an `error` event and sends nothing after the
//! last one. Keep-alive comments go out while idle either way.

use std::convert::Infallible;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::{Stream, StreamExt};
use serde_json::json;
use tracing::Instrument;

use crate::error::ApiError;
use crate::metrics::Outcome;

/// One event of a stream: its JSON payload, and its name where the API names events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Chunk {
    pub(crate) event: Option<&'static str>,
    pub(crate) data: String,
}

impl Chunk {
    /// An `event: <name>` event.
    pub(crate) fn named(event: &'static str, data: String) -> Self {
        Chunk {
            event: Some(event),
            data,
        }
    }
}

/// An unnamed event.
impl From<String> for Chunk {
    fn from(data: String) -> Self {
        Chunk { event: None, data }
    }
}

/// How a stream's events are framed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Framing {
    /// Chat and completions: an error is `data: {"error": {...}}`; `data: [DONE]` ends the
    /// stream.
    Done,
    /// The Responses API: the chunks number themselves 0, 1, ... (`sequence_number`); an
    /// error is an `error` event `{"type": "error", "code", "message", "param",
    /// "sequence_number"}` numbered after them; nothing follows the last event.
    Named,
}

/// An SSE response of `chunks`. The first `Err` ends the stream with an error event; a panic
/// while producing chunks becomes a 500 error event. `outcome` learns how the stream ended;
/// `span` is entered while chunks are produced.
pub(crate) fn response<S>(
    chunks: S,
    framing: Framing,
    keep_alive: Duration,
    span: tracing::Span,
    outcome: Outcome,
) -> Response
where
    S: Stream<Item = Result<Chunk, ApiError>> + Send + 'static,
{
    outcome.streaming();
    let events = async_stream::stream! {
        let mut chunks = std::pin::pin!(AssertUnwindSafe(chunks).catch_unwind());
        let mut sent: u64 = 0;
        loop {
            let error = match chunks.next().instrument(span.clone()).await {
                Some(Ok(Ok(chunk))) => {
                    sent += 1;
                    yield Ok::<_, Infallible>(event(chunk));
                    continue;
                }
                Some(Ok(Err(e))) => e,
                Some(Err(panic)) => ApiError::Internal(format!(
                    "panic while streaming the response: {}",
                    panic_message(&*panic)
                )),
                None => {
                    outcome.finish(StatusCode::OK);
                    break;
                }
            };
            span.in_scope(|| error.log());
            outcome.finish(error.status());
            yield Ok(event(error_chunk(&error, framing, sent)));
            break;
        }
        if framing == Framing::Done {
            yield Ok(Event::default().data("[DONE]"));
        }
    };
    Sse::new(events)
        .keep_alive(KeepAlive::new().interval(keep_alive))
        .into_response()
}

/// An SSE event: `event: <name>` (first, as OpenAI writes it) where named, then `data:`.
fn event(chunk: Chunk) -> Event {
    let event = match chunk.event {
        Some(name) => Event::default().event(name),
        None => Event::default(),
    };
    event.data(chunk.data)
}

/// The event that reports `error` after `sent` events.
fn error_chunk(error: &ApiError, framing: Framing, sent: u64) -> Chunk {
    match framing {
        Framing::Done => Chunk::from(error.body().to_string()),
        Framing::Named => Chunk::named(
            "error",
            json!({
                "type": "error",
                "code": error.code(),
                "message": error.to_string(),
                "param": error.param(),
                "sequence_number": sent,
            })
            .to_string(),
        ),
    }
}

/// The text of a panic payload.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("non-string panic payload")
}
