//! Admission control: refuse a request up front (429 + `Retry-After`) when the queueing delay
//! it would see breaks the TTFT target, so the requests already admitted keep their latency
//! instead of everyone's latency exploding together.
//!
//! The estimate calibrates itself from what the backend actually does, so the same code fits
//! one process (`kvmesh serve`) and the mesh router: it tracks the prompt tokens of admitted
//! requests still waiting for their first token (*pending tokens*). When a request gets its
//! first token, `ttft / (tokens pending ahead of it at admission + its own)` is one sample of
//! the backend's seconds per queued prompt token; an EWMA of the samples is the rate. A
//! request with `own` tokens is refused iff something is pending and
//! `(pending + own) * seconds_per_token > ttft_target`. With nothing pending a request is
//! always admitted (so samples keep coming and a stale, too-pessimistic rate recovers); before
//! the first sample only the in-flight bound applies.
//!
//! Independently, at most `max_in_flight` admitted requests may be unfinished (a bounded
//! queue whatever the estimate says).
//!
//! [`Estimator`] is the pure core (time comes in as `now`); [`Admission`] wraps it in a mutex
//! and hands out [`Ticket`]s whose drop ends the request's accounting.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::metrics::metrics;

/// Weight of a new sample in the EWMA of seconds per token: about the last ten requests
/// count, so the rate follows a load change within a few TTFTs without jumping on one
/// outlier.
const EWMA_WEIGHT: f64 = 0.2;

/// Why a request was refused.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Rejection {
    /// The estimated time to its first token exceeds the TTFT target.
    QueueDelay {
        estimated: Duration,
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
                estimated, target, ..
            } => write!(
                f,
                "the estimated time to the first token ({:.2}s) exceeds the target ({:.2}s)",
                estimated.as_secs_f64(),
                target.as_secs_f64()
            ),
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
    in_flight: usize,
    /// EWMA of seconds per pending prompt token; `None` until the first sample.
    seconds_per_token: Option<f64>,
}

impl Estimator {
    /// `ttft_target` zero disables the delay check.
    pub(crate) fn new(ttft_target: Duration, max_in_flight: usize) -> Self {
        Estimator {
            ttft_target: (!ttft_target.is_zero()).then_some(ttft_target),
            max_in_flight,
            pending_tokens: 0,
            in_flight: 0,
            seconds_per_token: None,
        }
    }

    /// Admits a request of `own` prompt tokens at `now`, or says why not.
    pub(crate) fn admit(&mut self, own: u64, now: Instant) -> Result<Admitted, Rejection> {
        let retry_after_secs = whole_secs(self.estimated_delay(self.pending_tokens));
        if self.in_flight >= self.max_in_flight {
            return Err(Rejection::InFlight {
                limit: self.max_in_flight,
                retry_after_secs,
            });
        }
        if let Some(target) = self.ttft_target {
            let estimated = self.estimated_delay(self.pending_tokens + own);
            if self.pending_tokens > 0 && estimated > target {
                return Err(Rejection::QueueDelay {
                    estimated,
                    target,
                    retry_after_secs,
                });
            }
        }
        let admitted = Admitted {
            ahead: self.pending_tokens,
            own,
            at: now,
            pending: true,
        };
        self.pending_tokens += own;
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
        let tokens = request.ahead + request.own;
        if tokens == 0 {
            return;
        }
        let sample = now.saturating_duration_since(request.at).as_secs_f64() / tokens as f64;
        self.seconds_per_token = Some(match self.seconds_per_token {
            None => sample,
            Some(avg) => avg + EWMA_WEIGHT * (sample - avg),
        });
    }

    /// `request` is over (finished, failed or cancelled).
    pub(crate) fn finish(&mut self, request: Admitted) {
        if request.pending {
            self.pending_tokens -= request.own;
        }
        self.in_flight -= 1;
    }

    /// How long `tokens` pending tokens take by the current rate (zero before any sample).
    fn estimated_delay(&self, tokens: u64) -> Duration {
        let secs = self.seconds_per_token.unwrap_or(0.0) * tokens as f64;
        Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX)
    }

    /// What the queue would make a new request wait now (for the gauge).
    pub(crate) fn queue_delay(&self) -> Duration {
        self.estimated_delay(self.pending_tokens)
    }

    pub(crate) fn pending_tokens(&self) -> u64 {
        self.pending_tokens
    }

    #[cfg(test)]
    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight
    }
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
        let result = self.update(|e| e.admit(own, Instant::now()));
        match result {
            Ok(admitted) => Ok(Ticket {
                admission: self.clone(),
                admitted: Some(admitted),
            }),
            Err(rejection) => {
                metrics()
                    .rejected
                    .with_label_values(&[rejection.reason()])
                    .inc();
                Err(rejection)
            }
        }
    }

    /// Runs `f` on the estimator and refreshes the gauges.
    fn update<T>(&self, f: impl FnOnce(&mut Estimator) -> T) -> T {
        let mut e = self.estimator.lock().unwrap_or_else(|e| e.into_inner());
        let out = f(&mut e);
        let m = metrics();
        m.admission_pending_tokens
            .set(i64::try_from(e.pending_tokens()).unwrap_or(i64::MAX));
        m.admission_queue_delay.set(e.queue_delay().as_secs_f64());
        out
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

    /// An estimator calibrated to `spt` seconds per token by one request served alone.
    fn calibrated(t0: Instant, spt_ms_per_100: u64) -> Estimator {
        let mut e = Estimator::new(TARGET, 100);
        let mut a = e.admit(100, t0).unwrap();
        e.first_token(&mut a, t0 + ms(spt_ms_per_100));
        e.finish(a);
        e
    }

    #[test]
    fn admits_everything_until_calibrated_then_rejects_what_would_miss_the_target() {
        let t0 = Instant::now();
        let mut e = Estimator::new(TARGET, 100);
        // No sample yet: no delay estimate, only the in-flight bound.
        let held: Vec<_> = (0..10).map(|_| e.admit(1000, t0).unwrap()).collect();
        assert_eq!(e.pending_tokens(), 10_000);
        for a in held {
            e.finish(a);
        }
        assert_eq!((e.pending_tokens(), e.in_flight()), (0, 0));

        // 100 tokens took 100 ms: 1 ms per token.
        let mut e = calibrated(t0, 100);
        let first = e.admit(600, t0).unwrap();
        // Nothing was pending: admitted whatever its size.
        assert_eq!(first.ahead, 0);
        // 600 + 300 = 900 ms <= 1 s: admitted.
        let second = e.admit(300, t0).unwrap();
        assert_eq!(second.ahead, 600);
        // 900 + 200 = 1.1 s > 1 s: refused, retry after the 0.9 s queue drains.
        let r = e.admit(200, t0).unwrap_err();
        assert_eq!(
            r,
            Rejection::QueueDelay {
                estimated: ms(1100),
                target: TARGET,
                retry_after_secs: 1,
            }
        );
        assert_eq!(r.reason(), "queue_delay");
        // A smaller one still fits.
        let third = e.admit(100, t0).unwrap();
        assert_eq!(e.pending_tokens(), 1000);
        for a in [first, second, third] {
            e.finish(a);
        }
        assert_eq!((e.pending_tokens(), e.in_flight()), (0, 0));
    }

    #[test]
    fn samples_are_ttft_over_tokens_ahead_plus_own_and_move_the_ewma() {
        let t0 = Instant::now();
        let mut e = calibrated(t0, 100);
        assert_eq!(e.seconds_per_token, Some(0.001));
        let mut a = e.admit(100, t0).unwrap();
        let mut b = e.admit(100, t0).unwrap();
        // `a`: 100 tokens in 100 ms (1 ms/token, unchanged). `b` had 100 ahead: 200 tokens in
        // 600 ms = 3 ms/token, so the EWMA moves 20% of the way: 1 + 0.2 * 2 = 1.4 ms.
        e.first_token(&mut a, t0 + ms(100));
        assert_eq!(e.pending_tokens(), 100);
        e.first_token(&mut b, t0 + ms(600));
        let spt = e.seconds_per_token.unwrap();
        assert!((spt - 0.0014).abs() < 1e-12, "{spt}");
        // A second first-token call is ignored.
        e.first_token(&mut b, t0 + ms(5000));
        assert_eq!(e.seconds_per_token.unwrap(), spt);
        // Tokens left pending only until the first token; in flight until finished.
        assert_eq!((e.pending_tokens(), e.in_flight()), (0, 2));
        e.finish(a);
        e.finish(b);
        assert_eq!(e.in_flight(), 0);
    }

    #[test]
    fn a_slow_backend_raises_the_rate_and_a_fast_one_brings_it_back() {
        let t0 = Instant::now();
        let mut e = calibrated(t0, 10); // 0.1 ms per token
        let mut now = t0;
        // The backend slows down 100x: samples of 10 ms per token.
        for _ in 0..30 {
            let mut a = e.admit(100, now).unwrap();
            now += Duration::from_secs(1);
            e.first_token(&mut a, now);
            e.finish(a);
        }
        assert!(e.seconds_per_token.unwrap() > 0.009);
        // Now even a short queue breaks the target...
        let held = e.admit(100, now).unwrap();
        assert!(matches!(
            e.admit(10, now),
            Err(Rejection::QueueDelay { .. })
        ));
        e.finish(held);
        // ...yet with nothing pending requests still go through, and fast answers bring the
        // rate back down.
        for _ in 0..60 {
            let mut a = e.admit(100, now).unwrap();
            now += ms(10);
            e.first_token(&mut a, now);
            e.finish(a);
        }
        assert!(e.seconds_per_token.unwrap() < 0.0002);
        let _a = e.admit(100, now).unwrap();
        assert!(e.admit(100, now).is_ok());
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
    fn retry_after_is_the_queue_delay_in_whole_seconds() {
        let t0 = Instant::now();
        let mut e = calibrated(t0, 100); // 1 ms per token
        let _a = e.admit(2500, t0).unwrap(); // 2.5 s pending
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
