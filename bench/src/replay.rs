//! Open-loop replay of scaled trace requests against a running router.
//!
//! Every request is a streaming `POST /v1/completions` whose prompt is an array of token
//! ids (so the router tokenizes nothing), fired at its scheduled time whether or not
//! earlier ones finished, except that a conversation's next turn waits for the end of the
//! turn it follows; a concurrency cap is only a safety valve, and the report counts the
//! requests that had to wait for it.

mod client;
mod report;
mod sse;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde_json::json;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::trace::{ideal_hit_rate, ScaledRequest};
use client::{Endpoint, Failure};
use report::Outcome;
pub use report::{ReplayReport, RequestRecord};

/// How requests are sent.
#[derive(Clone, Debug, PartialEq)]
pub struct ReplayOptions {
    /// Requests in flight at most; more wait (and are counted).
    pub max_concurrency: usize,
    /// A request still running after this counts as a `timeout` error.
    pub request_timeout: Duration,
    /// Sent as `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// Generate exactly `max_tokens` tokens (`ignore_eos`), so output lengths follow the
    /// trace rather than the model's taste.
    pub ignore_eos: bool,
    /// Send a follow-up turn no earlier than the end of the turn it follows (see
    /// [`ScaledRequest::previous_turn`]): a compressed schedule would otherwise send it
    /// before the answer its prompt contains exists.
    pub follow_turns: bool,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        ReplayOptions {
            max_concurrency: 256,
            request_timeout: Duration::from_secs(300),
            api_key: None,
            ignore_eos: true,
            follow_turns: true,
        }
    }
}

/// Why a replay could not start.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReplayError {
    #[error("bad base URL {url:?}: {reason}")]
    BadUrl { url: String, reason: String },
    #[error("max_concurrency must be positive")]
    NoConcurrency,
}

/// The body of one request.
fn request_body(model: &str, request: &ScaledRequest, opts: &ReplayOptions) -> Bytes {
    let mut body = json!({
        "prompt": request.prompt_tokens,
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    if !model.is_empty() {
        body["model"] = json!(model);
    }
    if opts.ignore_eos {
        body["ignore_eos"] = json!(true);
    }
    Bytes::from(body.to_string())
}

/// Sends `requests` to the router at `base_url` (its root, e.g. `http://127.0.0.1:8000`)
/// for `model` (empty: the router's own, the field left out) at their scheduled times and reports what the client saw. Per-request failures are
/// counted in the report; only an unusable URL or option is an error.
pub async fn replay(
    base_url: &str,
    model: &str,
    requests: &[ScaledRequest],
    opts: &ReplayOptions,
) -> Result<ReplayReport, ReplayError> {
    if opts.max_concurrency == 0 {
        return Err(ReplayError::NoConcurrency);
    }
    let endpoint = Arc::new(Endpoint::parse(base_url)?);
    let api_key: Option<Arc<str>> = opts.api_key.as_deref().map(Arc::from);
    let mut order: Vec<usize> = (0..requests.len()).collect();
    order.sort_by_key(|&i| requests[i].at);
    // Bodies are built before the clock starts, so building them never delays a send.
    let mut bodies: Vec<Option<Bytes>> = requests
        .iter()
        .map(|r| Some(request_body(model, r, opts)))
        .collect();
    // A request's task holds its sender; the sender dropping, when the task ends however
    // it ends, releases the next turn of its conversation.
    let (mut ended, ends): (Vec<_>, Vec<_>) = requests
        .iter()
        .map(|_| {
            let (tx, rx) = watch::channel(());
            (Some(tx), rx)
        })
        .unzip();
    let permits = Arc::new(Semaphore::new(opts.max_concurrency));
    let timeout = opts.request_timeout;

    let start = Instant::now();
    let mut max_lateness = Duration::ZERO;
    let mut tasks = JoinSet::new();
    // Which request each task sends, should one panic.
    let mut scheduled = HashMap::new();
    for (index, &i) in order.iter().enumerate() {
        let at = requests[i].at;
        let due = start + at;
        tokio::time::sleep_until(due).await;
        max_lateness = max_lateness.max(due.elapsed());
        let (endpoint, api_key, permits) = (endpoint.clone(), api_key.clone(), permits.clone());
        let body = bodies[i].take().unwrap_or_default();
        let this_ended = ended[i].take();
        let previous_turn = requests[i]
            .previous_turn
            .filter(|_| opts.follow_turns)
            .and_then(|p| ends.get(p).cloned());
        let task = tasks.spawn(async move {
            let _ended = this_ended;
            let held = match previous_turn {
                // `Err` once the sender is gone: the previous turn has ended.
                Some(mut previous) => {
                    let running = previous.has_changed().is_ok();
                    let _ = previous.changed().await;
                    running
                }
                None => false,
            };
            let sent_at = start.elapsed();
            let (permit, waited) = match permits.clone().try_acquire_owned() {
                Ok(p) => (Some(p), false),
                Err(_) => (permits.acquire_owned().await.ok(), true),
            };
            let sent = client::send(&endpoint, api_key.as_deref(), body);
            let result = tokio::time::timeout(timeout, sent)
                .await
                .unwrap_or_else(|_| {
                    Err(Failure::new(
                        "timeout",
                        format!("no end of stream after {timeout:?}"),
                    ))
                });
            drop(permit);
            Outcome {
                index,
                sent: sent_at,
                held,
                waited,
                finished: start.elapsed(),
                result,
            }
        });
        scheduled.insert(task.id(), (index, at));
    }
    let mut outcomes = Vec::with_capacity(order.len());
    while let Some(joined) = tasks.join_next_with_id().await {
        outcomes.push(match joined {
            Ok((_, outcome)) => outcome,
            Err(e) => {
                let (index, sent) = scheduled.get(&e.id()).copied().unwrap_or_default();
                Outcome {
                    index,
                    sent,
                    held: false,
                    waited: false,
                    finished: start.elapsed(),
                    result: Err(Failure::new("panic", e)),
                }
            }
        });
    }
    let offered_span = match (order.first(), order.last()) {
        (Some(&first), Some(&last)) => requests[last].at - requests[first].at,
        _ => Duration::ZERO,
    };
    Ok(report::summarize(
        &outcomes,
        ideal_hit_rate(order.iter().map(|&i| &requests[i])),
        offered_span,
        max_lateness,
    ))
}
