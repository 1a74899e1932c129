//! The Prometheus metrics every engine-owning worker (prefill or decode) reports, in the
//! process-wide default registry. Names come from `kvmesh_common::metrics`; labels are `node`
//! and `role`. Several workers of one process share each metric family under their own
//! labels, so registration happens once, on first use (`describe` forces it at start-up).

use kvmesh_common::kv_tier::Tier;
use kvmesh_common::metrics as names;
use kvmesh_common::NodeId;
use kvmesh_engine::block_pool::BlockPool;
use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
};
use std::sync::OnceLock;

const LABELS: &[&str] = &["node", "role"];
const TIER_LABELS: &[&str] = &["node", "role", "tier"];
/// The tiers below the pool, with their label values.
const LOWER_TIERS: [(Tier, &str); 2] = [(Tier::Host, "host"), (Tier::Disk, "disk")];

struct Families {
    queue_seconds: HistogramVec,
    running: IntGaugeVec,
    waiting: IntGaugeVec,
    kv_used: IntGaugeVec,
    kv_total: IntGaugeVec,
    prefix_queried: IntCounterVec,
    prefix_hit: IntCounterVec,
    preemptions: IntCounterVec,
    transfer_bytes: IntCounterVec,
    transfer_seconds: HistogramVec,
    tier_blocks: IntGaugeVec,
    tier_promoted: IntCounterVec,
    pulled_blocks: IntCounterVec,
    pulled_bytes: IntCounterVec,
    pull_failures: IntCounterVec,
    exported_blocks: IntCounterVec,
}

fn register<C: prometheus::core::Collector + Clone + 'static>(c: C) -> C {
    if let Err(e) = prometheus::register(Box::new(c.clone())) {
        // Someone registered the name already (a second registry user in tests): keep
        // counting on our copy rather than failing the worker.
        tracing::warn!("metric registration: {e}");
    }
    c
}

fn gauge(name: &str, help: &str) -> IntGaugeVec {
    register(IntGaugeVec::new(Opts::new(name, help), LABELS).expect("valid metric"))
}

fn counter(name: &str, help: &str) -> IntCounterVec {
    register(IntCounterVec::new(Opts::new(name, help), LABELS).expect("valid metric"))
}

fn histogram(name: &str, help: &str, buckets: Vec<f64>) -> HistogramVec {
    let opts = HistogramOpts::new(name, help).buckets(buckets);
    register(HistogramVec::new(opts, LABELS).expect("valid metric"))
}

fn families() -> &'static Families {
    static F: OnceLock<Families> = OnceLock::new();
    F.get_or_init(|| {
        let latency = prometheus::exponential_buckets(0.001, 2.0, 16).expect("valid buckets");
        Families {
            queue_seconds: histogram(
                names::WORKER_QUEUE_SECONDS,
                "Time from a request's arrival at a worker to its first KV blocks.",
                latency.clone(),
            ),
            running: gauge(
                names::WORKER_REQUESTS_RUNNING,
                "Requests holding KV blocks (decoding, prefilling or awaiting KV).",
            ),
            waiting: gauge(
                names::WORKER_REQUESTS_WAITING,
                "Requests queued for KV blocks.",
            ),
            kv_used: gauge(names::WORKER_KV_BLOCKS_USED, "KV blocks in use."),
            kv_total: gauge(names::WORKER_KV_BLOCKS_TOTAL, "KV blocks in the pool."),
            prefix_queried: counter(
                names::WORKER_PREFIX_QUERIED_TOKENS_TOTAL,
                "Prompt tokens looked up in the prefix cache.",
            ),
            prefix_hit: counter(
                names::WORKER_PREFIX_HIT_TOKENS_TOTAL,
                "Prompt tokens served from the prefix cache.",
            ),
            preemptions: counter(
                names::WORKER_PREEMPTIONS_TOTAL,
                "Sequences preempted (KV freed, to be recomputed).",
            ),
            transfer_bytes: counter(
                names::TRANSFER_BYTES_TOTAL,
                "KV bytes sent (prefill) or received intact (decode).",
            ),
            transfer_seconds: histogram(
                names::TRANSFER_SECONDS,
                "Time from asking a prefill worker for a prompt to having all of its KV.",
                latency,
            ),
            pulled_blocks: counter(
                names::WORKER_KV_PULLED_BLOCKS_TOTAL,
                "Prefix blocks pulled from another node's cache instead of recomputed.",
            ),
            pulled_bytes: counter(
                names::WORKER_KV_PULLED_BYTES_TOTAL,
                "KV bytes pulled from other nodes' caches.",
            ),
            pull_failures: counter(
                names::WORKER_KV_PULL_FAILURES_TOTAL,
                "Pulls that fell back to recomputing the blocks.",
            ),
            exported_blocks: counter(
                names::WORKER_KV_EXPORTED_BLOCKS_TOTAL,
                "Cached blocks sent to other nodes that pulled them.",
            ),
            tier_blocks: register(
                IntGaugeVec::new(
                    Opts::new(
                        names::WORKER_KV_TIER_BLOCKS,
                        "Prefix-cache blocks held in a tier below the KV pool.",
                    ),
                    TIER_LABELS,
                )
                .expect("valid metric"),
            ),
            tier_promoted: register(
                IntCounterVec::new(
                    Opts::new(
                        names::WORKER_KV_TIER_PROMOTED_BLOCKS_TOTAL,
                        "Prefix hits served from a tier below the KV pool, in blocks.",
                    ),
                    TIER_LABELS,
                )
                .expect("valid metric"),
            ),
        }
    })
}

/// Registers every worker metric with its help text; call once at start-up so scrapes list
/// them before the first request.
pub fn describe() {
    families();
}

/// One worker's handles on the metric families.
#[derive(Clone, Debug)]
pub struct WorkerMetrics {
    pub queue_seconds: Histogram,
    pub running: IntGauge,
    pub waiting: IntGauge,
    pub kv_blocks_used: IntGauge,
    pub kv_blocks_total: IntGauge,
    pub prefix_queried_tokens: IntCounter,
    pub prefix_hit_tokens: IntCounter,
    pub preemptions: IntCounter,
    pub transfer_bytes: IntCounter,
    pub transfer_seconds: Histogram,
    pub kv_pulled_blocks: IntCounter,
    pub kv_pulled_bytes: IntCounter,
    pub kv_pull_failures: IntCounter,
    pub kv_exported_blocks: IntCounter,
    /// Per lower tier (host, disk): blocks held, and hits promoted from it.
    tiers: [(Tier, IntGauge, IntCounter); 2],
}

impl WorkerMetrics {
    /// `role` is `"prefill"` or `"decode"`.
    pub fn new(node: NodeId, role: &str) -> Self {
        let f = families();
        let node = node.to_string();
        let l = [node.as_str(), role];
        WorkerMetrics {
            queue_seconds: f.queue_seconds.with_label_values(&l),
            running: f.running.with_label_values(&l),
            waiting: f.waiting.with_label_values(&l),
            kv_blocks_used: f.kv_used.with_label_values(&l),
            kv_blocks_total: f.kv_total.with_label_values(&l),
            prefix_queried_tokens: f.prefix_queried.with_label_values(&l),
            prefix_hit_tokens: f.prefix_hit.with_label_values(&l),
            preemptions: f.preemptions.with_label_values(&l),
            transfer_bytes: f.transfer_bytes.with_label_values(&l),
            transfer_seconds: f.transfer_seconds.with_label_values(&l),
            kv_pulled_blocks: f.pulled_blocks.with_label_values(&l),
            kv_pulled_bytes: f.pulled_bytes.with_label_values(&l),
            kv_pull_failures: f.pull_failures.with_label_values(&l),
            kv_exported_blocks: f.exported_blocks.with_label_values(&l),
            tiers: LOWER_TIERS.map(|(tier, name)| {
                let l = [node.as_str(), role, name];
                (
                    tier,
                    f.tier_blocks.with_label_values(&l),
                    f.tier_promoted.with_label_values(&l),
                )
            }),
        }
    }

    /// Brings the tier metrics up to `pool`'s state.
    pub fn observe_tiers(&self, pool: &BlockPool) {
        for (tier, blocks, promoted) in &self.tiers {
            let held = match tier {
                Tier::Host => pool.num_host_cached(),
                _ => pool.num_disk_cached(),
            };
            blocks.set(held as i64);
            promoted.inc_by(pool.num_promoted(*tier).saturating_sub(promoted.get()));
        }
    }
}
