//! The `etcd` actuator: for an external orchestrator. Each decision to act is written as the
//! desired counts at `/{cluster}/planner/desired` (JSON, with a generation that grows by one
//! per write); the orchestrator writes the generation it has carried out at
//! `/{cluster}/planner/ack`. The planner never waits on it: the next observation shows the
//! actual counts, and the lag is logged and exported.

use super::actuator::{Actuator, Move};
use anyhow::{Context, Result};
use kvmesh_kvstore::Leadership;
use kvmesh_planner::Decision;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// What `/{cluster}/planner/desired` holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Desired {
    pub generation: u64,
    pub prefill: u32,
    pub decode: u32,
    pub prefill_to_decode: u32,
    pub decode_to_prefill: u32,
    /// Node ids (hex) the planner would drain or switch, least loaded first: a hint.
    pub drain: Vec<String>,
    pub switch: Vec<String>,
}

pub struct EtcdActuator {
    leadership: Arc<Leadership>,
    generation: u64,
}

impl EtcdActuator {
    /// Continues from the generation already in etcd (a new leader goes on from its
    /// predecessor's).
    pub async fn new(leadership: Arc<Leadership>) -> Result<Self> {
        let generation = match leadership.get("desired").await? {
            Some(json) => {
                serde_json::from_str::<Desired>(&json)
                    .context("the desired counts in etcd")?
                    .generation
            }
            None => 0,
        };
        Ok(EtcdActuator {
            leadership,
            generation,
        })
    }

    /// The generation the orchestrator last acknowledged.
    pub async fn acknowledged(&self) -> Result<Option<u64>> {
        Ok(match self.leadership.get("ack").await? {
            Some(s) => Some(s.trim().parse().context("the planner ack in etcd")?),
            None => None,
        })
    }
}

#[kvmesh_router::async_trait]
impl Actuator for EtcdActuator {
    fn name(&self) -> &'static str {
        "etcd"
    }

    async fn apply(&mut self, decision: &Decision, moves: &[Move]) -> Result<()> {
        let ids = |pick: fn(&Move) -> Option<&kvmesh_kvstore::NodeEntry>| {
            moves
                .iter()
                .filter_map(pick)
                .map(|n| n.info.node_id.to_string())
                .collect()
        };
        let desired = Desired {
            generation: self.generation + 1,
            prefill: decision.prefill.target,
            decode: decision.decode.target,
            prefill_to_decode: decision.switches.prefill_to_decode,
            decode_to_prefill: decision.switches.decode_to_prefill,
            drain: ids(|m| match m {
                Move::Drain(n) => Some(n),
                _ => None,
            }),
            switch: ids(|m| match m {
                Move::Switch { node, .. } => Some(node),
                _ => None,
            }),
        };
        let json = serde_json::to_string(&desired).expect("Desired serializes");
        self.leadership.put("desired", json).await?;
        self.generation = desired.generation;
        let ack = self.acknowledged().await?;
        if ack.is_some_and(|a| a + 1 < self.generation) {
            tracing::warn!(
                generation = self.generation,
                acknowledged = ack,
                "the orchestrator is behind the planner's desired counts"
            );
        }
        Ok(())
    }
}
