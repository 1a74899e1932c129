//! Every metric name in one place (`kvmesh_<component>_<name>_<unit>`; counters end in
//! `_total`, histograms in `_seconds`). Labels stay low-cardinality: `node`, `role`, `status`.

// Router (HTTP gateway).
pub const ROUTER_REQUESTS_TOTAL: &str = "kvmesh_router_requests_total";
pub const ROUTER_TTFT_SECONDS: &str = "kvmesh_router_ttft_seconds";
pub const ROUTER_ITL_SECONDS: &str = "kvmesh_router_inter_token_latency_seconds";
pub const ROUTER_E2E_SECONDS: &str = "kvmesh_router_e2e_latency_seconds";
pub const ROUTER_PROMPT_TOKENS_TOTAL: &str = "kvmesh_router_prompt_tokens_total";
/// Prompt tokens whose KV a node already held (its prefix cache, or pulled from another node).
pub const ROUTER_PROMPT_CACHED_TOKENS_TOTAL: &str = "kvmesh_router_prompt_cached_tokens_total";
pub const ROUTER_GENERATION_TOKENS_TOTAL: &str = "kvmesh_router_generation_tokens_total";
pub const ROUTER_REQUESTS_IN_FLIGHT: &str = "kvmesh_router_requests_in_flight";
pub const ROUTER_MIGRATIONS_TOTAL: &str = "kvmesh_router_migrations_total";
pub const ROUTER_DECODE_RETRIES_TOTAL: &str = "kvmesh_router_decode_retries_total";
/// Decode streams given up as hung: silent past their node's idle bound after a token.
pub const ROUTER_STALLED_STREAMS_TOTAL: &str = "kvmesh_router_stalled_streams_total";
/// Requests refused with 429 (label `reason`: queue_delay, in_flight, rate_limit,
/// backend_overloaded).
pub const ROUTER_REJECTED_TOTAL: &str = "kvmesh_router_rejected_requests_total";
/// Prompt tokens of admitted requests still waiting for their first token.
pub const ROUTER_ADMISSION_PENDING_TOKENS: &str = "kvmesh_router_admission_pending_tokens";
/// Admission control's estimate of a new request's time to first token.
pub const ROUTER_ADMISSION_ESTIMATED_TTFT_SECONDS: &str =
    "kvmesh_router_admission_estimated_ttft_seconds";
/// The share of the TTFT target admission control lets an estimate use (1 until admitted
/// requests break the target).
pub const ROUTER_ADMISSION_HEADROOM: &str = "kvmesh_router_admission_headroom";

// Workers (labels: node, role).
pub const WORKER_QUEUE_SECONDS: &str = "kvmesh_worker_queue_time_seconds";
pub const WORKER_REQUESTS_RUNNING: &str = "kvmesh_worker_requests_running";
pub const WORKER_REQUESTS_WAITING: &str = "kvmesh_worker_requests_waiting";
pub const WORKER_KV_BLOCKS_USED: &str = "kvmesh_worker_kv_blocks_used";
pub const WORKER_KV_BLOCKS_TOTAL: &str = "kvmesh_worker_kv_blocks_total";
pub const WORKER_PREFIX_QUERIED_TOKENS_TOTAL: &str =
    "kvmesh_worker_prefix_cache_queried_tokens_total";
pub const WORKER_PREFIX_HIT_TOKENS_TOTAL: &str = "kvmesh_worker_prefix_cache_hit_tokens_total";
/// Prefix-cache blocks held in a tier below the pool (label `tier`: host, disk).
pub const WORKER_KV_TIER_BLOCKS: &str = "kvmesh_worker_kv_tier_blocks";
/// Prefix hits served from a tier below the pool, in blocks copied back (label `tier`).
pub const WORKER_KV_TIER_PROMOTED_BLOCKS_TOTAL: &str =
    "kvmesh_worker_kv_tier_promoted_blocks_total";
/// Prefix blocks pulled from other nodes' caches instead of recomputed (decode workers).
pub const WORKER_KV_PULLED_BLOCKS_TOTAL: &str = "kvmesh_worker_kv_pulled_blocks_total";
pub const WORKER_KV_PULLED_BYTES_TOTAL: &str = "kvmesh_worker_kv_pulled_bytes_total";
/// Pulls that fell back to recomputing (the holder lacked the blocks, failed or was slow).
pub const WORKER_KV_PULL_FAILURES_TOTAL: &str = "kvmesh_worker_kv_pull_failures_total";
/// Cached blocks this node sent to pullers.
pub const WORKER_KV_EXPORTED_BLOCKS_TOTAL: &str = "kvmesh_worker_kv_exported_blocks_total";
pub const WORKER_PREEMPTIONS_TOTAL: &str = "kvmesh_worker_preemptions_total";
/// Engine steps that ran the model (one forward pass over the batch each).
pub const WORKER_ENGINE_STEPS_TOTAL: &str = "kvmesh_worker_engine_steps_total";
/// Tokens the steps generated: drawn, and forced by a structured-output format.
pub const WORKER_GENERATED_TOKENS_TOTAL: &str = "kvmesh_worker_generated_tokens_total";

// Node processes (labels: node; `to` on switches, `role` on the role gauge).
/// Role switches done in place (label `to`: the role switched to).
pub const NODE_ROLE_SWITCHES_TOTAL: &str = "kvmesh_node_role_switches_total";
/// Time from a switch request to serving the new role (registered), drain included.
pub const NODE_ROLE_SWITCH_SECONDS: &str = "kvmesh_node_role_switch_seconds";
/// 1 for the role the node serves now, 0 for the other (both 0 while switching).
pub const NODE_ROLE: &str = "kvmesh_node_role";
/// Times the process loaded model weights (1: role switches reuse them).
pub const NODE_MODEL_LOADS_TOTAL: &str = "kvmesh_node_model_loads_total";

// KV transfer.
pub const TRANSFER_BYTES_TOTAL: &str = "kvmesh_transfer_bytes_total";
pub const TRANSFER_SECONDS: &str = "kvmesh_transfer_duration_seconds";

// Prefix index (label: node).
pub const KV_EVENTS_PUBLISHED_TOTAL: &str = "kvmesh_kvstore_kv_events_published_total";
pub const KV_ETCD_WRITES_TOTAL: &str = "kvmesh_kvstore_kv_etcd_writes_total";
pub const KV_ETCD_WRITE_FAILURES_TOTAL: &str = "kvmesh_kvstore_kv_etcd_write_failures_total";
pub const KV_HELD_BLOCKS: &str = "kvmesh_kvstore_kv_held_blocks";
pub const PREFIX_INDEX_ENTRIES: &str = "kvmesh_router_prefix_index_entries";
pub const PREFIX_INDEX_RESYNCS_TOTAL: &str = "kvmesh_router_prefix_index_resyncs_total";

// Planner (`kvmesh planner`; label role where per role).
/// 1 while this planner holds the cluster's planner lease.
pub const PLANNER_LEADER: &str = "kvmesh_planner_leader";
/// Nodes per role: the latest decision's targets, and those alive (discovery).
pub const PLANNER_DESIRED_NODES: &str = "kvmesh_planner_desired_nodes";
pub const PLANNER_ACTUAL_NODES: &str = "kvmesh_planner_actual_nodes";
/// Requests per second the routers saw over the last observation interval.
pub const PLANNER_ARRIVAL_RATE: &str = "kvmesh_planner_arrival_rate";
/// TTFT and ITL over the last observation interval (label quantile: 0.5, 0.99).
pub const PLANNER_TTFT_SECONDS: &str = "kvmesh_planner_ttft_seconds";
pub const PLANNER_ITL_SECONDS: &str = "kvmesh_planner_itl_seconds";
/// Share of prompt tokens served from a prefix cache over the last observation interval.
pub const PLANNER_PREFIX_HIT_RATE: &str = "kvmesh_planner_prefix_hit_rate";
/// Engine steps the nodes reported and the performance model was refitted to.
pub const PLANNER_ENGINE_STEPS_TOTAL: &str = "kvmesh_planner_engine_steps_total";
/// Decisions by role and reason (label reason: the kind of `kvmesh_planner::Reason`).
pub const PLANNER_DECISIONS_TOTAL: &str = "kvmesh_planner_decisions_total";
/// Node-seconds per role while this planner led: what the mesh cost.
pub const PLANNER_NODE_SECONDS_TOTAL: &str = "kvmesh_planner_node_seconds_total";
/// Decisions the actuator failed to carry out.
pub const PLANNER_ACTUATION_FAILURES_TOTAL: &str = "kvmesh_planner_actuation_failures_total";

// Histogram bucket upper bounds (seconds), one list per histogram.
pub const ROUTER_TTFT_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
pub const ROUTER_ITL_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0,
];
pub const ROUTER_E2E_BUCKETS: &[f64] = &[
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];
/// Worker latencies: 1 ms doubling up to 32.768 s.
pub const WORKER_LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024, 2.048, 4.096,
    8.192, 16.384, 32.768,
];
/// Every histogram with its buckets (the exporter makes a histogram of exactly these names).
pub const HISTOGRAM_BUCKETS: &[(&str, &[f64])] = &[
    (ROUTER_TTFT_SECONDS, ROUTER_TTFT_BUCKETS),
    (ROUTER_ITL_SECONDS, ROUTER_ITL_BUCKETS),
    (ROUTER_E2E_SECONDS, ROUTER_E2E_BUCKETS),
    (WORKER_QUEUE_SECONDS, WORKER_LATENCY_BUCKETS),
    (TRANSFER_SECONDS, WORKER_LATENCY_BUCKETS),
    (NODE_ROLE_SWITCH_SECONDS, WORKER_LATENCY_BUCKETS),
];

/// The sum of the samples of `name` in Prometheus text `scrape` whose labels include every
/// `(label, value)` of `labels` (0 when there is none; label values without commas): a counter over some of its label
/// sets, or a histogram's `_count`.
pub fn scraped_sum(scrape: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    scrape
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (sample, label_text) = match series.split_once('{') {
                Some((sample, rest)) => (sample, rest.strip_suffix('}')?),
                None => (series, ""),
            };
            let wanted = sample == name
                && labels.iter().all(|(k, v)| {
                    label_text
                        .split(',')
                        .any(|pair| pair == format!("{k}=\"{v}\""))
                });
            wanted.then(|| value.parse::<f64>().ok())?
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scraped_sum_adds_the_matching_label_sets() {
        let scrape = "# HELP a_total A.\n# TYPE a_total counter\n\
                      a_total{node=\"1\",role=\"decode\"} 3\n\
                      a_total{node=\"2\",role=\"decode\"} 4\n\
                      a_total{node=\"1\",role=\"prefill\"} 5\n\
                      a_total_other{node=\"1\"} 100\n\
                      b 7\n";
        assert_eq!(scraped_sum(scrape, "a_total", &[("role", "decode")]), 7.0);
        assert_eq!(scraped_sum(scrape, "a_total", &[("node", "1")]), 8.0);
        assert_eq!(scraped_sum(scrape, "a_total", &[]), 12.0);
        assert_eq!(scraped_sum(scrape, "b", &[]), 7.0);
        assert_eq!(scraped_sum(scrape, "a_total", &[("node", "9")]), 0.0);
    }
}
