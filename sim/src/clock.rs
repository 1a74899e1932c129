//! Virtual time: a clock that only moves when the event loop says so.
//!
//! Time is a [`Duration`] since the simulation's start, so it carries nanosecond precision
//! without floating-point drift, and outcomes convert to bench's report types unchanged.

use std::time::Duration;

/// The simulation's "now". It never goes backwards: an event scheduled in the past is a bug
/// in the simulator, not something to paper over.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct VirtualClock {
    now: Duration,
}

impl VirtualClock {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn now(&self) -> Duration {
        self.now
    }

    /// Moves to `t`.
    ///
    /// # Panics
    /// If `t` is before now: the event queue hands events out in time order, so this only
    /// fires on a simulator bug.
    pub fn advance_to(&mut self, t: Duration) {
        assert!(
            t >= self.now,
            "virtual time went backwards: {t:?} < {:?}",
            self.now
        );
        self.now = t;
    }
}

/// A virtual time in whole nanoseconds, as runs of quiet steps and token times keep it.
///
/// # Panics
/// Past u64's 584 years of nanoseconds: no simulation runs that long.
pub fn nanos(at: Duration) -> u64 {
    u64::try_from(at.as_nanos()).expect("virtual time within u64 ns")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advances_and_stays() {
        let mut c = VirtualClock::new();
        c.advance_to(Duration::from_millis(3));
        c.advance_to(Duration::from_millis(3));
        assert_eq!(c.now(), Duration::from_millis(3));
    }

    #[test]
    #[should_panic(expected = "backwards")]
    fn refuses_to_go_back() {
        let mut c = VirtualClock::new();
        c.advance_to(Duration::from_millis(3));
        c.advance_to(Duration::from_millis(2));
    }
}
