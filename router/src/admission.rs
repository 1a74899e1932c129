//! Admission control: refuse a request up front (429 + `Retry-After`) when the time to its
//! first token would break the TTFT target, so the requests already admitted keep their
//! latency instead of everyone's latency exploding together.
//!
//! The estimate calibrates itself from what the backend actually does, so the same code fits
//! one process (`kvmesh serve`) and the mesh router. It tracks the prompt tokens of admitted
//! requests still waiting for their first token (*pending tokens*) and the admitted requests
//! past it (*decoding*: every engine step also carries their next tokens). When a request
//! gets its first token, `(x, d, ttft)` is a sample, `x` being the tokens pending ahead of it
//! at admission plus its own and `d` the requests decoding then; an exponentially weighted
//! least-squares plane `ttft = a + b * x + c * d` through the recent samples is the model.
//! `a` is what a request costs with nothing ahead (a step of the engine, HTTP, tokenizing);
//! `b` is the cost of a queued token, which a batching engine keeps far below `ttft / x`; `c`
//! is what each decoding request adds (longer steps to wait through). A slope is fitted only
//! along a regressor whose samples are spread enough; until `x` is (the prompts are all about
//! the same size and queues short, e.g. one client at a time), the plane goes through the
//! origin along it (`b = (mean ttft - c * mean d) / mean x`): the cautious reading, since it
//! charges every queued token the full cost.
//!
//! A request with `own` tokens is refused iff something is in flight and
//! `a + b * (pending + own) + c * decoding + 2 * rms_error > ttft_target`, `rms_error` being
//! the recent error of the model's predictions: the target then bounds the tail of the
//! admitted requests' TTFT, not their mean. With nothing in flight a request
//! is always admitted, so samples keep coming and a stale, too-pessimistic model recovers.
//! Before the first sample only the in-flight bound applies: at most `max_in_flight` admitted
//! requests may be unfinished (a bounded queue whatever the estimate says).
//!
//! The model cannot see what slows every request at once: CPU throttling, a noisy neighbour,
//! the cost of refusing the excess. So the outcome closes the loop: each admitted request
//! whose TTFT breaks the target shrinks the share of the target the estimate may use
//! (`headroom`, multiplicatively, down to a floor), each one that keeps it gives a little
//! back. Shedding more lowers the load that causes the stalls, until few requests break it.
//!
//! [`Estimator`] is the pure core (time comes in as `now`); [`Admission`] wraps it in a mutex
//! and hands out [`Ticket`]s whose drop ends the request's accounting.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;
use crate::metrics::metrics;

/// Weight of a new sample in the fit: about the last ten requests count, so the model
/// follows a load change within a few TTFTs without jumping on one outlier.
const EWMA_WEIGHT: f64 = 0.2;

/// The samples' token counts must vary by this fraction of their mean (coefficient of
/// variation) before a slope is fitted; below it the slope is noise.
const MIN_SPREAD: f64 = 0.25;

/// The admission estimate is the model's TTFT plus this many of its recent prediction
/// errors (root mean square), so that the target bounds the tail of admitted TTFTs rather
/// than their mean: a request that arrives during a step waits out the rest of it, which no
/// regressor sees.
const ERROR_MARGIN: f64 = 2.0;

/// A request that breaks the target multiplies the headroom by this...
const TIGHTEN: f64 = 0.8;

/// ...and one that keeps it multiplies it by `1 + RELAX` (up to 1). The loop settles where
/// the steps balance, `p * ln(1 / TIGHTEN) = (1 - p) * RELAX`: about 0.5% of the requests
/// break the target whatever the headroom, so the target bounds the p99.
const RELAX: f64 = 0.0011;

/// The headroom never falls below this: stalls that shedding cannot cure (a request alone
/// breaks the target) must not shut the door.
const MIN_HEADROOM: f64 = 0.25;

/// An exponentially weighted least-squares fit of `ttft` (seconds) against `x` (tokens
/// pending ahead plus the request's own) and `d` (requests decoding at admission): running
/// means of the regressors, the TTFT and their products.
#[derive(Clone, Debug, Default)]
struct Fit {
    samples: u64,
    x: f64,
    d: f64,
    y: f64,
    xx: f64,
    dd: f64,
    xd: f64,
    xy: f64,
    dy: f64,
    /// Mean squared error of each sample's prediction by the model before it.
    err: f64,
}

/// `ttft = a + b * x + c * d`, all coefficients non-negative.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Model {
    a: f64,
    b: f64,
    c: f64,
}

impl Model {
    fn ttft(&self, x: f64, d: f64) -> f64 {
        self.a + self.b * x + self.c * d
    }
}

impl Fit {
    fn add(&mut self, x: f64, d: f64, y: f64) {
        // A plain mean over the first few samples, then exponential forgetting.
        let w = EWMA_WEIGHT.max(1.0 / (self.samples + 1) as f64);
        let mean = |m: &mut f64, v: f64| *m += w * (v - *m);
        if let Some(m) = self.model() {
            mean(&mut self.err, (y - m.ttft(x, d)).powi(2));
        }
        mean(&mut self.x, x);
        mean(&mut self.d, d);
        mean(&mut self.y, y);
        mean(&mut self.xx, x * x);
        mean(&mut self.dd, d * d);
        mean(&mut self.xd, x * d);
        mean(&mut self.xy, x * y);
        mean(&mut self.dy, d * y);
        self.samples += 1;
    }

    /// `None` before any sample.
    fn model(&self) -> Option<Model> {
        if self.samples == 0 {
            return None;
        }
        let (vx, vd) = (self.xx - self.x * self.x, self.dd - self.d * self.d);
        let cxd = self.xd - self.x * self.d;
        let (cxy, cdy) = (self.xy - self.x * self.y, self.dy - self.d * self.y);
        let x_spread = vx > (MIN_SPREAD * self.x).powi(2);
        // `d` counts requests, often 0 or 1: spread is judged against at least one.
        let d_spread = vd > (MIN_SPREAD * self.d.max(1.0)).powi(2);
        let along_x = || (cxy / vx).max(0.0);
        let along_d = || (cdy / vd).max(0.0);
        let (b, c) = match (x_spread, d_spread) {
            (true, true) => {
                let det = vx * vd - cxd * cxd;
                // Nearly collinear regressors tell the slopes apart no better than noise.
                let b = (cxy * vd - cdy * cxd) / det;
                let c = (cdy * vx - cxy * cxd) / det;
                if det <= 1e-3 * vx * vd {
                    (along_x(), 0.0)
                } else if b < 0.0 {
                    (0.0, along_d())
                } else if c < 0.0 {
                    (along_x(), 0.0)
                } else {
                    (b, c)
                }
            }
            (true, false) => (along_x(), 0.0),
            (false, d_spread) => {
                // Through the origin along x: the rest of the mean TTFT is the tokens' cost.
                let c = if d_spread { along_d() } else { 0.0 };
                let rest = (self.y - c * self.d).max(0.0);
                return Some(if self.x > 0.0 {
                    Model {
                        a: 0.0,
                        b: rest / self.x,
                        c,
                    }
                } else {
                    Model { a: rest, b: 0.0, c }
                });
            }
        };
        let a = (self.y - b * self.x - c * self.d).max(0.0);
        Some(Model { a, b, c })
    }
}

/// Why a request was refused.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Rejection {
    /// The estimated time to its first token exceeds what admission allows: the TTFT
    /// target, or less while admitted requests break it (the headroom).
    QueueDelay {
        estimated: Duration,
        allowed: Duration,
        target: Duration,
        retry_after_secs: u64,
    },
    /// `max_in_flight` requests are already admitted and unfinished.
    InFlight { limit: usize, retry_after_secs: u64 },
}

impl Rejection {
    /// The `reason` label of the rejections counter.
    pub(crate) fn reason(&self) -> &'static str {
        match self {
            Rejection::QueueDelay { .. } => "queue_delay",
            Rejection::InFlight { .. } => "in_flight",
        }
    }

    pub(crate) fn retry_after_secs(&self) -> u64 {
        match self {
            Rejection::QueueDelay {
                retry_after_secs, ..
            }
            | Rejection::InFlight {
                retry_after_secs, ..
            } => *retry_after_secs,
        }
    }
}

impl std::fmt::Display for Rejection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Rejection::QueueDelay {
                estimated,
                allowed,
                target,
                ..
            } => {
                write!(
                    f,
                    "the estimated time to the first token ({:.3}s) exceeds ",
                    estimated.as_secs_f64()
                )?;
                if allowed < target {
                    write!(
                        f,
                        "the {:.3}s admitted while recent requests break the target ({:.3}s)",
                        allowed.as_secs_f64(),
                        target.as_secs_f64()
                    )
                } else {
                    write!(f, "the target ({:.3}s)", target.as_secs_f64())
                }
            }
            Rejection::InFlight { limit, .. } => {
                write!(f, "{limit} requests are already in flight")
            }
        }
    }
}

/// One admitted request, as the estimator knows it.
#[derive(Debug)]
pub(crate) struct Admitted {
    /// Pending tokens ahead of it when it was admitted.
    ahead: u64,
    /// Requests decoding when it was admitted.
    decoding: usize,
    /// Its own prompt tokens (all choices).
    own: u64,
    at: Instant,
    /// Still counted in the pending tokens (no first token yet).
    pending: bool,
}

/// The admission decision and its state, without I/O or clocks.
#[derive(Debug)]
pub(crate) struct Estimator {
    /// `None`: only the in-flight bound applies.
    ttft_target: Option<Duration>,
    max_in_flight: usize,
    pending_tokens: u64,
    /// Admitted requests without their first token yet.
    pending_requests: usize,
    in_flight: usize,
    fit: Fit,
    /// The share of the target an admitted request's estimate may use (see the module doc).
    headroom: f64,
}

impl Estimator {
    /// `ttft_target` zero disables the delay check.
    pub(crate) fn new(ttft_target: Duration, max_in_flight: usize) -> Self {
        Estimator {
            ttft_target: (!ttft_target.is_zero()).then_some(ttft_target),
            max_in_flight,
            pending_tokens: 0,
            pending_requests: 0,
            in_flight: 0,
            fit: Fit::default(),
            headroom: 1.0,
        }
    }

    /// Whether a request of `own` prompt tokens would be admitted now.
    pub(crate) fn check(&self, own: u64) -> Result<(), Rejection> {
        // The queue ahead drains in about `b * pending`.
        let retry_after_secs = whole_secs(secs(self.slope() * self.pending_tokens as f64));
        if self.in_flight >= self.max_in_flight {
            return Err(Rejection::InFlight {
                limit: self.max_in_flight,
                retry_after_secs,
            });
        }
        if let Some(target) = self.ttft_target {
            let estimated = self.estimated_ttft(self.pending_tokens.saturating_add(own));
            let allowed = target.mul_f64(self.headroom);
            if self.in_flight > 0 && estimated > allowed {
                return Err(Rejection::QueueDelay {
                    estimated,
                    allowed,
                    target,
                    retry_after_secs,
                });
            }
        }
        Ok(())
    }

    /// Admits a request of `own` prompt tokens at `now`, or says why not.
    pub(crate) fn admit(&mut self, own: u64, now: Instant) -> Result<Admitted, Rejection> {
        self.check(own)?;
        let admitted = Admitted {
            ahead: self.pending_tokens,
            decoding: self.decoding(),
            own,
            at: now,
            pending: true,
        };
        self.pending_tokens += own;
        self.pending_requests += 1;
        self.in_flight += 1;
        Ok(admitted)
    }

    /// `request` produced its first token at `now`: it stops being pending and its TTFT
    /// becomes a sample. Later calls for the same request do nothing.
    pub(crate) fn first_token(&mut self, request: &mut Admitted, now: Instant) {
        if !std::mem::take(&mut request.pending) {
            return;
        }
        self.pending_tokens -= request.own;
        self.pending_requests -= 1;
        let ttft = now.saturating_duration_since(request.at);
        if let Some(target) = self.ttft_target {
            self.headroom = if ttft > target {
                (self.headroom * TIGHTEN).max(MIN_HEADROOM)
            } else {
                (self.headroom * (1.0 + RELAX)).min(1.0)
            };
        }
        let x = (request.ahead + request.own) as f64;
        self.fit.add(x, request.decoding as f64, ttft.as_secs_f64());
    }

    /// `request` is over (finished, failed or cancelled).
    pub(crate) fn finish(&mut self, request: Admitted) {
        if request.pending {
            self.pending_tokens -= request.own;
            self.pending_requests -= 1;
        }
        self.in_flight -= 1;
    }

    /// The TTFT now for a request with `tokens` pending ahead plus its own, with the margin
    /// for the model's error (zero before any sample).
    fn estimated_ttft(&self, tokens: u64) -> Duration {
        let ttft = self.fit.model().map_or(0.0, |m| {
            let margin = ERROR_MARGIN * self.fit.err.sqrt();
            m.ttft(tokens as f64, self.decoding() as f64) + margin
        });
        secs(ttft)
    }

    /// Admitted requests past their first token.
    fn decoding(&self) -> usize {
        self.in_flight - self.pending_requests
    }

    fn slope(&self) -> f64 {
        self.fit.model().map_or(0.0, |m| m.b)
    }

    /// The model's TTFT for a new one-token request now (for the gauge).
    pub(crate) fn estimated_ttft_now(&self) -> Duration {
        self.estimated_ttft(self.pending_tokens.saturating_add(1))
    }

    pub(crate) fn pending_tokens(&self) -> u64 {
        self.pending_tokens
    }

    #[cfg(test)]
    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight
    }
}

fn secs(s: f64) -> Duration {
    Duration::try_from_secs_f64(s).unwrap_or(Duration::MAX)
}

/// `Retry-After` in whole seconds, at least 1.
fn whole_secs(d: Duration) -> u64 {
    d.as_secs()
        .saturating_add(u64::from(d.subsec_nanos() > 0))
        .max(1)
}

/// The shared [`Estimator`] of one router.
pub(crate) struct Admission {
    estimator: Mutex<Estimator>,
}

impl Admission {
    pub(crate) fn new(ttft_target: Duration, max_in_flight: usize) -> Arc<Self> {
        Arc::new(Admission {
            estimator: Mutex::new(Estimator::new(ttft_target, max_in_flight)),
        })
    }

    /// Admits a request of `own` prompt tokens; the ticket accounts for it until dropped.
    /// A refusal is counted in the rejections metric.
    pub(crate) fn admit(self: &Arc<Self>, own: u64) -> Result<Ticket, Rejection> {
        let admitted = self
            .update(|e| e.admit(own, Instant::now()))
            .map_err(counted)?;
        Ok(Ticket {
            admission: self.clone(),
            admitted: Some(admitted),
        })
    }

    /// Refuses early, before the body is read, what would be refused whatever its size.
    fn precheck(&self) -> Result<(), Rejection> {
        self.update(|e| e.check(0)).map_err(counted)
    }

    /// Runs `f` on the estimator and refreshes the gauges.
    fn update<T>(&self, f: impl FnOnce(&mut Estimator) -> T) -> T {
        let mut e = self.estimator.lock().unwrap_or_else(|e| e.into_inner());
        let out = f(&mut e);
        let m = metrics();
        m.admission_pending_tokens.set(e.pending_tokens() as f64);
        m.admission_estimated_ttft
            .set(e.estimated_ttft_now().as_secs_f64());
        m.admission_headroom.set(e.headroom);
        out
    }
}

fn counted(rejection: Rejection) -> Rejection {
    metrics().rejected(rejection.reason());
    rejection
}

impl From<Rejection> for ApiError {
    fn from(r: Rejection) -> Self {
        ApiError::Overloaded {
            message: r.to_string(),
            retry_after_secs: r.retry_after_secs(),
        }
    }
}

/// Middleware for the completion routes: under overload, requests are refused before their
/// body is read, parsed and tokenized, so shedding load costs as little as possible. (Those
/// that pass are checked again with their size.)
pub(crate) async fn shed(
    State(admission): State<Arc<Admission>>,
    req: Request,
    next: Next,
) -> Response {
    match admission.precheck() {
        Ok(()) => next.run(req).await,
        Err(rejection) => ApiError::from(rejection).into_response(),
    }
}

/// One admitted request; dropping it ends its accounting.
pub(crate) struct Ticket {
    admission: Arc<Admission>,
    /// Taken on drop.
    admitted: Option<Admitted>,
}

impl Ticket {
    /// The request's first token arrived (only the first call counts).
    pub(crate) fn first_token(&mut self) {
        if let Some(a) = self.admitted.as_mut().filter(|a| a.pending) {
            self.admission.update(|e| e.first_token(a, Instant::now()));
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Some(a) = self.admitted.take() {
            self.admission.update(|e| e.finish(a));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TARGET: Duration = Duration::from_secs(1);

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// Serves a request of `tokens` alone, its first token after `ttft`.
    fn serve_alone(e: &mut Estimator, now: &mut Instant, tokens: u64, ttft: Duration) {
        let mut a = e.admit(tokens, *now).unwrap();
        assert_eq!(a.ahead, 0);
        *now += ttft;
        e.first_token(&mut a, *now);
        e.finish(a);
    }

    /// An estimator that saw one 100-token request take `ttft` alone.
    fn calibrated(t0: Instant, ttft: Duration) -> Estimator {
        let mut e = Estimator::new(TARGET, 100);
        serve_alone(&mut e, &mut t0.clone(), 100, ttft);
        e
    }

    fn line(e: &Estimator) -> (f64, f64) {
        let m = e.fit.model().unwrap();
        assert_eq!(m.c, 0.0, "no decoding requests, no slope along them");
        (m.a, m.b)
    }

    fn close(x: f64, y: f64) -> bool {
        (x - y).abs() < 1e-9 * y.abs().max(1.0)
    }

    #[test]
    fn admits_everything_until_calibrated_then_rejects_what_would_miss_the_target() {
        let t0 = Instant::now();
        let mut e = Estimator::new(TARGET, 100);
        // No sample yet: no estimate, only the in-flight bound.
        let held: Vec<_> = (0..10).map(|_| e.admit(1000, t0).unwrap()).collect();
        assert_eq!(e.pending_tokens(), 10_000);
        for a in held {
            e.finish(a);
        }
        assert_eq!((e.pending_tokens(), e.in_flight()), (0, 0));

        // One sample, 100 tokens in 100 ms: the cautious line through the origin, 1 ms per
        // token.
        let mut e = calibrated(t0, ms(100));
        assert!(close(line(&e).0, 0.0) && close(line(&e).1, 0.001));
        let first = e.admit(600, t0).unwrap();
        // Nothing was pending: admitted whatever its size.
        assert_eq!(first.ahead, 0);
        // 600 + 300 tokens: 900 ms <= 1 s, admitted.
        let second = e.admit(300, t0).unwrap();
        assert_eq!(second.ahead, 600);
        // 900 + 200: 1.1 s > 1 s, refused; retry once the 0.9 s queue drains.
        let r = e.admit(200, t0).unwrap_err();
        assert_eq!(
            r,
            Rejection::QueueDelay {
                estimated: ms(1100),
                allowed: TARGET,
                target: TARGET,
                retry_after_secs: 1,
            }
        );
        assert_eq!(r.reason(), "queue_delay");
        // The early check (size unknown, taken as zero) lets it through to this one.
        assert!(e.check(0).is_ok());
        // A smaller one still fits.
        let third = e.admit(100, t0).unwrap();
        assert_eq!(e.pending_tokens(), 1000);
        for a in [first, second, third] {
            e.finish(a);
        }
        assert_eq!((e.pending_tokens(), e.in_flight()), (0, 0));
    }

    #[test]
    fn samples_of_one_size_fit_through_the_origin_and_follow_the_backend() {
        let t0 = Instant::now();
        let mut now = t0;
        let mut e = calibrated(t0, ms(10)); // 0.1 ms per token
                                            // The backend slows down 100x.
        for _ in 0..30 {
            serve_alone(&mut e, &mut now, 100, Duration::from_secs(1));
        }
        let (a, b) = line(&e);
        assert!(a == 0.0 && b > 0.009, "{a} {b}");
        // Now even a short queue breaks the target...
        let held = e.admit(100, now).unwrap();
        assert!(matches!(
            e.admit(10, now),
            Err(Rejection::QueueDelay { .. })
        ));
        e.finish(held);
        // ...yet with nothing pending requests still go through, and fast answers bring the
        // estimate back down.
        for _ in 0..60 {
            serve_alone(&mut e, &mut now, 100, ms(10));
        }
        assert!(line(&e).1 < 0.0002, "{:?}", line(&e));
        let _a = e.admit(100, now).unwrap();
        assert!(e.admit(100, now).is_ok());
    }

    /// Offers `n` requests of `own` tokens at `now`; the admitted ones all get their first
    /// token `ttft(ahead + own)` later. Returns how many were admitted.
    fn batch(
        e: &mut Estimator,
        now: &mut Instant,
        n: usize,
        own: u64,
        ttft: impl Fn(u64) -> f64,
    ) -> usize {
        let mut admitted: Vec<_> = (0..n).filter_map(|_| e.admit(own, *now).ok()).collect();
        let count = admitted.len();
        for a in &mut admitted {
            let at = *now + secs(ttft(a.ahead + a.own));
            e.first_token(a, at);
        }
        *now += secs(ttft(count as u64 * own));
        for a in admitted {
            e.finish(a);
        }
        count
    }

    #[test]
    fn a_batching_backend_is_charged_its_fixed_cost_not_a_cost_per_queued_token() {
        let t0 = Instant::now();
        let mut now = t0;
        // A TTFT of 2 s for 10 tokens alone: through the origin, 0.2 s per token.
        let mut e = Estimator::new(Duration::from_secs(5), 100);
        serve_alone(&mut e, &mut now, 10, Duration::from_secs(2));
        // Six concurrent clients: at first only two fit the cautious estimate (a third would
        // be charged 6 s)...
        assert_eq!(batch(&mut e, &mut now, 6, 10, |_| 2.0), 2);
        // ...but their first tokens come together: the flat TTFT shows the engine batches
        // them. The fit learns a = 2 s, b = 0, and admits all six at a 5 s target.
        assert_eq!(batch(&mut e, &mut now, 6, 10, |_| 2.0), 6);
        for _ in 0..20 {
            assert_eq!(batch(&mut e, &mut now, 6, 10, |_| 2.0), 6);
        }
        let (a, b) = line(&e);
        assert!(close(a, 2.0) && close(b, 0.0), "{a} {b}");
        // A backend whose TTFT does grow with the queue (10 ms + 1 ms per token) is fitted
        // as such.
        for _ in 0..40 {
            batch(&mut e, &mut now, 6, 10, |x| 0.01 + 0.001 * x as f64);
        }
        let (a, b) = line(&e);
        assert!(
            (a - 0.01).abs() < 1e-6 && (b - 0.001).abs() < 1e-6,
            "{a} {b}"
        );
    }

    #[test]
    fn requests_decoding_count_even_with_nothing_pending() {
        let now = Instant::now();
        let mut e = Estimator::new(ms(40), 100);
        // A backend whose steps grow with the batch: 5 ms plus 3 ms per request decoding,
        // whatever the prompt's size. Keep 0..10 requests decoding while one more arrives.
        let ttft = |decoding: usize| ms(5 + 3 * decoding as u64);
        let mut decoding = Vec::new();
        let decode_until = |e: &mut Estimator, decoding: &mut Vec<Admitted>, n: usize| {
            while decoding.len() > n {
                e.finish(decoding.pop().unwrap());
            }
            while decoding.len() < n {
                let mut a = e.admit(50, now).unwrap();
                e.first_token(&mut a, now + ttft(decoding.len()));
                decoding.push(a);
            }
        };
        for i in 0..60 {
            decode_until(&mut e, &mut decoding, i % 11);
            let mut a = e.admit(50 + 10 * (i % 7) as u64, now).unwrap();
            e.first_token(&mut a, now + ttft(decoding.len()));
            e.finish(a);
        }
        let m = e.fit.model().unwrap();
        assert!(close(m.c, 0.003) && m.b.abs() < 1e-9, "{m:?}");
        assert!((m.a - 0.005).abs() < 1e-6, "{m:?}");
        // Nothing is pending: with eleven decoding (38 ms) a request fits the 40 ms target,
        // with twelve (41 ms) it does not.
        decode_until(&mut e, &mut decoding, 11);
        assert_eq!(e.pending_tokens(), 0);
        assert!(e.check(50).is_ok());
        decode_until(&mut e, &mut decoding, 12);
        assert!(matches!(e.check(50), Err(Rejection::QueueDelay { .. })));
        decode_until(&mut e, &mut decoding, 0);
        // With nothing in flight, anything goes.
        assert!(e.check(5000).is_ok());
    }

    #[test]
    fn the_target_bounds_the_tail_not_the_mean() {
        let t0 = Instant::now();
        let mut now = t0;
        let mut e = Estimator::new(ms(30), 100);
        // The same request alone takes 10 ms or 30 ms, by turns (where in a step it
        // arrives): 20 ms on average, 10 ms off either way.
        for i in 0..100 {
            serve_alone(&mut e, &mut now, 100, ms(if i % 2 == 0 { 10 } else { 30 }));
        }
        let (a, b) = line(&e);
        assert!(close(a, 0.0) && (b * 100.0 - 0.02).abs() < 0.002, "{a} {b}");
        assert!(
            (e.fit.err.sqrt() - 0.01).abs() < 0.002,
            "{}",
            e.fit.err.sqrt()
        );
        // With one in flight, a 2-token request is expected at 20.4 ms on average (the 100
        // tokens ahead and its own), under the target, but its tail is some 40 ms: refused.
        let held = e.admit(100, now).unwrap();
        assert!(matches!(e.check(2), Err(Rejection::QueueDelay { .. })));
        e.finish(held);
    }

    #[test]
    fn requests_that_break_the_target_tighten_admission_until_they_keep_it() {
        let mut now = Instant::now();
        let mut e = Estimator::new(ms(30), 100);
        for _ in 0..20 {
            serve_alone(&mut e, &mut now, 100, ms(10));
        }
        assert_eq!(e.headroom, 1.0);
        // A stall the model cannot see (it strikes requests alone): three break the target.
        for _ in 0..3 {
            serve_alone(&mut e, &mut now, 100, ms(40));
        }
        assert!((e.headroom - 0.8f64.powi(3)).abs() < 1e-9, "{}", e.headroom);
        // Fast answers bring the model back within a few dozen requests; with one request
        // in flight another is then expected inside the target, yet refused: the headroom
        // is still short of it.
        for _ in 0..30 {
            serve_alone(&mut e, &mut now, 100, ms(10));
        }
        let held = e.admit(100, now).unwrap();
        assert!(
            e.estimated_ttft(200) < ms(30),
            "{:?}",
            e.estimated_ttft(200)
        );
        let refused = e.check(100).unwrap_err();
        assert!(
            refused
                .to_string()
                .contains("while recent requests break the target"),
            "{refused}"
        );
        e.finish(held);
        // Requests that keep the target give the headroom back, and the second is admitted.
        for _ in 0..600 {
            serve_alone(&mut e, &mut now, 100, ms(10));
        }
        assert_eq!(e.headroom, 1.0);
        let held = e.admit(100, now).unwrap();
        assert!(e.check(100).is_ok());
        e.finish(held);
        // However many break it, the headroom stays above its floor.
        for _ in 0..50 {
            serve_alone(&mut e, &mut now, 100, ms(40));
        }
        assert_eq!(e.headroom, MIN_HEADROOM);
    }

    #[test]
    fn in_flight_is_bounded_even_without_a_target() {
        let t0 = Instant::now();
        let mut e = Estimator::new(Duration::ZERO, 2);
        let mut a = e.admit(10, t0).unwrap();
        let _b = e.admit(10_000_000, t0).unwrap();
        let r = e.admit(1, t0).unwrap_err();
        assert_eq!(
            r,
            Rejection::InFlight {
                limit: 2,
                retry_after_secs: 1
            }
        );
        // The first token does not free a slot; finishing does.
        e.first_token(&mut a, t0 + ms(5));
        assert!(e.admit(1, t0).is_err());
        e.finish(a);
        assert!(e.admit(1, t0).is_ok());
    }

    #[test]
    fn first_tokens_count_once_and_tokens_stay_pending_until_then() {
        let t0 = Instant::now();
        let mut e = calibrated(t0, ms(100));
        let mut a = e.admit(100, t0).unwrap();
        let b = e.admit(50, t0).unwrap();
        assert_eq!(e.pending_tokens(), 150);
        e.first_token(&mut a, t0 + ms(100));
        let fitted = e.fit.clone();
        e.first_token(&mut a, t0 + ms(5000));
        assert_eq!(e.fit.samples, fitted.samples);
        assert_eq!((e.pending_tokens(), e.in_flight()), (50, 2));
        // A request that ends without a first token leaves no sample.
        e.finish(b);
        e.finish(a);
        assert_eq!((e.pending_tokens(), e.in_flight()), (0, 0));
        assert_eq!(e.fit.samples, fitted.samples);
    }

    #[test]
    fn retry_after_is_the_queue_drain_time_in_whole_seconds() {
        let t0 = Instant::now();
        let mut e = calibrated(t0, ms(100)); // 1 ms per token
        let _a = e.admit(2500, t0).unwrap(); // 2.5 s pending
                                             // Refused whatever its size: the early check refuses it too.
        assert!(matches!(e.check(0), Err(Rejection::QueueDelay { .. })));
        match e.admit(1, t0).unwrap_err() {
            Rejection::QueueDelay {
                retry_after_secs, ..
            } => assert_eq!(retry_after_secs, 3),
            other => panic!("{other:?}"),
        }
        assert_eq!(whole_secs(Duration::ZERO), 1);
        assert_eq!(whole_secs(Duration::from_secs(2)), 2);
        assert_eq!(whole_secs(Duration::MAX), u64::MAX);
    }

    #[test]
    fn tickets_release_their_tokens_and_slot_on_drop() {
        let admission = Admission::new(TARGET, 1);
        let mut ticket = admission.admit(50).unwrap();
        assert!(admission.admit(1).is_err());
        ticket.first_token();
        ticket.first_token();
        assert_eq!(admission.update(|e| e.pending_tokens()), 0);
        drop(ticket);
        let ticket = admission.admit(7).unwrap();
        assert_eq!(admission.update(|e| e.pending_tokens()), 7);
        drop(ticket);
        assert_eq!(
            admission.update(|e| (e.pending_tokens(), e.in_flight())),
            (0, 0)
        );
    }
}
