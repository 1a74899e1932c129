//! How much of a prompt a node already holds, split by the tier the blocks sit in
//! ([`TieredOverlap`], the prefix index's answer): a block in host memory or on disk saves
//! less than one in the device pool, since it must be brought back first.

use kvmesh_common::fast_hash::U64Map;
use kvmesh_common::NodeId;
pub use kvmesh_kvstore::{Tier, TieredOverlap};

/// A device-only answer ([`kvmesh_kvstore::PrefixIndex::overlap`]) as the policies take it.
pub fn overlap_on_device(blocks: U64Map<NodeId, usize>) -> U64Map<NodeId, TieredOverlap> {
    blocks
        .into_iter()
        .map(|(node, n)| (node, TieredOverlap::on_device(n)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_counts_lift_to_device_overlaps() {
        let lifted = overlap_on_device(U64Map::from_iter([(NodeId(7), 4)]));
        assert_eq!(lifted[&NodeId(7)], TieredOverlap::on_device(4));
        assert_eq!(lifted[&NodeId(7)].get(Tier::Host), 0);
    }
}
