//! Every metric name in one place (`kvmesh_<component>_<name>_<unit>`; counters end in
//! `_total`, histograms in `_seconds`). Labels stay low-cardinality: `node`, `role`, `status`.

// Router (HTTP gateway).
pub const ROUTER_REQUESTS_TOTAL: &str = "kvmesh_router_requests_total";
pub const ROUTER_TTFT_SECONDS: &str = "kvmesh_router_ttft_seconds";
pub const ROUTER_ITL_SECONDS: &str = "kvmesh_router_inter_token_latency_seconds";
pub const ROUTER_E2E_SECONDS: &str = "kvmesh_router_e2e_latency_seconds";
pub const ROUTER_PROMPT_TOKENS_TOTAL: &str = "kvmesh_router_prompt_tokens_total";
pub const ROUTER_GENERATION_TOKENS_TOTAL: &str = "kvmesh_router_generation_tokens_total";
pub const ROUTER_REQUESTS_IN_FLIGHT: &str = "kvmesh_router_requests_in_flight";
pub const ROUTER_MIGRATIONS_TOTAL: &str = "kvmesh_router_migrations_total";
pub const ROUTER_DECODE_RETRIES_TOTAL: &str = "kvmesh_router_decode_retries_total";
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
