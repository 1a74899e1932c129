//! The KV pool flags of a node that runs an engine (prefill and decode nodes).

use clap::Args;
use kvmesh_engine::engine_config::EngineConfig;

#[derive(Args, Debug)]
pub struct EngineArgs {
    /// KV blocks of 16 tokens in the pool (360 KiB each for SmolLM2-135M); default 1024.
    #[arg(long, env = "KVMESH_KV_BLOCKS")]
    pub kv_blocks: Option<usize>,
    /// Evicted prefix-cache blocks kept in host memory and copied back on a hit (0: none).
    #[arg(long, env = "KVMESH_KV_HOST_BLOCKS", default_value_t = 0)]
    pub kv_host_blocks: usize,
    /// Blocks pushed out of host memory kept on disk in `--kv-disk-dir` (0: none); a
    /// restarted node serves and announces them again.
    #[arg(
        long,
        env = "KVMESH_KV_DISK_BLOCKS",
        default_value_t = 0,
        requires = "kv_disk_dir"
    )]
    pub kv_disk_blocks: usize,
    /// The disk tier's directory (one file per block).
    #[arg(long, env = "KVMESH_KV_DISK_DIR")]
    pub kv_disk_dir: Option<std::path::PathBuf>,
}

impl EngineArgs {
    pub fn config(&self) -> EngineConfig {
        let defaults = EngineConfig::default();
        EngineConfig {
            num_blocks: self.kv_blocks.unwrap_or(defaults.num_blocks),
            host_tier_blocks: self.kv_host_blocks,
            disk_tier_blocks: self.kv_disk_blocks,
            disk_tier_dir: self.kv_disk_dir.clone(),
            ..defaults
        }
    }
}
