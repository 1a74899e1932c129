//! The load generator's driver: sends a [`Workload`](crate::workload::Workload) to an
//! OpenAI-compatible endpoint under a [`LoadShape`], streaming every response, and records one
//! [`RequestOutcome`](crate::slo::RequestOutcome) per request.

use std::time::Duration;

use crate::arrivals::LoadShape;

/// Which endpoint requests go to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Api {
    /// `POST /v1/completions`.
    #[default]
    Completions,
    /// `POST /v1/chat/completions`.
    Chat,
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
}
