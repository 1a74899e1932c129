//! Property tests for `BlockPool`: random allocate / take / cache / free sequences checked
//! against a simple model of who holds which block and what each block contains.

use kvmesh_common::{BlockId, SequenceHash};
use kvmesh_engine::block_pool::{BlockPool, BlockPoolError, KvEvent};
use proptest::prelude::*;
use std::collections::{HashMap, HashSet};

const NUM_BLOCKS: usize = 12;

#[derive(Clone, Debug)]
enum Op {
    Allocate(usize),
    /// Take another reference on one of the held blocks.
    Share(usize),
    /// Look up a content hash and take the hit, as admission does.
    TakeHit(u64),
    /// Write content `u64` into one of the held blocks and cache it.
    Cache(usize, u64),
    Free(usize),
    /// Free a block nobody holds a reference to: must fail without changing anything.
    FreeUnheld(u32),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (1usize..5).prop_map(Op::Allocate),
        any::<usize>().prop_map(Op::Share),
        (0u64..8).prop_map(Op::TakeHit),
        (any::<usize>(), 0u64..8).prop_map(|(i, c)| Op::Cache(i, c)),
        any::<usize>().prop_map(Op::Free),
        (0u32..NUM_BLOCKS as u32 + 2).prop_map(Op::FreeUnheld),
    ]
}

/// What the test believes: one entry in `held` per reference it owns, the content hash it
/// wrote into each block, and which hashes the pool promised to serve.
#[derive(Default)]
struct Model {
    held: Vec<BlockId>,
    content: HashMap<BlockId, SequenceHash>,
    cached: HashMap<SequenceHash, BlockId>,
    announced: HashSet<SequenceHash>,
}

impl Model {
    fn refs(&self, b: BlockId) -> u32 {
        self.held.iter().filter(|&&h| h == b).count() as u32
    }
}

fn apply(pool: &mut BlockPool, model: &mut Model, op: Op) -> Result<(), TestCaseError> {
    match op {
        Op::Allocate(n) => {
            let free = pool.num_free();
            match pool.allocate(n) {
                Some(blocks) => {
                    prop_assert_eq!(blocks.len(), n);
                    for b in blocks {
                        prop_assert_eq!(model.refs(b), 0, "allocated a held block");
                        // Reallocation overwrites the block: its old prefix is gone.
                        if let Some(old) = model.content.remove(&b) {
                            if model.cached.get(&old) == Some(&b) {
                                model.cached.remove(&old);
                            }
                        }
                        model.held.push(b);
                    }
                }
                None => prop_assert!(n > free, "allocation failed with {free} free"),
            }
        }
        Op::Share(i) if !model.held.is_empty() => {
            let b = model.held[i % model.held.len()];
            pool.take(&[b]).unwrap();
            model.held.push(b);
        }
        Op::TakeHit(c) => {
            let hash = SequenceHash(c);
            let hit = pool.lookup_prefix(&[hash]);
            prop_assert_eq!(hit.first(), model.cached.get(&hash));
            pool.take(&hit).unwrap();
            model.held.extend(hit);
        }
        Op::Cache(i, c) if !model.held.is_empty() => {
            let b = model.held[i % model.held.len()];
            let hash = SequenceHash(c);
            match model.content.get(&b) {
                // A full block's content is fixed once written.
                Some(&old) if old != hash => {
                    // The pool can only catch this when it cached the block under `old`.
                    if model.cached.get(&old) == Some(&b) {
                        prop_assert_eq!(
                            pool.cache_full_block(b, hash),
                            Err(BlockPoolError::AlreadyCached { block: b })
                        );
                    }
                }
                _ => {
                    model.content.insert(b, hash);
                    let newly = pool.cache_full_block(b, hash).unwrap();
                    let expect_new = !model.cached.contains_key(&hash);
                    prop_assert_eq!(newly, expect_new);
                    model.cached.entry(hash).or_insert(b);
                }
            }
        }
        Op::Free(i) if !model.held.is_empty() => {
            let b = model.held.swap_remove(i % model.held.len());
            pool.free(&[b]).unwrap();
        }
        Op::FreeUnheld(id) => {
            let b = BlockId(id);
            if model.refs(b) == 0 {
                let before = (pool.num_free(), pool.ref_count(b));
                prop_assert!(pool.free(&[b]).is_err());
                prop_assert_eq!(before, (pool.num_free(), pool.ref_count(b)));
            }
        }
        _ => {}
    }
    Ok(())
}

fn check_invariants(pool: &mut BlockPool, model: &mut Model) -> Result<(), TestCaseError> {
    prop_assert_eq!(pool.num_free() + pool.num_used(), NUM_BLOCKS);
    let distinct: HashSet<_> = model.held.iter().collect();
    prop_assert_eq!(pool.num_used(), distinct.len());
    for id in 0..NUM_BLOCKS as u32 {
        prop_assert_eq!(pool.ref_count(BlockId(id)), model.refs(BlockId(id)));
    }
    // Every hash the model expects is served by its block, freed or not, and that block's
    // content matches; every other hash misses.
    for c in 0..8 {
        let hash = SequenceHash(c);
        let hit = pool.lookup_prefix(&[hash]);
        prop_assert_eq!(hit.first(), model.cached.get(&hash));
        if let Some(b) = hit.first() {
            prop_assert_eq!(model.content.get(b), Some(&hash));
            prop_assert_eq!(pool.cached_hash(*b), Some(hash));
        }
    }
    // The event stream, replayed, yields exactly the cached set.
    for event in pool.drain_events() {
        match event.event {
            KvEvent::Stored(h) => prop_assert!(model.announced.insert(h), "stored twice"),
            KvEvent::Removed(h) => prop_assert!(model.announced.remove(&h), "removed unknown"),
        }
    }
    let cached: HashSet<_> = model.cached.keys().copied().collect();
    prop_assert_eq!(&model.announced, &cached);
    prop_assert_eq!(pool.num_cached(), cached.len());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn pool_matches_model(ops in proptest::collection::vec(op(), 1..80)) {
        let mut pool = BlockPool::new(NUM_BLOCKS, 4);
        pool.set_record_events(true);
        let mut model = Model::default();
        for op in ops {
            apply(&mut pool, &mut model, op)?;
            check_invariants(&mut pool, &mut model)?;
        }
        // Releasing every reference returns the pool to all-free, hits intact.
        let held = std::mem::take(&mut model.held);
        pool.free(&held).unwrap();
        prop_assert_eq!(pool.num_free(), NUM_BLOCKS);
        check_invariants(&mut pool, &mut model)?;
    }
}
