//! The candidates ordered by load, for a router that keeps its candidates between requests
//! and hears of every change to their load: a policy can then find the least-loaded nodes
//! without looking at every node ([`RoutingPolicy::select_ordered`]).
//!
//! [`RoutingPolicy::select_ordered`]: super::RoutingPolicy::select_ordered

use super::RouteRequest;
use kvmesh_common::fast_hash::U64Map;
use kvmesh_common::NodeId;
use kvmesh_kvstore::NodeEntry;
use std::collections::BTreeMap;

/// Positions in [`RouteRequest::nodes`] by load (running + waiting + in flight, as
/// [`RouteRequest::load`] counts it), the least loaded first, equal loads in position order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadOrder {
    by_load: Ranked,
    /// Each node's position, by id.
    positions: U64Map<NodeId, usize>,
    /// Each position's load: read here, a policy need not count it from the node's entry
    /// and the in-flight map again.
    loads: Vec<usize>,
}

impl LoadOrder {
    /// `nodes` (in their order) with each one's `load`.
    pub fn new(nodes: &[NodeEntry], load: impl Fn(&NodeEntry) -> usize) -> Self {
        let loads: Vec<usize> = nodes.iter().map(load).collect();
        LoadOrder {
            by_load: Ranked::new(loads.iter().copied()),
            positions: nodes
                .iter()
                .enumerate()
                .map(|(i, n)| (n.info.node_id, i))
                .collect(),
            loads,
        }
    }

    /// The nodes of `request`, loaded as it counts load.
    pub fn of(request: &RouteRequest<'_>) -> Self {
        Self::new(request.nodes, |n| request.load(n))
    }

    /// The node at `position` now has load `to`.
    pub fn reload(&mut self, position: usize, to: usize) {
        let from = std::mem::replace(&mut self.loads[position], to);
        self.by_load.rerank(position, from, to);
    }

    /// The load of the node at `position`.
    pub fn load(&self, position: usize) -> usize {
        self.loads[position]
    }

    /// Where `node` is among the nodes; `None` if it is not one.
    pub fn position(&self, node: NodeId) -> Option<usize> {
        self.positions.get(&node).copied()
    }

    /// `(load, position)` of every node, the least loaded first.
    pub fn iter(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.by_load.iter()
    }

    /// Each load some node has, the least first, with its nodes' positions a bit each (bit
    /// `i % 64` of word `i / 64`; trailing words of no position may be absent).
    pub fn levels(&self) -> impl Iterator<Item = (usize, &[u64])> + '_ {
        self.by_load
            .levels
            .iter()
            .map(|(&load, words)| (load, &words[..]))
    }

    pub fn len(&self) -> usize {
        self.by_load.len
    }

    pub fn is_empty(&self) -> bool {
        self.by_load.len == 0
    }
}

/// Positions `0..n`, each with a value, in order of `(value, position)`: a set of positions
/// a bit each for every value some position has. A router hears of a load change for each
/// request routed and each step of a node; an ordered tree of `(value, position)` pairs
/// cost a walk of its nodes for each, where the values in use are few.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Ranked {
    /// Value -> the positions having it, a bit each.
    levels: BTreeMap<usize, Vec<u64>>,
    len: usize,
}

impl Ranked {
    /// Position `i` has the `i`th value.
    pub(crate) fn new(values: impl IntoIterator<Item = usize>) -> Ranked {
        let mut ranked = Ranked::default();
        for (i, value) in values.into_iter().enumerate() {
            ranked.set(i, value);
            ranked.len += 1;
        }
        ranked
    }

    fn set(&mut self, position: usize, value: usize) {
        let words = self.levels.entry(value).or_default();
        let word = position / 64;
        if words.len() <= word {
            words.resize(word + 1, 0);
        }
        words[word] |= 1 << (position % 64);
    }

    /// Position `position` goes from value `from` to `to` (nothing if it did not have `from`).
    pub(crate) fn rerank(&mut self, position: usize, from: usize, to: usize) {
        if from == to {
            return;
        }
        let Some(words) = self.levels.get_mut(&from) else {
            return;
        };
        let (word, bit) = (position / 64, 1 << (position % 64));
        match words.get_mut(word) {
            Some(w) if *w & bit != 0 => *w &= !bit,
            _ => return,
        }
        // Trailing empty words go, so that equal sets compare equal.
        while words.last() == Some(&0) {
            words.pop();
        }
        if words.is_empty() {
            self.levels.remove(&from);
        }
        self.set(position, to);
    }

    /// The least value any position has.
    pub(crate) fn least(&self) -> Option<usize> {
        self.levels.keys().next().copied()
    }

    /// `(value, position)` of every position, in order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.levels.iter().flat_map(|(&value, words)| {
            words.iter().enumerate().flat_map(move |(w, &bits)| {
                let mut rest = bits;
                std::iter::from_fn(move || {
                    (rest != 0).then(|| {
                        let bit = rest.trailing_zeros() as usize;
                        rest &= rest - 1;
                        (value, w * 64 + bit)
                    })
                })
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::Snapshot;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    proptest! {
        #[test]
        fn ranked_orders_as_a_set_of_value_position_pairs(
            values in prop::collection::vec(0usize..6, 0..150),
            moves in prop::collection::vec((0usize..160, 0usize..6, 0usize..6), 0..300),
        ) {
            let mut ranked = Ranked::new(values.iter().copied());
            let mut model: BTreeSet<(usize, usize)> =
                values.iter().enumerate().map(|(i, &v)| (v, i)).collect();
            for (position, from, to) in moves {
                ranked.rerank(position, from, to);
                if from != to && model.remove(&(from, position)) {
                    model.insert((to, position));
                }
                prop_assert_eq!(ranked.iter().collect::<Vec<_>>(), model.iter().copied().collect::<Vec<_>>());
                prop_assert_eq!(ranked.least(), model.first().map(|&(v, _)| v));
                let rebuilt = Ranked::new((0..values.len()).map(|i| {
                    model.iter().find(|&&(_, p)| p == i).map(|&(v, _)| v).unwrap()
                }));
                prop_assert_eq!(&ranked, &rebuilt);
            }
        }
    }

    #[test]
    fn least_loaded_first_then_by_position() {
        let s = Snapshot::with_loads(&[3, 1, 3, 0], 4);
        let order = LoadOrder::of(&s.request());
        assert_eq!(
            order.iter().collect::<Vec<_>>(),
            [(0, 3), (1, 1), (3, 0), (3, 2)]
        );
        let mut moved = order.clone();
        moved.reload(1, 4);
        assert_eq!(moved.iter().last(), Some((4, 1)));
        assert_eq!((moved.load(1), moved.load(3)), (4, 0));
        assert_eq!(moved.len(), 4);
        assert_eq!(moved.position(NodeId(2)), Some(1));
        assert_eq!(moved.position(NodeId(9)), None);
    }
}
