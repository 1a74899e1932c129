//! Open-loop replay of scaled trace requests against a running router.
//!
//! Every request is a streaming `POST /v1/completions` whose prompt is an array of token
//! ids (so the router tokenizes nothing), fired at its scheduled time whether or not
//! earlier ones finished, except that a conversation's next turn waits for the end of the
//! turn it follows; a concurrency cap is only a safety valve, and the report counts the
//! requests that had to wait for it. The load generator ([`crate::load::run`]) sends them,
//! trace-timed.

mod report;

use std::time::Duration;

use crate::arrivals::LoadShape;
use crate::load::{self, Api, LoadError, RunPlan, Target};
use crate::trace::{ideal_hit_rate, Pacing, ScaledRequest};
use crate::workload::{Prompt, WorkItem, Workload};
pub use report::ReplayReport;

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

/// The scaled requests as a workload, their times already paced.
fn workload(requests: &[ScaledRequest]) -> Workload {
    Workload {
        name: "trace replay".into(),
        items: requests
            .iter()
            .map(|r| WorkItem {
                prompt: Prompt::Tokens(r.prompt_tokens.clone()),
                max_tokens: r.max_tokens,
                at: Some(r.at),
                previous_turn: r.previous_turn,
                hash_ids: r.hash_ids.clone(),
            })
            .collect(),
    }
}

/// Sends `requests` to the router at `base_url` (its root, e.g. `http://127.0.0.1:8000`)
/// for `model` (empty: the router's own, the field left out) at their scheduled times and
/// reports what the client saw. Per-request failures are counted in the report; only an
/// unusable URL or option is an error.
pub async fn replay(
    base_url: &str,
    model: &str,
    requests: &[ScaledRequest],
    opts: &ReplayOptions,
) -> Result<ReplayReport, LoadError> {
    let target = Target {
        url: base_url.to_owned(),
        api: Api::Completions,
        model: (!model.is_empty()).then(|| model.to_owned()),
        api_key: opts.api_key.clone(),
        ignore_eos: opts.ignore_eos,
        request_timeout: opts.request_timeout,
        extra_body: Default::default(),
    };
    let plan = RunPlan {
        // The requests' times are already paced by the scaling.
        shape: LoadShape::Trace(Pacing::Speedup(1.0)),
        seed: 0,
        max_requests: None,
        duration: None,
        max_in_flight: opts.max_concurrency,
        follow_turns: opts.follow_turns,
        first_item: 0,
    };
    let run = load::run(&target, &workload(requests), &plan, &mut |_| {}).await?;
    let mut order: Vec<&ScaledRequest> = requests.iter().collect();
    order.sort_by_key(|r| r.at);
    let offered_span = match (order.first(), order.last()) {
        (Some(first), Some(last)) => last.at - first.at,
        _ => Duration::ZERO,
    };
    Ok(report::summarize(
        run,
        ideal_hit_rate(order.iter().copied()),
        offered_span,
    ))
}
