//! The RDMA transport's state without the verbs: which link (queue pair and rings) serves
//! which peer, what each may post and when, and where KV goes when a link fails.
//!
//! The driver (`verbs.rs`) allocates, posts and polls; it tells the table what happened
//! (with `now` where time matters) and the table answers with values: the slot a new link
//! takes, where a write goes, what landed where, and [`Action`]s to carry out (post a
//! receive or a credit, free a link). `R` is the driver's handle to a link's resources (an
//! `Arc` in the driver, a plain id in tests), `C` the chunk a write carries.
//!
//! A link lives in a slot; its [`LinkKey`] (slot and generation) is in the id of every
//! work request it posts, so a completion for a link since replaced finds nothing, and two
//! links never share a key however their preparations interleave. A peer has at most one
//! link in use (`active`) and at most one exchange under way (`pending`, held for a lease),
//! so concurrent preparations for one peer cannot hand out two rings for it: the second is
//! refused while the first is under way. A link leaves the table exactly once, through
//! [`Action::Free`] (or handed straight back when it cannot be installed): when a new
//! exchange with its peer completes, when it fails (an error completion, a post that
//! fails, a protocol violation), or when its peer never finished the exchange. A connected
//! link drains first ([`Action::Drain`], as the kernel's `ib_drain_rq`): messages that
//! landed before it failed are still taken and queued, so a write the peer saw complete is
//! never dropped here.
//!
//! A failed link never holds KV: the chunk its write carried joins its peer's undelivered
//! chunks, which the caller sends another way (QUIC). The peer then has no link until it
//! exchanges again; when and how often is the network transport's call (`network/routes`).

use super::ring::{RecvRing, RingError, SendRing};
use super::send_queue::SendQueue;
use super::{RdmaError, RdmaRegion, Undelivered};
use kvmesh_common::NodeId;
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

#[cfg(test)]
mod tests;

/// How the table bounds and times its links.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TableConfig {
    /// Bytes of each receive ring this side registers.
    pub ring_bytes: u64,
    /// Send work requests a queue pair holds (`max_send_wr`); at least 2.
    pub send_depth: u32,
    /// Receives kept posted per queue pair (`max_recv_wr`); at least `send_depth`, so that a
    /// peer configured alike never has more sends in flight than receives posted for them.
    pub recv_depth: u32,
    /// Peers with links at once (each holds up to two rings while it exchanges again).
    pub max_peers: usize,
    /// How long a prepared link waits for its peer's details before it is freed.
    pub exchange_lease: Duration,
    /// An idle link sends an empty credit this often, so a vanished peer fails it.
    pub keepalive: Duration,
    /// How long a failed link may take to drain before it is freed regardless.
    pub drain_timeout: Duration,
}

/// Identifies one link for its whole life; never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct LinkKey {
    pub slot: u32,
    pub generation: u32,
}

const GENERATION_MASK: u32 = (1 << 30) - 1;

/// What a work request does, as its id says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Work {
    /// The receive posted after a failed link's queue pair went to the error state.
    Drain = 0,
    Write = 1,
    Credit = 2,
    Recv = 3,
}

impl LinkKey {
    /// The id of a work request of `work` on this link: the kind in the top two bits, the
    /// generation in the next 30, the slot in the low 32.
    pub fn wr_id(self, work: Work) -> u64 {
        (work as u64) << 62
            | u64::from(self.generation & GENERATION_MASK) << 32
            | u64::from(self.slot)
    }

    pub fn from_wr_id(wr_id: u64) -> (Work, LinkKey) {
        let work = match wr_id >> 62 {
            0 => Work::Drain,
            1 => Work::Write,
            2 => Work::Credit,
            _ => Work::Recv,
        };
        let key = LinkKey {
            slot: wr_id as u32,
            generation: (wr_id >> 32) as u32 & GENERATION_MASK,
        };
        (work, key)
    }

    /// The first packet sequence number the link sends with (24 bits).
    pub fn psn(self) -> u32 {
        let mixed = (u64::from(self.slot) << 30 | u64::from(self.generation))
            .wrapping_mul(0x9e37_79b9_7f4a_7c15);
        (mixed >> 40) as u32 & 0xff_ffff
    }
}

/// What a completed work request reported.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Event {
    /// A write or a credit went through.
    Done,
    /// A receive took a message of this many bytes, written into the ring.
    Landed(u32),
    /// A receive took a credit: the peer handed back this many bytes.
    Credited(u32),
    /// The work request failed (or was flushed when its queue pair failed).
    Failed(String),
}

/// Something the driver must do for the table.
#[derive(Debug)]
pub(crate) enum Action<R> {
    PostRecv {
        key: LinkKey,
        resources: R,
        wr_id: u64,
    },
    /// Hand `bytes` of the ring back to the peer (zero: a keepalive).
    PostCredit {
        key: LinkKey,
        resources: R,
        wr_id: u64,
        bytes: u32,
    },
    /// The link failed: move its queue pair to the error state (its work flushes), then
    /// post a receive with `wr_id`, whose completion comes after every earlier receive's.
    /// The link stays in the table (landed messages still decoded) until that completion.
    Drain { resources: R, wr_id: u64 },
    /// The link left the table: destroy its queue pair, then its memory.
    Free { node: NodeId, resources: R },
}

/// Why a write cannot start now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum WriteRefusal {
    /// No connected link to the peer (none exchanged, or it failed for this reason).
    NoLink(String),
    /// The message can never fit the peer's ring.
    TooLarge { len: u64, max: u64 },
    /// Another write is staged or in flight, or the ring is full: wait for a completion.
    Busy,
}

/// A write may go: copy the message into `resources`' staging buffer, then `commit_write`.
#[derive(Clone, Debug)]
pub(crate) struct WriteGrant<R> {
    pub key: LinkKey,
    pub resources: R,
    /// Where in the peer's memory (its ring's address plus the message's offset).
    pub remote_addr: u64,
    pub rkey: u32,
}

/// A message landed in a link's ring: decode `len` bytes at `offset`, then report it with
/// `consumed(key, advance)` once its chunk is queued or dropped.
#[derive(Clone, Debug)]
pub(crate) struct Landing<R> {
    pub key: LinkKey,
    pub resources: R,
    pub offset: u64,
    pub len: u64,
    pub advance: u64,
}

enum Staging<C> {
    Idle,
    /// A sender is copying a message in.
    Claimed,
    InFlight(Undelivered<C>),
}

/// A connected link's traffic.
struct Io<C> {
    remote: RdmaRegion,
    send: SendRing,
    recv: RecvRing,
    queue: SendQueue,
    staging: Staging<C>,
    /// Receives posted and not yet completed.
    receives: u32,
    /// When this side last posted anything.
    last_post: Instant,
}

/// A link's life: `Reserved`, `Prepared` and `Connecting` make up an exchange (held for the
/// link's lease), then `Connected`, then `Draining` once it failed or was replaced.
enum State<R, C> {
    /// Its resources are being allocated.
    Reserved,
    /// Allocated; waiting for its peer's details.
    Prepared {
        resources: R,
    },
    /// Its queue pair is being moved to ready-to-send.
    Connecting {
        resources: R,
    },
    Connected {
        resources: R,
        io: Box<Io<C>>,
    },
    /// Failed; its receives flush until the drain receive completes (or `until`).
    Draining {
        resources: R,
        io: Box<Io<C>>,
        until: Instant,
    },
}

struct Link<R, C> {
    node: NodeId,
    state: State<R, C>,
    /// An exchange not connected by then is abandoned (its RPC or its driver call was
    /// lost), so that it cannot hold the peer's exchange or its memory for good.
    lease_until: Instant,
}

struct Slot<R, C> {
    generation: u32,
    link: Option<Link<R, C>>,
}

/// A peer's links and the KV its failed links left behind.
struct PeerLinks<C> {
    pending: Option<LinkKey>,
    active: Option<LinkKey>,
    undelivered: VecDeque<Undelivered<C>>,
    last_failure: Option<String>,
}

impl<C> Default for PeerLinks<C> {
    fn default() -> Self {
        PeerLinks {
            pending: None,
            active: None,
            undelivered: VecDeque::new(),
            last_failure: None,
        }
    }
}

impl<C> PeerLinks<C> {
    fn is_empty(&self) -> bool {
        self.pending.is_none() && self.active.is_none() && self.undelivered.is_empty()
    }
}

/// See the module docs.
pub(crate) struct PeerTable<R, C> {
    config: TableConfig,
    slots: Vec<Slot<R, C>>,
    free_slots: Vec<u32>,
    peers: HashMap<NodeId, PeerLinks<C>>,
    actions: VecDeque<Action<R>>,
}

impl<R: Clone, C> PeerTable<R, C> {
    pub fn new(config: TableConfig) -> Self {
        assert!(config.send_depth >= 2 && config.recv_depth >= config.send_depth);
        PeerTable {
            config,
            slots: Vec::new(),
            free_slots: Vec::new(),
            peers: HashMap::new(),
            actions: VecDeque::new(),
        }
    }

    /// The next thing to do, oldest first.
    pub fn poll_action(&mut self) -> Option<Action<R>> {
        self.actions.pop_front()
    }

    /// Step 1 of preparing a link to `node`: a slot for it. Refused while another
    /// exchange with `node` is under way (until its lease ends), and when `max_peers`
    /// other peers have links.
    pub fn begin_prepare(&mut self, node: NodeId, now: Instant) -> Result<LinkKey, RdmaError> {
        self.expire_leases(now);
        let has_links = match self.peers.get(&node) {
            Some(p) if p.pending.is_some() => return Err(RdmaError::ExchangeInProgress(node)),
            Some(p) => p.active.is_some(),
            None => false,
        };
        if !has_links && self.peers_with_links() >= self.config.max_peers {
            return Err(RdmaError::TooManyPeers {
                max: self.config.max_peers,
            });
        }
        let slot = match self.free_slots.pop() {
            Some(slot) => slot,
            None => {
                self.slots.push(Slot {
                    generation: 0,
                    link: None,
                });
                (self.slots.len() - 1) as u32
            }
        };
        let s = &mut self.slots[slot as usize];
        debug_assert!(s.link.is_none());
        s.link = Some(Link {
            node,
            state: State::Reserved,
            lease_until: now + self.config.exchange_lease,
        });
        let key = LinkKey {
            slot,
            generation: s.generation,
        };
        self.peers.entry(node).or_default().pending = Some(key);
        Ok(key)
    }

    /// Step 2: the link's resources are allocated. Hands them back when the link is gone.
    pub fn finish_prepare(&mut self, key: LinkKey, resources: R, now: Instant) -> Result<(), R> {
        let lease_until = now + self.config.exchange_lease;
        match self.link_mut(key) {
            Some(link) if matches!(link.state, State::Reserved) => {
                link.state = State::Prepared { resources };
                link.lease_until = lease_until;
                Ok(())
            }
            _ => Err(resources),
        }
    }

    /// The link reserved or prepared under `key` will not be used (allocating it failed).
    pub fn abandon(&mut self, key: LinkKey, why: &str, now: Instant) {
        self.retire(key, why, now);
    }

    /// Step 3: connect the link prepared for `node`. Its resources, to connect with.
    pub fn begin_connect(&mut self, node: NodeId, now: Instant) -> Result<(LinkKey, R), RdmaError> {
        self.expire_leases(now);
        let key = self
            .peers
            .get(&node)
            .and_then(|p| p.pending)
            .ok_or(RdmaError::NotPrepared(node))?;
        let link = self.link_mut(key).ok_or(RdmaError::NotPrepared(node))?;
        match std::mem::replace(&mut link.state, State::Reserved) {
            State::Prepared { resources, .. } => {
                link.state = State::Connecting {
                    resources: resources.clone(),
                };
                Ok((key, resources))
            }
            other => {
                link.state = other;
                Err(RdmaError::ExchangeInProgress(node))
            }
        }
    }

    /// Step 4: the queue pair is ready to send to the peer whose ring is `remote`. The link
    /// replaces the peer's previous one (freed, its chunk in flight undelivered); the
    /// driver posts the receives the actions ask for.
    pub fn finish_connect(
        &mut self,
        node: NodeId,
        key: LinkKey,
        remote: RdmaRegion,
        now: Instant,
    ) -> Result<(), RdmaError> {
        let ring_bytes = self.config.ring_bytes;
        let (send_depth, recv_depth) = (self.config.send_depth, self.config.recv_depth);
        let link = self.link_mut(key).ok_or(RdmaError::NotPrepared(node))?;
        debug_assert_eq!(link.node, node);
        if remote.len == 0 || remote.len > u64::from(u32::MAX) {
            let why = format!("node {node} offered a {}-byte ring", remote.len);
            self.retire(key, &why, now);
            return Err(RdmaError::Config(why));
        }
        let resources = match std::mem::replace(&mut link.state, State::Reserved) {
            State::Connecting { resources } => resources,
            other => {
                link.state = other;
                return Err(RdmaError::NotPrepared(node));
            }
        };
        link.state = State::Connected {
            resources: resources.clone(),
            io: Box::new(Io {
                remote,
                send: SendRing::new(remote.len),
                recv: RecvRing::new(ring_bytes),
                queue: SendQueue::new(send_depth),
                staging: Staging::Idle,
                receives: 0,
                last_post: now,
            }),
        };
        let peer = self.peers.entry(node).or_default();
        peer.pending = None;
        peer.last_failure = None;
        if let Some(old) = peer.active.replace(key) {
            self.retire(old, "replaced by a new exchange", now);
        }
        for _ in 0..recv_depth {
            self.post_recv(key, &resources);
        }
        Ok(())
    }

    /// Connecting the link under `key` failed.
    pub fn connect_failed(&mut self, key: LinkKey, why: &str, now: Instant) {
        self.retire(key, why, now);
    }

    /// Whether `node` has a connected link.
    pub fn link_up(&self, node: NodeId) -> bool {
        self.peers.get(&node).is_some_and(|p| p.active.is_some())
    }

    /// Why `node`'s last link failed, if it did.
    pub fn last_failure(&self, node: NodeId) -> Option<&str> {
        self.peers.get(&node)?.last_failure.as_deref()
    }

    /// Whether a write of `len` bytes to `node` may start now, and where it goes.
    pub fn begin_write(&mut self, node: NodeId, len: u64) -> Result<WriteGrant<R>, WriteRefusal> {
        let Some(key) = self.peers.get(&node).and_then(|p| p.active) else {
            let why = self
                .last_failure(node)
                .map_or_else(|| format!("no RDMA link to node {node}"), str::to_owned);
            return Err(WriteRefusal::NoLink(why));
        };
        let ring_bytes = self.config.ring_bytes;
        let Some(Link {
            state: State::Connected { resources, io },
            ..
        }) = self.link_mut(key)
        else {
            unreachable!("an active link is connected");
        };
        let max = io.remote.len.min(ring_bytes);
        if len > max || len > u64::from(u32::MAX) {
            return Err(WriteRefusal::TooLarge { len, max });
        }
        if !matches!(io.staging, Staging::Idle) || !io.queue.can_write() {
            return Err(WriteRefusal::Busy);
        }
        match io.send.try_place(len) {
            Ok(Some(p)) => {
                io.staging = Staging::Claimed;
                Ok(WriteGrant {
                    key,
                    resources: resources.clone(),
                    remote_addr: io.remote.addr + p.offset,
                    rkey: io.remote.rkey,
                })
            }
            Ok(None) => Err(WriteRefusal::Busy),
            Err(e) => Err(WriteRefusal::TooLarge { len, max: e.ring() }),
        }
    }

    /// The write granted under `key` is staged: the work request id to post it with (the
    /// driver posts it before it lets go of the table). When the link is gone meanwhile, the
    /// chunk joins the peer's undelivered ones and the reason comes back.
    pub fn commit_write(
        &mut self,
        node: NodeId,
        key: LinkKey,
        len: u64,
        chunk: Undelivered<C>,
        now: Instant,
    ) -> Result<u64, String> {
        let current = self.peers.get(&node).and_then(|p| p.active) == Some(key);
        let io = match self.link_mut(key) {
            Some(Link {
                state: State::Connected { io, .. },
                ..
            }) if current && matches!(io.staging, Staging::Claimed) => io,
            _ => {
                let why = self
                    .last_failure(node)
                    .unwrap_or("the RDMA link was replaced")
                    .to_owned();
                self.park(node, chunk);
                return Err(why);
            }
        };
        let p = io
            .send
            .try_place(len)
            .ok()
            .flatten()
            .expect("only credits came in since the grant, and they only free space");
        io.send.commit(p);
        io.queue.start_write();
        io.staging = Staging::InFlight(chunk);
        io.last_post = now;
        Ok(key.wr_id(Work::Write))
    }

    /// Keeps `chunk` with `node`'s undelivered ones (it cannot go over RDMA).
    pub fn park(&mut self, node: NodeId, chunk: Undelivered<C>) {
        self.peers
            .entry(node)
            .or_default()
            .undelivered
            .push_back(chunk);
    }

    /// The chunks to `node` that RDMA did not deliver, oldest first.
    pub fn take_undelivered(&mut self, node: NodeId) -> Vec<Undelivered<C>> {
        let Some(peer) = self.peers.get_mut(&node) else {
            return Vec::new();
        };
        let taken = peer.undelivered.drain(..).collect();
        if peer.is_empty() && peer.last_failure.is_none() {
            self.peers.remove(&node);
        }
        taken
    }

    /// The deadline of the write in flight to `node`, if one is.
    pub fn in_flight(&self, node: NodeId) -> Option<Instant> {
        let key = self.peers.get(&node)?.active?;
        match &self.link(key)?.state {
            State::Connected { io, .. } => match &io.staging {
                Staging::InFlight(u) => Some(u.deadline),
                _ => None,
            },
            _ => None,
        }
    }

    /// Gives up `node`'s link (its write did not complete in time): it is freed and its
    /// chunk in flight joins the undelivered ones.
    pub fn give_up(&mut self, node: NodeId, why: &str, now: Instant) {
        if let Some(key) = self.peers.get(&node).and_then(|p| p.active) {
            self.retire(key, why, now);
        }
    }

    /// Gives up every link (the device failed).
    pub fn give_up_all(&mut self, why: &str, now: Instant) {
        let keys: Vec<LinkKey> = self
            .peers
            .values()
            .flat_map(|p| p.pending.into_iter().chain(p.active))
            .collect();
        for key in keys {
            self.retire(key, why, now);
        }
    }

    /// A work request completed. A landed message comes back to be decoded; everything
    /// else shows in the table and its actions.
    pub fn on_completion(&mut self, wr_id: u64, event: Event, now: Instant) -> Option<Landing<R>> {
        let (work, key) = LinkKey::from_wr_id(wr_id);
        let link = self.link_mut(key)?;
        let node = link.node;
        let (resources, io) = match &mut link.state {
            State::Connected { resources, io } => (resources.clone(), io),
            State::Draining { resources, io, .. } => {
                let resources = resources.clone();
                return match (work, event) {
                    (Work::Drain, _) => {
                        self.free(key);
                        None
                    }
                    // Landed before the link failed: still taken (no credit goes back).
                    (Work::Recv, Event::Landed(len)) => {
                        let p = io.recv.land(u64::from(len)).ok()?;
                        Some(Landing {
                            key,
                            resources,
                            offset: p.offset,
                            len: u64::from(len),
                            advance: p.advance,
                        })
                    }
                    _ => None,
                };
            }
            // Not connected yet (nothing is posted before), so nothing to do.
            _ => return None,
        };
        let violation =
            |what: &dyn std::fmt::Display| format!("node {node} broke the protocol: {what}");
        match (work, event) {
            (_, Event::Failed(why)) => {
                if work == Work::Recv {
                    io.receives = io.receives.saturating_sub(1);
                }
                self.retire(key, &format!("work completion failed: {why}"), now);
                None
            }
            (Work::Write, Event::Done) => {
                io.queue.write_done();
                io.staging = Staging::Idle;
                None
            }
            (Work::Credit, Event::Done) => {
                io.queue.credit_done();
                self.send_credit(key, false, now);
                None
            }
            (Work::Recv, Event::Landed(len)) => {
                io.receives = io.receives.saturating_sub(1);
                match io.recv.land(u64::from(len)) {
                    Ok(p) => {
                        self.post_recv(key, &resources);
                        Some(Landing {
                            key,
                            resources,
                            offset: p.offset,
                            len: u64::from(len),
                            advance: p.advance,
                        })
                    }
                    Err(e) => {
                        self.retire(key, &violation(&e), now);
                        None
                    }
                }
            }
            (Work::Recv, Event::Credited(bytes)) => {
                io.receives = io.receives.saturating_sub(1);
                match io.send.credit(u64::from(bytes)) {
                    Ok(()) => {
                        self.post_recv(key, &resources);
                        None
                    }
                    Err(e) => {
                        self.retire(key, &violation(&e), now);
                        None
                    }
                }
            }
            (work, event) => {
                let what = format!("{event:?} for a {work:?}");
                self.retire(key, &violation(&what), now);
                None
            }
        }
    }

    /// The message that moved `key`'s ring by `advance` was consumed (its chunk queued or
    /// dropped): its space goes back to the peer (unless the link failed meanwhile).
    pub fn consumed(&mut self, key: LinkKey, advance: u64, now: Instant) {
        match self.link_mut(key).map(|l| &mut l.state) {
            Some(State::Connected { io, .. }) => {
                io.recv.consume(advance);
                io.queue.owe(advance);
                self.send_credit(key, false, now);
            }
            Some(State::Draining { io, .. }) => io.recv.consume(advance),
            _ => {}
        }
    }

    /// Posting the work request of an action for `key` failed.
    pub fn post_failed(&mut self, key: LinkKey, why: &str, now: Instant) {
        self.retire(key, why, now);
    }

    /// The clock: frees links whose peer never finished the exchange or that did not
    /// drain in time, gives up links whose write is still in flight past its deadline, and
    /// sends keepalives on idle links.
    pub fn on_timer(&mut self, now: Instant) {
        self.expire_leases(now);
        let (mut stuck, mut idle, mut drained) = (Vec::new(), Vec::new(), Vec::new());
        for (slot, s) in self.slots.iter().enumerate() {
            let key = LinkKey {
                slot: slot as u32,
                generation: s.generation,
            };
            match s.link.as_ref().map(|l| &l.state) {
                Some(State::Connected { io, .. }) => match &io.staging {
                    Staging::InFlight(u) if u.deadline <= now => stuck.push(key),
                    _ if io.queue.outstanding() == 0
                        && now.saturating_duration_since(io.last_post) >= self.config.keepalive =>
                    {
                        idle.push(key)
                    }
                    _ => {}
                },
                Some(State::Draining { until, .. }) if *until <= now => drained.push(key),
                _ => {}
            }
        }
        for key in stuck {
            self.retire(key, "a write did not complete by its deadline", now);
        }
        for key in idle {
            self.send_credit(key, true, now);
        }
        for key in drained {
            self.free(key);
        }
    }

    fn expire_leases(&mut self, now: Instant) {
        let expired: Vec<LinkKey> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(slot, s)| match &s.link {
                Some(Link {
                    state: State::Reserved | State::Prepared { .. } | State::Connecting { .. },
                    lease_until,
                    ..
                }) if *lease_until <= now => Some(LinkKey {
                    slot: slot as u32,
                    generation: s.generation,
                }),
                _ => None,
            })
            .collect();
        for key in expired {
            self.retire(key, "the peer never completed the exchange", now);
        }
    }

    fn post_recv(&mut self, key: LinkKey, resources: &R) {
        let recv_depth = self.config.recv_depth;
        if let Some(Link {
            state: State::Connected { io, .. },
            ..
        }) = self.link_mut(key)
        {
            if io.receives < recv_depth {
                io.receives += 1;
                self.actions.push_back(Action::PostRecv {
                    key,
                    resources: resources.clone(),
                    wr_id: key.wr_id(Work::Recv),
                });
            }
        }
    }

    fn send_credit(&mut self, key: LinkKey, keepalive: bool, now: Instant) {
        if let Some(Link {
            state: State::Connected { io, resources },
            ..
        }) = self.link_mut(key)
        {
            if let Some(bytes) = io.queue.next_credit(keepalive) {
                io.last_post = now;
                let resources = resources.clone();
                self.actions.push_back(Action::PostCredit {
                    key,
                    resources,
                    wr_id: key.wr_id(Work::Credit),
                    bytes,
                });
            }
        }
    }

    /// Takes the link under `key` out of its peer's hands (if it is still there): its chunk
    /// in flight is undelivered, and it drains (connected) or is freed (not yet).
    fn retire(&mut self, key: LinkKey, why: &str, now: Instant) {
        let drain_until = now + self.config.drain_timeout;
        let Some(link) = self.link_mut(key) else {
            return;
        };
        let node = link.node;
        let state = std::mem::replace(&mut link.state, State::Reserved);
        let (state, undelivered, drain) = match state {
            State::Connected { resources, mut io } => {
                let undelivered = match std::mem::replace(&mut io.staging, Staging::Idle) {
                    Staging::InFlight(chunk) => Some(chunk),
                    _ => None,
                };
                let drain = Action::Drain {
                    resources: resources.clone(),
                    wr_id: key.wr_id(Work::Drain),
                };
                let draining = State::Draining {
                    resources,
                    io,
                    until: drain_until,
                };
                (Some(draining), undelivered, Some(drain))
            }
            // Already out of its peer's hands.
            draining @ State::Draining { .. } => {
                link.state = draining;
                return;
            }
            other => {
                link.state = other;
                (None, None, None)
            }
        };
        let peer = self.peers.entry(node).or_default();
        if peer.pending == Some(key) {
            peer.pending = None;
        }
        if peer.active == Some(key) {
            peer.active = None;
            peer.last_failure = Some(format!("RDMA link to node {node} failed: {why}"));
            tracing::warn!(%node, why, "RDMA link given up");
        }
        peer.undelivered.extend(undelivered);
        if peer.is_empty() && peer.last_failure.is_none() {
            self.peers.remove(&node);
        }
        match (state, drain) {
            (Some(draining), Some(drain)) => {
                if let Some(link) = self.link_mut(key) {
                    link.state = draining;
                }
                self.actions.push_back(drain);
            }
            _ => self.free(key),
        }
    }

    /// Frees the link under `key`: its slot takes the next generation (so work still
    /// addressed to it finds nothing) and its resources go.
    fn free(&mut self, key: LinkKey) {
        let Some(s) = self.slots.get_mut(key.slot as usize) else {
            return;
        };
        if s.generation != key.generation {
            return;
        }
        let Some(link) = s.link.take() else {
            return;
        };
        s.generation = (s.generation + 1) & GENERATION_MASK;
        self.free_slots.push(key.slot);
        let resources = match link.state {
            State::Reserved => None,
            State::Prepared { resources, .. }
            | State::Connecting { resources }
            | State::Connected { resources, .. }
            | State::Draining { resources, .. } => Some(resources),
        };
        if let Some(resources) = resources {
            self.actions.push_back(Action::Free {
                node: link.node,
                resources,
            });
        }
    }

    fn peers_with_links(&self) -> usize {
        self.peers
            .values()
            .filter(|p| p.pending.is_some() || p.active.is_some())
            .count()
    }

    fn link(&self, key: LinkKey) -> Option<&Link<R, C>> {
        let s = self.slots.get(key.slot as usize)?;
        (s.generation == key.generation).then_some(s.link.as_ref()?)
    }

    fn link_mut(&mut self, key: LinkKey) -> Option<&mut Link<R, C>> {
        let s = self.slots.get_mut(key.slot as usize)?;
        if s.generation != key.generation {
            return None;
        }
        s.link.as_mut()
    }
}

impl RingError {
    fn ring(&self) -> u64 {
        match self {
            RingError::TooLarge { ring, .. } => *ring,
            _ => 0,
        }
    }
}

#[cfg(test)]
impl<R: Clone, C> PeerTable<R, C> {
    /// The resources of every link in the table.
    fn resources(&self) -> Vec<R> {
        self.slots
            .iter()
            .filter_map(|s| match &s.link.as_ref()?.state {
                State::Reserved => None,
                State::Prepared { resources, .. }
                | State::Connecting { resources }
                | State::Connected { resources, .. }
                | State::Draining { resources, .. } => Some(resources.clone()),
            })
            .collect()
    }

    /// Links in the table.
    fn live_links(&self) -> usize {
        self.slots.iter().filter(|s| s.link.is_some()).count()
    }

    /// Everything the table promises about itself.
    fn check_invariants(&self) -> Result<(), String> {
        let mut referenced = std::collections::HashSet::new();
        let mut with_links = 0;
        for (node, p) in &self.peers {
            with_links += usize::from(p.pending.is_some() || p.active.is_some());
            for (key, active) in [(p.pending, false), (p.active, true)] {
                let Some(key) = key else { continue };
                let link = self
                    .link(key)
                    .ok_or(format!("node {node} points at a freed link {key:?}"))?;
                if link.node != *node {
                    return Err(format!("{key:?} is node {}'s, not {node}'s", link.node));
                }
                let connected = matches!(link.state, State::Connected { .. });
                if connected != active {
                    return Err(format!("{key:?}: active {active}, connected {connected}"));
                }
                if !referenced.insert(key) {
                    return Err(format!("{key:?} referenced twice"));
                }
            }
        }
        if with_links > self.config.max_peers {
            return Err(format!(
                "{with_links} peers have links (max {})",
                self.config.max_peers
            ));
        }
        let mut free = self.free_slots.clone();
        free.sort_unstable();
        if free.windows(2).any(|w| w[0] == w[1]) {
            return Err("a slot is free twice".into());
        }
        for (slot, s) in self.slots.iter().enumerate() {
            let key = LinkKey {
                slot: slot as u32,
                generation: s.generation,
            };
            let is_free = free.binary_search(&(slot as u32)).is_ok();
            match &s.link {
                None if !is_free => return Err(format!("slot {slot} is empty but not free")),
                Some(_) if is_free => return Err(format!("slot {slot} is used and free")),
                Some(Link {
                    state: State::Draining { .. },
                    ..
                }) if referenced.contains(&key) => {
                    return Err(format!("{key:?} is draining and still in use"))
                }
                Some(Link {
                    state: State::Draining { .. },
                    ..
                }) => {}
                Some(_) if !referenced.contains(&key) => {
                    return Err(format!("{key:?} is in no peer's hands: a leak"))
                }
                Some(Link {
                    state: State::Connected { io, .. },
                    ..
                }) => {
                    let q = &io.queue;
                    if q.outstanding() > self.config.send_depth
                        || q.credits_in_flight() >= q.depth()
                    {
                        return Err(format!("{key:?}: {} sends outstanding", q.outstanding()));
                    }
                    if io.receives > self.config.recv_depth {
                        return Err(format!("{key:?}: {} receives posted", io.receives));
                    }
                    if matches!(io.staging, Staging::InFlight(_)) != q.write_in_flight() {
                        return Err(format!(
                            "{key:?}: the staging buffer and the queue disagree"
                        ));
                    }
                }
                _ => {}
            }
        }
        Ok(())
    }
}
