//! When a request's tokens reached its client, kept by the run rather than by the token.
//!
//! A decode node's run of quiet steps gives every sequence of its batch a token at each of
//! the same instants, so the run's times are kept once ([`RunTimes`]) and each request holds
//! the runs it got tokens from ([`Delivered`]): a request costs a few words a run, not one a
//! token. The gaps between a completed request's tokens are pooled into the run's histogram
//! ([`GapHistogram`]): those between its runs (and single tokens) when it completes, and
//! those within a run once for all the requests that completed with it, when the last
//! request holding the run lets it go. The histogram counts whole nanoseconds in sums, so
//! the order gaps are pooled in changes nothing it reports.

use crate::gaps::GapHistogram;
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Duration;

/// The run's histogram of completed requests' gaps, shared with the runs that pool into it.
pub(super) type SharedGaps = Rc<RefCell<GapHistogram>>;

/// The instants a run of quiet steps delivered its tokens at (one a step, to each sequence
/// of its batch).
#[derive(Debug)]
pub(super) struct RunTimes {
    ends: Vec<Duration>,
    /// The longest gap between two of `ends`.
    longest: Option<Duration>,
    /// Requests holding the run that completed: each pools its gaps within the run.
    completed: Cell<u64>,
    pool: SharedGaps,
}

impl RunTimes {
    /// A run's times (at least one), whose completed requests' gaps go to `pool`.
    pub(super) fn new(ends: Vec<Duration>, pool: &SharedGaps) -> Rc<RunTimes> {
        assert!(!ends.is_empty(), "a run delivers at least one token");
        Rc::new(RunTimes {
            longest: ends.windows(2).map(|w| w[1] - w[0]).max(),
            ends,
            completed: Cell::new(0),
            pool: pool.clone(),
        })
    }

    pub(super) fn ends(&self) -> &[Duration] {
        &self.ends
    }
}

impl Drop for RunTimes {
    /// The last holder has let the run go: its gaps, once for each request that completed.
    fn drop(&mut self) {
        let times = self.completed.get();
        if times > 0 {
            let mut pool = self.pool.borrow_mut();
            for w in self.ends.windows(2) {
                pool.record_times(nanos(w[1]) - nanos(w[0]), times);
            }
        }
    }
}

/// What reached a client in one go.
#[derive(Debug)]
enum Segment {
    One(Duration),
    Run(Rc<RunTimes>),
}

impl Segment {
    fn first(&self) -> Duration {
        match self {
            Segment::One(t) => *t,
            Segment::Run(r) => r.ends[0],
        }
    }

    fn last(&self) -> Duration {
        match self {
            Segment::One(t) => *t,
            Segment::Run(r) => r.ends[r.ends.len() - 1],
        }
    }

    fn times(&self) -> &[Duration] {
        match self {
            Segment::One(t) => std::slice::from_ref(t),
            Segment::Run(r) => &r.ends,
        }
    }
}

/// When each token of one request reached its client, across migrations.
#[derive(Debug, Default)]
pub(super) struct Delivered {
    segments: Vec<Segment>,
    count: usize,
}

impl Delivered {
    /// Tokens delivered.
    pub(super) fn len(&self) -> usize {
        self.count
    }

    pub(super) fn first(&self) -> Option<Duration> {
        self.segments.first().map(Segment::first)
    }

    pub(super) fn last(&self) -> Option<Duration> {
        self.segments.last().map(Segment::last)
    }

    /// One token, at `at`.
    pub(super) fn push(&mut self, at: Duration) {
        self.segments.push(Segment::One(at));
        self.count += 1;
    }

    /// A token at each of `run`'s times.
    pub(super) fn push_run(&mut self, run: &Rc<RunTimes>) {
        self.count += run.ends.len();
        self.segments.push(Segment::Run(run.clone()));
    }

    /// Every gap between its tokens, in order.
    pub(super) fn gaps(&self) -> Vec<Duration> {
        let times = self.segments.iter().flat_map(Segment::times);
        times
            .clone()
            .zip(times.skip(1))
            .map(|(a, b)| *b - *a)
            .collect()
    }

    /// The longest gap between its tokens.
    pub(super) fn longest(&self) -> Option<Duration> {
        let between = self.segments.windows(2).map(|w| w[1].first() - w[0].last());
        let within = self.segments.iter().filter_map(|s| match s {
            Segment::Run(r) => r.longest,
            Segment::One(_) => None,
        });
        between.chain(within).max()
    }

    /// The request completed: its gaps join `pool` (those within its runs when the runs are
    /// let go, see [`RunTimes`]).
    pub(super) fn pool(self, pool: &SharedGaps) {
        let mut p = pool.borrow_mut();
        for w in self.segments.windows(2) {
            p.record_times(nanos(w[1].first()) - nanos(w[0].last()), 1);
        }
        drop(p);
        for s in &self.segments {
            if let Segment::Run(r) = s {
                r.completed.set(r.completed.get() + 1);
            }
        }
    }
}

/// Whole nanoseconds (a run's times are far below u64's 584 years of them).
fn nanos(t: Duration) -> u64 {
    t.as_secs() * 1_000_000_000 + u64::from(t.subsec_nanos())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn runs_pool_as_their_tokens_one_by_one_would() {
        let pool = SharedGaps::default();
        let run = RunTimes::new(vec![3 * MS, 5 * MS, 9 * MS], &pool);
        let (mut a, mut b, mut failed) = (
            Delivered::default(),
            Delivered::default(),
            Delivered::default(),
        );
        a.push(MS);
        a.push_run(&run);
        a.push(10 * MS);
        b.push(2 * MS);
        b.push_run(&run);
        failed.push_run(&run);
        drop(run);
        assert_eq!((a.len(), a.first(), a.last()), (5, Some(MS), Some(10 * MS)));
        assert_eq!(a.gaps(), [2 * MS, 2 * MS, 4 * MS, MS]);
        assert_eq!(a.longest(), Some(4 * MS));
        assert_eq!(b.longest(), Some(4 * MS));
        let mut expected = GapHistogram::default();
        for gaps in [a.gaps(), b.gaps()] {
            gaps.into_iter().for_each(|g| expected.record(g));
        }
        a.pool(&pool);
        b.pool(&pool);
        // A request that did not complete pools nothing, and the run's gaps wait for it.
        assert_eq!(pool.borrow().count(), 3);
        drop(failed);
        let pooled = pool.borrow();
        assert_eq!(pooled.count(), expected.count());
        assert_eq!(pooled.summary(), expected.summary());
        assert_eq!(pooled.cdf(), expected.cdf());
        assert!(Delivered::default().longest().is_none());
    }
}
