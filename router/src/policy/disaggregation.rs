//! Conditional disaggregation: whether a prompt is worth a prefill node. A short uncached
//! part prefills on the decode node faster than the KV could be shipped, and queuing behind
//! busy prefill nodes costs more time than prefilling locally.

use crate::ConfigError;
use kvmesh_common::fast_hash::U64Map;
use kvmesh_common::NodeId;
use kvmesh_kvstore::NodeEntry;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DisaggConfig {
    /// Prompts with at most this many tokens not cached on the decode node prefill there.
    pub local_prefill_max_tokens: usize,
    /// A prefill node with this many requests queued (waiting + this router's in flight)
    /// counts as busy. At least 1.
    pub prefill_busy_threshold: usize,
    /// Name another node to pull cached prefix blocks from when it holds at least this many
    /// more of the prompt than the chosen decode node (0: never pull).
    pub pull_min_blocks: usize,
}

impl Default for DisaggConfig {
    fn default() -> Self {
        DisaggConfig {
            local_prefill_max_tokens: 256,
            prefill_busy_threshold: 8,
            // 64 tokens: below that a pull's round trip is about what recomputing costs.
            pull_min_blocks: 4,
        }
    }
}

impl DisaggConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.prefill_busy_threshold == 0 {
            return Err(ConfigError {
                field: "disaggregation.prefill_busy_threshold",
                reason: "must be at least 1",
            });
        }
        Ok(())
    }
}

/// True when the request should prefill on a prefill node: the part of the prompt the
/// chosen decode node has not cached (`uncached_tokens`) is long, and some prefill node is
/// not busy. `in_flight` counts requests this router sent to a node that its last report
/// may not show yet (missing = 0).
pub fn should_prefill_remotely(
    uncached_tokens: usize,
    prefill_nodes: &[NodeEntry],
    in_flight: &U64Map<NodeId, usize>,
    config: &DisaggConfig,
) -> bool {
    if uncached_tokens <= config.local_prefill_max_tokens {
        return false;
    }
    prefill_nodes.iter().any(|n| {
        let queued = n.load.waiting + in_flight.get(&n.info.node_id).copied().unwrap_or(0);
        queued < config.prefill_busy_threshold
    })
}

/// [`should_prefill_remotely`] for a caller that knows the shortest queue (waiting + in
/// flight) among the prefill nodes, `None` when there are none: some node is not busy exactly
/// when the least busy one is not.
pub fn prefill_remotely_given(
    uncached_tokens: usize,
    least_queue: Option<usize>,
    config: &DisaggConfig,
) -> bool {
    uncached_tokens > config.local_prefill_max_tokens
        && least_queue.is_some_and(|q| q < config.prefill_busy_threshold)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::node;

    /// The rule over `nodes`, checked against the rule given their shortest queue.
    fn remote(uncached: usize, nodes: &[NodeEntry], in_flight: &[(u64, usize)]) -> bool {
        let in_flight: U64Map<_, _> = in_flight.iter().map(|&(id, n)| (NodeId(id), n)).collect();
        let config = DisaggConfig::default();
        let queue = |n: &NodeEntry| n.load.waiting + in_flight.get(&n.info.node_id).unwrap_or(&0);
        let least = nodes.iter().map(queue).min();
        let remote = should_prefill_remotely(uncached, nodes, &in_flight, &config);
        assert_eq!(remote, prefill_remotely_given(uncached, least, &config));
        remote
    }

    #[test]
    fn short_uncached_part_prefills_locally() {
        let idle = [node(1, 0, 0, 0)];
        assert!(!remote(0, &idle, &[]));
        assert!(!remote(256, &idle, &[]));
        assert!(remote(257, &idle, &[]));
    }

    #[test]
    fn local_when_every_prefill_node_is_busy_or_none_exists() {
        assert!(!remote(4096, &[], &[]));
        // Running requests are the prefill batch; only the queue behind it counts.
        let nodes = [node(1, 30, 8, 0), node(2, 4, 7, 0)];
        assert!(remote(4096, &nodes, &[]));
        assert!(!remote(4096, &nodes, &[(2, 1)]));
        assert!(!remote(4096, &[node(1, 0, 9, 0)], &[]));
    }

    #[test]
    fn threshold_must_be_positive() {
        DisaggConfig::default().validate().unwrap();
        let c = DisaggConfig {
            prefill_busy_threshold: 0,
            ..DisaggConfig::default()
        };
        assert!(c.validate().is_err());
        assert!(serde_json::from_str::<DisaggConfig>(r#"{"local_prefill_max": 1}"#).is_err());
    }
}
