//! Where a cached block lives on its node, and the events that say so.

pub use kvmesh_common::kv_tier::{Tier, TieredKvEvent};
use kvmesh_common::KvEvent;
#[cfg(test)]
use kvmesh_common::SequenceHash;

/// The tiers one node holds one block in. A block can sit in several at once (kept on the
/// device and also spilled to host memory), so this is a set, not a single tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct TierSet(u8);

impl TierSet {
    pub const EMPTY: TierSet = TierSet(0);

    /// The set with exactly these bits (bit `i` is `Tier::ALL[i]`); `None` for unknown bits.
    pub fn from_bits(bits: u8) -> Option<TierSet> {
        (bits < 1 << Tier::ALL.len()).then_some(TierSet(bits))
    }

    pub fn bits(self) -> u8 {
        self.0
    }

    pub fn only(tier: Tier) -> TierSet {
        TierSet(tier.bit())
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    pub fn contains(self, tier: Tier) -> bool {
        self.0 & tier.bit() != 0
    }

    #[must_use]
    pub fn with(self, tier: Tier) -> TierSet {
        TierSet(self.0 | tier.bit())
    }

    #[must_use]
    pub fn without(self, tier: Tier) -> TierSet {
        TierSet(self.0 & !tier.bit())
    }

    /// The tier a reuse would read from.
    pub fn fastest(self) -> Option<Tier> {
        Tier::ALL.into_iter().find(|&t| self.contains(t))
    }

    /// This set after `event`.
    #[must_use]
    pub fn after(self, event: TieredKvEvent) -> TierSet {
        match event.event {
            KvEvent::Stored(_) => self.with(event.tier),
            KvEvent::Removed(_) => self.without(event.tier),
        }
    }
}

/// How much of a prompt one node can serve from cache.
///
/// The node holds the prompt's first [`total`](TieredOverlap::total) blocks, each in at least
/// one tier; every one of them is counted once, in the fastest tier the node holds it in, so
/// `device + host + disk == total`. A router prices reuse from that: device blocks are free,
/// host and disk blocks cost a copy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct TieredOverlap {
    pub device: usize,
    pub host: usize,
    pub disk: usize,
}

impl TieredOverlap {
    /// `blocks` leading blocks, all in the device pool.
    pub fn on_device(blocks: usize) -> Self {
        TieredOverlap::default().with(Tier::Device, blocks)
    }

    /// This overlap with `blocks` more whose fastest copy is in `tier`.
    #[must_use]
    pub fn with(mut self, tier: Tier, blocks: usize) -> Self {
        self.add(tier, blocks);
        self
    }

    pub fn add(&mut self, tier: Tier, blocks: usize) {
        match tier {
            Tier::Device => self.device += blocks,
            Tier::Host => self.host += blocks,
            Tier::Disk => self.disk += blocks,
        }
    }

    /// Leading blocks held in any tier.
    pub fn total(&self) -> usize {
        self.device + self.host + self.disk
    }

    /// Leading blocks whose fastest copy is in `tier`.
    pub fn get(&self, tier: Tier) -> usize {
        match tier {
            Tier::Device => self.device,
            Tier::Host => self.host,
            Tier::Disk => self.disk,
        }
    }

    /// Counts one more leading block, held in `tiers` (not empty). (The index counts with a
    /// table instead; this is the definition its tests check it against.)
    #[cfg(test)]
    pub(crate) fn push(&mut self, tiers: TierSet) {
        match tiers.fastest() {
            Some(Tier::Device) => self.device += 1,
            Some(Tier::Host) => self.host += 1,
            Some(Tier::Disk) => self.disk += 1,
            None => debug_assert!(false, "an index entry with no tier"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tier_sets() {
        let s = TierSet::EMPTY.with(Tier::Disk).with(Tier::Host);
        assert_eq!(s.fastest(), Some(Tier::Host));
        assert_eq!(s.without(Tier::Host).fastest(), Some(Tier::Disk));
        assert!(s.without(Tier::Host).without(Tier::Disk).is_empty());
        assert_eq!(
            TierSet::from_bits(0b111).unwrap().fastest(),
            Some(Tier::Device)
        );
        assert_eq!(TierSet::from_bits(0b1000), None);
        let e = TieredKvEvent::from(KvEvent::Stored(SequenceHash(3)));
        assert_eq!(e, TieredKvEvent::stored(Tier::Device, SequenceHash(3)));
        assert_eq!(TierSet::EMPTY.after(e), TierSet::only(Tier::Device));
    }

    #[test]
    fn overlap_counts_each_block_in_its_fastest_tier() {
        let mut o = TieredOverlap::default();
        o.push(TierSet::only(Tier::Disk).with(Tier::Device));
        o.push(TierSet::only(Tier::Host));
        o.push(TierSet::only(Tier::Disk));
        assert_eq!((o.device, o.host, o.disk, o.total()), (1, 1, 1, 3));
        assert_eq!(o.get(Tier::Host), 1);
    }

    #[test]
    fn tiers_add_up() {
        let o = TieredOverlap::on_device(3)
            .with(Tier::Host, 2)
            .with(Tier::Disk, 1);
        assert_eq!(Tier::ALL.map(|t| o.get(t)), [3, 2, 1], "per-tier counts");
        assert_eq!(o.total(), 6);
    }
}
