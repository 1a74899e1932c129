//! How a node's published KV state is laid out in etcd, without I/O.
//!
//! Keys, under `/{cluster}/kv/` (node ids in hex, as in discovery keys; numbers zero-padded
//! so that key order is numeric order and a range delete can drop "everything before"):
//!
//! - `{node}/log/{seq:020}`: one flush, the tiers of every block that changed (empty: gone).
//! - `{node}/snapshot/{seq:020}/{part:06}`: part of everything the node holds as of `seq`;
//!   a snapshot counts once all its parts are there.
//!
//! Values are compact binary, little-endian: a 4-byte tag, the header the key also carries
//! (checked against it), an entry count, then 9-byte entries (hash, tier bits). Decoding
//! bounds every size and is total: malformed input is an error, never a panic.

use super::index::SeqMap;
use super::TierSet;
use kvmesh_common::{NodeId, SequenceHash};

/// One block of a node and the tiers it holds it in.
pub(crate) type Entry = (SequenceHash, TierSet);

/// Entries per value: a part stays near 72 KiB, far below etcd's 1.5 MiB request limit even
/// with a dozen parts in one transaction.
pub(crate) const PART_ENTRIES: usize = 8192;
/// The most parts a snapshot may claim (half a billion blocks).
const MAX_PARTS: u32 = 1 << 16;
const ENTRY_BYTES: usize = 9;
const LOG_TAG: &[u8; 4] = b"KVL1";
const SNAPSHOT_TAG: &[u8; 4] = b"KVS1";
const LOG_HEADER: usize = 4 + 8 + 4;
const SNAPSHOT_HEADER: usize = 4 + 8 + 4 + 4 + 4;
/// Bigger values are rejected before parsing.
pub(crate) const MAX_VALUE_BYTES: usize = SNAPSHOT_HEADER + PART_ENTRIES * ENTRY_BYTES;

/// What a key under the kv prefix names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum KvKey {
    Log { node: NodeId, seq: u64 },
    Snapshot { node: NodeId, seq: u64, part: u32 },
}

impl KvKey {
    pub(crate) fn node(&self) -> NodeId {
        match *self {
            KvKey::Log { node, .. } | KvKey::Snapshot { node, .. } => node,
        }
    }

    pub(crate) fn to_key(self, prefix: &str) -> String {
        match self {
            KvKey::Log { node, seq } => format!("{}{seq:020}", log_dir(prefix, node)),
            KvKey::Snapshot { node, seq, part } => {
                format!("{}{seq:020}/{part:06}", snapshot_dir(prefix, node))
            }
        }
    }
}

/// `{prefix}{node}/`: everything one node publishes.
pub(crate) fn node_dir(prefix: &str, node: NodeId) -> String {
    format!("{prefix}{node}/")
}

pub(crate) fn log_dir(prefix: &str, node: NodeId) -> String {
    format!("{prefix}{node}/log/")
}

pub(crate) fn snapshot_dir(prefix: &str, node: NodeId) -> String {
    format!("{prefix}{node}/snapshot/")
}

/// The first key after every key that starts with `prefix` (etcd's range end for a prefix).
pub(crate) fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < u8::MAX {
            end.push(last + 1);
            return end;
        }
    }
    vec![0] // every key: not reachable with our prefixes, which end in '/'
}

pub(crate) fn parse_key(prefix: &str, key: &[u8]) -> Result<KvKey, String> {
    let rest = key
        .strip_prefix(prefix.as_bytes())
        .and_then(|r| std::str::from_utf8(r).ok())
        .ok_or("not a kv key")?;
    let mut parts = rest.split('/');
    let node = parts.next().ok_or("no node")?;
    if node.is_empty() || node.len() > 16 || !node.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(format!("bad node id {node:?}"));
    }
    let node = NodeId(u64::from_str_radix(node, 16).map_err(|e| e.to_string())?);
    let key = match (parts.next(), parts.next(), parts.next(), parts.next()) {
        (Some("log"), Some(seq), None, None) => KvKey::Log {
            node,
            seq: fixed_width(seq, 20)?,
        },
        (Some("snapshot"), Some(seq), Some(part), None) => KvKey::Snapshot {
            node,
            seq: fixed_width(seq, 20)?,
            part: u32::try_from(fixed_width(part, 6)?).map_err(|e| e.to_string())?,
        },
        _ => return Err(format!("unknown kv key {rest:?}")),
    };
    Ok(key)
}

fn fixed_width(digits: &str, width: usize) -> Result<u64, String> {
    if digits.len() != width || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("{digits:?} is not {width} digits"));
    }
    digits
        .parse()
        .map_err(|e: std::num::ParseIntError| e.to_string())
}

/// A decoded value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Record {
    /// The blocks that changed in one flush, with their new tiers (empty: no longer held).
    Log(Vec<Entry>),
    /// Part `part` of a snapshot in `parts` parts.
    Part { parts: u32, entries: Vec<Entry> },
}

pub(crate) fn encode_log(seq: u64, entries: &[Entry]) -> Vec<u8> {
    debug_assert!(entries.len() <= PART_ENTRIES);
    let mut out = Vec::with_capacity(LOG_HEADER + entries.len() * ENTRY_BYTES);
    out.extend_from_slice(LOG_TAG);
    out.extend_from_slice(&seq.to_le_bytes());
    put_entries(&mut out, entries);
    out
}

pub(crate) fn encode_part(seq: u64, part: u32, parts: u32, entries: &[Entry]) -> Vec<u8> {
    debug_assert!(entries.len() <= PART_ENTRIES);
    let mut out = Vec::with_capacity(SNAPSHOT_HEADER + entries.len() * ENTRY_BYTES);
    out.extend_from_slice(SNAPSHOT_TAG);
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&part.to_le_bytes());
    out.extend_from_slice(&parts.to_le_bytes());
    put_entries(&mut out, entries);
    out
}

fn put_entries(out: &mut Vec<u8>, entries: &[Entry]) {
    out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    for (hash, tiers) in entries {
        out.extend_from_slice(&hash.0.to_le_bytes());
        out.push(tiers.bits());
    }
}

/// Decodes the value stored at `key`; its header must agree with the key.
pub(crate) fn decode(key: &KvKey, value: &[u8]) -> Result<Record, String> {
    if value.len() > MAX_VALUE_BYTES {
        return Err(format!(
            "{} bytes, more than {MAX_VALUE_BYTES}",
            value.len()
        ));
    }
    let mut r = Reader(value);
    let tag = r.take(4)?;
    match *key {
        KvKey::Log { seq, .. } => {
            if tag != LOG_TAG {
                return Err("not a log batch".into());
            }
            r.expect_u64(seq, "seq")?;
            Ok(Record::Log(r.entries(true)?))
        }
        KvKey::Snapshot { seq, part, .. } => {
            if tag != SNAPSHOT_TAG {
                return Err("not a snapshot part".into());
            }
            r.expect_u64(seq, "seq")?;
            r.expect_u32(part, "part")?;
            let parts = r.u32()?;
            if part >= parts || parts > MAX_PARTS {
                return Err(format!("part {part} of {parts}"));
            }
            let entries = r.entries(false)?;
            Ok(Record::Part { parts, entries })
        }
    }
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        if self.0.len() < n {
            return Err("truncated".into());
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn u32(&mut self) -> Result<u32, String> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes(b.try_into().expect("4 bytes")))
    }

    fn u64(&mut self) -> Result<u64, String> {
        let b = self.take(8)?;
        Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }

    fn expect_u64(&mut self, want: u64, what: &str) -> Result<(), String> {
        match self.u64()? {
            got if got == want => Ok(()),
            got => Err(format!("{what} {got} under the key of {want}")),
        }
    }

    fn expect_u32(&mut self, want: u32, what: &str) -> Result<(), String> {
        match self.u32()? {
            got if got == want => Ok(()),
            got => Err(format!("{what} {got} under the key of {want}")),
        }
    }

    /// The count, then exactly that many entries and nothing after them.
    fn entries(&mut self, empty_tiers_allowed: bool) -> Result<Vec<Entry>, String> {
        let count = self.u32()? as usize;
        if count > PART_ENTRIES || self.0.len() != count * ENTRY_BYTES {
            return Err(format!("{count} entries in {} bytes", self.0.len()));
        }
        let mut seen = SeqMap::default();
        let mut entries = Vec::with_capacity(count);
        for chunk in self.0.chunks_exact(ENTRY_BYTES) {
            let hash = SequenceHash(u64::from_le_bytes(chunk[..8].try_into().expect("8 bytes")));
            let tiers = TierSet::from_bits(chunk[8]).ok_or("unknown tier bits")?;
            if tiers.is_empty() && !empty_tiers_allowed {
                return Err("a snapshot entry with no tier".into());
            }
            if seen.insert(hash, ()).is_some() {
                return Err(format!("block {hash} listed twice"));
            }
            entries.push((hash, tiers));
        }
        Ok(entries)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefix::Tier;
    use proptest::prelude::*;

    const P: &str = "/c/kv/";

    #[test]
    fn keys_round_trip_and_sort_numerically() {
        let log = KvKey::Log {
            node: NodeId(255),
            seq: 7,
        };
        assert_eq!(log.to_key(P), "/c/kv/ff/log/00000000000000000007");
        assert_eq!(parse_key(P, log.to_key(P).as_bytes()), Ok(log));
        let part = KvKey::Snapshot {
            node: NodeId(1),
            seq: 12,
            part: 3,
        };
        assert_eq!(
            part.to_key(P),
            "/c/kv/1/snapshot/00000000000000000012/000003"
        );
        assert_eq!(parse_key(P, part.to_key(P).as_bytes()), Ok(part));
        let a = KvKey::Log {
            node: NodeId(1),
            seq: 9,
        }
        .to_key(P);
        let b = KvKey::Log {
            node: NodeId(1),
            seq: 10,
        }
        .to_key(P);
        assert!(a < b);
        for bad in [
            "/c/kv/1/log/7",
            "/c/kv/xyz/log/00000000000000000007",
            "/c/kv/1/snapshot/00000000000000000012",
            "/c/kv/1/other/00000000000000000012",
            "/c/kv/",
            "/d/kv/1/log/00000000000000000007",
            "/c/kv/11111111111111111/log/00000000000000000007",
        ] {
            assert!(parse_key(P, bad.as_bytes()).is_err(), "{bad}");
        }
        assert_eq!(prefix_end("/c/kv/"), b"/c/kv0");
    }

    #[test]
    fn values_round_trip_and_must_match_their_key() {
        let t = TierSet::only(Tier::Host);
        let entries = vec![(SequenceHash(1), t), (SequenceHash(2), TierSet::EMPTY)];
        let key = KvKey::Log {
            node: NodeId(1),
            seq: 5,
        };
        let value = encode_log(5, &entries);
        assert_eq!(decode(&key, &value), Ok(Record::Log(entries.clone())));
        let other = KvKey::Log {
            node: NodeId(1),
            seq: 6,
        };
        assert!(decode(&other, &value).is_err());

        let key = KvKey::Snapshot {
            node: NodeId(1),
            seq: 5,
            part: 1,
        };
        let value = encode_part(5, 1, 2, &entries[..1]);
        assert_eq!(
            decode(&key, &value),
            Ok(Record::Part {
                parts: 2,
                entries: entries[..1].to_vec()
            })
        );
        // No tier is a removal: meaningless in a snapshot.
        assert!(decode(&key, &encode_part(5, 1, 2, &entries)).is_err());
        // Truncated, padded, duplicated, out-of-range.
        assert!(decode(&key, &value[..value.len() - 1]).is_err());
        let mut padded = value.clone();
        padded.push(0);
        assert!(decode(&key, &padded).is_err());
        let dup = encode_part(5, 1, 2, &[(SequenceHash(1), t), (SequenceHash(1), t)]);
        assert!(decode(&key, &dup).is_err());
        assert!(decode(&key, &encode_part(5, 1, 1, &[])).is_err());
        let mut bad_tier = encode_log(5, &entries[..1]);
        *bad_tier.last_mut().unwrap() = 0x80;
        assert!(decode(
            &KvKey::Log {
                node: NodeId(1),
                seq: 5
            },
            &bad_tier
        )
        .is_err());
    }

    proptest! {
        #[test]
        fn decoding_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200), log in any::<bool>()) {
            let key = if log {
                KvKey::Log { node: NodeId(1), seq: 1 }
            } else {
                KvKey::Snapshot { node: NodeId(1), seq: 1, part: 0 }
            };
            let _ = decode(&key, &bytes);
            let _ = parse_key(P, &bytes);
        }
    }
}
