//! The prefix index's hot paths at cluster scale: 1,000 nodes, 100,000 distinct cached blocks
//! (about 500,000 (block, node) entries over three tiers), lookups of 64-block prompts, and
//! how fast events apply. Two data structures:
//!
//! - `hash`: the crate's [`InMemoryPrefixIndex`], a flat map from sequence hash to holders.
//! - `radix`: a trie of blocks (children keyed by sequence hash, holders per trie node), as in
//!   Dynamo's indexer. It needs each stored block's parent, which `KvEvent` does not carry;
//!   here the generator supplies it, so this is the trie at its best.
//!
//! `cargo bench -p kvmesh-kvstore --bench prefix_index` (add `-- <filter>` to pick cases).

use criterion::{BenchmarkId, Criterion, Throughput};
use kvmesh_common::fast_hash::U64Map;
use kvmesh_common::{NodeId, SequenceHash};
use kvmesh_kvstore::{
    InMemoryPrefixIndex, PrefixIndex, Tier, TierSet, TieredKvEvent, TieredOverlap,
};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::hint::black_box;
use std::time::Duration;

const NODES: u64 = 1000;
const SYSTEM_PROMPTS: usize = 200;
const SYSTEM_BLOCKS: usize = 32;
const CONVERSATION_BLOCKS: usize = 32;
const BLOCKS: usize = 100_000;
const SYSTEM_PROMPTS_PER_NODE: usize = 10;
const PROMPTS: usize = 256;

/// One stored block as a node would announce it, plus the parent only the trie needs.
#[derive(Clone, Copy)]
struct Stored {
    node: NodeId,
    parent: Option<SequenceHash>,
    hash: SequenceHash,
    tier: Tier,
}

struct Workload {
    stored: Vec<Stored>,
    system: Vec<Vec<SequenceHash>>,
    conversations: Vec<(usize, Vec<SequenceHash>)>,
}

fn random_tier(rng: &mut StdRng) -> Tier {
    match rng.gen_range(0..10) {
        0..=5 => Tier::Device,
        6..=8 => Tier::Host,
        _ => Tier::Disk,
    }
}

fn chain(rng: &mut StdRng, n: usize) -> Vec<SequenceHash> {
    (0..n).map(|_| SequenceHash(rng.gen())).collect()
}

fn store_chain(
    out: &mut Vec<Stored>,
    rng: &mut StdRng,
    node: NodeId,
    parent: Option<SequenceHash>,
    hashes: &[SequenceHash],
) {
    let mut parent = parent;
    for &hash in hashes {
        let tier = random_tier(rng);
        out.push(Stored {
            node,
            parent,
            hash,
            tier,
        });
        parent = Some(hash);
    }
}

/// 200 system prompts of 32 blocks, each node holding 10 of them (so ~50 holders each); the
/// other blocks are conversations of 32 blocks after a system prompt, held by 1-3 nodes.
fn workload() -> Workload {
    let mut rng = StdRng::seed_from_u64(7);
    let system: Vec<Vec<SequenceHash>> = (0..SYSTEM_PROMPTS)
        .map(|_| chain(&mut rng, SYSTEM_BLOCKS))
        .collect();
    let mut stored = Vec::new();
    let mut holds: HashMap<(NodeId, usize), ()> = HashMap::new();
    for n in 0..NODES {
        let node = NodeId(n);
        let mut picks: Vec<usize> = (0..SYSTEM_PROMPTS).collect();
        picks.shuffle(&mut rng);
        for &s in &picks[..SYSTEM_PROMPTS_PER_NODE] {
            store_chain(&mut stored, &mut rng, node, None, &system[s]);
            holds.insert((node, s), ());
        }
    }
    let n_conversations = (BLOCKS - SYSTEM_PROMPTS * SYSTEM_BLOCKS) / CONVERSATION_BLOCKS;
    let mut conversations = Vec::new();
    for _ in 0..n_conversations {
        let s = rng.gen_range(0..SYSTEM_PROMPTS);
        let blocks = chain(&mut rng, CONVERSATION_BLOCKS);
        for _ in 0..rng.gen_range(1..=3) {
            let node = NodeId(rng.gen_range(0..NODES));
            if holds.insert((node, s), ()).is_none() {
                store_chain(&mut stored, &mut rng, node, None, &system[s]);
            }
            let parent = system[s].last().copied();
            store_chain(&mut stored, &mut rng, node, parent, &blocks);
        }
        conversations.push((s, blocks));
    }
    Workload {
        stored,
        system,
        conversations,
    }
}

/// 64-block prompts: `hit` (a system prompt and a cached conversation: 64 blocks on 1-3
/// nodes, 32 on ~50), `partial` (a system prompt, then new blocks), `miss` (all new).
fn prompts(w: &Workload, kind: &str) -> Vec<Vec<SequenceHash>> {
    let mut rng = StdRng::seed_from_u64(11);
    (0..PROMPTS)
        .map(|_| match kind {
            "hit" => {
                let (s, conv) = &w.conversations[rng.gen_range(0..w.conversations.len())];
                w.system[*s].iter().chain(conv).copied().collect()
            }
            "partial" => {
                let s = &w.system[rng.gen_range(0..w.system.len())];
                s.iter().copied().chain(chain(&mut rng, 32)).collect()
            }
            _ => chain(&mut rng, 64),
        })
        .collect()
}

// ---- the trie alternative ----

type Map<V> = U64Map<SequenceHash, V>;

struct TrieNode {
    parent: usize,
    children: Map<usize>,
    holders: Vec<(NodeId, TierSet)>,
}

/// Blocks as a tree (root = index 0), with a hash -> tree node table for events that name a
/// block by hash alone (removals, and finding a parent).
struct RadixIndex {
    tree: Vec<TrieNode>,
    by_hash: Map<usize>,
    free: Vec<usize>,
}

impl RadixIndex {
    fn new() -> Self {
        RadixIndex {
            tree: vec![TrieNode {
                parent: 0,
                children: Map::default(),
                holders: Vec::new(),
            }],
            by_hash: Map::default(),
            free: Vec::new(),
        }
    }

    fn store(&mut self, s: &Stored) {
        let at = match self.by_hash.get(&s.hash) {
            Some(&at) => at,
            None => {
                // A parent the tree does not know: the block hangs off the root.
                let parent = s
                    .parent
                    .and_then(|p| self.by_hash.get(&p).copied())
                    .unwrap_or(0);
                let node = TrieNode {
                    parent,
                    children: Map::default(),
                    holders: Vec::new(),
                };
                let at = match self.free.pop() {
                    Some(at) => {
                        self.tree[at] = node;
                        at
                    }
                    None => {
                        self.tree.push(node);
                        self.tree.len() - 1
                    }
                };
                self.tree[parent].children.insert(s.hash, at);
                self.by_hash.insert(s.hash, at);
                at
            }
        };
        let holders = &mut self.tree[at].holders;
        match holders.binary_search_by_key(&s.node, |&(n, _)| n) {
            Ok(i) => holders[i].1 = holders[i].1.with(s.tier),
            Err(i) => holders.insert(i, (s.node, TierSet::only(s.tier))),
        }
    }

    fn remove(&mut self, node: NodeId, hash: SequenceHash, tier: Tier) {
        let Some(&at) = self.by_hash.get(&hash) else {
            return;
        };
        let holders = &mut self.tree[at].holders;
        if let Ok(i) = holders.binary_search_by_key(&node, |&(n, _)| n) {
            holders[i].1 = holders[i].1.without(tier);
            if holders[i].1.is_empty() {
                holders.remove(i);
            }
        }
        if holders.is_empty() && self.tree[at].children.is_empty() {
            let parent = self.tree[at].parent;
            self.tree[parent].children.remove(&hash);
            self.by_hash.remove(&hash);
            self.free.push(at);
        }
    }

    /// Leading blocks per node, by fastest tier: the same answer as the crate's.
    fn overlap_tiered(&self, hashes: &[SequenceHash]) -> U64Map<NodeId, TieredOverlap> {
        // As in the crate: fastest tier by tier bits, as a table.
        const FASTEST: [usize; 8] = [3, 0, 1, 0, 2, 0, 1, 0];
        let finish = |c: &[u32; 4]| TieredOverlap {
            device: c[0] as usize,
            host: c[1] as usize,
            disk: c[2] as usize,
        };
        let mut result = U64Map::default();
        let mut cur = 0;
        let mut matching: Vec<(NodeId, [u32; 4])> = Vec::new();
        for (i, hash) in hashes.iter().enumerate() {
            let Some(&next) = self.tree[cur].children.get(hash) else {
                break;
            };
            cur = next;
            let holders = &self.tree[cur].holders;
            if i == 0 {
                matching = holders
                    .iter()
                    .map(|&(n, t)| {
                        let mut c = [0; 4];
                        c[FASTEST[t.bits() as usize]] += 1;
                        (n, c)
                    })
                    .collect();
            } else {
                let mut at = 0;
                matching.retain_mut(|(node, c)| {
                    at = seek(holders, at, *node);
                    match holders.get(at) {
                        Some(&(n, t)) if n == *node => {
                            c[FASTEST[t.bits() as usize]] += 1;
                            true
                        }
                        _ => {
                            result.insert(*node, finish(c));
                            false
                        }
                    }
                });
            }
            if matching.is_empty() {
                break;
            }
        }
        result.extend(matching.iter().map(|(n, c)| (*n, finish(c))));
        result
    }
}

/// The crate's merge step (a few linear steps, then a binary search), so both structures
/// intersect holders the same way.
fn seek(holders: &[(NodeId, TierSet)], mut from: usize, node: NodeId) -> usize {
    for _ in 0..4 {
        match holders.get(from) {
            Some(&(n, _)) if n < node => from += 1,
            _ => return from,
        }
    }
    from + holders[from..].partition_point(|&(n, _)| n < node)
}

// ---- the runs ----

/// Events arrive in batches per node (a publisher's flush, a watcher's log batch).
fn build_hash(w: &Workload) -> InMemoryPrefixIndex {
    let index = InMemoryPrefixIndex::new();
    for batch in w.stored.chunk_by(|a, b| a.node == b.node) {
        let events: Vec<TieredKvEvent> = batch
            .iter()
            .map(|s| TieredKvEvent::stored(s.tier, s.hash))
            .collect();
        index.apply(batch[0].node, &events);
    }
    index
}

fn build_radix(w: &Workload) -> RadixIndex {
    let mut index = RadixIndex::new();
    for s in &w.stored {
        index.store(s);
    }
    index
}

fn main() {
    let w = workload();
    let hash = build_hash(&w);
    let mut radix = build_radix(&w);
    println!(
        "workload: {} nodes, {} distinct blocks, {} (block, node) entries, {} stored events",
        NODES,
        radix.by_hash.len(),
        hash.len(),
        w.stored.len()
    );
    for kind in ["hit", "partial", "miss"] {
        let ps = prompts(&w, kind);
        let avg = ps.iter().map(|p| hash.overlap(p).len()).sum::<usize>() as f64 / ps.len() as f64;
        println!("{kind}: {avg:.1} nodes per lookup");
    }
    // Both structures answer the same (any-tier) question the same way.
    for kind in ["hit", "partial", "miss"] {
        for p in prompts(&w, kind).iter().take(32) {
            assert_eq!(hash.overlap_tiered(p), radix.overlap_tiered(p), "{kind}");
        }
    }

    let mut c = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();

    let mut group = c.benchmark_group("lookup_64_blocks");
    group.throughput(Throughput::Elements(PROMPTS as u64));
    for kind in ["hit", "partial", "miss"] {
        let ps = prompts(&w, kind);
        group.bench_with_input(BenchmarkId::new("hash_tiered", kind), &ps, |b, ps| {
            b.iter(|| {
                ps.iter()
                    .map(|p| hash.overlap_tiered(black_box(p)).len())
                    .sum::<usize>()
            })
        });
        group.bench_with_input(BenchmarkId::new("hash", kind), &ps, |b, ps| {
            b.iter(|| {
                ps.iter()
                    .map(|p| hash.overlap(black_box(p)).len())
                    .sum::<usize>()
            })
        });
        group.bench_with_input(BenchmarkId::new("radix_tiered", kind), &ps, |b, ps| {
            b.iter(|| {
                ps.iter()
                    .map(|p| radix.overlap_tiered(black_box(p)).len())
                    .sum::<usize>()
            })
        });
    }
    group.finish();

    // Churn on a full index: a node caches a 64-block conversation, then evicts it.
    let mut rng = StdRng::seed_from_u64(3);
    let (s, _) = &w.conversations[0];
    let parent = w.system[*s].last().copied();
    let mut churn = Vec::new();
    let fresh = chain(&mut rng, 64);
    store_chain(&mut churn, &mut rng, NodeId(1), parent, &fresh);
    let events: Vec<TieredKvEvent> = churn
        .iter()
        .map(|s| TieredKvEvent::stored(s.tier, s.hash))
        .chain(
            churn
                .iter()
                .rev()
                .map(|s| TieredKvEvent::removed(s.tier, s.hash)),
        )
        .collect();
    let mut group = c.benchmark_group("apply");
    group.throughput(Throughput::Elements(events.len() as u64));
    group.bench_function("hash/churn_128_events", |b| {
        b.iter(|| hash.apply(NodeId(1), black_box(&events)))
    });
    group.bench_function("radix/churn_128_events", |b| {
        b.iter(|| {
            for s in &churn {
                radix.store(black_box(s));
            }
            for s in churn.iter().rev() {
                radix.remove(s.node, s.hash, s.tier);
            }
        })
    });
    group.throughput(Throughput::Elements(w.stored.len() as u64));
    group.sample_size(10);
    group.bench_function("hash/build_full_index", |b| b.iter(|| build_hash(&w).len()));
    group.bench_function("radix/build_full_index", |b| {
        b.iter(|| build_radix(&w).by_hash.len())
    });
    group.finish();

    // A node leaving, then coming back with a snapshot (what a lease expiry and a re-register
    // cost the hash index; the trie has no per-node table to do it without a full walk).
    let node = NodeId(500);
    let blocks: Vec<(SequenceHash, TierSet)> = w
        .stored
        .iter()
        .filter(|s| s.node == node)
        .map(|s| (s.hash, TierSet::only(s.tier)))
        .collect();
    let mut group = c.benchmark_group("node");
    group.throughput(Throughput::Elements(blocks.len() as u64));
    group.bench_function("hash/remove_and_replace", |b| {
        b.iter(|| {
            hash.remove_node(node);
            hash.replace_node(node, blocks.iter().copied());
        })
    });
    group.finish();
    c.final_summary();
}
