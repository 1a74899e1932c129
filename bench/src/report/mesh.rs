//! What a mesh did over a run, node by node: how busy each node was, how full its KV cache,
//! what moved between nodes and how much of the prompts the prefix caches served. The
//! simulator (`kvmesh-sim`) fills it for every run; a real `bench serve` run, which sees the
//! mesh only from outside, leaves it out. Field by field: `docs/bench-report.md`.

use serde::{Deserialize, Serialize};

/// The mesh over one run (one [`super::Point`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MeshStats {
    /// Every node, decode nodes first, by id.
    pub nodes: Vec<NodeStats>,
    /// KV bytes moved from prefill nodes to decode nodes.
    pub kv_bytes_transferred: u64,
    /// Prefills computed on a prefill node for a decode node.
    pub remote_prefills: u64,
    /// Times a request moved to another decode node after its node died (one request may
    /// move more than once).
    pub migrations: u64,
    /// Prefix-cache hits over every admission on every node.
    pub prefix_cache: PrefixCacheStats,
}

/// One node over the run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeStats {
    /// Its node id.
    pub id: u64,
    /// `decode` or `prefill`.
    pub role: String,
    /// Requests that were routed to it (a migrated request counts on every node it ran on;
    /// a remote prefill counts on its prefill node and its decode node).
    pub requests: u64,
    /// Forward passes it ran (a step cut short by its death included).
    pub steps: u64,
    /// Busy time over its lifetime (the run, or up to its death), in [0, 1].
    pub utilization: f64,
    /// Fraction of its KV blocks in use (held by a sequence), averaged over its lifetime.
    pub kv_usage_mean: f64,
    /// The largest fraction of its KV blocks in use at once.
    pub kv_usage_peak: f64,
    /// KV blocks in its pool.
    pub kv_blocks: u64,
    /// Sequences it preempted (their KV freed, to recompute later).
    pub preemptions: u64,
    /// When it died, from the run's start; `None` if it lived to the end.
    pub died_at_s: Option<f64>,
}

/// Prompt tokens served from each tier of the prefix cache instead of being computed.
///
/// Counted at every admission of a sequence: its first, a re-admission after preemption, a
/// migrated request's admission on its new node, and both halves of a remote prefill (the
/// prefill node computes what it does not hold, the decode node reserves what it does not
/// hold). A re-admitted or migrated sequence looks up its generated tokens too. At most all
/// but the last token of an admission is a hit, so the three rates sum to less than 1.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PrefixCacheStats {
    /// Tokens of the sequences admitted (the lookups).
    pub lookup_tokens: u64,
    /// Of those, held in the device pool.
    pub device_tokens: u64,
    /// Copied back from the host-memory tier.
    pub host_tokens: u64,
    /// Read back from the disk tier.
    pub disk_tokens: u64,
    /// `device_tokens / lookup_tokens`; `None` with no lookup.
    pub device_rate: Option<f64>,
    pub host_rate: Option<f64>,
    pub disk_rate: Option<f64>,
}

impl PrefixCacheStats {
    /// From token counts, with the rates they give.
    pub fn new(lookup_tokens: u64, device: u64, host: u64, disk: u64) -> PrefixCacheStats {
        let rate = |n: u64| (lookup_tokens > 0).then(|| n as f64 / lookup_tokens as f64);
        PrefixCacheStats {
            lookup_tokens,
            device_tokens: device,
            host_tokens: host,
            disk_tokens: disk,
            device_rate: rate(device),
            host_rate: rate(host),
            disk_rate: rate(disk),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_shares_of_the_lookups() {
        let p = PrefixCacheStats::new(200, 100, 50, 10);
        assert_eq!(p.device_rate, Some(0.5));
        assert_eq!(p.host_rate, Some(0.25));
        assert_eq!(p.disk_rate, Some(0.05));
        assert_eq!(PrefixCacheStats::new(0, 0, 0, 0).device_rate, None);
    }
}
