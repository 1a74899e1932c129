//! Snapshots for the policy tests.

use super::{RouteRequest, TieredOverlap};
use kvmesh_common::fast_hash::U64Map;
use kvmesh_common::{LoadReport, NodeId, NodeInfo, NodeRole};
use kvmesh_kvstore::NodeEntry;
use proptest::prelude::*;

pub fn node(id: u64, running: usize, waiting: usize, used: usize) -> NodeEntry {
    NodeEntry {
        info: NodeInfo {
            node_id: NodeId(id),
            role: NodeRole::Decode,
            address: "in-process".into(),
            transfer_address: String::new(),
            model_fingerprint: kvmesh_common::ModelFingerprint(0),
            block_size: 16,
            kv_blocks_total: 100,
        },
        load: LoadReport {
            running,
            waiting,
            kv_blocks_used: used,
            ..LoadReport::default()
        },
    }
}

/// An owned snapshot a test can borrow a [`RouteRequest`] from.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub nodes: Vec<NodeEntry>,
    pub in_flight: U64Map<NodeId, usize>,
    pub prompt_blocks: usize,
    pub overlap: U64Map<NodeId, TieredOverlap>,
}

impl Snapshot {
    /// Nodes with these `running` counts, ids 1.., and a prompt of `prompt_blocks`.
    pub fn with_loads(loads: &[usize], prompt_blocks: usize) -> Self {
        Snapshot {
            nodes: (1..)
                .zip(loads)
                .map(|(id, &running)| node(id, running, 0, 0))
                .collect(),
            prompt_blocks,
            ..Snapshot::default()
        }
    }

    pub fn request(&self) -> RouteRequest<'_> {
        RouteRequest {
            nodes: &self.nodes,
            in_flight: &self.in_flight,
            prompt_blocks: self.prompt_blocks,
            overlap: &self.overlap,
        }
    }
}

/// 1..=12 nodes with random loads, in-flight counts and device/host/disk overlaps of a
/// prompt of up to 64 blocks.
pub fn snapshots() -> impl Strategy<Value = Snapshot> {
    let spec = (
        0..20usize,
        0..10usize,
        0..100usize,
        0..4usize,
        0..=64usize,
        0..3usize,
    );
    (prop::collection::vec(spec, 1..=12), 0..=64usize).prop_map(|(specs, prompt_blocks)| {
        let mut s = Snapshot {
            prompt_blocks,
            ..Snapshot::default()
        };
        for (id, (running, waiting, used, in_flight, cached, tier)) in (1..).zip(specs) {
            s.nodes.push(node(id, running, waiting, used));
            if in_flight > 0 {
                s.in_flight.insert(NodeId(id), in_flight);
            }
            let cached = cached.min(prompt_blocks);
            if cached > 0 {
                let tier = super::Tier::ALL[tier];
                s.overlap
                    .insert(NodeId(id), TieredOverlap::default().with(tier, cached));
            }
        }
        s
    })
}
