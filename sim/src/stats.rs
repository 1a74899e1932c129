//! What the simulator counts per node as a run goes, for bench's [`MeshStats`]: time-weighted
//! KV usage and prefix-cache hits by tier. Integer counts throughout (block-nanoseconds,
//! tokens), so a run's statistics do not depend on the order of float additions.

use kvmesh_bench::report::{MeshStats, NodeStats, PrefixCacheStats};
use std::time::Duration;

/// KV blocks in use over time: the integral of the used count and its peak.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KvUsage {
    /// When `used` was last observed.
    since: Duration,
    used: usize,
    /// Sum of used blocks × nanoseconds up to `since`.
    block_nanos: u128,
    peak: usize,
}

impl KvUsage {
    /// `used` blocks are in use from `now` on (the count held since the last observation
    /// until now).
    pub fn observe(&mut self, now: Duration, used: usize) {
        self.block_nanos += self.used as u128 * now.saturating_sub(self.since).as_nanos();
        self.since = self.since.max(now);
        self.used = used;
        self.peak = self.peak.max(used);
    }

    /// The mean fraction of `blocks` in use over `0..until`, in [0, 1]. Observations after
    /// `until` (a node's last step running past the run's end) are cut off at 1.
    pub fn mean(&self, until: Duration, blocks: usize) -> f64 {
        self.mean_over(Duration::ZERO, until, blocks)
    }

    /// The mean fraction of `blocks` in use over `from..until`, for a node that joined at
    /// `from` (it held nothing before).
    pub fn mean_over(&self, from: Duration, until: Duration, blocks: usize) -> f64 {
        let span = until.saturating_sub(from);
        if span.is_zero() || blocks == 0 {
            return 0.0;
        }
        let tail = self.used as u128 * until.saturating_sub(self.since).as_nanos();
        let total = (self.block_nanos + tail) as f64;
        (total / (blocks as f64 * span.as_nanos() as f64)).min(1.0)
    }

    /// The peak fraction of `blocks` in use.
    pub fn peak(&self, blocks: usize) -> f64 {
        if blocks == 0 {
            return 0.0;
        }
        self.peak as f64 / blocks as f64
    }
}

/// Prefix-cache lookups and hits by tier, in tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixTally {
    pub lookup: u64,
    pub device: u64,
    pub host: u64,
    pub disk: u64,
}

impl PrefixTally {
    pub fn add(&mut self, other: &PrefixTally) {
        self.lookup += other.lookup;
        self.device += other.device;
        self.host += other.host;
        self.disk += other.disk;
    }

    pub fn stats(&self) -> PrefixCacheStats {
        PrefixCacheStats::new(self.lookup, self.device, self.host, self.disk)
    }
}

/// One node's share of a run's [`MeshStats`], as the mesh gathers it at the end.
#[derive(Clone, Debug)]
pub struct NodeTotals {
    pub id: u64,
    pub role: &'static str,
    pub requests: u64,
    pub steps: u64,
    pub busy: Duration,
    pub kv: KvUsage,
    pub kv_blocks: usize,
    pub preemptions: u64,
    pub prefix: PrefixTally,
    pub died_at: Option<Duration>,
    /// When it joined the mesh (0 for the nodes it starts with; a planner adds others).
    pub joined_at: Duration,
    /// When it left without dying (drained away by a planner).
    pub left_at: Option<Duration>,
}

impl NodeTotals {
    /// The node over a run of `duration` (its lifetime runs from its joining to the end, its
    /// leaving or its death, whichever is first).
    pub fn stats(&self, duration: Duration) -> NodeStats {
        let end = [Some(duration), self.died_at, self.left_at]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(duration);
        let lifetime = end.saturating_sub(self.joined_at);
        let utilization = if lifetime.is_zero() {
            0.0
        } else {
            (self.busy.as_secs_f64() / lifetime.as_secs_f64()).min(1.0)
        };
        NodeStats {
            id: self.id,
            role: self.role.into(),
            requests: self.requests,
            steps: self.steps,
            utilization,
            kv_usage_mean: self.kv.mean_over(self.joined_at, end, self.kv_blocks),
            kv_usage_peak: self.kv.peak(self.kv_blocks),
            kv_blocks: self.kv_blocks as u64,
            preemptions: self.preemptions,
            died_at_s: self.died_at.map(|d| d.as_secs_f64()),
        }
    }
}

/// A run's [`MeshStats`] from its nodes' totals and the mesh's own counts.
pub fn mesh_stats(
    nodes: &[NodeTotals],
    duration: Duration,
    kv_bytes_transferred: u64,
    remote_prefills: u64,
    migrations: u64,
) -> MeshStats {
    let mut prefix = PrefixTally::default();
    for n in nodes {
        prefix.add(&n.prefix);
    }
    MeshStats {
        nodes: nodes.iter().map(|n| n.stats(duration)).collect(),
        kv_bytes_transferred,
        remote_prefills,
        migrations,
        prefix_cache: prefix.stats(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn usage_is_weighted_by_how_long_it_lasts() {
        let mut kv = KvUsage::default();
        kv.observe(Duration::ZERO, 10);
        kv.observe(10 * MS, 30);
        kv.observe(20 * MS, 0);
        // 10 blocks for 10 ms, 30 for 10 ms, none for 20 ms: 400 block-ms over 40 ms.
        assert_eq!(kv.mean(40 * MS, 100), 0.1);
        assert_eq!(kv.peak(100), 0.3);
        // Still held at the end: the tail counts.
        kv.observe(30 * MS, 50);
        assert_eq!(kv.mean(40 * MS, 100), 0.225);
        assert_eq!(kv.mean(Duration::ZERO, 100), 0.0);
    }

    #[test]
    fn utilization_is_busy_time_over_lifetime() {
        let node = NodeTotals {
            id: 3,
            role: "decode",
            requests: 1,
            steps: 2,
            busy: 250 * MS,
            kv: KvUsage::default(),
            kv_blocks: 8,
            preemptions: 0,
            prefix: PrefixTally::default(),
            died_at: Some(500 * MS),
            joined_at: Duration::ZERO,
            left_at: None,
        };
        let s = node.stats(1000 * MS);
        assert_eq!(s.utilization, 0.5, "over its 500 ms of life");
        assert_eq!(s.died_at_s, Some(0.5));
        let alive = NodeTotals {
            died_at: None,
            ..node
        };
        assert_eq!(alive.stats(1000 * MS).utilization, 0.25);
    }
}
