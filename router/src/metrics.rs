//! Router metrics (names from `kvmesh_common::metrics`) and the `/metrics` endpoint.
//!
//! Everything lives in the `prometheus` crate's default registry, which [`registry`]
//! returns: whatever else in the process registers there (worker metrics, say) is served
//! by the same `/metrics` output.

use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, LazyLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body::{Frame, SizeHint};
use kvmesh_common::metrics as names;
use prometheus::{
    Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
    TextEncoder,
};

use crate::error::{status_label, ApiError};
use crate::request_id::RequestContext;

/// The registry `/metrics` serves: the `prometheus` default registry, with the router's
/// metrics registered (and so described) from the first call on.
pub fn registry() -> &'static Registry {
    LazyLock::force(&METRICS);
    prometheus::default_registry()
}

pub(crate) struct Metrics {
    /// Labels: `endpoint` (`chat_completions`, `completions`), `status` (HTTP status; `499`
    /// when the client went away first).
    pub(crate) requests: IntCounterVec,
    pub(crate) ttft: Histogram,
    pub(crate) itl: Histogram,
    pub(crate) e2e: Histogram,
    pub(crate) prompt_tokens: IntCounter,
    pub(crate) generation_tokens: IntCounter,
    pub(crate) in_flight: IntGauge,
    /// Requests moved to another decode node after their stream broke.
    pub(crate) migrations: IntCounter,
    /// Decode nodes that refused a request before another one took it.
    pub(crate) decode_retries: IntCounter,
    /// Label: `reason` (`queue_delay`, `in_flight`, `rate_limit`, `backend_overloaded`).
    pub(crate) rejected: IntCounterVec,
    pub(crate) admission_pending_tokens: IntGauge,
    pub(crate) admission_estimated_ttft: Gauge,
    pub(crate) admission_headroom: Gauge,
}

static METRICS: LazyLock<Metrics> = LazyLock::new(|| {
    let r = prometheus::default_registry();
    let histogram = |name: &str, help: &str, buckets: &[f64]| {
        let h = Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec()))
            .expect("valid histogram options");
        register(r, h)
    };
    Metrics {
        requests: register(
            r,
            IntCounterVec::new(
                Opts::new(
                    names::ROUTER_REQUESTS_TOTAL,
                    "Completion requests by endpoint and final HTTP status (499: client went away).",
                ),
                &["endpoint", "status"],
            )
            .expect("valid counter options"),
        ),
        ttft: histogram(
            names::ROUTER_TTFT_SECONDS,
            "Time from receiving a request to its first generated token.",
            &[
                0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
            ],
        ),
        itl: histogram(
            names::ROUTER_ITL_SECONDS,
            "Time between consecutive tokens of one choice.",
            &[
                0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0,
            ],
        ),
        e2e: histogram(
            names::ROUTER_E2E_SECONDS,
            "Time from receiving a request to its last byte, for successful requests.",
            &[
                0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
            ],
        ),
        prompt_tokens: register(
            r,
            IntCounter::new(
                names::ROUTER_PROMPT_TOKENS_TOTAL,
                "Prompt tokens of requests sent to the backend.",
            )
            .expect("valid counter options"),
        ),
        generation_tokens: register(
            r,
            IntCounter::new(
                names::ROUTER_GENERATION_TOKENS_TOTAL,
                "Tokens generated (all choices).",
            )
            .expect("valid counter options"),
        ),
        in_flight: register(
            r,
            IntGauge::new(
                names::ROUTER_REQUESTS_IN_FLIGHT,
                "Completion requests being served.",
            )
            .expect("valid gauge options"),
        ),
        migrations: register(
            r,
            IntCounter::new(
                names::ROUTER_MIGRATIONS_TOTAL,
                "Requests moved to another decode node after their stream broke mid-request.",
            )
            .expect("valid counter options"),
        ),
        decode_retries: register(
            r,
            IntCounter::new(
                names::ROUTER_DECODE_RETRIES_TOTAL,
                "Requests sent to another decode node because the first one was unavailable.",
            )
            .expect("valid counter options"),
        ),
        rejected: register(
            r,
            IntCounterVec::new(
                Opts::new(
                    names::ROUTER_REJECTED_TOTAL,
                    "Requests refused with 429, by reason: queue_delay (the TTFT target would \
                     be missed), in_flight (max_in_flight reached), rate_limit (per-key rate), \
                     backend_overloaded (a worker's queue is full).",
                ),
                &["reason"],
            )
            .expect("valid counter options"),
        ),
        admission_pending_tokens: register(
            r,
            IntGauge::new(
                names::ROUTER_ADMISSION_PENDING_TOKENS,
                "Prompt tokens of admitted requests still waiting for their first token.",
            )
            .expect("valid gauge options"),
        ),
        admission_estimated_ttft: register(
            r,
            Gauge::new(
                names::ROUTER_ADMISSION_ESTIMATED_TTFT_SECONDS,
                "Admission control's estimate of a new request's time to first token.",
            )
            .expect("valid gauge options"),
        ),
        admission_headroom: register(
            r,
            Gauge::new(
                names::ROUTER_ADMISSION_HEADROOM,
                "The share of the TTFT target admission control lets an estimate use; it \
                 shrinks when admitted requests break the target.",
            )
            .expect("valid gauge options"),
        ),
    }
});

/// Registers `c`; if something registered the same metric first, ours still counts but
/// is not exported (logged).
fn register<C: prometheus::core::Collector + Clone + 'static>(r: &Registry, c: C) -> C {
    if let Err(e) = r.register(Box::new(c.clone())) {
        tracing::warn!(error = %e, "router metric not registered");
    }
    c
}

pub(crate) fn metrics() -> &'static Metrics {
    &METRICS
}

/// `GET /metrics`: Prometheus text format.
pub(crate) async fn render() -> Response {
    let families = registry().gather();
    match TextEncoder::new().encode_to_string(&families) {
        Ok(text) => ([(header::CONTENT_TYPE, prometheus::TEXT_FORMAT)], text).into_response(),
        Err(e) => ApiError::Internal(format!("encoding metrics: {e}")).into_response(),
    }
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
        metrics().in_flight.inc();
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
        m.in_flight.dec();
        let status = match self.outcome.0.load(Ordering::Relaxed) {
            UNSET => self.response_status.map_or(CLIENT_GONE, |s| s.as_u16()),
            STREAMING => CLIENT_GONE,
            s => s,
        };
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        if status == StatusCode::OK {
            m.e2e.observe(self.received.elapsed().as_secs_f64());
        }
        let label = if status.as_u16() == CLIENT_GONE {
            "499"
        } else {
            status_label(status)
        };
        m.requests.with_label_values(&[self.endpoint, label]).inc();
    }
}

/// Middleware (around auth) for the completion routes: in-flight gauge, requests counter
/// and e2e latency, whatever produced the response (handler, auth, body limit) and however
/// it ended. Other routes pass through.
pub(crate) async fn track(mut req: Request, next: Next) -> Response {
    let endpoint = match req.uri().path() {
        "/v1/chat/completions" => "chat_completions",
        "/v1/completions" => "completions",
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
        m.generation_tokens.inc();
        if !self.first_seen {
            self.first_seen = true;
            m.ttft.observe(secs(now - self.received));
        }
        if let Some(slot) = self.last.get_mut(index) {
            if let Some(prev) = slot.replace(now) {
                m.itl.observe(secs(now - prev));
            }
        }
    }
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}
