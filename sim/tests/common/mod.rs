//! What the simulator's integration tests share: small meshes, workloads and checks.

#![allow(dead_code)]

use kvmesh_bench::arrivals::{Arrivals, LoadShape, OpenLoop, RateProfile};
use kvmesh_bench::slo::{Class, SloSpec};
use kvmesh_bench::trace::block_token_ids;
use kvmesh_common::{BlockHasher, ModelFingerprint};
use kvmesh_engine::scheduler::SchedulerConfig;
use kvmesh_router::policy::DisaggConfig;
use kvmesh_sim::link::LinkClass;
use kvmesh_sim::mesh::{MeshConfig, MeshRun, PrefillPool, SimRequest};
use kvmesh_sim::node::NodeConfig;
use kvmesh_sim::timing::TimingProfile;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::time::Duration;

pub const BLOCK: usize = 16;
pub const MS: Duration = Duration::from_millis(1);

pub fn shape(rate: f64) -> LoadShape {
    LoadShape::Open(OpenLoop {
        profile: RateProfile::Fixed(rate),
        arrivals: Arrivals::Poisson,
    })
}

pub fn slo() -> SloSpec {
    "ttft=500ms,itl=50ms".parse().unwrap()
}

pub fn scheduler(num_blocks: usize, max_num_seqs: usize, caching: bool) -> SchedulerConfig {
    SchedulerConfig {
        block_size: BLOCK,
        num_blocks,
        max_num_batched_tokens: 2048,
        max_num_seqs,
        max_model_len: 4096,
        enable_prefix_caching: caching,
        host_tier_blocks: 0,
        disk_tier_blocks: 0,
        hasher: BlockHasher::new(ModelFingerprint(42), BLOCK),
    }
}

/// `nodes` decode nodes with the H200 roofline profile.
pub fn mesh(nodes: usize, policy: &str, seed: u64) -> MeshConfig {
    let node = NodeConfig {
        scheduler: scheduler(2048, 64, true),
        timing: TimingProfile::named("h200-llama8b").unwrap(),
        vocab_size: 32_000,
    };
    MeshConfig {
        seed,
        ..MeshConfig::new(nodes, node, policy.parse().unwrap())
    }
}

/// `decode` decode nodes and `prefill` prefill nodes over `link`; every prompt of
/// [`workload`] that is not well cached goes to a prefill node.
pub fn disaggregated(decode: usize, prefill: usize, link: LinkClass, seed: u64) -> MeshConfig {
    let mut config = mesh(decode, "kv_aware", seed);
    config.prefill = Some(PrefillPool {
        nodes: prefill,
        node: config.node.clone(),
        disaggregation: DisaggConfig {
            local_prefill_max_tokens: 64,
            ..DisaggConfig::default()
        },
        link,
        // Llama 3.1 8B: 32 layers, 8 KV heads of 128, f16 K and V.
        kv_bytes_per_token: 2 * 32 * 8 * 128 * 2,
    });
    config
}

/// Nodes that take `service` for every step, whatever it holds, and step as soon as a
/// request reaches them (no gather window), so their runs can be worked by hand.
pub fn fixed(nodes: usize, service: Duration) -> MeshConfig {
    let node = NodeConfig {
        scheduler: scheduler(64, 8, true),
        timing: TimingProfile::fixed(service),
        vocab_size: 100,
    };
    MeshConfig {
        gather_window: Duration::ZERO,
        ..MeshConfig::new(nodes, node, "round_robin".parse().unwrap())
    }
}

/// Poisson arrivals at `rate`; each prompt is one of `prefixes` shared system prompts (four
/// blocks) followed by its own blocks.
pub fn workload(seed: u64, n: usize, rate: f64, prefixes: u64) -> Vec<SimRequest> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
    let LoadShape::Open(open) = shape(rate) else {
        unreachable!()
    };
    open.schedule(seed)
        .take(n)
        .enumerate()
        .map(|(i, at)| {
            let shared = rng.gen_range(0..prefixes);
            let own = rng.gen_range(1..8u64);
            let mut hash_ids: Vec<u64> = (0..4).map(|b| shared * 100 + b).collect();
            hash_ids.extend((0..own).map(|b| 1_000_000 + i as u64 * 10 + b));
            let prompt = hash_ids
                .iter()
                .flat_map(|&h| block_token_ids(h, BLOCK, &(1..32_000)))
                .collect();
            SimRequest {
                at,
                prompt,
                max_tokens: rng.gen_range(1..64),
                after: None,
            }
        })
        .collect()
}

/// A request of `prompt_len` tokens for `max_tokens`, at `at`.
pub fn request(at: Duration, prompt_len: u32, max_tokens: usize) -> SimRequest {
    SimRequest {
        at,
        prompt: (1..=prompt_len).collect(),
        max_tokens,
        after: None,
    }
}

/// Every request completed once, whole, and every surviving node holds no block.
pub fn assert_all_complete(run: &MeshRun, requests: &[SimRequest]) {
    assert_eq!(run.outcomes.len(), requests.len());
    for (i, o) in run.outcomes.iter().enumerate() {
        assert_eq!(o.item, i, "outcomes come one per request, in order");
        assert_eq!(o.class(), Class::Ok, "request {i}: {o:?}");
        assert_eq!(o.output_tokens as usize, requests[i].max_tokens);
        assert_eq!(o.gaps.len() + 1, requests[i].max_tokens);
        assert_eq!(o.ended, o.sent + o.e2e.unwrap());
    }
    assert_no_leak(run);
}

/// Every node alive at the end holds no block.
pub fn assert_no_leak(run: &MeshRun) {
    for (id, used) in run.blocks_in_use.iter().enumerate() {
        let died = run.stats.nodes[id].died_at_s.is_some();
        assert_eq!(used.is_none(), died, "node {id}");
        assert!(used.unwrap_or(0) == 0, "node {id} leaked {used:?} blocks");
    }
}

/// The median of `xs`.
pub fn median(mut xs: Vec<f64>) -> f64 {
    assert!(!xs.is_empty());
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}
