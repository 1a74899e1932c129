//! Fixtures of the planner's tests.

use kvmesh_common::{LoadReport, ModelFingerprint, NodeId, NodeInfo, NodeRole};
use kvmesh_kvstore::NodeEntry;
use kvmesh_planner::{Decision, Reason, RoleDecision, RoleSwitches};
use std::time::Duration;

/// A decision from (observed, target) prefill and decode counts, with `switches`.
pub fn decision(prefill: (u32, u32), decode: (u32, u32), switches: RoleSwitches) -> Decision {
    let role = |(observed, target)| RoleDecision {
        observed,
        target,
        reason: Reason::Hold,
    };
    Decision {
        at: Duration::ZERO,
        prefill: role(prefill),
        decode: role(decode),
        switches,
        advisory: false,
    }
}

/// A registered node `id` of `role` at 127.0.0.1:`id`, with 100 KV blocks and this load
/// (no prompt tokens queued).
pub fn node(id: u64, role: NodeRole, running: usize, waiting: usize, used: usize) -> NodeEntry {
    NodeEntry {
        info: NodeInfo {
            node_id: NodeId(id),
            role,
            address: format!("127.0.0.1:{id}"),
            transfer_address: String::new(),
            model_fingerprint: ModelFingerprint(1),
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
