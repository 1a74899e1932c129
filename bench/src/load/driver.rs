//! The driver: offers a workload's requests under a load shape and collects their outcomes.
//!
//! One loop owns every decision (when a request is due, whether it may go, what ended), and
//! each request runs as its own task, so the loop never waits on a stream. A request is
//! *due* at its offset (open loop, trace) or when one in flight ends (closed loop); it is
//! *held* while the previous turn of its conversation is still running (`follow_turns`), and
//! it *waits* while `max_in_flight` requests are running. Held and waiting requests go in the
//! order they became due; in a closed loop a held request keeps its place, so the loop's
//! concurrency counts it.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::task::{Id, JoinError, JoinSet};
use tokio::time::Instant;

use super::client::{request_body, Client, Exchange};
use super::meter::Failure;
use super::{LoadError, RunPlan, Target};
use crate::arrivals::{LoadShape, Schedule};
use crate::slo::RequestOutcome;
use crate::trace::paced_offsets;
use crate::workload::Workload;

/// What the driver reports as it goes (for a live progress display).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RunEvent<'a> {
    /// Workload item `item` was sent `at` after the run's start.
    Sent { item: usize, at: Duration },
    /// A request ended, however it ended.
    Ended(&'a RequestOutcome),
}

/// What a run measured.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Run {
    /// Every request sent, in the order it was sent.
    pub outcomes: Vec<RequestOutcome>,
    /// From the first send to the last end.
    pub duration: Duration,
    /// How late the latest request left its schedule, of those neither held nor waiting: the
    /// generator's own lag.
    pub max_lateness: Duration,
    /// Requests that found `max_in_flight` requests running and waited.
    pub waited: usize,
    /// Follow-up turns due before the turn they follow had ended, held until it did.
    pub held: usize,
    /// The first message of each error kind in `outcomes` (an error body, the stream's error
    /// event, the I/O error).
    pub error_examples: BTreeMap<String, String>,
    /// The caller's stop rule ended sending before the plan did ([`run_until`]).
    pub stopped: bool,
}

/// Sends `workload` to `target` as `plan` says, calling `observer` at each send and end.
///
/// The run ends when `plan.max_requests` have been sent, `plan.duration` has passed or a
/// finite shape (a profile with an end, the trace) is done, and every request sent has ended.
/// The workload is cycled when more requests are needed than it holds; a repeated item does
/// not wait for its previous turn. Per-request failures are outcomes; only a plan that cannot
/// run is an error.
pub async fn run(
    target: &Target,
    workload: &Workload,
    plan: &RunPlan,
    observer: &mut (dyn FnMut(RunEvent<'_>) + Send),
) -> Result<Run, LoadError> {
    run_until(target, workload, plan, observer, &mut |_| false).await
}

/// [`run`], which also stops sending once `stop` says so of a request that ended (the
/// requests in flight are still awaited): a probe whose verdict is settled ends early.
pub async fn run_until(
    target: &Target,
    workload: &Workload,
    plan: &RunPlan,
    observer: &mut (dyn FnMut(RunEvent<'_>) + Send),
    stop: &mut (dyn FnMut(&RequestOutcome) -> bool + Send),
) -> Result<Run, LoadError> {
    let offers = Offers::new(workload, plan)?;
    if target.request_timeout.is_zero() {
        return Err(LoadError::NoTimeout);
    }
    if plan.max_in_flight == 0 {
        return Err(LoadError::NoInFlight);
    }
    // Bodies are built before the clock starts, so building them never delays a send.
    let bodies = workload
        .items
        .iter()
        .enumerate()
        .map(|(i, item)| request_body(i, item, target))
        .collect::<Result<Vec<Bytes>, LoadError>>()?;
    let client = Arc::new(Client::new(target)?);
    let mut driver = Driver {
        start: Instant::now(),
        offers,
        client,
        bodies,
        timeout: target.request_timeout,
        follow_turns: plan.follow_turns,
        max_in_flight: plan.max_in_flight,
        tasks: JoinSet::new(),
        running: HashMap::new(),
        turn_ended: vec![false; workload.items.len()],
        held_for: HashMap::new(),
        waiting: VecDeque::new(),
        outcomes: Vec::new(),
        run: Run::default(),
    };
    driver.drive(plan.duration, observer, stop).await;
    Ok(driver.finish())
}

/// The requests a run offers, in order, and when each is due.
struct Offers {
    shape: Shape,
    items: usize,
    /// The item a closed or open loop offers first ([`RunPlan::first_item`]).
    offset: usize,
    /// Requests offered so far.
    next: usize,
    limit: Option<usize>,
    /// For each item, its place in the first pass (the trace's order differs from the
    /// items').
    position: Vec<usize>,
    previous_turn: Vec<Option<usize>>,
}

enum Shape {
    /// Due as one ends; `concurrency` at the start.
    Closed { concurrency: usize },
    /// Due at the schedule's offsets (`peeked`: the next, drawn ahead).
    Open {
        schedule: Box<Schedule>,
        peeked: Option<Option<Duration>>,
    },
    /// The items in `order`, due at their paced arrival times.
    Trace {
        order: Vec<usize>,
        offsets: Vec<Duration>,
    },
}

/// One request on its way: the `n`-th offered, of workload item `item`.
#[derive(Clone, Copy, Debug)]
struct Offer {
    n: usize,
    item: usize,
    /// Its schedule's time, for lateness; `None` in a closed loop.
    due: Option<Instant>,
}

impl Offers {
    fn new(workload: &Workload, plan: &RunPlan) -> Result<Offers, LoadError> {
        let items = workload.items.len();
        if items == 0 {
            return Err(LoadError::EmptyWorkload(workload.name.clone()));
        }
        if plan.max_requests == Some(0) {
            return Err(LoadError::NoRequests);
        }
        let bounded = plan.max_requests.is_some() || plan.duration.is_some();
        let no_end = || LoadError::NoEnd(plan.shape.to_string());
        // Closed and open loops offer items in order from `first_item`, wrapping.
        let offset = plan.first_item % items;
        let mut position: Vec<usize> = (0..items).map(|i| (i + items - offset) % items).collect();
        let shape = match &plan.shape {
            LoadShape::Concurrency(n) if bounded => Shape::Closed {
                concurrency: n.get(),
            },
            LoadShape::Open(open) if bounded || open.profile.duration().is_some() => Shape::Open {
                schedule: Box::new(open.schedule(plan.seed)),
                peeked: None,
            },
            LoadShape::Concurrency(_) | LoadShape::Open(_) => return Err(no_end()),
            LoadShape::Trace(pacing) => {
                let ms = workload
                    .items
                    .iter()
                    .enumerate()
                    .map(|(item, w)| {
                        w.at.map(|at| ((at.as_nanos() + 500_000) / 1_000_000) as u64)
                            .ok_or_else(|| LoadError::NoArrivalTimes {
                                workload: workload.name.clone(),
                                item,
                            })
                    })
                    .collect::<Result<Vec<u64>, LoadError>>()?;
                let offsets = paced_offsets(&ms, *pacing);
                let mut order: Vec<usize> = (0..items).collect();
                order.sort_by_key(|&i| offsets[i]);
                for (n, &item) in order.iter().enumerate() {
                    position[item] = n;
                }
                Shape::Trace { order, offsets }
            }
        };
        Ok(Offers {
            shape,
            items,
            offset,
            next: 0,
            limit: plan.max_requests,
            position,
            previous_turn: workload.items.iter().map(|w| w.previous_turn).collect(),
        })
    }

    fn at_limit(&self) -> bool {
        self.limit.is_some_and(|l| self.next >= l)
            || matches!(self.shape, Shape::Trace { .. } if self.next >= self.items)
    }

    /// When the next request is due, from the start: `None` for a closed loop (due when one
    /// ends) or when there are no more.
    fn next_due(&mut self) -> Option<Duration> {
        if self.at_limit() {
            return None;
        }
        match &mut self.shape {
            Shape::Closed { .. } => None,
            Shape::Open { schedule, peeked } => *peeked.get_or_insert_with(|| schedule.next()),
            Shape::Trace { order, offsets } => Some(offsets[order[self.next]]),
        }
    }

    /// Whether more requests may still be offered.
    fn exhausted(&mut self) -> bool {
        let open = matches!(self.shape, Shape::Open { .. });
        self.at_limit() || (open && self.next_due().is_none())
    }

    /// The next request (due now or at `next_due`), if any.
    fn take(&mut self, start: Instant) -> Option<Offer> {
        if self.exhausted() {
            return None;
        }
        let n = self.next;
        let (item, due) = match &mut self.shape {
            Shape::Closed { .. } => ((self.offset + n) % self.items, None),
            Shape::Open { peeked, .. } => ((self.offset + n) % self.items, peeked.take().flatten()),
            Shape::Trace { order, offsets } => (order[n], Some(offsets[order[n]])),
        };
        self.next += 1;
        Some(Offer {
            n,
            item,
            due: due.map(|d| start + d),
        })
    }

    /// Whether `offer` is its item's first-pass request.
    fn first_pass(&self, offer: &Offer) -> bool {
        offer.n < self.items
    }

    /// The item whose end `offer` must wait for: its previous turn, on the first pass only,
    /// and only when that turn is offered before it (a link forward could never be met).
    fn previous_turn(&self, offer: &Offer) -> Option<usize> {
        if !self.first_pass(offer) {
            return None;
        }
        let p = self.previous_turn[offer.item]?;
        (p < self.items && self.position[p] < offer.n).then_some(p)
    }
}

/// What a request's task hands back.
struct Ended {
    offer: Offer,
    sent: Instant,
    exchange: Exchange,
    timed_out: bool,
    /// When the task ended (the end of a request that did not complete).
    at: Instant,
}

struct Driver {
    start: Instant,
    offers: Offers,
    client: Arc<Client>,
    bodies: Vec<Bytes>,
    timeout: Duration,
    follow_turns: bool,
    max_in_flight: usize,
    tasks: JoinSet<Ended>,
    /// The request of each task, should it panic.
    running: HashMap<Id, (Offer, Instant)>,
    /// Whether each item's first-pass request has ended.
    turn_ended: Vec<bool>,
    /// Offers held until the item keyed has ended.
    held_for: HashMap<usize, Vec<Offer>>,
    /// Offers waiting for a place under `max_in_flight`.
    waiting: VecDeque<Offer>,
    /// With the offer's number, to order ties.
    outcomes: Vec<(usize, RequestOutcome)>,
    run: Run,
}

impl Driver {
    async fn drive(
        &mut self,
        duration: Option<Duration>,
        observer: &mut (dyn FnMut(RunEvent<'_>) + Send),
        stop: &mut (dyn FnMut(&RequestOutcome) -> bool + Send),
    ) {
        let deadline = duration.map(|d| self.start + d);
        let mut sending = true;
        if let Shape::Closed { concurrency } = self.offers.shape {
            for _ in 0..concurrency {
                self.offer_next(observer);
            }
        }
        loop {
            let cut = self.run.stopped || deadline.is_some_and(|d| Instant::now() >= d);
            if sending && (self.offers.exhausted() || cut) {
                sending = false;
                if cut {
                    // Not yet sent when time ran out or the caller stopped: they never will be.
                    self.held_for.clear();
                    self.waiting.clear();
                }
            }
            if self.tasks.is_empty() {
                if !self.waiting.is_empty() {
                    self.admit_waiting(observer);
                    continue;
                }
                if !self.held_for.is_empty() {
                    // Unreachable by construction (a held turn's previous turn was offered
                    // first, so it is running, waiting or has released it); should it happen,
                    // send them rather than wait forever.
                    let held: Vec<Offer> = self.held_for.drain().flat_map(|(_, v)| v).collect();
                    self.waiting.extend(held);
                    continue;
                }
                if !sending {
                    break;
                }
            }
            let next_due = if sending {
                self.offers.next_due().map(|d| self.start + d)
            } else {
                None
            };
            tokio::select! {
                biased;
                _ = tokio::time::sleep_until(next_due.unwrap_or(self.start)), if next_due.is_some() => {
                    let now = Instant::now();
                    while self.offers.next_due().is_some_and(|d| self.start + d <= now) {
                        self.offer_next(observer);
                    }
                }
                Some(joined) = self.tasks.join_next_with_id(), if !self.tasks.is_empty() => {
                    let sending = sending && deadline.is_none_or(|d| Instant::now() < d);
                    self.ended(joined, sending, observer, stop);
                }
                _ = tokio::time::sleep_until(deadline.unwrap_or(self.start)), if sending && deadline.is_some() => {}
            }
        }
    }

    fn offer_next(&mut self, observer: &mut (dyn FnMut(RunEvent<'_>) + Send)) {
        if let Some(offer) = self.offers.take(self.start) {
            self.offer(offer, false, observer);
        }
    }

    /// Sends `offer` now, or holds it for its previous turn, or queues it for the cap.
    fn offer(
        &mut self,
        offer: Offer,
        delayed: bool,
        observer: &mut (dyn FnMut(RunEvent<'_>) + Send),
    ) {
        if self.follow_turns && !delayed {
            if let Some(p) = self.offers.previous_turn(&offer) {
                if !self.turn_ended[p] {
                    self.run.held += 1;
                    self.held_for.entry(p).or_default().push(offer);
                    return;
                }
            }
        }
        if self.tasks.len() >= self.max_in_flight || !self.waiting.is_empty() {
            self.run.waited += 1;
            self.waiting.push_back(offer);
            return;
        }
        self.send(offer, delayed, observer);
    }

    fn admit_waiting(&mut self, observer: &mut (dyn FnMut(RunEvent<'_>) + Send)) {
        while self.tasks.len() < self.max_in_flight {
            let Some(offer) = self.waiting.pop_front() else {
                break;
            };
            self.send(offer, true, observer);
        }
    }

    fn send(
        &mut self,
        offer: Offer,
        delayed: bool,
        observer: &mut (dyn FnMut(RunEvent<'_>) + Send),
    ) {
        let sent = Instant::now();
        if let (Some(due), false) = (offer.due, delayed) {
            self.run.max_lateness = self
                .run
                .max_lateness
                .max(sent.saturating_duration_since(due));
        }
        let client = self.client.clone();
        let body = self.bodies[offer.item].clone();
        let timeout = self.timeout;
        let task = self.tasks.spawn(async move {
            let mut exchange = Exchange::default();
            let timed_out =
                tokio::time::timeout(timeout, client.exchange(body, sent, &mut exchange))
                    .await
                    .is_err();
            Ended {
                offer,
                sent,
                exchange,
                timed_out,
                at: Instant::now(),
            }
        });
        self.running.insert(task.id(), (offer, sent));
        observer(RunEvent::Sent {
            item: offer.item,
            at: sent - self.start,
        });
    }

    fn ended(
        &mut self,
        joined: Result<(Id, Ended), JoinError>,
        sending: bool,
        observer: &mut (dyn FnMut(RunEvent<'_>) + Send),
        stop: &mut (dyn FnMut(&RequestOutcome) -> bool + Send),
    ) {
        let (offer, outcome, failure) = match joined {
            Ok((id, ended)) => {
                self.running.remove(&id);
                let offer = ended.offer;
                let (outcome, failure) = self.outcome(ended);
                (offer, outcome, failure)
            }
            Err(e) => {
                let Some((offer, sent)) = self.running.remove(&e.id()) else {
                    return;
                };
                let outcome = RequestOutcome {
                    item: offer.item,
                    sent: sent - self.start,
                    ended: self.start.elapsed(),
                    error: Some("panic".into()),
                    ..RequestOutcome::default()
                };
                (offer, outcome, Some(Failure::new("panic", e)))
            }
        };
        if let Some(f) = failure {
            self.run.error_examples.entry(f.kind).or_insert(f.message);
        }
        observer(RunEvent::Ended(&outcome));
        self.run.stopped |= stop(&outcome);
        self.outcomes.push((offer.n, outcome));
        if self.run.stopped {
            // Nothing more goes out; the loop awaits what is in flight.
            self.held_for.clear();
            self.waiting.clear();
            return;
        }
        if self.offers.first_pass(&offer) {
            self.turn_ended[offer.item] = true;
            for follow_up in self.held_for.remove(&offer.item).unwrap_or_default() {
                self.offer(follow_up, true, observer);
            }
        }
        self.admit_waiting(observer);
        if sending && matches!(self.offers.shape, Shape::Closed { .. }) {
            self.offer_next(observer);
        }
    }

    /// The outcome of a request whose task ended, and its failure's message.
    fn outcome(&self, ended: Ended) -> (RequestOutcome, Option<Failure>) {
        let Ended {
            offer,
            sent,
            exchange,
            timed_out,
            at,
        } = ended;
        let metered = exchange.meter.finish();
        let failure = if timed_out {
            Some(Failure::new(
                "timeout",
                format!("no end of stream after {:?}", self.timeout),
            ))
        } else {
            exchange.failure.or(metered.failure)
        };
        let e2e = metered.e2e.filter(|_| failure.is_none());
        let since_start = sent - self.start;
        let outcome = RequestOutcome {
            item: offer.item,
            sent: since_start,
            ended: e2e.map_or(at - self.start, |e2e| since_start + e2e),
            status: exchange.status,
            error: failure.as_ref().map(|f| f.kind.clone()),
            ttft: metered.ttft,
            gaps: metered.gaps,
            e2e,
            prompt_tokens: metered.prompt_tokens,
            cached_tokens: metered.cached_tokens,
            output_tokens: metered.output_tokens,
        };
        (outcome, failure)
    }

    fn finish(mut self) -> Run {
        self.outcomes.sort_by_key(|(n, o)| (o.sent, *n));
        let mut run = self.run;
        run.outcomes = self.outcomes.into_iter().map(|(_, o)| o).collect();
        let first = run.outcomes.iter().map(|o| o.sent).min();
        let last = run.outcomes.iter().map(|o| o.ended).max();
        if let (Some(first), Some(last)) = (first, last) {
            run.duration = last.saturating_sub(first);
        }
        run
    }
}
