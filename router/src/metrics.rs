//! Router metrics (names from `kvmesh_common::metrics`) and the `/metrics` endpoint.
//!
//! Instrumentation goes through the `metrics` facade; [`exporter`] installs the process's
//! Prometheus recorder (once, whoever asks first), so whatever else in the process records
//! metrics (worker metrics, say) is served by the same `/metrics` output.

use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, LazyLock, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use ::metrics::{
    counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram, Counter,
    Gauge, Histogram,
};
use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body::{Frame, SizeHint};
use kvmesh_common::metrics as names;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::error::status_label;
use crate::request_id::RequestContext;

/// The Prometheus text format's content type.
const TEXT_FORMAT: &str = "text/plain; version=0.0.4";
/// How often histogram samples are folded into their buckets between scrapes (so a process
/// nobody scrapes does not keep every sample).
const UPKEEP_INTERVAL: Duration = Duration::from_secs(5);

/// The process's Prometheus recorder, installed on the first call (every histogram with the
/// buckets of `kvmesh_common::metrics::HISTOGRAM_BUCKETS`). Metric handles taken before it
/// is installed record nothing, so processes call this before starting their workers.
pub fn exporter() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(install)
}

fn install() -> PrometheusHandle {
    let mut builder = PrometheusBuilder::new();
    for &(name, buckets) in names::HISTOGRAM_BUCKETS {
        builder = match builder.set_buckets_for_metric(Matcher::Full(name.into()), buckets) {
            Ok(b) => b,
            Err(e) => unreachable!("{name}: bucket lists are never empty ({e})"),
        };
    }
    let recorder = builder.build_recorder();
    let handle = recorder.handle();
    if let Err(e) = ::metrics::set_global_recorder(recorder) {
        tracing::warn!("another metrics recorder is installed, /metrics stays empty: {e}");
    }
    let upkeep = handle.clone();
    let spawned = std::thread::Builder::new()
        .name("metrics-upkeep".into())
        .spawn(move || loop {
            std::thread::sleep(UPKEEP_INTERVAL);
            upkeep.run_upkeep();
        });
    if let Err(e) = spawned {
        tracing::warn!("no metrics upkeep thread (histograms fold at scrapes only): {e}");
    }
    handle
}

pub(crate) struct Metrics {
    pub(crate) ttft: Histogram,
    pub(crate) itl: Histogram,
    pub(crate) e2e: Histogram,
    pub(crate) prompt_tokens: Counter,
    pub(crate) prompt_cached_tokens: Counter,
    pub(crate) generation_tokens: Counter,
    pub(crate) in_flight: Gauge,
    /// Requests moved to another decode node after their stream broke.
    pub(crate) migrations: Counter,
    /// Decode nodes that refused a request before another one took it.
    pub(crate) decode_retries: Counter,
    /// Decode streams given up as hung (silent past their idle bound).
    pub(crate) stalled_streams: Counter,
    pub(crate) admission_pending_tokens: Gauge,
    pub(crate) admission_estimated_ttft: Gauge,
    pub(crate) admission_headroom: Gauge,
}

impl Metrics {
    /// Counts a finished completion request: `endpoint` (`chat_completions`, `completions`,
    /// `responses`), `status` (HTTP status; `499` when the client went away first).
    fn request_finished(&self, endpoint: &'static str, status: &'static str) {
        counter!(names::ROUTER_REQUESTS_TOTAL, "endpoint" => endpoint, "status" => status)
            .increment(1);
    }

    /// Counts a request refused with 429 for `reason` (one of [`REJECTION_REASONS`]).
    pub(crate) fn rejected(&self, reason: &'static str) {
        counter!(names::ROUTER_REJECTED_TOTAL, "reason" => reason).increment(1);
    }
}

/// Why a request is refused with 429: admission control's `queue_delay` (the TTFT target
/// would be missed) and `in_flight`, the per-key `rate_limit`, `backend_overloaded` (a
/// worker's queue is full).
const REJECTION_REASONS: [&str; 4] = [
    "queue_delay",
    "in_flight",
    "rate_limit",
    "backend_overloaded",
];

static METRICS: LazyLock<Metrics> = LazyLock::new(|| {
    exporter();
    describe_counter!(
        names::ROUTER_REQUESTS_TOTAL,
        "Completion requests by endpoint and final HTTP status (499: client went away)."
    );
    describe_counter!(
        names::ROUTER_REJECTED_TOTAL,
        "Requests refused with 429, by reason: queue_delay (the TTFT target would be missed), \
         in_flight (max_in_flight reached), rate_limit (per-key rate), backend_overloaded (a \
         worker's queue is full)."
    );
    // Every reason exported from the start at 0: dashboards and alerts see no shedding as a
    // rate of 0 rather than as no data.
    for reason in REJECTION_REASONS {
        counter!(names::ROUTER_REJECTED_TOTAL, "reason" => reason).increment(0);
    }
    let histogram = |name: &'static str, help: &'static str| {
        describe_histogram!(name, help);
        histogram!(name)
    };
    let counter = |name: &'static str, help: &'static str| {
        describe_counter!(name, help);
        counter!(name)
    };
    let gauge = |name: &'static str, help: &'static str| {
        describe_gauge!(name, help);
        gauge!(name)
    };
    Metrics {
        ttft: histogram(
            names::ROUTER_TTFT_SECONDS,
            "Time from receiving a request to its first generated token.",
        ),
        itl: histogram(
            names::ROUTER_ITL_SECONDS,
            "Time between consecutive tokens of one choice.",
        ),
        e2e: histogram(
            names::ROUTER_E2E_SECONDS,
            "Time from receiving a request to its last byte, for successful requests.",
        ),
        prompt_tokens: counter(
            names::ROUTER_PROMPT_TOKENS_TOTAL,
            "Prompt tokens of requests sent to the backend.",
        ),
        prompt_cached_tokens: counter(
            names::ROUTER_PROMPT_CACHED_TOKENS_TOTAL,
            "Prompt tokens whose KV a node held already (counted as a request's choices end).",
        ),
        generation_tokens: counter(
            names::ROUTER_GENERATION_TOKENS_TOTAL,
            "Tokens generated (all choices).",
        ),
        in_flight: gauge(
            names::ROUTER_REQUESTS_IN_FLIGHT,
            "Completion requests being served.",
        ),
        migrations: counter(
            names::ROUTER_MIGRATIONS_TOTAL,
            "Requests moved to another decode node after their stream broke mid-request.",
        ),
        decode_retries: counter(
            names::ROUTER_DECODE_RETRIES_TOTAL,
            "Requests sent to another decode node because the first one was unavailable.",
        ),
        stalled_streams: counter(
            names::ROUTER_STALLED_STREAMS_TOTAL,
            "Decode streams given up as hung: silent past their node's idle bound after a token.",
        ),
        admission_pending_tokens: gauge(
            names::ROUTER_ADMISSION_PENDING_TOKENS,
            "Prompt tokens of admitted requests still waiting for their first token.",
        ),
        admission_estimated_ttft: gauge(
            names::ROUTER_ADMISSION_ESTIMATED_TTFT_SECONDS,
            "Admission control's estimate of a new request's time to first token.",
        ),
        admission_headroom: gauge(
            names::ROUTER_ADMISSION_HEADROOM,
            "The share of the TTFT target admission control lets an estimate use; it \
             shrinks when admitted requests break the target.",
        ),
    }
});

pub(crate) fn metrics() -> &'static Metrics {
    &METRICS
}

/// `GET /metrics`: Prometheus text format.
pub(crate) async fn render() -> Response {
    let text = exporter().render();
    ([(header::CONTENT_TYPE, TEXT_FORMAT)], text).into_response()
}

/// How a completion request ended, for the requests counter. A request extension shared
/// by the metrics middleware and the handler: a streaming response's final status is only
/// known when its stream ends.
#[derive(Clone, Debug, Default)]
pub(crate) struct Outcome(Arc<AtomicU16>);

const UNSET: u16 = 0;
const STREAMING: u16 = 1;
const CLIENT_GONE: u16 = 499;

impl Outcome {
    /// The response is a stream: until [`Outcome::finish`], the request is unfinished.
    pub(crate) fn streaming(&self) {
        self.0.store(STREAMING, Ordering::Relaxed);
    }

    /// The stream ended with `status` (200, or the status of the error event it sent).
    pub(crate) fn finish(&self, status: StatusCode) {
        self.0.store(status.as_u16(), Ordering::Relaxed);
    }
}

/// Counts one completion request from arrival until its response body is done or dropped.
struct RequestGuard {
    endpoint: &'static str,
    received: Instant,
    outcome: Outcome,
    response_status: Option<StatusCode>,
}

impl RequestGuard {
    fn new(endpoint: &'static str, received: Instant, outcome: Outcome) -> Self {
        metrics().in_flight.increment(1.0);
        RequestGuard {
            endpoint,
            received,
            outcome,
            response_status: None,
        }
    }
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        let m = metrics();
        m.in_flight.decrement(1.0);
        let status = match self.outcome.0.load(Ordering::Relaxed) {
            UNSET => self.response_status.map_or(CLIENT_GONE, |s| s.as_u16()),
            STREAMING => CLIENT_GONE,
            s => s,
        };
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        if status == StatusCode::OK {
            m.e2e.record(self.received.elapsed().as_secs_f64());
        }
        let label = if status.as_u16() == CLIENT_GONE {
            "499"
        } else {
            status_label(status)
        };
        m.request_finished(self.endpoint, label);
    }
}

/// Middleware (around auth) for the completion routes: in-flight gauge, requests counter
/// and e2e latency, whatever produced the response (handler, auth, body limit) and however
/// it ended. Other routes pass through.
pub(crate) async fn track(mut req: Request, next: Next) -> Response {
    let endpoint = match req.uri().path() {
        "/v1/chat/completions" => "chat_completions",
        "/v1/completions" => "completions",
        "/v1/responses" => "responses",
        _ => return next.run(req).await,
    };
    let received = req
        .extensions()
        .get::<RequestContext>()
        .map_or_else(Instant::now, |c| c.received);
    let outcome = Outcome::default();
    req.extensions_mut().insert(outcome.clone());
    let mut guard = RequestGuard::new(endpoint, received, outcome);
    let resp = next.run(req).await;
    guard.response_status = Some(resp.status());
    let (parts, body) = resp.into_parts();
    Response::from_parts(
        parts,
        Body::new(GuardedBody {
            inner: body,
            _guard: guard,
        }),
    )
}

/// A response body that holds the request's guard until it is finished or dropped.
struct GuardedBody {
    inner: Body,
    _guard: RequestGuard,
}

impl http_body::Body for GuardedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        std::pin::Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Per-request token timing: TTFT once, ITL per choice.
pub(crate) struct TokenTimer {
    received: Instant,
    first_seen: bool,
    last: Vec<Option<Instant>>,
}

impl TokenTimer {
    pub(crate) fn new(received: Instant, choices: usize) -> Self {
        TokenTimer {
            received,
            first_seen: false,
            last: vec![None; choices],
        }
    }

    /// A token of choice `index` arrived now.
    pub(crate) fn token(&mut self, index: usize) {
        let now = Instant::now();
        let m = metrics();
        m.generation_tokens.increment(1);
        if !self.first_seen {
            self.first_seen = true;
            m.ttft.record(secs(now - self.received));
        }
        if let Some(slot) = self.last.get_mut(index) {
            if let Some(prev) = slot.replace(now) {
                m.itl.record(secs(now - prev));
            }
        }
    }
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}
