//! [`LoopbackRdma`]: a stand-in for an RDMA device, for testing what the control plane does
//! with RDMA on machines without one (as these are). It is not a transport to deploy.
//!
//! Nodes made from one [`LoopbackFabric`] reach each other through an in-process queue per
//! node, and each side's `connect_peer` checks that it got exactly what its peer prepared
//! for it, as a real queue pair would fail to reach the wrong one.

use super::{RdmaEndpoint, RdmaError, RdmaPeerInfo, RdmaRegion};
use crate::chunk::KvChunk;
use crate::in_process::InProcessTransport;
use crate::network::RdmaPeering;
use crate::transport::{KvReceiver, Transport, TransportError};
use kvmesh_common::NodeId;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// The "network" a set of [`LoopbackRdma`] devices share.
#[derive(Clone, Default)]
pub struct LoopbackFabric {
    queues: Arc<InProcessTransport>,
    /// What each node prepared for each peer: (preparer, peer) -> info.
    prepared: Arc<Mutex<HashMap<(NodeId, NodeId), RdmaPeerInfo>>>,
}

impl LoopbackFabric {
    /// The device of node `me` on this fabric.
    pub fn device(&self, me: NodeId) -> LoopbackRdma {
        LoopbackRdma {
            me,
            fabric: self.clone(),
            sent: AtomicUsize::new(0),
        }
    }
}

pub struct LoopbackRdma {
    me: NodeId,
    fabric: LoopbackFabric,
    sent: AtomicUsize,
}

impl LoopbackRdma {
    /// Chunks this device has sent.
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
        self.sent.fetch_add(1, Ordering::Relaxed);
        self.fabric.queues.send(dest, chunk, deadline)
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
            Some(p) if *p == remote => Ok(()),
            _ => Err(RdmaError::Config(format!(
                "{remote:?} is not what node {peer} prepared for node {}",
                self.me
            ))),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
