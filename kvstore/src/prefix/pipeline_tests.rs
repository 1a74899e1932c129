//! The publisher's journal and the reader's replica joined by a simulated etcd: whatever the
//! events, and whichever writes fail (before or after landing, or half-way through a
//! snapshot), a reader converges to what the node holds, and etcd holds O(blocks held).

use super::codec::{self, parse_key, KvKey, Record};
use super::journal::{Journal, Write, MAX_LOG_KEYS, MIN_COMPACT_ENTRIES};
use super::publisher::{requests, StoreOp};
use super::replica::{Outcome, Replica};
use super::{InMemoryPrefixIndex, Tier, TieredKvEvent};
use kvmesh_common::{NodeId, SequenceHash};
use proptest::prelude::*;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

const PREFIX: &str = "/t/kv/";
const NODE: NodeId = NodeId(0xab);

/// A key-value store with revisions and a watch, as much of etcd as the pipeline uses.
#[derive(Default)]
struct Etcd {
    kv: BTreeMap<String, Vec<u8>>,
    revision: i64,
}

enum Change {
    Put(String, Vec<u8>),
    Delete(String),
}

impl Etcd {
    fn txn(&mut self, ops: Vec<StoreOp>) -> Vec<(Change, i64)> {
        self.revision += 1;
        let mut changes = Vec::new();
        for op in ops {
            match op {
                StoreOp::Put { key, value } => {
                    self.kv.insert(key.clone(), value.clone());
                    changes.push(Change::Put(key, value));
                }
                StoreOp::Delete { from, to } => {
                    let doomed: Vec<String> = self
                        .kv
                        .range(from..)
                        .take_while(|(k, _)| k.as_bytes() < to.as_slice())
                        .map(|(k, _)| k.clone())
                        .collect();
                    for key in doomed {
                        self.kv.remove(&key);
                        changes.push(Change::Delete(key));
                    }
                }
            }
        }
        changes.into_iter().map(|c| (c, self.revision)).collect()
    }

    fn listing(&self, prefix: &str) -> Vec<(KvKey, Record)> {
        self.kv
            .range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, v)| {
                let key = parse_key(PREFIX, k.as_bytes()).unwrap();
                (key, codec::decode(&key, v).unwrap())
            })
            .collect()
    }

    fn entries(&self) -> usize {
        self.listing(PREFIX)
            .iter()
            .map(|(_, r)| match r {
                Record::Log(e) | Record::Part { entries: e, .. } => e.len(),
            })
            .sum()
    }
}

fn deliver(replica: &mut Replica, etcd: &Etcd, changes: Vec<(Change, i64)>) {
    for (change, revision) in changes {
        match change {
            Change::Put(k, v) => {
                let key = parse_key(PREFIX, k.as_bytes()).unwrap();
                let record = codec::decode(&key, &v).unwrap();
                if let Outcome::Relist(node) = replica.on_put(key, record, revision) {
                    let dir = codec::node_dir(PREFIX, node);
                    replica.load_node(node, etcd.listing(&dir), etcd.revision);
                }
            }
            Change::Delete(k) => {
                replica.on_delete(parse_key(PREFIX, k.as_bytes()).unwrap(), revision)
            }
        }
    }
}

#[derive(Clone, Debug)]
enum Step {
    Publish(Vec<TieredKvEvent>),
    /// One flush; `Some(n)`: it fails after its first `n` requests landed.
    Flush(Option<usize>),
}

fn step() -> impl Strategy<Value = Step> {
    let event = (0..3000u64, 0..3usize, 0..3u8).prop_map(|(h, t, kind)| {
        let hash = SequenceHash(h % if kind == 0 { 40 } else { 3000 });
        if kind == 2 {
            TieredKvEvent::removed(Tier::ALL[t], hash)
        } else {
            TieredKvEvent::stored(Tier::ALL[t], hash)
        }
    });
    prop_oneof![
        4 => proptest::collection::vec(event, 0..300).prop_map(Step::Publish),
        4 => Just(Step::Flush(None)),
        1 => (0..3usize).prop_map(|n| Step::Flush(Some(n))),
    ]
}

/// Runs one flush of `journal` into `etcd`; true if it succeeded.
fn flush(
    journal: &mut Journal,
    etcd: &mut Etcd,
    replica: &mut Replica,
    fail: Option<usize>,
) -> bool {
    let Some(write) = journal.next_write() else {
        return true;
    };
    let reqs = requests(PREFIX, NODE, &write);
    let landing = fail.map_or(reqs.len(), |n| n.min(reqs.len()));
    for ops in reqs.into_iter().take(landing) {
        let changes = etcd.txn(ops);
        deliver(replica, etcd, changes);
    }
    if fail.is_some() {
        journal.failed();
        return false;
    }
    journal.written(&write);
    if let Write::Log { .. } = write {
        assert!(etcd.kv.len() <= MAX_LOG_KEYS + 2, "{} keys", etcd.kv.len());
    }
    true
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn a_reader_converges_to_what_the_node_holds(steps in proptest::collection::vec(step(), 1..60)) {
        let mut journal = Journal::default();
        let mut etcd = Etcd::default();
        let index = Arc::new(InMemoryPrefixIndex::new());
        let mut replica = Replica::new(index.clone(), Arc::default());
        for step in steps {
            match step {
                Step::Publish(events) => journal.record(events),
                Step::Flush(fail) => {
                    flush(&mut journal, &mut etcd, &mut replica, fail);
                }
            }
            // etcd holds the snapshot plus a log no larger than it (or a small minimum).
            let held = journal.held_entries().len();
            prop_assert!(etcd.entries() <= 2 * held.max(MIN_COMPACT_ENTRIES) + codec::PART_ENTRIES);
        }
        // Flush until nothing is left (a failure leaves a snapshot due: at most two writes).
        for _ in 0..3 {
            flush(&mut journal, &mut etcd, &mut replica, None);
        }
        prop_assert_eq!(journal.next_write(), None);
        prop_assert_eq!(index.node_entries(NODE), journal.held_entries());

        // A reader that starts now, from a listing alone, agrees.
        let fresh = Arc::new(InMemoryPrefixIndex::new());
        let mut late = Replica::new(fresh.clone(), Arc::default());
        late.load_all(HashMap::from([(NODE, etcd.listing(PREFIX))]), etcd.revision);
        prop_assert_eq!(fresh.node_entries(NODE), journal.held_entries());
    }
}
