//! A node's life in a mesh whose node set changes: requested and starting, serving, draining
//! (out of routing, finishing its requests), gone. One notion of leaving routing serves a
//! death ([`Mesh::node_dies`]) and a drain: the node leaves the routing candidates and the
//! prefix index at once.

use super::{entry, Event, Mesh};
use crate::autoscale::{AutoscaleReport, ChangeKind, CountsAt, RoleSeconds};
use crate::node::SimNode;
use kvmesh_common::{NodeId, NodeRole};
use kvmesh_planner::Role;
use std::time::Duration;

/// Where a node is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Life {
    /// Requested, loading its weights (or flipping its role): billed, not routed.
    Starting,
    /// A routing candidate.
    Serving,
    /// Out of routing, finishing what it holds; then gone, or (with `into`) a node of that
    /// role starts in its place on the same machine.
    Draining { into: Option<NodeRole> },
    /// Drained, cancelled before it served, or dead.
    Gone,
}

/// When a node was requested (billing starts), started serving, and left (billing ends).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct NodeTimes {
    pub requested: Duration,
    pub serving: Option<Duration>,
    pub left: Option<Duration>,
}

impl NodeTimes {
    /// A node the mesh starts with.
    pub fn initial() -> NodeTimes {
        NodeTimes {
            requested: Duration::ZERO,
            serving: Some(Duration::ZERO),
            left: None,
        }
    }
}

pub(super) fn planner_role(role: NodeRole) -> Role {
    match role {
        NodeRole::Decode => Role::Decode,
        _ => Role::Prefill,
    }
}

fn other(role: NodeRole) -> NodeRole {
    match role {
        NodeRole::Decode => NodeRole::Prefill,
        _ => NodeRole::Decode,
    }
}

pub(super) fn node_role(role: Role) -> NodeRole {
    match role {
        Role::Decode => NodeRole::Decode,
        Role::Prefill => NodeRole::Prefill,
    }
}

/// Node-seconds per role: each node from its request to its leaving or `end`.
pub(super) fn billed(roles: &[NodeRole], times: &[NodeTimes], end: Duration) -> RoleSeconds {
    let mut s = RoleSeconds::default();
    for (role, t) in roles.iter().zip(times) {
        let until = t.left.unwrap_or(end).min(end);
        s.add(
            planner_role(*role),
            until.saturating_sub(t.requested).as_secs_f64(),
        );
    }
    s
}

impl Mesh<'_> {
    /// Node `n` leaves routing: no request is sent to it any more, and the router's index
    /// forgets what it holds.
    pub(super) fn leave_routing(&mut self, n: usize) {
        self.candidates.remove(n);
        self.keep_candidates();
        self.index.remove_node(NodeId(n as u64));
    }

    /// Requests a node of `role`: it serves `after` from now.
    pub(super) fn add_node(&mut self, role: NodeRole, now: Duration, after: Duration) -> usize {
        let config = match role {
            NodeRole::Decode => &self.decode_node,
            _ => &self.prefill.as_ref().expect("checked at the start").node,
        };
        let mut node = SimNode::new(config.clone()).expect("validated at the start");
        node.set_record_kv_events(config.scheduler.enable_prefix_caching);
        // Nodes that come and go never share hosts' cores (refused at the start).
        node.set_coalesce(self.quiet_runs);
        node.set_gather_window(self.gather_window);
        if self.scaler.is_some() {
            node.set_record_steps(super::scaler::STEPS_KEPT);
        }
        let n = self.nodes.len();
        self.nodes.push(node);
        self.roles.push(role);
        self.life.push(Life::Starting);
        self.times.push(NodeTimes {
            requested: now,
            serving: None,
            left: None,
        });
        self.sending_until.push(Duration::ZERO);
        self.routed.push(0);
        self.step_event.push(0);
        self.run_seq.push(0);
        self.queue.push_at(now + after, Event::Ready(n));
        self.record_counts(now);
        n
    }

    /// A starting node has started: it joins the routing candidates.
    pub(super) fn ready(&mut self, n: usize, now: Duration) {
        if self.life[n] != Life::Starting {
            return; // cancelled, or died, while it started
        }
        self.life[n] = Life::Serving;
        self.times[n].serving = Some(now);
        let config = match self.roles[n] {
            NodeRole::Decode => &self.decode_node,
            _ => &self.prefill.as_ref().expect("checked at the start").node,
        };
        let mut e = entry(n, self.roles[n], config);
        e.load = self.nodes[n].load();
        self.candidates.add(e);
        self.keep_candidates();
        self.record_counts(now);
    }

    /// A starting node is not wanted after all: it goes at once.
    pub(super) fn cancel(&mut self, n: usize, now: Duration) {
        debug_assert_eq!(self.life[n], Life::Starting);
        self.gone(n, now);
    }

    /// Node `n` stops taking requests and goes once it holds none; with `into`, a node of
    /// that role then starts on its machine.
    pub(super) fn drain(&mut self, n: usize, into: Option<NodeRole>, now: Duration) {
        debug_assert_eq!(self.life[n], Life::Serving);
        self.life[n] = Life::Draining { into };
        self.leave_routing(n);
        self.record_counts(now);
        self.settle(n, now);
    }

    /// A draining node that has finished everything is gone (a switching one restarts in its
    /// new role); a prefill node waits for its last KV to leave.
    pub(super) fn settle(&mut self, n: usize, now: Duration) {
        let Life::Draining { into } = self.life[n] else {
            return;
        };
        if self.nodes[n].has_work() {
            return;
        }
        if self.roles[n] != NodeRole::Decode {
            // Requests routed to it whose decode node has not yet handed it the prompt.
            if self.live.iter().flatten().any(|l| l.prefill == Some(n)) {
                return;
            }
            if self.sending_until[n] > now {
                self.queue.push_at(self.sending_until[n], Event::Drained(n));
                return;
            }
        }
        self.gone(n, now);
        if let Some(role) = into {
            self.add_node(role, now, self.switch_delay);
        }
    }

    /// A scripted change: `changes[k]` happens.
    pub(super) fn change(&mut self, k: usize, now: Duration) {
        match self.changes[k].kind {
            ChangeKind::Add(role) => {
                self.add_node(node_role(role), now, self.startup);
                self.ledger_mut().nodes_requested += 1;
            }
            ChangeKind::Drain(n) | ChangeKind::Switch(n) => {
                let n = n.0 as usize;
                if self.life[n] != Life::Serving {
                    return;
                }
                let into = match self.changes[k].kind {
                    ChangeKind::Switch(_) => Some(other(self.roles[n])),
                    _ => None,
                };
                let ledger = self.ledger_mut();
                match into {
                    Some(_) => ledger.role_switches += 1,
                    None => ledger.nodes_drained += 1,
                }
                self.drain(n, into, now);
            }
        }
    }

    /// Node `n` has left the mesh (and the bill).
    pub(super) fn gone(&mut self, n: usize, now: Duration) {
        self.life[n] = Life::Gone;
        self.times[n].left = Some(now);
        self.record_counts(now);
    }

    /// Nodes of `role` serving, starting, or switching into it: what the role will have
    /// when every change under way is done.
    pub(super) fn provisioned(&self, role: NodeRole) -> u32 {
        let mut count = 0;
        for (r, life) in self.roles.iter().zip(&self.life) {
            let counts = match life {
                Life::Starting | Life::Serving => *r == role,
                Life::Draining { into } => *into == Some(role),
                Life::Gone => false,
            };
            count += u32::from(counts);
        }
        count
    }

    /// Serving nodes of `role`.
    pub(super) fn serving(&self, role: NodeRole) -> impl Iterator<Item = usize> + '_ {
        (0..self.nodes.len())
            .filter(move |&n| self.roles[n] == role && self.life[n] == Life::Serving)
    }

    pub(super) fn ledger_mut(&mut self) -> &mut AutoscaleReport {
        self.ledger
            .as_mut()
            .expect("a mesh whose nodes change keeps a ledger")
    }

    /// Notes the node counts in the planner's timeline.
    pub(super) fn record_counts(&mut self, now: Duration) {
        let Some(ledger) = self.ledger.as_mut() else {
            return;
        };
        let mut c = CountsAt {
            at_s: now.as_secs_f64(),
            prefill_serving: 0,
            decode_serving: 0,
            prefill_billed: 0,
            decode_billed: 0,
        };
        for (r, life) in self.roles.iter().zip(&self.life) {
            let decode = *r == NodeRole::Decode;
            let (serving, billed) = if decode {
                (&mut c.decode_serving, &mut c.decode_billed)
            } else {
                (&mut c.prefill_serving, &mut c.prefill_billed)
            };
            *serving += u32::from(*life == Life::Serving);
            *billed += u32::from(*life != Life::Gone);
        }
        ledger.counts(c);
    }
}
