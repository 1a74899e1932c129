//! Time per routing decision over 1,000 decode nodes whose prefix index holds 100k
//! (block, node) entries: the index lookup of a 64-block prompt, each policy's selection on
//! the result, and the two together for kv_aware (what the router does per request).
//!
//! `cargo bench -p kvmesh-router --bench policy` (add `-- <filter>` to pick cases).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvmesh_common::fast_hash::U64Map;
use kvmesh_common::{KvEvent, LoadReport, NodeId, NodeInfo, NodeRole, SequenceHash};
use kvmesh_kvstore::{InMemoryPrefixIndex, NodeEntry, PrefixIndex};
use kvmesh_router::policy::{overlap_on_device, RouteRequest, RoutingConfig};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::hint::black_box;
use std::time::Duration;

const NODES: u64 = 1_000;
const BLOCKS_PER_NODE: usize = 100;
const PROMPT_BLOCKS: usize = 64;
/// Share of nodes holding some leading part of the prompt.
const HOLDERS: f64 = 0.3;

struct Mesh {
    nodes: Vec<NodeEntry>,
    in_flight: U64Map<NodeId, usize>,
    index: InMemoryPrefixIndex,
    prompt: Vec<SequenceHash>,
}

/// Each node holds 100 blocks: a random-length leading part of the prompt (for 30% of them)
/// and blocks of unrelated prompts for the rest.
fn mesh() -> Mesh {
    let mut rng = StdRng::seed_from_u64(42);
    let prompt: Vec<SequenceHash> = (0..PROMPT_BLOCKS)
        .map(|_| SequenceHash(rng.gen()))
        .collect();
    let index = InMemoryPrefixIndex::new();
    let mut nodes = Vec::new();
    let mut in_flight = U64Map::default();
    for id in (1..=NODES).map(NodeId) {
        let held = if rng.gen_bool(HOLDERS) {
            rng.gen_range(1..=PROMPT_BLOCKS)
        } else {
            0
        };
        let events: Vec<KvEvent> = prompt[..held]
            .iter()
            .copied()
            .chain((held..BLOCKS_PER_NODE).map(|_| SequenceHash(rng.gen())))
            .map(KvEvent::Stored)
            .collect();
        index.apply(id, &events);
        nodes.push(NodeEntry {
            info: NodeInfo {
                node_id: id,
                role: NodeRole::Decode,
                address: format!("10.0.{}.{}:7000", id.0 / 256, id.0 % 256),
                transfer_address: String::new(),
                model_fingerprint: kvmesh_common::ModelFingerprint(0),
                block_size: 16,
                kv_blocks_total: 4096,
            },
            load: LoadReport {
                running: rng.gen_range(0..32),
                waiting: rng.gen_range(0..8),
                kv_blocks_used: rng.gen_range(0..4096),
                ..LoadReport::default()
            },
        });
        if rng.gen_bool(0.2) {
            in_flight.insert(id, rng.gen_range(1..4));
        }
    }
    assert_eq!(index.len(), NODES as usize * BLOCKS_PER_NODE);
    Mesh {
        nodes,
        in_flight,
        index,
        prompt,
    }
}

fn bench(c: &mut Criterion) {
    let mesh = mesh();
    let overlap = overlap_on_device(mesh.index.overlap(&mesh.prompt));
    let request = RouteRequest {
        nodes: &mesh.nodes,
        in_flight: &mesh.in_flight,
        prompt_blocks: PROMPT_BLOCKS,
        overlap: &overlap,
    };

    c.bench_function("prefix_index/overlap_64_blocks", |b| {
        b.iter(|| black_box(mesh.index.overlap(black_box(&mesh.prompt))))
    });

    let mut group = c.benchmark_group("select_1000_nodes");
    for name in RoutingConfig::NAMES {
        let policy = name.parse::<RoutingConfig>().unwrap().build();
        group.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter(|| black_box(policy.select(black_box(&request))))
        });
    }
    group.finish();

    let kv_aware = RoutingConfig::default().build();
    c.bench_function("route/lookup_then_kv_aware", |b| {
        b.iter(|| {
            let overlap = overlap_on_device(mesh.index.overlap(black_box(&mesh.prompt)));
            let request = RouteRequest {
                overlap: &overlap,
                ..request
            };
            black_box(kv_aware.select(&request))
        })
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = bench
}
criterion_main!(benches);
