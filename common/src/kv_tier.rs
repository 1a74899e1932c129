//! Where a cached block lives on its node (its tier), and the prefix-cache events that say
//! so: what nodes publish and the cluster's prefix index consumes.

use crate::{KvEvent, NodeId, SequenceHash};
use serde::{Deserialize, Serialize};

/// A KV storage tier of one node, fastest first: a block in a faster tier is cheaper to reuse.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    /// The node's main KV pool (the engine's BlockPool): reusable as is.
    Device,
    /// Host memory: copied into the main pool before use.
    Host,
    /// Local disk: read, then copied.
    Disk,
}

impl Tier {
    /// Every tier, fastest first.
    pub const ALL: [Tier; 3] = [Tier::Device, Tier::Host, Tier::Disk];

    /// Bit `i` for `ALL[i]`, for sets of tiers.
    pub fn bit(self) -> u8 {
        1 << self as u8
    }
}

/// A [`KvEvent`] of one tier. A plain `KvEvent` converts into the [`Tier::Device`] event.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TieredKvEvent {
    pub tier: Tier,
    pub event: KvEvent,
}

impl TieredKvEvent {
    pub fn stored(tier: Tier, hash: SequenceHash) -> Self {
        TieredKvEvent {
            tier,
            event: KvEvent::Stored(hash),
        }
    }

    pub fn removed(tier: Tier, hash: SequenceHash) -> Self {
        TieredKvEvent {
            tier,
            event: KvEvent::Removed(hash),
        }
    }

    pub fn hash(&self) -> SequenceHash {
        match self.event {
            KvEvent::Stored(h) | KvEvent::Removed(h) => h,
        }
    }
}

impl From<KvEvent> for TieredKvEvent {
    fn from(event: KvEvent) -> Self {
        TieredKvEvent {
            tier: Tier::Device,
            event,
        }
    }
}

/// Where nodes announce their prefix-cache changes: the cluster's prefix index mirrors every
/// node's pool from them (the in-memory index itself in `kvmesh serve`; in the multi-process
/// mesh, the node's etcd publisher).
pub trait KvEventSink: Send + Sync + std::fmt::Debug {
    /// `node`'s events of one engine step. Called on the worker's thread: never blocks (hand
    /// the events to a queue or apply them to an in-memory index).
    fn publish(&self, node: NodeId, events: Vec<TieredKvEvent>);
}
