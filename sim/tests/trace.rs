//! The bundled Mooncake conversation trace, replayed through the simulated mesh.

use kvmesh_bench::trace::{load_trace, Pacing, ScaleConfig, TraceSource};
use kvmesh_common::{BlockHasher, ModelFingerprint};
use kvmesh_engine::scheduler::SchedulerConfig;
use kvmesh_sim::mesh::{simulate, MeshConfig, SimRequest};
use kvmesh_sim::node::NodeConfig;
use kvmesh_sim::timing::TimingProfile;

fn trace_requests() -> Vec<SimRequest> {
    let config = ScaleConfig {
        // Ten times the trace's pace: a busy mesh.
        pacing: Pacing::Speedup(10.0),
        ..ScaleConfig::default()
    };
    let scaled = load_trace(&TraceSource::Bundled, Some(3_000), &config).unwrap();
    scaled.iter().map(SimRequest::from_scaled).collect()
}

fn mesh(policy: &str) -> MeshConfig {
    // Block size = the scaled trace's tokens per hash id, so trace blocks are KV blocks.
    let block = ScaleConfig::default().block_tokens() as usize;
    let node = NodeConfig {
        scheduler: SchedulerConfig {
            block_size: block,
            num_blocks: 4096,
            max_num_batched_tokens: 2048,
            max_num_seqs: 64,
            max_model_len: 16_384,
            enable_prefix_caching: true,
            host_tier_blocks: 0,
            disk_tier_blocks: 0,
            hasher: BlockHasher::new(ModelFingerprint(9), block),
        },
        timing: TimingProfile::named("h100-llama8b").unwrap(),
        vocab_size: 49_152,
    };
    MeshConfig {
        seed: 1,
        ..MeshConfig::new(32, node, policy.parse().unwrap())
    }
}

#[test]
fn the_bundled_trace_runs_to_completion_and_kv_aware_reuses_its_prefixes() {
    let requests = trace_requests();
    let cached = |policy| {
        let run = simulate(&mesh(policy), &requests).unwrap();
        assert!(run.outcomes.iter().all(|o| o.error.is_none()), "{policy}");
        assert!(run.blocks_in_use.iter().all(|&used| used == Some(0)));
        run.outcomes
            .iter()
            .map(|o| o.cached_tokens.unwrap())
            .sum::<u64>()
    };
    let (kv, rr) = (cached("kv_aware"), cached("round_robin"));
    assert!(kv > rr, "kv_aware cached {kv} tokens, round_robin {rr}");
}
