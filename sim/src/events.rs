//! The event loop's queue: a min-heap of timestamped events.
//!
//! Events are ordered by `(time, push time, sequence number)`, the sequence number being the
//! order they were pushed. Pushes happen in time order, so for events pushed when they are
//! scheduled this is the order they were scheduled in: two events at the same instant pop in
//! that order, never in one that depends on the heap's layout or on the events' contents,
//! which is what makes a run with a given seed reproducible byte for byte. The push time is
//! in the key for the events a node pushes on behalf of steps it runs at once
//! ([`EventQueue::push_as_of`]): such an event takes the place the last step's own event would
//! have taken, pushed when the step before it ended.
//!
//! Most events are pushed in time order: a run pushes every request's arrival up front, in
//! arrival order. Those go to a FIFO lane instead of the heap, so the heap holds only the
//! events pushed out of order (step ends, transfers: a few per node) and each pop sifts
//! through that much instead of every future arrival. An event goes to the lane when its key
//! is above the lane's last; the lane is then sorted by the key too, and a pop takes the
//! earlier of the two heads, so the order is exactly the heap's alone.

use crate::clock::VirtualClock;
use std::cmp::Ordering;
use std::collections::{BTreeSet, BinaryHeap, VecDeque};
use std::time::Duration;

/// Pending events and the clock they advance.
#[derive(Debug)]
pub struct EventQueue<E> {
    heap: BinaryHeap<Pending<E>>,
    /// Events pushed in key order (see the module docs).
    lane: VecDeque<Pending<E>>,
    clock: VirtualClock,
    next_seq: u64,
    /// The key of the event popped last.
    current: EventKey,
    /// Keys of queued events that are never to pop (see [`EventQueue::cancel`]).
    cancelled: BTreeSet<EventKey>,
}

/// Where an event sorts among those due at its instant (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct EventKey {
    pub at: Duration,
    pub pushed: Duration,
    pub seq: u64,
}

#[derive(Debug)]
struct Pending<E> {
    key: EventKey,
    event: E,
}

// Ordered by the key alone, reversed so that `BinaryHeap` (a max-heap) pops the earliest.
impl<E> Ord for Pending<E> {
    fn cmp(&self, other: &Self) -> Ordering {
        other.key.cmp(&self.key)
    }
}

impl<E> PartialOrd for Pending<E> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl<E> PartialEq for Pending<E> {
    fn eq(&self, other: &Self) -> bool {
        self.key == other.key
    }
}

impl<E> Eq for Pending<E> {}

impl<E> Default for EventQueue<E> {
    fn default() -> Self {
        EventQueue {
            heap: BinaryHeap::new(),
            lane: VecDeque::new(),
            clock: VirtualClock::new(),
            next_seq: 0,
            current: EventKey::default(),
            cancelled: BTreeSet::new(),
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
        self.push_as_of(at, self.clock.now(), event);
    }

    /// Schedules `event` at `at` as if it had been pushed at `pushed` (no earlier than now, no
    /// later than `at`): among the events due at `at` it sorts with those pushed then.
    ///
    /// # Panics
    /// If `at` is before now or `pushed` outside `now..=at`.
    pub fn push_as_of(&mut self, at: Duration, pushed: Duration, event: E) {
        let now = self.clock.now();
        assert!(at >= now, "event scheduled in the past: {at:?} < {now:?}");
        assert!(
            (now..=at).contains(&pushed),
            "event pushed as of {pushed:?}, outside {now:?}..={at:?}"
        );
        let key = EventKey {
            at,
            pushed,
            seq: self.next_seq,
        };
        self.next_seq += 1;
        let pending = Pending { key, event };
        if self.lane.back().is_none_or(|last| key > last.key) {
            self.lane.push_back(pending);
        } else {
            self.heap.push(pending);
        }
    }

    /// Queues `event` under `key`, one given out before to an event now stale (a node's run
    /// of quiet steps cut short takes its place in the order back for the step left in
    /// flight, [`EventQueue::push_as_of`]).
    ///
    /// # Panics
    /// If `key` is due before now, was pushed after it is due, or was never given out.
    pub fn push_keyed(&mut self, key: EventKey, event: E) {
        assert!(
            key.at >= self.clock.now() && key.pushed <= key.at && key.seq < self.next_seq,
            "bad key {key:?} at {:?}",
            self.clock.now()
        );
        let pending = Pending { key, event };
        if self.lane.back().is_none_or(|last| key > last.key) {
            self.lane.push_back(pending);
        } else {
            self.heap.push(pending);
        }
    }

    /// The sequence number the next push takes.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// The key of the event popped last: where "now" is among the events due now.
    pub fn current(&self) -> EventKey {
        self.current
    }

    /// Schedules `event` `delay` from now.
    pub fn push_in(&mut self, delay: Duration, event: E) {
        self.push_at(self.clock.now() + delay, event);
    }

    /// The earliest event, advancing the clock to its time; `None` when none is left.
    pub fn pop(&mut self) -> Option<(Duration, E)> {
        loop {
            let from_lane = match (self.lane.front(), self.heap.peek()) {
                (None, None) => return None,
                (Some(_), None) => true,
                (None, Some(_)) => false,
                (Some(l), Some(h)) => l.key < h.key,
            };
            let p = if from_lane {
                self.lane.pop_front()
            } else {
                self.heap.pop()
            }
            .expect("checked above");
            if !self.cancelled.is_empty() && self.cancelled.remove(&p.key) {
                continue;
            }
            self.clock.advance_to(p.key.at);
            self.current = p.key;
            return Some((p.key.at, p.event));
        }
    }

    /// The queued event under `key` never pops, and no longer counts as pending: a node's
    /// run of quiet steps cut short leaves no event behind that the run would not have.
    pub fn cancel(&mut self, key: EventKey) {
        self.cancelled.insert(key);
    }

    /// Events pending, cancelled ones not counted.
    pub fn len(&self) -> usize {
        self.heap.len() + self.lane.len() - self.cancelled.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
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
    fn interleaves_in_order_and_out_of_order_pushes_exactly() {
        // Arrivals pushed up front in order (the lane), then events pushed while popping,
        // some before the lane's head and some at the same instant as lane events.
        let mut q = EventQueue::new();
        for t in [1, 3, 3, 5, 8] {
            q.push_at(t * MS, ("arrive", t));
        }
        assert_eq!(q.pop(), Some((MS, ("arrive", 1))));
        q.push_at(3 * MS, ("step", 3)); // same instant as two arrivals, pushed after them
        q.push_at(2 * MS, ("step", 2));
        q.push_at(9 * MS, ("step", 9));
        q.push_at(4 * MS, ("step", 4));
        assert_eq!(q.len(), 8);
        let order: Vec<_> = std::iter::from_fn(|| q.pop()).map(|(_, e)| e).collect();
        assert_eq!(
            order,
            [
                ("step", 2),
                ("arrive", 3),
                ("arrive", 3),
                ("step", 3),
                ("step", 4),
                ("arrive", 5),
                ("arrive", 8),
                ("step", 9)
            ]
        );
        assert!(q.is_empty());
    }

    #[test]
    fn an_event_pushed_as_of_a_later_time_sorts_with_those_pushed_then() {
        let mut q = EventQueue::new();
        q.push_at(10 * MS, "early");
        q.push_as_of(10 * MS, 5 * MS, "as of 5");
        q.push_at(MS, "tick");
        assert_eq!(q.pop(), Some((MS, "tick")));
        q.push_at(10 * MS, "pushed at 1");
        q.push_at(10 * MS, "also at 1");
        let order: Vec<_> = std::iter::from_fn(|| q.pop()).map(|(_, e)| e).collect();
        assert_eq!(order, ["early", "pushed at 1", "also at 1", "as of 5"]);
        let key = EventKey {
            at: 10 * MS,
            pushed: 5 * MS,
            seq: 1,
        };
        assert_eq!(q.current(), key);
    }

    #[test]
    fn a_cancelled_event_never_pops_nor_counts() {
        let mut q = EventQueue::new();
        q.push_at(MS, "a");
        q.push_at(2 * MS, "cancelled");
        let key = EventKey {
            at: 2 * MS,
            pushed: Duration::ZERO,
            seq: 1,
        };
        q.cancel(key);
        assert_eq!(q.len(), 1);
        assert_eq!(q.pop(), Some((MS, "a")));
        assert!(q.is_empty());
        assert_eq!(q.pop(), None);
        assert_eq!(q.now(), MS, "the clock stays at the last real event");
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
