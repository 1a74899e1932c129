//! Per-API-key rate limits: a token bucket per configured key (requests per second, with a
//! burst), keyed by the key's SHA-256 digest, so the limiter holds no key either. Excess
//! requests get 429 with `Retry-After`.
//!
//! The buckets are made once, one per configured key (one shared bucket when auth is off), and
//! never added to: memory is bounded by the configuration, not by what clients send.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::auth::{ApiKeys, KeyDigest};
use crate::error::ApiError;
use crate::metrics::metrics;

/// A token bucket: holds up to `burst` tokens, refilled at `per_second`; a request takes one.
#[derive(Clone, Debug)]
pub(crate) struct TokenBucket {
    per_second: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    /// Starts full. `per_second` must be positive and finite, `burst` at least 1.
    pub(crate) fn new(per_second: f64, burst: u32, now: Instant) -> Self {
        TokenBucket {
            per_second,
            burst: f64::from(burst),
            tokens: f64::from(burst),
            last: now,
        }
    }

    /// Takes a token at `now`, or says how long until one is available.
    pub(crate) fn try_take(&mut self, now: Instant) -> Result<(), Duration> {
        // A clock read before `last` (another thread was first) adds nothing.
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = self.last.max(now);
        self.tokens = (self.tokens + elapsed * self.per_second).min(self.burst);
        // The epsilon absorbs float error in the refill sums (ten refills of 0.1 are 0.999..).
        if self.tokens >= 1.0 - 1e-9 {
            self.tokens -= 1.0;
            Ok(())
        } else {
            let wait = (1.0 - self.tokens) / self.per_second;
            Err(Duration::try_from_secs_f64(wait).unwrap_or(Duration::MAX))
        }
    }
}

/// The buckets of all keys.
pub(crate) struct RateLimiter {
    buckets: HashMap<KeyDigest, Mutex<TokenBucket>>,
}

impl RateLimiter {
    /// One bucket per key of `keys`, or one shared by every request when `keys` is empty
    /// (auth off). `None` when `per_second` is zero (no limit).
    pub(crate) fn new(keys: &ApiKeys, per_second: f64, burst: u32) -> Option<Self> {
        if per_second <= 0.0 {
            return None;
        }
        let now = Instant::now();
        let mut digests = keys.digests().to_vec();
        if digests.is_empty() {
            digests.push(KeyDigest::ANONYMOUS);
        }
        let buckets = digests
            .into_iter()
            .map(|d| (d, Mutex::new(TokenBucket::new(per_second, burst, now))))
            .collect();
        Some(RateLimiter { buckets })
    }

    /// Takes a token from `key`'s bucket, or says how long to wait for one. A key without a
    /// bucket (none can pass auth) is not limited.
    pub(crate) fn check(&self, key: &KeyDigest, now: Instant) -> Result<(), Duration> {
        match self.buckets.get(key) {
            Some(bucket) => bucket
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .try_take(now),
            None => Ok(()),
        }
    }
}

/// Middleware for the completion routes, inside auth (which leaves the caller's
/// [`KeyDigest`] in the request's extensions).
pub(crate) async fn limit(
    State(limiter): State<Option<Arc<RateLimiter>>>,
    req: Request,
    next: Next,
) -> Response {
    if let Some(limiter) = &limiter {
        let key = req
            .extensions()
            .get::<KeyDigest>()
            .copied()
            .unwrap_or(KeyDigest::ANONYMOUS);
        if let Err(wait) = limiter.check(&key, Instant::now()) {
            metrics().rejected("rate_limit");
            let secs = wait.as_secs_f64().ceil().clamp(1.0, u64::MAX as f64) as u64;
            return ApiError::RateLimited {
                retry_after_secs: secs,
            }
            .into_response();
        }
    }
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_full_bucket_allows_the_burst_then_the_rate() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(2.0, 3, t0);
        for _ in 0..3 {
            assert!(b.try_take(t0).is_ok());
        }
        // Empty: the next token comes in 1/2 s.
        assert_eq!(b.try_take(t0), Err(ms(500)));
        // 250 ms later half a token is back: 250 ms more to wait.
        assert_eq!(b.try_take(t0 + ms(250)), Err(ms(250)));
        assert!(b.try_take(t0 + ms(500)).is_ok());
        assert!(b.try_take(t0 + ms(500)).is_err());
        // A long idle period refills only up to the burst.
        let later = t0 + Duration::from_secs(60);
        for _ in 0..3 {
            assert!(b.try_take(later).is_ok());
        }
        assert!(b.try_take(later).is_err());
    }

    #[test]
    fn over_time_the_rate_is_kept() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(10.0, 1, t0);
        // Offered 100/s for 10 s: about 10/s get through (plus the initial burst).
        let allowed = (0..1000)
            .filter(|i| b.try_take(t0 + ms(i * 10)).is_ok())
            .count();
        assert!((100..=101).contains(&allowed), "{allowed}");
    }

    #[test]
    fn a_clock_reading_from_the_past_adds_no_tokens() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(1.0, 1, t0 + ms(1000));
        assert!(b.try_take(t0 + ms(1000)).is_ok());
        assert!(b.try_take(t0).is_err());
        assert!(b.try_take(t0 + ms(1999)).is_err());
        assert!(b.try_take(t0 + ms(2000)).is_ok());
    }

    #[test]
    fn each_key_has_its_own_bucket_and_no_others_are_made() {
        let keys = ApiKeys::new(&["k1".into(), "k2".into()]);
        let limiter = RateLimiter::new(&keys, 1.0, 1).unwrap();
        let (k1, k2) = (keys.digests()[0], keys.digests()[1]);
        let now = Instant::now();
        assert!(limiter.check(&k1, now).is_ok());
        assert!(limiter.check(&k1, now).is_err());
        assert!(limiter.check(&k2, now).is_ok());
        assert_eq!(limiter.buckets.len(), 2);
        assert!(RateLimiter::new(&keys, 0.0, 1).is_none());
        // Without keys one bucket serves everyone.
        let open = RateLimiter::new(&ApiKeys::new(&[]), 1.0, 2).unwrap();
        assert_eq!(open.buckets.len(), 1);
        assert!(open.check(&KeyDigest::ANONYMOUS, now).is_ok());
        assert!(open.check(&KeyDigest::ANONYMOUS, now).is_ok());
        assert!(open.check(&KeyDigest::ANONYMOUS, now).is_err());
    }
}
