//! A decode worker's own settings (its engine is configured where it is built).

use kvmesh_common::kv_tier::KvEventSink;
use kvmesh_common::NodeId;
use std::sync::Arc;
use std::time::Duration;

#[derive(Clone, Debug)]
pub struct DecodeConfig {
    pub node_id: NodeId,
    /// A prompt whose uncached part (after this node's prefix-cache hits) is shorter than this
    /// is prefilled here even when a prefill worker is offered. Default 256: up to that size a
    /// prompt fits in one step next to the running decodes, costing them about one slower
    /// step, while a remote prefill costs a round trip, a queue at the prefill worker and a
    /// transfer of every layer; above it, local prefill chunks start to stretch inter-token
    /// latency for everyone, which is what disaggregation exists to avoid.
    pub local_prefill_max_tokens: usize,
    /// Requests accepted but not yet holding KV blocks; more are refused with `Overloaded`
    /// (the router answers 429).
    pub max_queued_requests: usize,
    /// How long a remote prefill may stay silent (from the reservation of its blocks, then
    /// from each KV chunk that arrives) before its blocks are released and the prompt is
    /// prefilled here.
    pub remote_prefill_timeout: Duration,
    /// How long a request waits for its prefix to be pulled from another node before it
    /// recomputes it instead.
    pub pull_timeout: Duration,
    /// How long serving one pull from another node may hold up this node's engine (it runs
    /// between two steps) before the transfer counts as failed.
    pub export_timeout: Duration,
    /// Lets the prefill worker of a request pull the prompt's prefix this node holds (when it
    /// lacks it and pulling beats recomputing) instead of recomputing it.
    pub prefill_pulls: bool,
    /// Where this node announces its prefix-cache changes (none: not announced).
    pub kv_events: Option<Arc<dyn KvEventSink>>,
    /// How long an idle worker, woken by a request, waits for others before its first step
    /// (default [`kvmesh_worker::GATHER_WINDOW`]; zero: not at all).
    pub gather_window: Duration,
}

impl DecodeConfig {
    pub fn new(node_id: NodeId) -> Self {
        DecodeConfig {
            node_id,
            local_prefill_max_tokens: 256,
            max_queued_requests: 256,
            remote_prefill_timeout: Duration::from_secs(10),
            pull_timeout: Duration::from_secs(2),
            export_timeout: Duration::from_secs(1),
            prefill_pulls: true,
            kv_events: None,
            gather_window: kvmesh_worker::GATHER_WINDOW,
        }
    }
}
