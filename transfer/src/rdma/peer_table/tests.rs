//! The peer table as the driver drives it: two nodes on a simulated fabric (queue pairs
//! that deliver in order, receives that must be posted, queue pairs that fail), under
//! random sequences of exchanges, sends, completions (ok or failed) and time.

use super::*;
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};

/// A sends KV, B receives it (and sends the credits).
const A: NodeId = NodeId(1);
const B: NodeId = NodeId(2);
const RING: u64 = 256;
const SEND_DEPTH: u32 = 3;
const RECV_DEPTH: u32 = 4;

fn config() -> TableConfig {
    TableConfig {
        ring_bytes: RING,
        send_depth: SEND_DEPTH,
        recv_depth: RECV_DEPTH,
        max_peers: 2,
        exchange_lease: Duration::from_secs(10),
        keepalive: Duration::from_secs(2),
        drain_timeout: Duration::from_secs(1),
    }
}

/// A queue pair with its rings, by id.
type Res = u32;
type Table = PeerTable<Res, u64>;

fn chunk(id: u64, now: Instant) -> Undelivered<u64> {
    Undelivered {
        chunk: id,
        deadline: now + Duration::from_secs(3),
    }
}

#[test]
fn repeated_prepare_frees_what_it_replaces() {
    let now = Instant::now();
    let mut t = Table::new(config());
    let mut freed = Vec::new();
    for r in 0..100u32 {
        let key = t.begin_prepare(B, now).unwrap();
        t.finish_prepare(key, r, now).unwrap();
        let (k, res) = t.begin_connect(B, now).unwrap();
        assert_eq!((k, res), (key, r));
        t.finish_connect(B, key, region(r + 1000), now).unwrap();
        freed.extend(run(&mut t, now));
        // The one just connected is the only link; each before it was freed, once.
        assert_eq!(t.resources(), vec![r]);
        assert_eq!(freed, (0..r).collect::<Vec<_>>());
        t.check_invariants().unwrap();
    }
    assert_eq!(
        t.slots.len(),
        2,
        "two slots serve any number of re-exchanges"
    );
}

#[test]
fn concurrent_preparations_never_share_a_slot() {
    let now = Instant::now();
    let mut t = Table::new(config());
    let first = t.begin_prepare(B, now).unwrap();
    // A second preparation for the same peer while the first is under way is refused
    // (before: both took index `len()`, and the second overwrote the first's entry).
    assert!(matches!(
        t.begin_prepare(B, now),
        Err(RdmaError::ExchangeInProgress(n)) if n == B
    ));
    // Another peer gets another slot.
    let other = t.begin_prepare(NodeId(3), now).unwrap();
    assert_ne!(first.slot, other.slot);
    // A third peer is over max_peers.
    assert!(matches!(
        t.begin_prepare(NodeId(4), now),
        Err(RdmaError::TooManyPeers { max: 2 })
    ));
    // Allocation failed for the first: its slot comes back with a new generation, so work
    // still addressed to the old key finds nothing.
    t.abandon(first, "no memory", now);
    let again = t.begin_prepare(B, now).unwrap();
    assert_eq!(again.slot, first.slot);
    assert_ne!(again.generation, first.generation);
    assert_eq!(
        t.on_completion(first.wr_id(Work::Recv), Event::Landed(8), now)
            .map(|l| l.key),
        None
    );
    t.check_invariants().unwrap();
}

#[test]
fn an_unfinished_exchange_is_freed_when_its_lease_ends() {
    let now = Instant::now();
    let mut t = Table::new(config());
    let key = t.begin_prepare(B, now).unwrap();
    t.finish_prepare(key, 7, now).unwrap();
    t.on_timer(now + Duration::from_secs(9));
    assert!(t.poll_action().is_none());
    t.on_timer(now + Duration::from_secs(10));
    assert!(matches!(
        t.poll_action(),
        Some(Action::Free { resources: 7, .. })
    ));
    assert_eq!(t.live_links(), 0);
    // And the peer can be prepared again.
    let later = now + Duration::from_secs(10);
    let key = t.begin_prepare(B, later).unwrap();
    // Its allocation never reports back: the lease ends that too, and resources that come
    // after it are handed straight back to be freed.
    let much_later = later + Duration::from_secs(10);
    assert!(matches!(
        t.begin_prepare(B, much_later - Duration::from_millis(1)),
        Err(RdmaError::ExchangeInProgress(_))
    ));
    t.begin_prepare(B, much_later).unwrap();
    assert_eq!(t.finish_prepare(key, 8, much_later), Err(8));
    t.check_invariants().unwrap();
}

#[test]
fn an_error_completion_frees_the_link_and_hands_its_chunk_back() {
    let now = Instant::now();
    let mut t = Table::new(config());
    let key = connect(&mut t, B, 1, now);
    let grant = t.begin_write(B, 100).unwrap();
    assert_eq!(grant.key, key);
    let wr = t.commit_write(B, key, 100, chunk(42, now), now).unwrap();
    assert_eq!(t.in_flight(B), Some(now + Duration::from_secs(3)));
    t.on_completion(wr, Event::Failed("retry exceeded".into()), now);
    assert!(!t.link_up(B));
    // It drains, then goes.
    assert_eq!(run(&mut t, now), vec![1]);
    assert_eq!(t.live_links(), 0);
    let back = t.take_undelivered(B);
    assert_eq!(back.iter().map(|u| u.chunk).collect::<Vec<_>>(), vec![42]);
    match t.begin_write(B, 100) {
        Err(WriteRefusal::NoLink(why)) => assert!(why.contains("retry exceeded"), "{why}"),
        other => panic!("{other:?}"),
    }
    // Flushed work of the failed link changes nothing.
    t.on_completion(
        key.wr_id(Work::Credit),
        Event::Failed("flushed".into()),
        now,
    );
    // Not stuck: the peer exchanges again.
    connect(&mut t, B, 2, now);
    assert!(t.link_up(B));
    t.check_invariants().unwrap();
}

#[test]
fn a_write_stuck_past_its_deadline_is_given_up() {
    let now = Instant::now();
    let mut t = Table::new(config());
    let key = connect(&mut t, B, 1, now);
    t.begin_write(B, 10).unwrap();
    t.commit_write(B, key, 10, chunk(5, now), now).unwrap();
    t.on_timer(now + Duration::from_secs(3));
    assert!(!t.link_up(B));
    assert_eq!(t.take_undelivered(B).len(), 1);
}

#[test]
fn an_idle_link_sends_keepalives_within_its_depth() {
    let now = Instant::now();
    let mut t = Table::new(config());
    let key = connect(&mut t, B, 1, now);
    let later = now + Duration::from_secs(2);
    t.on_timer(later);
    assert!(matches!(
        t.poll_action(),
        Some(Action::PostCredit { bytes: 0, .. })
    ));
    // Not again while that one is outstanding.
    t.on_timer(later + Duration::from_secs(5));
    assert!(t.poll_action().is_none());
    t.on_completion(key.wr_id(Work::Credit), Event::Done, later);
    t.on_timer(later + Duration::from_secs(5));
    assert!(t.poll_action().is_some());
}

#[test]
fn work_request_ids_round_trip() {
    for (slot, generation) in [(0, 0), (7, 3), (u32::MAX, GENERATION_MASK)] {
        let key = LinkKey { slot, generation };
        for work in [Work::Drain, Work::Write, Work::Credit, Work::Recv] {
            assert_eq!(LinkKey::from_wr_id(key.wr_id(work)), (work, key));
        }
    }
}

/// Carries out the table's actions as a device would, draining at once; what it freed.
fn run(t: &mut Table, now: Instant) -> Vec<Res> {
    let mut freed = Vec::new();
    while let Some(a) = t.poll_action() {
        match a {
            Action::Drain { wr_id, .. } => {
                t.on_completion(wr_id, Event::Failed("flushed".into()), now);
            }
            Action::Free { resources, .. } => freed.push(resources),
            _ => {}
        }
    }
    freed
}

fn region(res: Res) -> RdmaRegion {
    RdmaRegion {
        addr: u64::from(res) << 32,
        rkey: res,
        len: RING,
    }
}

/// Prepares and connects a link to `node` with resources `res`; drops the actions.
fn connect(t: &mut Table, node: NodeId, res: Res, now: Instant) -> LinkKey {
    let key = t.begin_prepare(node, now).unwrap();
    t.finish_prepare(key, res, now).unwrap();
    t.begin_connect(node, now).unwrap();
    t.finish_connect(node, key, region(res + 1000), now)
        .unwrap();
    run(t, now);
    key
}

// ---- The simulated fabric --------------------------------------------------------------

#[derive(Clone, Debug)]
enum Op {
    /// The control plane's exchange: B prepares, A prepares and connects, B connects.
    Exchange,
    /// B prepares and the exchange goes no further (its RPC failed).
    HalfExchange,
    /// A sends a chunk of this many bytes.
    Send(u64),
    /// The next packet on the wire arrives.
    Deliver,
    /// One side polls a completion.
    Poll(usize),
    /// B's driver queues the oldest chunk that landed.
    Consume,
    /// The caller takes A's undelivered chunks.
    Take,
    /// One side's queue pair fails (all its work flushes).
    Break(usize),
    /// The next completion one side polls fails.
    FailNext(usize),
    /// Time passes (milliseconds).
    Tick(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => Just(Op::Exchange),
        1 => Just(Op::HalfExchange),
        8 => (1u64..RING + 40).prop_map(Op::Send),
        12 => Just(Op::Deliver),
        12 => (0usize..2).prop_map(Op::Poll),
        6 => Just(Op::Consume),
        2 => Just(Op::Take),
        1 => (0usize..2).prop_map(Op::Break),
        1 => (0usize..2).prop_map(Op::FailNext),
        2 => (1u64..4000).prop_map(Op::Tick),
    ]
}

struct Qp {
    side: usize,
    peer: Option<Res>,
    errored: bool,
    freed: bool,
    recv_wr: u64,
    recvs: u32,
    /// Send work requests posted and not yet polled.
    sends: u32,
}

enum What {
    Write { len: u64, chunk: u64, addr: u64 },
    Credit(u32),
}

struct Packet {
    from: Res,
    wr_id: u64,
    what: What,
}

struct Fabric {
    now: Instant,
    tables: [Table; 2],
    /// Completions waiting to be polled, per side: (queue pair, work request id, event).
    cqs: [VecDeque<(Res, u64, Event)>; 2],
    fail_next: [bool; 2],
    qps: BTreeMap<Res, Qp>,
    active: [Option<Res>; 2],
    wire: VecDeque<Packet>,
    /// Messages written into each queue pair's ring and not yet consumed: offset -> len.
    rings: BTreeMap<Res, BTreeMap<u64, u64>>,
    /// Which chunk each of those messages carries.
    chunks_at: BTreeMap<(Res, u64), u64>,
    /// What B's driver decoded and has not queued yet.
    landed: VecDeque<(LinkKey, Res, u64, u64, u64)>,
    next_res: Res,
    next_chunk: u64,
    installed: BTreeSet<Res>,
    freed: BTreeSet<Res>,
    /// Chunks a write took, chunks parked without one, chunks refused (ring full).
    accepted: BTreeSet<u64>,
    parked: BTreeSet<u64>,
    refused: BTreeSet<u64>,
    delivered: Vec<u64>,
    returned: Vec<u64>,
}

impl Fabric {
    fn new() -> Self {
        Fabric {
            now: Instant::now(),
            tables: [Table::new(config()), Table::new(config())],
            cqs: Default::default(),
            fail_next: [false; 2],
            qps: BTreeMap::new(),
            active: [None; 2],
            wire: VecDeque::new(),
            rings: BTreeMap::new(),
            chunks_at: BTreeMap::new(),
            landed: VecDeque::new(),
            next_res: 1,
            next_chunk: 0,
            installed: BTreeSet::new(),
            freed: BTreeSet::new(),
            accepted: BTreeSet::new(),
            parked: BTreeSet::new(),
            refused: BTreeSet::new(),
            delivered: Vec::new(),
            returned: Vec::new(),
        }
    }

    fn peer_of(side: usize) -> NodeId {
        [B, A][side]
    }

    /// Prepares a link on `side`: a fresh queue pair. `None` when refused.
    fn prepare(&mut self, side: usize) -> Result<Option<Res>, TestCaseError> {
        let node = Self::peer_of(side);
        let key = match self.tables[side].begin_prepare(node, self.now) {
            Ok(key) => key,
            Err(RdmaError::ExchangeInProgress(n)) if n == node => return Ok(None),
            Err(e) => return Err(TestCaseError::fail(format!("prepare: {e}"))),
        };
        let res = self.next_res;
        self.next_res += 1;
        self.installed.insert(res);
        self.qps.insert(
            res,
            Qp {
                side,
                peer: None,
                errored: false,
                freed: false,
                recv_wr: 0,
                recvs: 0,
                sends: 0,
            },
        );
        self.rings.insert(res, BTreeMap::new());
        if let Err(r) = self.tables[side].finish_prepare(key, res, self.now) {
            self.free(r)?;
        }
        Ok(Some(res))
    }

    fn connect(&mut self, side: usize, remote: Res) -> Result<bool, TestCaseError> {
        let node = Self::peer_of(side);
        let Ok((key, res)) = self.tables[side].begin_connect(node, self.now) else {
            return Ok(false);
        };
        self.qps.get_mut(&res).unwrap().peer = Some(remote);
        self.tables[side]
            .finish_connect(node, key, region(remote), self.now)
            .map_err(|e| TestCaseError::fail(format!("connect: {e}")))?;
        self.active[side] = Some(res);
        self.run_actions(side)?;
        Ok(true)
    }

    fn exchange(&mut self) -> Result<(), TestCaseError> {
        let Some(b) = self.prepare(1)? else {
            return Ok(());
        };
        let Some(a) = self.prepare(0)? else {
            return Err(TestCaseError::fail("A refused the exchange"));
        };
        prop_assert!(self.connect(0, b)?);
        prop_assert!(self.connect(1, a)?);
        Ok(())
    }

    fn free(&mut self, res: Res) -> Result<(), TestCaseError> {
        prop_assert!(
            self.installed.contains(&res),
            "freed {res}, never installed"
        );
        prop_assert!(self.freed.insert(res), "freed {res} twice");
        let qp = self.qps.get_mut(&res).unwrap();
        qp.freed = true;
        // A destroyed queue pair sends nothing more; its ring is unregistered.
        self.wire.retain(|p| p.from != res);
        self.rings.remove(&res);
        self.chunks_at.retain(|&(r, _), _| r != res);
        Ok(())
    }

    fn run_actions(&mut self, side: usize) -> Result<(), TestCaseError> {
        while let Some(action) = self.tables[side].poll_action() {
            match action {
                Action::PostRecv {
                    resources, wr_id, ..
                } => {
                    let qp = self.qps.get_mut(&resources).unwrap();
                    prop_assert!(!qp.freed);
                    qp.recv_wr = wr_id;
                    if qp.errored {
                        self.cqs[side].push_back((
                            resources,
                            wr_id,
                            Event::Failed("flushed".into()),
                        ));
                    } else {
                        qp.recvs += 1;
                        prop_assert!(qp.recvs <= RECV_DEPTH, "{} receives posted", qp.recvs);
                    }
                }
                Action::PostCredit {
                    resources,
                    wr_id,
                    bytes,
                    ..
                } => self.post_send(side, resources, wr_id, What::Credit(bytes))?,
                Action::Drain {
                    resources, wr_id, ..
                } => {
                    // To the error state: posted receives and sends flush, in order, and
                    // the drain receive completes after them.
                    let qp = self.qps.get_mut(&resources).unwrap();
                    qp.errored = true;
                    for _ in 0..std::mem::take(&mut qp.recvs) {
                        let flushed = (resources, qp.recv_wr, Event::Failed("flushed".into()));
                        self.cqs[side].push_back(flushed);
                    }
                    let cq = &mut self.cqs[side];
                    self.wire.retain(|p| {
                        let keep = p.from != resources;
                        if !keep {
                            cq.push_back((p.from, p.wr_id, Event::Failed("flushed".into())));
                        }
                        keep
                    });
                    cq.push_back((resources, wr_id, Event::Failed("flushed".into())));
                }
                Action::Free { resources, .. } => self.free(resources)?,
            }
        }
        Ok(())
    }

    fn post_send(
        &mut self,
        side: usize,
        res: Res,
        wr_id: u64,
        what: What,
    ) -> Result<(), TestCaseError> {
        let qp = self.qps.get_mut(&res).unwrap();
        prop_assert!(!qp.freed, "posted on a freed queue pair");
        qp.sends += 1;
        prop_assert!(
            qp.sends <= SEND_DEPTH,
            "{} sends outstanding on a depth of {SEND_DEPTH}",
            qp.sends
        );
        if qp.errored {
            self.cqs[side].push_back((res, wr_id, Event::Failed("flushed".into())));
        } else {
            self.wire.push_back(Packet {
                from: res,
                wr_id,
                what,
            });
        }
        Ok(())
    }

    fn send(&mut self, len: u64) -> Result<(), TestCaseError> {
        let id = self.next_chunk;
        self.next_chunk += 1;
        let now = self.now;
        match self.tables[0].begin_write(B, len) {
            Ok(grant) => {
                match self.tables[0].commit_write(B, grant.key, len, chunk(id, now), now) {
                    Ok(wr_id) => {
                        self.accepted.insert(id);
                        let what = What::Write {
                            len,
                            chunk: id,
                            addr: grant.remote_addr,
                        };
                        self.post_send(0, grant.resources, wr_id, what)?;
                    }
                    Err(_) => {
                        self.parked.insert(id);
                    }
                }
            }
            Err(WriteRefusal::NoLink(_)) => {
                self.tables[0].park(B, chunk(id, now));
                self.parked.insert(id);
            }
            Err(WriteRefusal::TooLarge { len: l, max }) => {
                prop_assert!(l > max && max <= RING);
                self.tables[0].park(B, chunk(id, now));
                self.parked.insert(id);
            }
            Err(WriteRefusal::Busy) => {
                self.refused.insert(id);
            }
        }
        Ok(())
    }

    /// The first packet that can move (its target has a receive posted, or is gone).
    fn deliver(&mut self) -> Result<(), TestCaseError> {
        let ready = self.wire.iter().position(|p| {
            let from = &self.qps[&p.from];
            match from.peer.map(|t| &self.qps[&t]) {
                Some(t) => from.errored || t.freed || t.errored || t.recvs > 0,
                None => true,
            }
        });
        let Some(i) = ready else { return Ok(()) };
        let p = self.wire.remove(i).unwrap();
        let from_side = self.qps[&p.from].side;
        let target = self.qps[&p.from].peer.filter(|t| {
            let t = &self.qps[t];
            !t.freed && !t.errored
        });
        let Some(t) = target.filter(|_| !self.qps[&p.from].errored) else {
            // The remote queue pair is gone: the sender's retries run out.
            self.qps.get_mut(&p.from).unwrap().errored = true;
            self.cqs[from_side].push_back((
                p.from,
                p.wr_id,
                Event::Failed("retry exceeded".into()),
            ));
            return Ok(());
        };
        let tq = self.qps.get_mut(&t).unwrap();
        tq.recvs -= 1;
        let (to_side, recv_wr) = (tq.side, tq.recv_wr);
        let event = match p.what {
            What::Write { len, chunk, addr } => {
                let offset = addr - region(t).addr;
                prop_assert!(offset + len <= RING, "a write past the ring");
                let ring = self.rings.get_mut(&t).unwrap();
                for (&o, &l) in ring.iter() {
                    prop_assert!(
                        offset + len <= o || o + l <= offset,
                        "[{offset}, {}) lands over unconsumed [{o}, {})",
                        offset + len,
                        o + l
                    );
                }
                ring.insert(offset, len);
                self.chunks_at.insert((t, offset), chunk);
                Event::Landed(len as u32)
            }
            What::Credit(bytes) => Event::Credited(bytes),
        };
        self.cqs[to_side].push_back((t, recv_wr, event));
        self.cqs[from_side].push_back((p.from, p.wr_id, Event::Done));
        Ok(())
    }

    fn poll(&mut self, side: usize) -> Result<(), TestCaseError> {
        let Some((res, wr_id, mut event)) = self.cqs[side].pop_front() else {
            return Ok(());
        };
        let (work, _) = LinkKey::from_wr_id(wr_id);
        if matches!(work, Work::Write | Work::Credit) {
            self.qps.get_mut(&res).unwrap().sends -= 1;
            // One error completion, as a requester sees it (retry exceeded, remote access
            // error); whether the message landed or not.
            if std::mem::take(&mut self.fail_next[side]) {
                event = Event::Failed("injected".into());
            }
        }
        if let Some(l) = self.tables[side].on_completion(wr_id, event, self.now) {
            prop_assert_eq!(side, 1, "only B receives KV");
            prop_assert_eq!(l.resources, res);
            let len = self.rings.get(&res).and_then(|r| r.get(&l.offset)).copied();
            prop_assert_eq!(len, Some(l.len), "both sides place the message alike");
            let chunk = self.chunks_at.remove(&(res, l.offset)).unwrap();
            self.landed
                .push_back((l.key, res, l.offset, l.advance, chunk));
        }
        self.run_actions(side)
    }

    fn consume(&mut self) -> Result<(), TestCaseError> {
        let Some((key, res, offset, advance, chunk)) = self.landed.pop_front() else {
            return Ok(());
        };
        prop_assert!(
            !self.delivered.contains(&chunk),
            "chunk {chunk} delivered twice"
        );
        self.delivered.push(chunk);
        if let Some(ring) = self.rings.get_mut(&res) {
            ring.remove(&offset);
        }
        self.tables[1].consumed(key, advance, self.now);
        self.run_actions(1)
    }

    fn break_qp(&mut self, side: usize) {
        let Some(res) = self.active[side] else { return };
        let qp = self.qps.get_mut(&res).unwrap();
        if qp.freed || qp.errored {
            return;
        }
        qp.errored = true;
        for _ in 0..std::mem::take(&mut qp.recvs) {
            self.cqs[side].push_back((res, qp.recv_wr, Event::Failed("flushed".into())));
        }
    }

    fn tick(&mut self, ms: u64) -> Result<(), TestCaseError> {
        self.now += Duration::from_millis(ms);
        for side in 0..2 {
            // One thread polls the completion queue and runs the clock: it has taken every
            // completion there is before it looks at the time.
            while !self.cqs[side].is_empty() {
                self.poll(side)?;
            }
            self.tables[side].on_timer(self.now);
            self.run_actions(side)?;
        }
        Ok(())
    }

    fn apply(&mut self, op: Op) -> Result<(), TestCaseError> {
        match op {
            Op::Exchange => self.exchange()?,
            Op::HalfExchange => {
                self.prepare(1)?;
            }
            Op::Send(len) => self.send(len)?,
            Op::Deliver => self.deliver()?,
            Op::Poll(side) => self.poll(side)?,
            Op::Consume => self.consume()?,
            Op::Take => {
                let back = self.tables[0].take_undelivered(B);
                self.returned.extend(back.into_iter().map(|u| u.chunk));
            }
            Op::Break(side) => self.break_qp(side),
            Op::FailNext(side) => self.fail_next[side] = true,
            Op::Tick(ms) => self.tick(ms)?,
        }
        self.check()
    }

    fn check(&mut self) -> Result<(), TestCaseError> {
        for t in &self.tables {
            t.check_invariants().map_err(TestCaseError::fail)?;
        }
        // Never stuck on a failed link: without one, a send is told so at once (and goes
        // another way) rather than waiting for space that will never come.
        if !self.tables[0].link_up(B) {
            let refusal = self.tables[0].begin_write(B, 1).err();
            prop_assert!(
                matches!(refusal, Some(WriteRefusal::NoLink(_))),
                "{refusal:?}"
            );
        }
        // No leak: every queue pair installed is in a table or was freed, never both.
        let mut held: Vec<Res> = self.tables.iter().flat_map(|t| t.resources()).collect();
        held.sort_unstable();
        let live: Vec<Res> = self.installed.difference(&self.freed).copied().collect();
        prop_assert_eq!(held, live);
        for (res, qp) in &self.qps {
            if !qp.freed {
                prop_assert!(
                    qp.sends <= SEND_DEPTH,
                    "queue pair {res}: {} sends",
                    qp.sends
                );
            }
        }
        Ok(())
    }

    /// Lets everything in flight finish, and time pass, until nothing moves.
    fn settle(&mut self) -> Result<(), TestCaseError> {
        for _ in 0..10_000 {
            let before = (
                self.wire.len(),
                self.cqs[0].len(),
                self.cqs[1].len(),
                self.landed.len(),
            );
            if before == (0, 0, 0, 0) {
                break;
            }
            self.deliver()?;
            self.poll(0)?;
            self.poll(1)?;
            self.consume()?;
            self.check()?;
        }
        // Writes that never completed are given up at their deadline.
        self.tick(10_000)?;
        let back = self.tables[0].take_undelivered(B);
        self.returned.extend(back.into_iter().map(|u| u.chunk));
        self.check()
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// After every event: the tables' own invariants, no queue pair leaked or freed twice,
    /// no queue pair with more sends outstanding than its depth or receives than posted
    /// room, no message landing over another. At the end, once everything in flight has
    /// finished: every chunk a write took arrived or came back to be sent another way,
    /// every chunk parked came back, and the peers can exchange again and send over RDMA.
    #[test]
    fn random_exchanges_sends_and_failures(ops in proptest::collection::vec(op(), 1..200)) {
        let mut f = Fabric::new();
        for op in ops {
            f.apply(op)?;
        }
        f.settle()?;
        let delivered: BTreeSet<u64> = f.delivered.iter().copied().collect();
        let returned: BTreeSet<u64> = f.returned.iter().copied().collect();
        prop_assert_eq!(returned.len(), f.returned.len(), "a chunk came back twice");
        for id in &f.accepted {
            prop_assert!(delivered.contains(id) || returned.contains(id), "chunk {id} lost");
        }
        for id in &f.parked {
            prop_assert!(returned.contains(id) && !delivered.contains(id), "parked chunk {id}");
        }
        for id in delivered.iter().chain(&returned) {
            prop_assert!(!f.refused.contains(id));
        }
        // Never stuck: whatever failed, a new exchange gives a link that takes a write.
        f.exchange()?;
        f.check()?;
        prop_assert!(f.tables[0].link_up(B) && f.tables[1].link_up(A));
        prop_assert!(f.tables[0].begin_write(B, RING).is_ok());
    }
}

#[derive(Clone, Debug)]
enum PrepOp {
    /// A caller starts preparing a link to peer `n`.
    Begin(u64),
    /// The `i`th caller under way takes its next step (allocated, connecting, connected).
    Step(usize),
    /// The `i`th caller's allocation fails.
    Fail(usize),
    Tick(u64),
}

proptest! {
    /// Callers preparing links to three peers, their steps interleaved at random (as
    /// concurrent `prepare_peer` / `connect_peer` calls take the table's lock in turn): no
    /// two links ever share a key, each peer has at most one exchange under way and one link
    /// in use, every step a caller takes lands on its own link, and every queue pair comes
    /// back exactly once when its link goes.
    #[test]
    fn interleaved_preparations_never_collide(ops in proptest::collection::vec(prop_oneof![
        (0u64..3).prop_map(PrepOp::Begin),
        any::<usize>().prop_map(PrepOp::Step),
        any::<usize>().prop_map(PrepOp::Fail),
        (0u64..15_000).prop_map(PrepOp::Tick),
    ], 1..120)) {
        let mut cfg = config();
        cfg.max_peers = 3;
        let mut t = Table::new(cfg);
        let mut now = Instant::now();
        // Callers under way: (peer, key, step reached: 0 reserved, 1 prepared, 2 connecting).
        let mut callers: Vec<(NodeId, LinkKey, u8)> = Vec::new();
        let (mut next_res, mut installed, mut freed) = (0u32, BTreeSet::new(), BTreeSet::new());
        let mut seen_keys = BTreeSet::new();
        for op in ops {
            match op {
                PrepOp::Begin(n) => match t.begin_prepare(NodeId(n), now) {
                    Ok(key) => {
                        prop_assert!(seen_keys.insert((key.slot, key.generation)), "{key:?} handed out twice");
                        callers.push((NodeId(n), key, 0));
                    }
                    Err(RdmaError::ExchangeInProgress(p)) => {
                        prop_assert_eq!(p, NodeId(n));
                        let under_way = callers.iter().any(|c| c.0 == p && t.link(c.1).is_some());
                        prop_assert!(under_way, "refused with no exchange under way");
                    }
                    Err(e) => return Err(TestCaseError::fail(e.to_string())),
                },
                PrepOp::Step(i) if !callers.is_empty() => {
                    let i = i % callers.len();
                    let (peer, key, step) = callers[i];
                    match step {
                        0 => {
                            next_res += 1;
                            installed.insert(next_res);
                            match t.finish_prepare(key, next_res, now) {
                                Ok(()) => callers[i].2 = 1,
                                Err(r) => {
                                    prop_assert!(freed.insert(r));
                                    callers.remove(i);
                                }
                            }
                        }
                        1 => match t.begin_connect(peer, now) {
                            Ok((k, _)) => {
                                prop_assert_eq!(k, key, "connecting someone else's link");
                                callers[i].2 = 2;
                            }
                            Err(_) => {
                                callers.remove(i);
                            }
                        },
                        _ => {
                            let done = t.finish_connect(peer, key, region(1), now);
                            prop_assert!(done.is_ok() || t.link(key).is_none());
                            callers.remove(i);
                        }
                    }
                }
                PrepOp::Fail(i) if !callers.is_empty() => {
                    let (_, key, _) = callers.remove(i % callers.len());
                    t.abandon(key, "no memory", now);
                }
                PrepOp::Tick(ms) => {
                    now += Duration::from_millis(ms);
                    t.on_timer(now);
                }
                _ => {}
            }
            // A caller whose lease ran out has lost its link; it finds out at its next step.
            callers.retain(|c| t.link(c.1).is_some() || c.2 == 0);
            for r in run(&mut t, now) {
                prop_assert!(freed.insert(r), "queue pair {r} freed twice");
            }
            t.check_invariants().map_err(TestCaseError::fail)?;
            let mut held = t.resources();
            held.sort_unstable();
            let live: Vec<u32> = installed.difference(&freed).copied().collect();
            prop_assert_eq!(held, live);
            // Among callers whose link is still there, no two share a link or a peer.
            let alive: Vec<_> = callers.iter().filter(|c| t.link(c.1).is_some()).collect();
            for (i, a) in alive.iter().enumerate() {
                for b in &alive[i + 1..] {
                    prop_assert!(a.1 != b.1 && a.0 != b.0, "two callers share a link or a peer");
                }
            }
        }
    }
}
