//! [`LoopbackRdma`]: a stand-in for an RDMA device, for testing what the control plane and
//! the network transport do with RDMA on machines without one (as these are). It is not a
//! transport to deploy.
//!
//! Nodes made from one [`LoopbackFabric`] reach each other through an in-process queue per
//! node, and each side's `connect_peer` checks that it got exactly what its peer prepared
//! for it, as a real queue pair would fail to reach the wrong one. [`LoopbackFabric::fail_link`]
//! breaks a link as a vanished peer would: the next write on it is taken and then fails (its
//! chunk comes back undelivered), and the link is down until the two exchange again.

use super::{RdmaEndpoint, RdmaError, RdmaPeerInfo, RdmaRegion, RdmaSendError, Undelivered};
use crate::chunk::KvChunk;
use crate::in_process::InProcessTransport;
use crate::network::RdmaPeering;
use crate::transport::{KvReceiver, Transport, TransportError};
use kvmesh_common::NodeId;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// The "network" a set of [`LoopbackRdma`] devices share.
#[derive(Clone, Default)]
pub struct LoopbackFabric {
    queues: Arc<InProcessTransport>,
    /// What each node prepared for each peer: (preparer, peer) -> info.
    prepared: Arc<Mutex<HashMap<(NodeId, NodeId), RdmaPeerInfo>>>,
    /// Links (sender, receiver) that fail their next write.
    broken: Arc<Mutex<HashSet<(NodeId, NodeId)>>>,
}

impl LoopbackFabric {
    /// The device of node `me` on this fabric.
    pub fn device(&self, me: NodeId) -> LoopbackRdma {
        LoopbackRdma {
            me,
            fabric: self.clone(),
            sent: AtomicUsize::new(0),
            links: Mutex::default(),
        }
    }

    /// Breaks the link from `from` to `to`: its next write is taken and then fails, and the
    /// link is down from then on (until the two exchange again).
    pub fn fail_link(&self, from: NodeId, to: NodeId) {
        lock(&self.broken).insert((from, to));
    }
}

/// One side's link to a peer.
#[derive(Default)]
struct Link {
    up: bool,
    undelivered: Vec<Undelivered>,
}

pub struct LoopbackRdma {
    me: NodeId,
    fabric: LoopbackFabric,
    sent: AtomicUsize,
    links: Mutex<HashMap<NodeId, Link>>,
}

impl LoopbackRdma {
    /// Chunks this device has delivered.
    pub fn chunks_sent(&self) -> usize {
        self.sent.load(Ordering::Relaxed)
    }

    /// The details node `me` gives `peer` (distinct for every pair).
    pub fn info(me: NodeId, peer: NodeId) -> RdmaPeerInfo {
        RdmaPeerInfo {
            endpoint: RdmaEndpoint {
                qp_num: (me.0 as u32) << 16 | peer.0 as u32 & 0xFFFF,
                lid: me.0 as u16,
                gid: [me.0 as u8; 16],
                psn: peer.0 as u32 & 0xFF_FFFF,
            },
            region: RdmaRegion {
                addr: 0x1000 * (me.0 & 0xFFFF),
                rkey: peer.0 as u32,
                len: 1 << 20,
            },
        }
    }
}

impl Transport for LoopbackRdma {
    fn bind(&self, node: NodeId) -> Result<KvReceiver, TransportError> {
        self.fabric.queues.bind(node)
    }

    fn unbind(&self, node: NodeId) {
        self.fabric.queues.unbind(node)
    }

    fn send(&self, dest: NodeId, chunk: KvChunk, deadline: Instant) -> Result<(), TransportError> {
        self.try_send(dest, chunk, deadline).map_err(|e| match e {
            RdmaSendError::Dropped(e) => e,
            e => {
                self.take_undelivered(dest);
                TransportError::Connection {
                    node: dest,
                    reason: e.to_string(),
                }
            }
        })
    }
}

impl RdmaPeering for LoopbackRdma {
    fn device_name(&self) -> &str {
        "loopback"
    }

    fn prepare_peer(&self, peer: NodeId) -> Result<RdmaPeerInfo, RdmaError> {
        let info = LoopbackRdma::info(self.me, peer);
        lock(&self.fabric.prepared).insert((self.me, peer), info);
        Ok(info)
    }

    fn connect_peer(&self, peer: NodeId, remote: RdmaPeerInfo) -> Result<(), RdmaError> {
        match lock(&self.fabric.prepared).get(&(peer, self.me)) {
            Some(p) if *p == remote => {
                lock(&self.links).entry(peer).or_default().up = true;
                lock(&self.fabric.broken).remove(&(self.me, peer));
                Ok(())
            }
            _ => Err(RdmaError::Config(format!(
                "{remote:?} is not what node {peer} prepared for node {}",
                self.me
            ))),
        }
    }

    fn link_up(&self, peer: NodeId) -> bool {
        lock(&self.links).get(&peer).is_some_and(|l| l.up)
    }

    fn try_send(
        &self,
        dest: NodeId,
        chunk: KvChunk,
        deadline: Instant,
    ) -> Result<(), RdmaSendError> {
        let mut links = lock(&self.links);
        let link = links.entry(dest).or_default();
        if !link.up {
            link.undelivered.push(Undelivered { chunk, deadline });
            return Err(RdmaSendError::Unusable(format!(
                "no RDMA link to node {dest}"
            )));
        }
        if lock(&self.fabric.broken).contains(&(self.me, dest)) {
            // Posted, then failed: the chunk comes back, the link is down.
            link.up = false;
            link.undelivered.push(Undelivered { chunk, deadline });
            return Ok(());
        }
        drop(links);
        self.fabric
            .queues
            .send(dest, chunk, deadline)
            .map_err(RdmaSendError::Dropped)?;
        self.sent.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn settle(&self, _dest: NodeId) {
        // Writes complete (or fail) as they are posted.
    }

    fn take_undelivered(&self, dest: NodeId) -> Vec<Undelivered> {
        lock(&self.links)
            .get_mut(&dest)
            .map(|l| std::mem::take(&mut l.undelivered))
            .unwrap_or_default()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
