//! Every environment variable kvmesh reads, in one table. Flags name their variable through
//! these constants (`#[arg(env = env_vars::LISTEN)]`); variables read outside the cli crate
//! keep their definition there and are listed here by reference.

/// One environment variable: its name and what it sets.
pub struct EnvVar {
    pub name: &'static str,
    #[cfg_attr(not(test), allow(dead_code))] // read for docs/configuration.md
    pub doc: &'static str,
}

/// Declares each variable as a constant and lists them all in [`ALL`].
macro_rules! env_vars {
    ($($(#[doc = $doc:literal])+ $constant:ident = $name:expr;)+) => {
        $($(#[doc = $doc])+ pub const $constant: &str = $name;)+

        /// Every variable, in declaration order.
        pub const ALL: &[EnvVar] = &[$(EnvVar {
            name: $constant,
            doc: concat!($($doc),+),
        }),+];
    };
}

env_vars! {
    /// TOML file with settings for `serve`, `router`, `prefill` or `decode` (`--config`).
    CONFIG = "KVMESH_CONFIG";
    /// Log filter (tracing `EnvFilter` syntax, e.g. `debug` or `kvmesh_router=debug`); default `info`.
    LOG = "KVMESH_LOG";
    /// Model file (.gguf) or HF checkpoint directory (`--model`).
    MODEL = kvmesh_prompt::model_fetch::ENV_MODEL;
    /// Where the default model is cached (default `$XDG_CACHE_HOME/kvmesh/models`, else `~/.cache/kvmesh/models`).
    MODEL_DIR = kvmesh_prompt::model_fetch::ENV_MODEL_DIR;
    /// Caps the CPU kernels' instruction set (e.g. `avx2`) below what the CPU supports.
    CPU_ISA = kvmesh_kernels::cpu::ISA_ENV;
    /// The NVRTC library for compiling the CUDA kernels (a path to `libnvrtc.so.13`); default: the venv `scripts/setup.sh` fills, then the library path.
    NVRTC_LIB = kvmesh_kernels::cuda::NVRTC_LIB_ENV;
    /// Where compiled CUDA kernels are cached, per source hash and architecture; default `~/.cache/kvmesh/kernels`.
    KERNEL_CACHE = kvmesh_kernels::cuda::KERNEL_CACHE_ENV;
    /// The etcd binary that `kvmesh bench trace` and the cluster tests start (default: `etcd` on the PATH).
    ETCD_BIN = kvmesh_kvstore::etcd_server::ETCD_BIN_ENV;
    /// Compute threads (`--threads`).
    THREADS = "KVMESH_THREADS";
    /// Listen address (`--listen`).
    LISTEN = "KVMESH_LISTEN";
    /// Prefill workers of `kvmesh serve` (`--prefill-workers`).
    PREFILL_WORKERS = "KVMESH_PREFILL_WORKERS";
    /// Decode workers of `kvmesh serve` (`--decode-workers`).
    DECODE_WORKERS = "KVMESH_DECODE_WORKERS";
    /// Comma-separated API keys (`--api-keys`).
    API_KEYS = "KVMESH_API_KEYS";
    /// Admission control's time-to-first-token target (`--ttft-target`).
    TTFT_TARGET = "KVMESH_TTFT_TARGET";
    /// Most completion requests in flight at once (`--max-in-flight`).
    MAX_IN_FLIGHT = "KVMESH_MAX_IN_FLIGHT";
    /// Requests per second per API key (`--rate-limit`).
    RATE_LIMIT = "KVMESH_RATE_LIMIT";
    /// Requests a key may send at once above its rate (`--rate-limit-burst`).
    RATE_LIMIT_BURST = "KVMESH_RATE_LIMIT_BURST";
    /// Refuse unknown request fields (`--strict-params`).
    STRICT_PARAMS = "KVMESH_STRICT_PARAMS";
    /// Comma-separated etcd client URLs (`--etcd`).
    ETCD = "KVMESH_ETCD";
    /// The address other nodes use to reach this one (`--advertise`).
    ADVERTISE = "KVMESH_ADVERTISE";
    /// Name of the mesh, the root of its etcd keys (`--cluster`).
    CLUSTER = "KVMESH_CLUSTER";
    /// This node's id, hex (`--node-id`).
    NODE_ID = "KVMESH_NODE_ID";
    /// How long a node outlives its last etcd keep-alive (`--lease-ttl`).
    LEASE_TTL = "KVMESH_LEASE_TTL";
    /// How long a draining node lets accepted requests finish (`--drain-timeout`).
    DRAIN_TIMEOUT = "KVMESH_DRAIN_TIMEOUT";
    /// The cluster CA certificate, PEM (`--tls-ca`).
    TLS_CA = "KVMESH_TLS_CA";
    /// This node's certificate, PEM (`--tls-cert`).
    TLS_CERT = "KVMESH_TLS_CERT";
    /// This node's private key, PEM (`--tls-key`).
    TLS_KEY = "KVMESH_TLS_KEY";
    /// Where a prefill or decode node serves `GET /metrics` (`--metrics-listen`).
    METRICS_LISTEN = "KVMESH_METRICS_LISTEN";
    /// What `kvmesh health` asks (`--url`).
    HEALTH_URL = "KVMESH_HEALTH_URL";
    /// How long to wait for a holder's blocks before recomputing them (`--pull-timeout`).
    PULL_TIMEOUT = "KVMESH_PULL_TIMEOUT";
    /// KV blocks in a node's pool (`--kv-blocks`).
    KV_BLOCKS = "KVMESH_KV_BLOCKS";
    /// Evicted prefix-cache blocks kept in host memory (`--kv-host-blocks`).
    KV_HOST_BLOCKS = "KVMESH_KV_HOST_BLOCKS";
    /// Blocks kept on disk below the host tier (`--kv-disk-blocks`).
    KV_DISK_BLOCKS = "KVMESH_KV_DISK_BLOCKS";
    /// The disk tier's directory (`--kv-disk-dir`).
    KV_DISK_DIR = "KVMESH_KV_DISK_DIR";
    /// Token budget of one engine step (`--max-batched-tokens`).
    MAX_BATCHED_TOKENS = "KVMESH_MAX_BATCHED_TOKENS";
    /// A target for one engine step's time (`--max-step-time`).
    MAX_STEP_TIME = "KVMESH_MAX_STEP_TIME";
    /// Where a node's engine computes: `cpu`, `cuda` or `cuda:N` (`--device`).
    DEVICE = "KVMESH_DEVICE";
    /// The router's node-picking policy (`--routing-policy`).
    ROUTING_POLICY = "KVMESH_ROUTING_POLICY";
    /// Prompts with fewer uncached tokens than this prefill on the decode node (`--local-prefill-max-tokens`).
    LOCAL_PREFILL_MAX_TOKENS = "KVMESH_LOCAL_PREFILL_MAX_TOKENS";
    /// Fewest extra cached blocks that make the router name a node to pull from (`--pull-min-blocks`).
    PULL_MIN_BLOCKS = "KVMESH_PULL_MIN_BLOCKS";
    /// How many times a broken stream may move to another decode node (`--max-migrations`).
    MAX_MIGRATIONS = "KVMESH_MAX_MIGRATIONS";
    /// The least silence after a token that makes a decode stream count as hung (`--stream-idle-timeout`).
    STREAM_IDLE_TIMEOUT = "KVMESH_STREAM_IDLE_TIMEOUT";
    /// Whether prefill nodes may pull a prefix this decode node holds (`--prefill-pulls`).
    PREFILL_PULLS = "KVMESH_PREFILL_PULLS";
}
