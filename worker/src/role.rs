//! Switching a node between the prefill and decode roles in place. Two role-free pieces:
//! the node's role state (a pure state machine: what it serves, and whether a switch or a
//! shutdown may start now), and the hand-back of a worker's engine when its thread exits,
//! so the other role's worker takes over the loaded weights and the warm KV pool instead of
//! loading the model again.

use crossbeam_channel::{Receiver, Sender};
use kvmesh_common::NodeRole;
use kvmesh_engine::llm_engine::LlmEngine;
use kvmesh_engine::runner::ModelRunner;

/// Where a node stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RoleState {
    Serving(NodeRole),
    /// Finishing `from`'s requests, then starting `to`: neither role takes requests.
    Switching {
        from: NodeRole,
        to: NodeRole,
    },
    /// Draining for shutdown (a signal or `Drain`): no more switches.
    ShuttingDown,
}

/// Why a switch cannot start (or finish).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SwitchError {
    #[error("{} is not a role a node can serve (prefill or decode)", .0.as_str())]
    NotAWorkerRole(NodeRole),
    #[error("a switch from {} to {} is in progress", .from.as_str(), .to.as_str())]
    InProgress { from: NodeRole, to: NodeRole },
    #[error("the node is draining for shutdown")]
    ShuttingDown,
}

/// What an accepted switch request asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SwitchPlan {
    /// The node already serves the role: nothing to do.
    AlreadyServing(NodeRole),
    Switch {
        from: NodeRole,
        to: NodeRole,
    },
}

/// A node's role over its life. Every transition is a method; the node's driver does the
/// I/O each one calls for.
#[derive(Debug)]
pub struct RoleMachine {
    state: RoleState,
}

impl RoleMachine {
    /// A node starting in `role`.
    pub fn new(role: NodeRole) -> Result<Self, SwitchError> {
        check_worker_role(role)?;
        Ok(RoleMachine {
            state: RoleState::Serving(role),
        })
    }

    pub fn state(&self) -> RoleState {
        self.state
    }

    /// The role whose requests the node takes now (none while switching or shutting down).
    pub fn serving(&self) -> Option<NodeRole> {
        match self.state {
            RoleState::Serving(role) => Some(role),
            _ => None,
        }
    }

    /// Asks to serve `to`. A node that already serves it stays as it is; one that serves the
    /// other role starts switching.
    pub fn begin_switch(&mut self, to: NodeRole) -> Result<SwitchPlan, SwitchError> {
        check_worker_role(to)?;
        match self.state {
            RoleState::Serving(from) if from == to => Ok(SwitchPlan::AlreadyServing(to)),
            RoleState::Serving(from) => {
                self.state = RoleState::Switching { from, to };
                Ok(SwitchPlan::Switch { from, to })
            }
            RoleState::Switching { from, to } => Err(SwitchError::InProgress { from, to }),
            RoleState::ShuttingDown => Err(SwitchError::ShuttingDown),
        }
    }

    /// The old role has drained: the node serves the new one from now on. Fails when a
    /// shutdown began meanwhile (the node then stops instead of starting the new role).
    pub fn finish_switch(&mut self) -> Result<NodeRole, SwitchError> {
        match self.state {
            RoleState::Switching { to, .. } => {
                self.state = RoleState::Serving(to);
                Ok(to)
            }
            RoleState::ShuttingDown => Err(SwitchError::ShuttingDown),
            RoleState::Serving(role) => {
                debug_assert!(false, "finish_switch without a switch");
                Ok(role)
            }
        }
    }

    /// Starts draining for shutdown, also in the middle of a switch. Returns whether this
    /// call started it.
    pub fn begin_shutdown(&mut self) -> bool {
        let first = self.state != RoleState::ShuttingDown;
        self.state = RoleState::ShuttingDown;
        first
    }
}

fn check_worker_role(role: NodeRole) -> Result<(), SwitchError> {
    match role {
        NodeRole::Prefill | NodeRole::Decode => Ok(()),
        NodeRole::Router => Err(SwitchError::NotAWorkerRole(role)),
    }
}

/// Where a worker's thread leaves its engine as it exits: after a drain, or after a stop
/// past the drain deadline; either way every request has ended and the engine is idle, its
/// prefix cache intact.
pub struct EngineReturn<R: ModelRunner>(Sender<LlmEngine<R>>);

impl<R: ModelRunner> EngineReturn<R> {
    pub fn give_back(self, engine: LlmEngine<R>) {
        // Nobody waiting (the node gave up on the switch): the engine is dropped.
        let _ = self.0.send(engine);
    }
}

/// A return slot for one worker's engine, and where it arrives.
pub fn engine_return<R: ModelRunner>() -> (EngineReturn<R>, Receiver<LlmEngine<R>>) {
    let (tx, rx) = crossbeam_channel::bounded(1);
    (EngineReturn(tx), rx)
}

#[cfg(test)]
mod tests {
    use super::*;
    use NodeRole::{Decode, Prefill, Router};

    #[test]
    fn a_switch_goes_through_switching_to_the_other_role_and_back() {
        let mut m = RoleMachine::new(Decode).unwrap();
        assert_eq!(m.serving(), Some(Decode));
        let plan = m.begin_switch(Prefill).unwrap();
        assert_eq!(
            plan,
            SwitchPlan::Switch {
                from: Decode,
                to: Prefill
            }
        );
        assert_eq!(m.serving(), None, "neither role is served mid-switch");
        assert_eq!(m.finish_switch(), Ok(Prefill));
        assert_eq!(m.serving(), Some(Prefill));
        assert!(matches!(
            m.begin_switch(Decode),
            Ok(SwitchPlan::Switch { .. })
        ));
        assert_eq!(m.finish_switch(), Ok(Decode));
        assert_eq!(m.state(), RoleState::Serving(Decode));
    }

    #[test]
    fn asking_for_the_role_it_serves_changes_nothing() {
        let mut m = RoleMachine::new(Prefill).unwrap();
        assert_eq!(
            m.begin_switch(Prefill),
            Ok(SwitchPlan::AlreadyServing(Prefill))
        );
        assert_eq!(m.state(), RoleState::Serving(Prefill));
    }

    #[test]
    fn a_second_switch_or_a_router_role_is_refused() {
        let mut m = RoleMachine::new(Decode).unwrap();
        assert_eq!(
            m.begin_switch(Router),
            Err(SwitchError::NotAWorkerRole(Router))
        );
        assert_eq!(
            RoleMachine::new(Router).unwrap_err(),
            SwitchError::NotAWorkerRole(Router)
        );
        m.begin_switch(Prefill).unwrap();
        let busy = SwitchError::InProgress {
            from: Decode,
            to: Prefill,
        };
        assert_eq!(m.begin_switch(Decode), Err(busy.clone()));
        assert_eq!(m.begin_switch(Prefill), Err(busy));
        assert_eq!(
            SwitchError::InProgress {
                from: Decode,
                to: Prefill
            }
            .to_string(),
            "a switch from decode to prefill is in progress"
        );
    }

    #[test]
    fn a_shutdown_wins_over_a_switch_before_and_during_it() {
        let mut m = RoleMachine::new(Decode).unwrap();
        m.begin_switch(Prefill).unwrap();
        assert!(m.begin_shutdown());
        assert!(!m.begin_shutdown(), "only the first call starts it");
        assert_eq!(m.finish_switch(), Err(SwitchError::ShuttingDown));
        assert_eq!(m.begin_switch(Decode), Err(SwitchError::ShuttingDown));
        assert_eq!(m.serving(), None);
    }

    #[test]
    fn an_engine_given_back_arrives_once() {
        let (back, rx) = engine_return::<kvmesh_engine::mock_runner::MockRunner>();
        drop(back);
        assert!(rx.recv().is_err(), "a thread that died gives nothing back");
    }
}
