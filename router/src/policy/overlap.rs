//! How much of a prompt a node already holds, split by the tier the blocks sit in: a block
//! in host memory or on disk saves less than one in the device pool, since it must be
//! brought back first.

use kvmesh_common::NodeId;
pub use kvmesh_kvstore::Tier;
use kvmesh_kvstore::TieredOverlap;
use std::collections::HashMap;

/// Leading prompt blocks one node holds, counted per tier (together they are the node's
/// cached prefix of the prompt).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Overlap {
    blocks_by_tier: [usize; Tier::ALL.len()],
}

impl Overlap {
    /// `blocks` leading blocks, all in the device pool (what today's prefix index knows).
    pub fn on_device(blocks: usize) -> Self {
        Overlap::default().with(Tier::Device, blocks)
    }

    /// This overlap with `blocks` more in `tier`.
    #[must_use]
    pub fn with(mut self, tier: Tier, blocks: usize) -> Self {
        self.add(tier, blocks);
        self
    }

    pub fn add(&mut self, tier: Tier, blocks: usize) {
        self.blocks_by_tier[tier as usize] += blocks;
    }

    pub fn blocks(&self, tier: Tier) -> usize {
        self.blocks_by_tier[tier as usize]
    }

    /// The cached prefix length in blocks, all tiers together.
    pub fn total(&self) -> usize {
        self.blocks_by_tier.iter().sum()
    }
}

/// Lifts a device-only answer of [`kvmesh_kvstore::PrefixIndex::overlap`] into per-tier
/// overlaps.
impl From<TieredOverlap> for Overlap {
    fn from(t: TieredOverlap) -> Self {
        Overlap::default()
            .with(Tier::Device, t.device)
            .with(Tier::Host, t.host)
            .with(Tier::Disk, t.disk)
    }
}

/// The index's answer as the policies take it.
pub fn overlap_by_tier(o: HashMap<NodeId, TieredOverlap>) -> HashMap<NodeId, Overlap> {
    o.into_iter().map(|(node, t)| (node, t.into())).collect()
}

pub fn overlap_on_device(blocks: HashMap<NodeId, usize>) -> HashMap<NodeId, Overlap> {
    blocks
        .into_iter()
        .map(|(node, n)| (node, Overlap::on_device(n)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiers_add_up() {
        let o = Overlap::on_device(3)
            .with(Tier::Host, 2)
            .with(Tier::Disk, 1);
        assert_eq!(Tier::ALL.map(|t| o.blocks(t)), [3, 2, 1], "per-tier counts");
        assert_eq!(o.total(), 6);
        let lifted = overlap_on_device(HashMap::from([(NodeId(7), 4)]));
        assert_eq!(lifted[&NodeId(7)], Overlap::on_device(4));
        assert_eq!(lifted[&NodeId(7)].blocks(Tier::Host), 0);
    }
}
