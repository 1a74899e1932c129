//! The load generator's driver: sends a [`Workload`](crate::workload::Workload) to an
//! OpenAI-compatible endpoint under a [`LoadShape`], streaming every response, and records one
//! [`RequestOutcome`](crate::slo::RequestOutcome) per request.
//!
//! - [`run`] (in `driver`) offers the load: a closed loop, an open-loop schedule or the
//!   workload's own arrival times, with follow-up turns held for the turn they follow and a
//!   cap on requests in flight.
//! - `client` sends one request over a kept-alive HTTP/1.1 connection; [`meter`] measures its
//!   stream (sans-IO, fed SSE events and times).
//! - [`csv`] writes outcomes one line each; [`scripted`] is an OpenAI-compatible server with
//!   scripted timings, to benchmark the generator itself.

mod client;
pub mod csv;
mod driver;
pub mod meter;
pub mod scripted;
mod sse;

use std::fmt;
use std::time::Duration;

use crate::arrivals::LoadShape;

pub use driver::{run, run_until, Run, RunEvent};

/// Which endpoint requests go to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Api {
    /// `POST /v1/completions`.
    #[default]
    Completions,
    /// `POST /v1/chat/completions`.
    Chat,
}

impl fmt::Display for Api {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Api::Completions => "completions",
            Api::Chat => "chat",
        })
    }
}

/// Where and how requests are sent.
#[derive(Clone, Debug, PartialEq)]
pub struct Target {
    /// The server's root (`http://127.0.0.1:8000`) or its `/v1`.
    pub url: String,
    pub api: Api,
    /// The `model` field; `None` leaves it out (the server's own).
    pub model: Option<String>,
    /// Sent as `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// Ask for exactly `max_tokens` tokens (`ignore_eos`, where the server supports it).
    pub ignore_eos: bool,
    /// A request still running after this fails as `timeout`.
    pub request_timeout: Duration,
    /// Fields set in every request body, over the generator's own (`response_format`,
    /// sampling parameters, a vendor's extensions).
    pub extra_body: serde_json::Map<String, serde_json::Value>,
}

/// How one run offers load.
#[derive(Clone, Debug, PartialEq)]
pub struct RunPlan {
    pub shape: LoadShape,
    /// Seeds the arrival schedule.
    pub seed: u64,
    /// Stop sending after this many requests (the workload is cycled if it holds fewer).
    pub max_requests: Option<usize>,
    /// Stop sending after this long (requests in flight are still awaited).
    pub duration: Option<Duration>,
    /// A safety valve for open-loop shapes: more requests in flight than this wait, and are
    /// counted as late.
    pub max_in_flight: usize,
    /// Send a follow-up turn no earlier than the end of the turn it follows.
    pub follow_turns: bool,
    /// Where in the workload a closed- or open-loop run starts (wrapping): successive points
    /// of one measurement start past each other's items, so no point re-sends prompts an
    /// earlier one left in the server's prefix cache. A trace-timed run always starts at its
    /// first arrival.
    pub first_item: usize,
}

/// Why a run could not start. Failures of single requests are not errors: they are outcomes.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    #[error("bad base URL {url:?}: {reason}")]
    BadUrl { url: String, reason: String },
    #[error("the API key cannot be sent in an HTTP header")]
    BadApiKey,
    #[error("workload item {item}: {prompt} cannot be sent to the {api} API")]
    PromptForApi {
        item: usize,
        prompt: String,
        api: Api,
    },
    #[error("the workload {0:?} has no requests")]
    EmptyWorkload(String),
    #[error("the run has no end: `{0}` goes on until a request count or a duration stops it")]
    NoEnd(String),
    #[error("max_requests must be at least 1")]
    NoRequests,
    #[error("max_in_flight must be at least 1")]
    NoInFlight,
    #[error("request_timeout must be positive")]
    NoTimeout,
    #[error(
        "a trace-timed load needs arrival times; item {item} of the workload {workload:?} has none"
    )]
    NoArrivalTimes { workload: String, item: usize },
}
