//! Turning a decision into moves on real nodes, and the actuators that make them.
//!
//! [`moves`] is pure: from a [`Decision`] and the nodes discovery lists, which nodes switch
//! roles, which drain and how many start, always touching the least loaded nodes. An
//! [`Actuator`] carries the moves out its own way (processes on this host, desired counts
//! in etcd for an external orchestrator).

use anyhow::Result;
use kvmesh_common::NodeRole;
use kvmesh_kvstore::NodeEntry;
use kvmesh_planner::{Decision, Role};

/// One change to the mesh.
#[derive(Clone, Debug, PartialEq)]
pub enum Move {
    /// Start a new node of this role.
    Start(NodeRole),
    /// Drain this node: it leaves routing, finishes its requests and exits.
    Drain(NodeEntry),
    /// Switch this node to the other role in place (drain, flip, republish).
    Switch { node: NodeEntry, to: NodeRole },
}

/// What carries out a decision.
#[kvmesh_router::async_trait]
pub trait Actuator: Send {
    /// For logs and metrics: `local`, `etcd`, `none`.
    fn name(&self) -> &'static str;

    /// Acts on `decision` (never advisory here), whose concrete `moves` are given. Returns
    /// once every move has been started; a move that fails is an error, the rest stand.
    async fn apply(&mut self, decision: &Decision, moves: &[Move]) -> Result<()>;

    /// Nodes it started that have not registered yet, `[prefill, decode]`, given those
    /// registered now: they count as present, so a slow start is not started again.
    fn starting(&mut self, _registered: &[NodeEntry]) -> [u32; 2] {
        [0, 0]
    }
}

pub fn node_role(role: Role) -> NodeRole {
    match role {
        Role::Prefill => NodeRole::Prefill,
        Role::Decode => NodeRole::Decode,
    }
}

/// The moves that take the mesh from the nodes listed to `decision`'s targets: its switches
/// first, then drains and starts for the rest of each role's change. Switched and drained
/// nodes are the least loaded of their role (running plus waiting requests).
pub fn moves(decision: &Decision, prefill: &[NodeEntry], decode: &[NodeEntry]) -> Vec<Move> {
    let by_load = |nodes: &[NodeEntry]| {
        let mut nodes = nodes.to_vec();
        nodes.sort_by_key(|n| (n.load.running + n.load.waiting, n.info.node_id));
        nodes
    };
    let mut pools = [by_load(prefill), by_load(decode)];
    let mut moves = Vec::new();
    let s = decision.switches;
    for (from, to, count) in [
        (0, NodeRole::Decode, s.prefill_to_decode),
        (1, NodeRole::Prefill, s.decode_to_prefill),
    ] {
        for _ in 0..count {
            if pools[from].is_empty() {
                break;
            }
            let node = pools[from].remove(0);
            moves.push(Move::Switch { node, to });
        }
    }
    for role in Role::ALL {
        let i = match role {
            Role::Prefill => 0,
            Role::Decode => 1,
        };
        // What the switches already did for this role.
        let switched_in = i64::from(match role {
            Role::Prefill => s.decode_to_prefill,
            Role::Decode => s.prefill_to_decode,
        });
        let switched_out = i64::from(match role {
            Role::Prefill => s.prefill_to_decode,
            Role::Decode => s.decode_to_prefill,
        });
        let rest = decision.role(role).delta() - switched_in + switched_out;
        for _ in 0..rest.max(0) {
            moves.push(Move::Start(node_role(role)));
        }
        for _ in 0..(-rest).max(0) {
            if pools[i].is_empty() {
                break;
            }
            moves.push(Move::Drain(pools[i].remove(0)));
        }
    }
    moves
}

/// Advisory without the planner's advisory mode: decides, logs and exports, acts on nothing.
pub struct NoActuator;

#[kvmesh_router::async_trait]
impl Actuator for NoActuator {
    fn name(&self) -> &'static str {
        "none"
    }

    async fn apply(&mut self, _decision: &Decision, _moves: &[Move]) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::testing::decision;
    use kvmesh_planner::RoleSwitches;

    fn node(id: u64, role: NodeRole, running: usize) -> NodeEntry {
        crate::planner::testing::node(id, role, running, 0, 0)
    }

    #[test]
    fn growth_starts_nodes_and_shrinking_drains_the_least_loaded() {
        let prefill = [node(1, NodeRole::Prefill, 3)];
        let decode = [
            node(2, NodeRole::Decode, 5),
            node(3, NodeRole::Decode, 1),
            node(4, NodeRole::Decode, 9),
        ];
        let m = moves(
            &decision((1, 3), (3, 2), RoleSwitches::default()),
            &prefill,
            &decode,
        );
        assert_eq!(
            m,
            vec![
                Move::Start(NodeRole::Prefill),
                Move::Start(NodeRole::Prefill),
                Move::Drain(decode[1].clone()),
            ]
        );
    }

    #[test]
    fn a_switch_moves_the_least_loaded_node_and_covers_both_changes() {
        let prefill = [node(1, NodeRole::Prefill, 3)];
        let decode = [node(2, NodeRole::Decode, 5), node(3, NodeRole::Decode, 1)];
        let switches = RoleSwitches {
            prefill_to_decode: 0,
            decode_to_prefill: 1,
        };
        let m = moves(&decision((1, 2), (2, 1), switches), &prefill, &decode);
        assert_eq!(
            m,
            vec![Move::Switch {
                node: decode[1].clone(),
                to: NodeRole::Prefill
            }]
        );
        // One more prefill node than the switch gives: the switch, then a start.
        let m = moves(&decision((1, 3), (2, 1), switches), &prefill, &decode);
        assert_eq!(m.len(), 2);
        assert_eq!(m[1], Move::Start(NodeRole::Prefill));
    }

    #[test]
    fn a_hold_moves_nothing() {
        let prefill = [node(1, NodeRole::Prefill, 0)];
        let m = moves(
            &decision((1, 1), (1, 1), RoleSwitches::default()),
            &prefill,
            &[],
        );
        assert!(m.is_empty());
    }
}
