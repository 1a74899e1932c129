//! Cross-node prefix reuse: when the chosen decode node holds less of the prompt than another
//! live node, name that node so the decode node can pull the blocks instead of recomputing
//! them. The decode node makes the final call from the transfer and prefill rates it has
//! measured; this only says where the blocks are.

use super::TieredOverlap;
use kvmesh_common::fast_hash::U64Map;
use kvmesh_common::NodeId;
use kvmesh_kvstore::NodeEntry;

/// The node among `holders` (live nodes of any role; `decode` itself is skipped) holding the
/// longest cached prefix of the prompt, with that prefix in blocks, when it exceeds what
/// `decode` holds by at least `min_blocks`. Ties go to the lowest node id, so that the choice
/// is stable.
pub fn pull_holder<'a>(
    holders: impl IntoIterator<Item = &'a NodeEntry> + Clone,
    overlap: &U64Map<NodeId, TieredOverlap>,
    decode: NodeId,
    min_blocks: usize,
) -> Option<(NodeId, usize)> {
    let own = overlap.get(&decode).map_or(0, TieredOverlap::total);
    // Only the nodes the index names hold anything: rank those (usually none gains enough)
    // rather than look up every live node, then take the best that is live.
    let mut ranked: Vec<(usize, NodeId)> = overlap
        .iter()
        .map(|(&id, o)| (o.total(), id))
        .filter(|&(blocks, id)| id != decode && blocks >= own + min_blocks.max(1))
        .collect();
    ranked.sort_unstable_by_key(|&(blocks, id)| (std::cmp::Reverse(blocks), id));
    let live = |id: NodeId| holders.clone().into_iter().any(|n| n.info.node_id == id);
    ranked
        .into_iter()
        .find(|&(_, id)| live(id))
        .map(|(blocks, id)| (id, blocks))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testing::node;
    use proptest::prelude::*;

    fn overlap(pairs: &[(u64, usize)]) -> U64Map<NodeId, TieredOverlap> {
        pairs
            .iter()
            .map(|&(id, n)| (NodeId(id), TieredOverlap::on_device(n)))
            .collect()
    }

    #[test]
    fn names_the_node_with_the_most_that_decode_lacks() {
        let nodes = [node(1, 0, 0, 0), node(2, 9, 0, 0), node(3, 0, 0, 0)];
        let o = overlap(&[(1, 2), (2, 62), (3, 40)]);
        assert_eq!(pull_holder(&nodes, &o, NodeId(1), 4), Some((NodeId(2), 62)));
        // The decode node's own cache is never a source.
        assert_eq!(pull_holder(&nodes, &o, NodeId(2), 4), None);
        // Equal holders: the lowest id.
        let o = overlap(&[(2, 10), (3, 10)]);
        assert_eq!(pull_holder(&nodes, &o, NodeId(1), 4), Some((NodeId(2), 10)));
    }

    #[test]
    fn a_small_gain_or_an_unknown_node_is_not_worth_a_pull() {
        let nodes = [node(1, 0, 0, 0), node(2, 0, 0, 0)];
        assert_eq!(
            pull_holder(&nodes, &overlap(&[(1, 10), (2, 13)]), NodeId(1), 4),
            None
        );
        assert_eq!(
            pull_holder(&nodes, &overlap(&[(1, 10), (2, 14)]), NodeId(1), 4),
            Some((NodeId(2), 14))
        );
        // The index may still list a node that left: only live candidates count.
        assert_eq!(
            pull_holder(&nodes, &overlap(&[(9, 50)]), NodeId(1), 4),
            None
        );
    }

    proptest! {
        /// Ranking the nodes the index names picks what looking up every live node picked.
        #[test]
        fn ranks_as_a_scan_of_every_live_node(
            live in prop::collection::btree_set(1..20u64, 0..12),
            held in prop::collection::vec((1..24u64, 1..12usize), 0..12),
            decode in 1..20u64,
            min_blocks in 0..4usize,
        ) {
            let nodes: Vec<NodeEntry> = live.iter().map(|&id| node(id, 0, 0, 0)).collect();
            let o = overlap(&held);
            let held = |id: NodeId| o.get(&id).map_or(0, TieredOverlap::total);
            let own = held(NodeId(decode));
            let scanned = nodes
                .iter()
                .map(|n| n.info.node_id)
                .filter(|&id| id != NodeId(decode))
                .map(|id| (id, held(id)))
                .filter(|&(_, blocks)| blocks >= own + min_blocks.max(1))
                .max_by_key(|&(id, blocks)| (blocks, std::cmp::Reverse(id)));
            prop_assert_eq!(pull_holder(&nodes, &o, NodeId(decode), min_blocks), scanned);
        }
    }
}
