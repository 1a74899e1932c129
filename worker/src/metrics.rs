//! The metrics every engine-owning worker (prefill or decode) reports, through the `metrics`
//! facade (the process that serves `/metrics` installs the recorder, before it starts its
//! workers). Names and histogram buckets come from `kvmesh_common::metrics`; labels are `node`
//! and `role`. Several workers of one process share each metric family under their own
//! labels.

use kvmesh_common::kv_tier::Tier;
use kvmesh_common::metrics as names;
use kvmesh_common::NodeId;
use kvmesh_engine::block_pool::BlockPool;
use metrics::{
    counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram, Counter,
    Gauge, Histogram,
};

/// The tiers below the pool, with their label values.
const LOWER_TIERS: [(Tier, &str); 2] = [(Tier::Host, "host"), (Tier::Disk, "disk")];

/// Gives every worker metric its help text (describing again changes nothing).
pub fn describe() {
    describe_histogram!(
        names::WORKER_QUEUE_SECONDS,
        "Time from a request's arrival at a worker to its first KV blocks."
    );
    describe_gauge!(
        names::WORKER_REQUESTS_RUNNING,
        "Requests holding KV blocks (decoding, prefilling or awaiting KV)."
    );
    describe_gauge!(
        names::WORKER_REQUESTS_WAITING,
        "Requests queued for KV blocks."
    );
    describe_gauge!(names::WORKER_KV_BLOCKS_USED, "KV blocks in use.");
    describe_gauge!(names::WORKER_KV_BLOCKS_TOTAL, "KV blocks in the pool.");
    describe_counter!(
        names::WORKER_PREFIX_QUERIED_TOKENS_TOTAL,
        "Prompt tokens looked up in the prefix cache."
    );
    describe_counter!(
        names::WORKER_PREFIX_HIT_TOKENS_TOTAL,
        "Prompt tokens served from the prefix cache."
    );
    describe_counter!(
        names::WORKER_PREEMPTIONS_TOTAL,
        "Sequences preempted (KV freed, to be recomputed)."
    );
    describe_counter!(
        names::WORKER_ENGINE_STEPS_TOTAL,
        "Engine steps that ran the model (one forward pass over the batch each)."
    );
    describe_counter!(
        names::WORKER_GENERATED_TOKENS_TOTAL,
        "Tokens generated: drawn, and forced by a structured-output format."
    );
    describe_counter!(
        names::TRANSFER_BYTES_TOTAL,
        "KV bytes sent (prefill) or received intact (decode)."
    );
    describe_histogram!(
        names::TRANSFER_SECONDS,
        "Time from asking a prefill worker for a prompt to having all of its KV."
    );
    describe_counter!(
        names::WORKER_KV_PULLED_BLOCKS_TOTAL,
        "Prefix blocks pulled from another node's cache instead of recomputed."
    );
    describe_counter!(
        names::WORKER_KV_PULLED_BYTES_TOTAL,
        "KV bytes pulled from other nodes' caches."
    );
    describe_counter!(
        names::WORKER_KV_PULL_FAILURES_TOTAL,
        "Pulls that fell back to recomputing the blocks."
    );
    describe_counter!(
        names::WORKER_KV_EXPORTED_BLOCKS_TOTAL,
        "Cached blocks sent to other nodes that pulled them."
    );
    describe_gauge!(
        names::WORKER_KV_TIER_BLOCKS,
        "Prefix-cache blocks held in a tier below the KV pool."
    );
    describe_counter!(
        names::WORKER_KV_TIER_PROMOTED_BLOCKS_TOTAL,
        "Prefix hits served from a tier below the KV pool, in blocks."
    );
}

/// A counter that follows a running total kept elsewhere (a pool's or a publisher's stats),
/// remembering the total it last caught up to.
#[derive(Clone, Debug)]
pub struct TotalCounter {
    counter: Counter,
    seen: u64,
}

impl TotalCounter {
    pub fn new(counter: Counter) -> Self {
        TotalCounter { counter, seen: 0 }
    }

    /// Moves the counter up to `total`.
    pub fn catch_up(&mut self, total: u64) {
        self.counter.increment(total.saturating_sub(self.seen));
        self.seen = self.seen.max(total);
    }

    /// Counts from `total` on: what is below it was counted elsewhere (by the worker that
    /// ran the same engine in the other role).
    pub fn count_from(&mut self, total: u64) {
        self.seen = self.seen.max(total);
    }
}

/// One lower tier's metrics.
#[derive(Clone, Debug)]
struct TierMetrics {
    tier: Tier,
    blocks: Gauge,
    promoted: TotalCounter,
}

/// One worker's handles on the metric families (taken, and so listed by scrapes, at once).
#[derive(Clone, Debug)]
pub struct WorkerMetrics {
    pub queue_seconds: Histogram,
    pub running: Gauge,
    pub waiting: Gauge,
    pub kv_blocks_used: Gauge,
    pub kv_blocks_total: Gauge,
    pub prefix_queried_tokens: Counter,
    pub prefix_hit_tokens: Counter,
    pub preemptions: Counter,
    pub engine_steps: Counter,
    pub generated_tokens: Counter,
    pub transfer_bytes: Counter,
    pub transfer_seconds: Histogram,
    pub kv_pulled_blocks: Counter,
    pub kv_pulled_bytes: Counter,
    pub kv_pull_failures: Counter,
    pub kv_exported_blocks: Counter,
    /// Per lower tier (host, disk): blocks held, and hits promoted from it.
    tiers: [TierMetrics; 2],
}

impl WorkerMetrics {
    /// `role` is `"prefill"` or `"decode"`.
    pub fn new(node: NodeId, role: &'static str) -> Self {
        describe();
        let node = node.to_string();
        let labels = [("node", node.clone()), ("role", role.to_string())];
        WorkerMetrics {
            queue_seconds: histogram!(names::WORKER_QUEUE_SECONDS, &labels),
            running: gauge!(names::WORKER_REQUESTS_RUNNING, &labels),
            waiting: gauge!(names::WORKER_REQUESTS_WAITING, &labels),
            kv_blocks_used: gauge!(names::WORKER_KV_BLOCKS_USED, &labels),
            kv_blocks_total: gauge!(names::WORKER_KV_BLOCKS_TOTAL, &labels),
            prefix_queried_tokens: counter!(names::WORKER_PREFIX_QUERIED_TOKENS_TOTAL, &labels),
            prefix_hit_tokens: counter!(names::WORKER_PREFIX_HIT_TOKENS_TOTAL, &labels),
            preemptions: counter!(names::WORKER_PREEMPTIONS_TOTAL, &labels),
            engine_steps: counter!(names::WORKER_ENGINE_STEPS_TOTAL, &labels),
            generated_tokens: counter!(names::WORKER_GENERATED_TOKENS_TOTAL, &labels),
            transfer_bytes: counter!(names::TRANSFER_BYTES_TOTAL, &labels),
            transfer_seconds: histogram!(names::TRANSFER_SECONDS, &labels),
            kv_pulled_blocks: counter!(names::WORKER_KV_PULLED_BLOCKS_TOTAL, &labels),
            kv_pulled_bytes: counter!(names::WORKER_KV_PULLED_BYTES_TOTAL, &labels),
            kv_pull_failures: counter!(names::WORKER_KV_PULL_FAILURES_TOTAL, &labels),
            kv_exported_blocks: counter!(names::WORKER_KV_EXPORTED_BLOCKS_TOTAL, &labels),
            tiers: LOWER_TIERS.map(|(tier, name)| {
                let labels = [
                    ("node", node.clone()),
                    ("role", role.to_string()),
                    ("tier", name.to_string()),
                ];
                TierMetrics {
                    tier,
                    blocks: gauge!(names::WORKER_KV_TIER_BLOCKS, &labels),
                    promoted: TotalCounter::new(counter!(
                        names::WORKER_KV_TIER_PROMOTED_BLOCKS_TOTAL,
                        &labels
                    )),
                }
            }),
        }
    }

    /// Counts tier promotions from `pool`'s totals as they are now.
    pub fn count_tiers_from(&mut self, pool: &BlockPool) {
        for t in &mut self.tiers {
            t.promoted.count_from(pool.num_promoted(t.tier));
        }
    }

    /// Zeroes the gauges of a worker that handed its engine to the other role's worker, so
    /// the node's series of the role it left do not count its pool twice.
    pub fn retire(&self) {
        for g in [
            &self.running,
            &self.waiting,
            &self.kv_blocks_used,
            &self.kv_blocks_total,
        ] {
            g.set(0.0);
        }
        for t in &self.tiers {
            t.blocks.set(0.0);
        }
    }

    /// Brings the tier metrics up to `pool`'s state (one caller, the load publisher, keeps
    /// the totals it has seen).
    pub fn observe_tiers(&mut self, pool: &BlockPool) {
        for t in &mut self.tiers {
            let held = match t.tier {
                Tier::Host => pool.num_host_cached(),
                _ => pool.num_disk_cached(),
            };
            t.blocks.set(held as f64);
            t.promoted.catch_up(pool.num_promoted(t.tier));
        }
    }
}
