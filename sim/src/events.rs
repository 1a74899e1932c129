//! The event loop's queue: a min-heap of timestamped events.
//!
//! Events are ordered by `(time, sequence number)`, the sequence number being the order they
//! were pushed. Two events at the same instant therefore pop in the order they were
//! scheduled, never in an order that depends on the heap's layout or on the events' contents,
//! which is what makes a run with a given seed reproducible byte for byte.

use crate::clock::VirtualClock;
use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::time::Duration;

/// Pending events and the clock they advance.
#[derive(Debug)]
pub struct EventQueue<E> {
    heap: BinaryHeap<Pending<E>>,
    clock: VirtualClock,
    next_seq: u64,
}

#[derive(Debug)]
struct Pending<E> {
    at: Duration,
    seq: u64,
    event: E,
}

// Ordered by (at, seq) alone, reversed so that `BinaryHeap` (a max-heap) pops the earliest.
impl<E> Ord for Pending<E> {
    fn cmp(&self, other: &Self) -> Ordering {
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}

impl<E> PartialOrd for Pending<E> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl<E> PartialEq for Pending<E> {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}

impl<E> Eq for Pending<E> {}

impl<E> Default for EventQueue<E> {
    fn default() -> Self {
        EventQueue {
            heap: BinaryHeap::new(),
            clock: VirtualClock::new(),
            next_seq: 0,
        }
    }
}

impl<E> EventQueue<E> {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn now(&self) -> Duration {
        self.clock.now()
    }

    /// Schedules `event` at `at`, which must not be in the past.
    ///
    /// # Panics
    /// If `at` is before now (a simulator bug: it would be handled late, out of order).
    pub fn push_at(&mut self, at: Duration, event: E) {
        assert!(
            at >= self.clock.now(),
            "event scheduled in the past: {at:?} < {:?}",
            self.clock.now()
        );
        self.heap.push(Pending {
            at,
            seq: self.next_seq,
            event,
        });
        self.next_seq += 1;
    }

    /// Schedules `event` `delay` from now.
    pub fn push_in(&mut self, delay: Duration, event: E) {
        self.push_at(self.clock.now() + delay, event);
    }

    /// The earliest event, advancing the clock to its time; `None` when none is left.
    pub fn pop(&mut self) -> Option<(Duration, E)> {
        let p = self.heap.pop()?;
        self.clock.advance_to(p.at);
        Some((p.at, p.event))
    }

    pub fn len(&self) -> usize {
        self.heap.len()
    }

    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn pops_in_time_order_then_push_order() {
        let mut q = EventQueue::new();
        q.push_at(3 * MS, "c");
        q.push_at(MS, "a");
        q.push_at(3 * MS, "d");
        q.push_at(2 * MS, "b");
        q.push_at(3 * MS, "e");
        let order: Vec<_> = std::iter::from_fn(|| q.pop()).collect();
        assert_eq!(
            order,
            [
                (MS, "a"),
                (2 * MS, "b"),
                (3 * MS, "c"),
                (3 * MS, "d"),
                (3 * MS, "e")
            ]
        );
        assert_eq!(q.now(), 3 * MS);
    }

    #[test]
    fn relative_delays_count_from_the_popped_time() {
        let mut q = EventQueue::new();
        q.push_at(5 * MS, 1);
        assert_eq!(q.pop(), Some((5 * MS, 1)));
        q.push_in(2 * MS, 2);
        assert_eq!(q.pop(), Some((7 * MS, 2)));
        assert!(q.is_empty());
    }

    #[test]
    #[should_panic(expected = "in the past")]
    fn refuses_past_events() {
        let mut q = EventQueue::new();
        q.push_at(5 * MS, ());
        q.pop();
        q.push_at(4 * MS, ());
    }
}
