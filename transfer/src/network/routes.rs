//! Which way KV goes to each peer, RDMA or QUIC, and when RDMA is worth trying again after
//! it failed. No I/O: time comes in as `now`.
//!
//! A peer starts on QUIC with an exchange due. An exchange that completes puts it on RDMA;
//! one that fails, or a link that fails later, puts it back on QUIC at once (the transport
//! resends what the link did not deliver) and schedules the next exchange after a delay
//! that doubles with each consecutive failure. After `max_failures` in a row the peer stays
//! on QUIC: no more exchanges are due (one the peer starts still succeeds). A link that
//! stayed up for `stable_after` starts a new streak when it fails.

use kvmesh_common::NodeId;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// How often and how soon to try RDMA again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RetryPolicy {
    /// The delay after the first failure; each further one doubles it.
    pub first_delay: Duration,
    pub max_delay: Duration,
    /// Consecutive failures after which the peer stays on QUIC.
    pub max_failures: u32,
    /// A link up this long before it fails starts a new streak.
    pub stable_after: Duration,
    /// An exchange not finished after this long failed (its RPC was lost).
    pub exchange_timeout: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            first_delay: Duration::from_secs(1),
            max_delay: Duration::from_secs(60),
            max_failures: 6,
            stable_after: Duration::from_secs(60),
            exchange_timeout: Duration::from_secs(30),
        }
    }
}

impl RetryPolicy {
    /// The delay before the next exchange after `failures` consecutive failures (from 1).
    pub fn delay(&self, failures: u32) -> Duration {
        let doubled = self
            .first_delay
            .checked_mul(1 << failures.saturating_sub(1).min(31))
            .unwrap_or(self.max_delay);
        doubled.min(self.max_delay)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Route {
    /// Chunks go over RDMA since `since`; `failures` is the streak before it.
    Rdma { since: Instant, failures: u32 },
    /// An exchange started at `started`.
    Exchanging { started: Instant, failures: u32 },
    /// Chunks go over QUIC after `failures` consecutive failures; the next exchange is due
    /// at `retry_at` (`None`: not any more).
    Quic {
        failures: u32,
        retry_at: Option<Instant>,
    },
}

/// See the module docs.
#[derive(Debug, Default)]
pub(crate) struct Routes {
    policy: RetryPolicy,
    peers: HashMap<NodeId, Route>,
}

impl Routes {
    pub fn new(policy: RetryPolicy) -> Self {
        Routes {
            policy,
            peers: HashMap::new(),
        }
    }

    /// `None`: QUIC, never tried.
    #[cfg(test)]
    pub fn route(&self, peer: NodeId) -> Option<Route> {
        self.peers.get(&peer).copied()
    }

    pub fn uses_rdma(&self, peer: NodeId) -> bool {
        matches!(self.peers.get(&peer), Some(Route::Rdma { .. }))
    }

    /// Whether this side should start an exchange with `peer` now.
    pub fn exchange_due(&mut self, peer: NodeId, now: Instant) -> bool {
        if let Some(&Route::Exchanging { started, failures }) = self.peers.get(&peer) {
            if now.saturating_duration_since(started) >= self.policy.exchange_timeout {
                self.fail(peer, failures, now);
            }
        }
        match self.peers.get(&peer) {
            None => true,
            Some(Route::Quic {
                retry_at: Some(t), ..
            }) => now >= *t,
            Some(_) => false,
        }
    }

    pub fn exchange_started(&mut self, peer: NodeId, now: Instant) {
        let failures = self.failures(peer);
        self.peers.insert(
            peer,
            Route::Exchanging {
                started: now,
                failures,
            },
        );
    }

    pub fn exchange_succeeded(&mut self, peer: NodeId, now: Instant) {
        let failures = self.failures(peer);
        self.peers.insert(
            peer,
            Route::Rdma {
                since: now,
                failures,
            },
        );
    }

    pub fn exchange_failed(&mut self, peer: NodeId, now: Instant) {
        let failures = self.failures(peer);
        self.fail(peer, failures, now);
    }

    /// The link to `peer` failed (an error completion, a write that never completed).
    /// Nothing changes unless `peer` was on RDMA.
    pub fn link_failed(&mut self, peer: NodeId, now: Instant) {
        if let Some(&Route::Rdma { since, failures }) = self.peers.get(&peer) {
            let stable = now.saturating_duration_since(since) >= self.policy.stable_after;
            self.fail(peer, if stable { 0 } else { failures }, now);
        }
    }

    fn failures(&self, peer: NodeId) -> u32 {
        match self.peers.get(&peer) {
            None => 0,
            Some(Route::Rdma { failures, .. })
            | Some(Route::Exchanging { failures, .. })
            | Some(Route::Quic { failures, .. }) => *failures,
        }
    }

    fn fail(&mut self, peer: NodeId, before: u32, now: Instant) {
        let failures = (before + 1).min(self.policy.max_failures);
        let retry_at =
            (failures < self.policy.max_failures).then(|| now + self.policy.delay(failures));
        self.peers.insert(peer, Route::Quic { failures, retry_at });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const P: NodeId = NodeId(7);

    fn policy() -> RetryPolicy {
        RetryPolicy {
            first_delay: Duration::from_secs(1),
            max_delay: Duration::from_secs(8),
            max_failures: 5,
            stable_after: Duration::from_secs(60),
            exchange_timeout: Duration::from_secs(30),
        }
    }

    #[test]
    fn failures_back_off_then_give_up() {
        let t0 = Instant::now();
        let mut r = Routes::new(policy());
        let mut now = t0;
        let mut attempts = Vec::new();
        // An initiator that exchanges whenever one is due, and always fails.
        for _ in 0..10_000 {
            if r.exchange_due(P, now) {
                attempts.push(now - t0);
                r.exchange_started(P, now);
                r.exchange_failed(P, now);
            }
            now += Duration::from_millis(100);
        }
        let secs: Vec<u64> = attempts.iter().map(|d| d.as_secs()).collect();
        // At once, then after 1, 2, 4 and 8 s; then QUIC for good.
        assert_eq!(secs, vec![0, 1, 3, 7, 15]);
        assert!(!r.uses_rdma(P));
        assert_eq!(
            r.route(P),
            Some(Route::Quic {
                failures: 5,
                retry_at: None
            })
        );
        // The peer exchanging with us still works.
        r.exchange_succeeded(P, now);
        assert!(r.uses_rdma(P));
    }

    #[test]
    fn a_lost_exchange_times_out_as_a_failure() {
        let t0 = Instant::now();
        let mut r = Routes::new(policy());
        r.exchange_started(P, t0);
        assert!(!r.exchange_due(P, t0 + Duration::from_secs(29)));
        assert!(!r.exchange_due(P, t0 + Duration::from_secs(30)));
        assert!(r.exchange_due(P, t0 + Duration::from_secs(31)));
    }

    #[test]
    fn a_link_that_was_stable_starts_a_new_streak() {
        let t0 = Instant::now();
        let mut r = Routes::new(policy());
        r.exchange_failed(P, t0);
        r.exchange_failed(P, t0);
        r.exchange_succeeded(P, t0);
        // Fails soon: the streak goes on (third failure: 4 s).
        r.link_failed(P, t0 + Duration::from_secs(1));
        assert_eq!(
            r.route(P),
            Some(Route::Quic {
                failures: 3,
                retry_at: Some(t0 + Duration::from_secs(5))
            })
        );
        r.exchange_succeeded(P, t0);
        // Fails after a minute up: a first failure again.
        let later = t0 + Duration::from_secs(60);
        r.link_failed(P, later);
        assert_eq!(
            r.route(P),
            Some(Route::Quic {
                failures: 1,
                retry_at: Some(later + Duration::from_secs(1))
            })
        );
    }

    #[derive(Clone, Debug)]
    enum Op {
        Start,
        Succeed,
        Fail,
        LinkFail,
        Wait(u64),
    }

    proptest! {
        /// Random exchanges, failures and time: a peer is on RDMA exactly after a success
        /// not followed by a failure; after any failure it is on QUIC at once with the next
        /// exchange no sooner than its backoff allows and never due before; the streak
        /// never exceeds the bound, and an exchange is due again unless it was reached.
        #[test]
        fn routes_follow_the_policy(ops in proptest::collection::vec(prop_oneof![
            Just(Op::Start), Just(Op::Succeed), Just(Op::Fail), Just(Op::LinkFail),
            (0u64..20_000).prop_map(Op::Wait),
        ], 1..100)) {
            let p = policy();
            let mut r = Routes::new(p);
            let mut now = Instant::now();
            for op in ops {
                let before = r.route(P);
                match op {
                    Op::Start => r.exchange_started(P, now),
                    Op::Succeed => r.exchange_succeeded(P, now),
                    Op::Fail => r.exchange_failed(P, now),
                    Op::LinkFail => r.link_failed(P, now),
                    Op::Wait(ms) => now += Duration::from_millis(ms),
                }
                let after = r.route(P);
                let was_rdma = matches!(before, Some(Route::Rdma { .. }));
                let failed = match op {
                    Op::Succeed => {
                        let on_rdma = matches!(after, Some(Route::Rdma { .. }));
                        prop_assert!(on_rdma);
                        false
                    }
                    Op::Fail => true,
                    // Only a peer on RDMA changes.
                    Op::LinkFail if !was_rdma => {
                        prop_assert_eq!(after, before);
                        false
                    }
                    Op::LinkFail => true,
                    _ => false,
                };
                if failed {
                    let Some(Route::Quic { failures, retry_at }) = after else {
                        return Err(TestCaseError::fail(format!("after a failure: {after:?}")));
                    };
                    prop_assert!(failures >= 1 && failures <= p.max_failures);
                    match retry_at {
                        Some(t) => {
                            prop_assert_eq!(t, now + p.delay(failures));
                            prop_assert!(t - now >= p.first_delay && t - now <= p.max_delay);
                            prop_assert!(!r.exchange_due(P, now));
                        }
                        None => prop_assert_eq!(failures, p.max_failures),
                    }
                }
                prop_assert_eq!(r.uses_rdma(P), matches!(after, Some(Route::Rdma { .. })));
                // Never stuck failed: on QUIC, an exchange is either scheduled or the
                // streak reached its bound.
                if let Some(Route::Quic { failures, retry_at: None }) = after {
                    prop_assert_eq!(failures, p.max_failures);
                }
                if let Some(Route::Quic { retry_at: Some(t), .. }) = after {
                    let mut probe = Routes::new(p);
                    probe.peers.insert(P, after.unwrap());
                    prop_assert!(probe.exchange_due(P, t));
                }
            }
        }
    }
}
