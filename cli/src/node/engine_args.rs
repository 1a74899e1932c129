//! The KV pool flags of a node that runs an engine (prefill and decode nodes); each sets a
//! key of the `[engine]` table (`EngineConfig`).

use crate::config::env_vars;
use clap::Args;
use humantime_serde::re::humantime;
use serde::Serialize;
use std::time::Duration;

#[derive(Args, Clone, Debug, Serialize)]
pub struct EngineArgs {
    /// KV blocks of 16 tokens in the pool (360 KiB each for SmolLM2-135M).
    #[arg(long, env = env_vars::KV_BLOCKS)]
    pub kv_blocks: Option<usize>,
    /// Evicted prefix-cache blocks kept in host memory and copied back on a hit (0: none).
    #[arg(long, env = env_vars::KV_HOST_BLOCKS)]
    pub kv_host_blocks: Option<usize>,
    /// Blocks pushed out of host memory kept on disk in `--kv-disk-dir` (0: none); a
    /// restarted node serves and announces them again.
    #[arg(long, env = env_vars::KV_DISK_BLOCKS)]
    pub kv_disk_blocks: Option<usize>,
    /// The disk tier's directory (one file per block).
    #[arg(long, env = env_vars::KV_DISK_DIR)]
    pub kv_disk_dir: Option<std::path::PathBuf>,
    /// Token budget of one engine step (prefill chunks and decodes together); the default is
    /// sized for a CPU (a step holds every decode on the node until it ends); a GPU wants
    /// 2048 or more.
    #[arg(long, env = env_vars::MAX_BATCHED_TOKENS, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_batched_tokens: Option<u32>,
    /// A target for one engine step's time (e.g. 70ms): prefill chunks get only the tokens
    /// that keep a step within it, as the engine's recent steps predict. Set it below the
    /// per-token latency objective; unset, the token budget alone sizes chunks.
    #[arg(long, env = env_vars::MAX_STEP_TIME, value_parser = humantime::parse_duration)]
    #[serde(with = "humantime_serde")]
    pub max_step_time: Option<Duration>,
    /// Where the engine computes: `cpu` (default), `cuda` or `cuda:N` (a build with the
    /// `cuda` feature and a CUDA device; otherwise the node does not start, and says why).
    #[arg(long, env = env_vars::DEVICE)]
    pub device: Option<kvmesh_engine::device::Device>,
}

/// Where the `EngineArgs` flags go in the TOML.
pub const KEYS: &[(&str, &str)] = &[
    ("kv_blocks", "engine.num_blocks"),
    ("kv_host_blocks", "engine.host_tier_blocks"),
    ("kv_disk_blocks", "engine.disk_tier_blocks"),
    ("kv_disk_dir", "engine.disk_tier_dir"),
    ("max_batched_tokens", "engine.max_num_batched_tokens"),
    ("max_step_time", "engine.max_step_time"),
    ("device", "engine.device"),
];
