//! Newtype identifiers. One definition each; no crate passes bare integers for these.

use serde::{Deserialize, Serialize};
use std::fmt;

/// A token id in the model's vocabulary.
pub type TokenId = u32;

macro_rules! id_newtype {
    ($(#[$doc:meta])* $name:ident($inner:ty)) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        pub struct $name(pub $inner);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{:x}", self.0)
            }
        }
    };
}

id_newtype!(
    /// Identifies one client request across router, decode and prefill nodes.
    RequestId(u64)
);
id_newtype!(
    /// Identifies one node (router, prefill or decode) in the mesh.
    NodeId(u64)
);
id_newtype!(
    /// Hash of the token ids of one full KV block, on its own.
    BlockHash(u64)
);
id_newtype!(
    /// Hash of a block chained with every block before it: the identity of a prefix.
    SequenceHash(u64)
);

/// Index of a physical KV block inside one node's block pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BlockId(pub u32);

impl RequestId {
    /// A fresh random id.
    pub fn random() -> Self {
        // xxh3 of a per-process counter and the clock: unique enough without a rand dependency.
        use std::sync::atomic::{AtomicU64, Ordering};
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let mut buf = [0u8; 20];
        buf[..8].copy_from_slice(&n.to_le_bytes());
        buf[8..16].copy_from_slice(&nanos.to_le_bytes());
        buf[16..].copy_from_slice(&std::process::id().to_le_bytes());
        RequestId(xxhash_rust::xxh3::xxh3_64(&buf))
    }
}
