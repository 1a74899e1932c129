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
    /// Token budget of one engine step (prefill chunks and decodes together); default 256,
    /// sized for a CPU (a step holds every decode on the node until it ends); a GPU wants
    /// 2048 or more.
    #[arg(long, env = "KVMESH_MAX_BATCHED_TOKENS", value_parser = clap::value_parser!(u32).range(1..))]
    pub max_batched_tokens: Option<u32>,
}

impl EngineArgs {
    pub fn config(&self) -> EngineConfig {
        let defaults = EngineConfig::default();
        EngineConfig {
            num_blocks: self.kv_blocks.unwrap_or(defaults.num_blocks),
            max_num_batched_tokens: self
                .max_batched_tokens
                .map_or(defaults.max_num_batched_tokens, |n| n as usize),
            host_tier_blocks: self.kv_host_blocks,
            disk_tier_blocks: self.kv_disk_blocks,
            disk_tier_dir: self.kv_disk_dir.clone(),
            ..defaults
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        engine: EngineArgs,
    }

    fn config(args: &[&str]) -> Result<EngineConfig, clap::Error> {
        let argv = std::iter::once("kvmesh").chain(args.iter().copied());
        Cli::try_parse_from(argv).map(|c| c.engine.config())
    }

    #[test]
    fn the_step_budget_flag_sets_the_engine_budget_and_refuses_zero() {
        assert_eq!(config(&[]).unwrap(), EngineConfig::default());
        let set = config(&["--max-batched-tokens", "256"]).unwrap();
        assert_eq!(set.max_num_batched_tokens, 256);
        assert!(config(&["--max-batched-tokens", "0"]).is_err());
    }
}
