//! Server-sent events for streaming responses: `data: {json}\n\n` per chunk, an error as
//! `data: {"error": {...}}` (the same body as a non-streaming error), always a final
//! `data: [DONE]`, and keep-alive comments while idle.

use std::convert::Infallible;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use axum::http::StatusCode;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::{Stream, StreamExt};
use tracing::Instrument;

use crate::error::ApiError;
use crate::metrics::Outcome;

/// An SSE response of `chunks` (serialized JSON payloads). The first `Err` ends the stream
/// with an error event; a panic while producing chunks becomes a 500 error event. `outcome`
/// learns how the stream ended; `span` is entered while chunks are produced.
pub(crate) fn response<S>(
    chunks: S,
    keep_alive: Duration,
    span: tracing::Span,
    outcome: Outcome,
) -> Response
where
    S: Stream<Item = Result<String, ApiError>> + Send + 'static,
{
    outcome.streaming();
    let events = async_stream::stream! {
        let mut chunks = std::pin::pin!(AssertUnwindSafe(chunks).catch_unwind());
        loop {
            let error = match chunks.next().instrument(span.clone()).await {
                Some(Ok(Ok(json))) => {
                    yield Ok::<_, Infallible>(Event::default().data(json));
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
            yield Ok(Event::default().data(error.body().to_string()));
            break;
        }
        yield Ok(Event::default().data("[DONE]"));
    };
    Sse::new(events)
        .keep_alive(KeepAlive::new().interval(keep_alive))
        .into_response()
}

/// The text of a panic payload.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("non-string panic payload")
}
