//! The bytes of the tiers below the KV pool: prefix-cache blocks the pool evicted, by hash,
//! in the transfer layout (every layer of one block), in host memory and in files on disk.
//! The pool decides what moves ([`TierMove`]); this carries the moves out against the
//! runner's KV cache.
//!
//! A disk file is `<hash as 16 hex digits>.kv`: a magic, the payload's xxh3 and the payload.
//! It is written to a temporary name and renamed, so a crash leaves no half file under a
//! block's name, and checked when read back.

use crate::block_pool::TierMove;
use crate::runner::{ModelRunner, RunnerError};
use kvmesh_common::kv_tier::Tier;
use kvmesh_common::{BlockId, SequenceHash};
use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};
use xxhash_rust::xxh3::xxh3_64;

const MAGIC: &[u8; 8] = b"kvmeshB1";
const HEADER: usize = 16;

#[derive(Debug, Default)]
pub struct TierStore {
    host: HashMap<SequenceHash, Vec<u8>>,
    disk: Option<PathBuf>,
}

/// What `TierStore::apply` could not do.
#[derive(Debug, Default)]
pub struct Applied {
    /// Copies that could not be kept: the pool must forget them.
    pub lost: Vec<SequenceHash>,
    /// Promoted blocks whose KV could not be brought back, and why.
    pub failed: Vec<(BlockId, TierError)>,
}

/// Why a tier move failed.
#[derive(Debug, thiserror::Error)]
pub enum TierError {
    #[error(transparent)]
    Runner(#[from] RunnerError),
    #[error("disk tier: {0}")]
    Disk(String),
    #[error("the host tier has no copy of block {0:?}")]
    HostMissing(SequenceHash),
}

impl TierStore {
    /// Keeps the disk tier in `dir` (created if missing); returns the store and the blocks
    /// the directory already holds (a restarted node's).
    pub fn with_disk(dir: PathBuf) -> io::Result<(TierStore, Vec<SequenceHash>)> {
        check_disk_dir(&dir)?;
        let mut found = Vec::new();
        for entry in std::fs::read_dir(&dir)? {
            let name = entry?.file_name();
            let name = name.to_string_lossy();
            if let Some(hex) = name.strip_suffix(".kv") {
                if let Ok(h) = u64::from_str_radix(hex, 16) {
                    found.push(SequenceHash(h));
                }
            }
        }
        let store = TierStore {
            host: HashMap::new(),
            disk: Some(dir),
        };
        Ok((store, found))
    }

    /// Carries out `moves` in order; call before the runner reuses an offloaded block.
    /// Never stops half way: a copy that cannot be kept (a failed disk write) is listed in
    /// `lost`, which the pool must forget, and a promotion whose copy cannot be read back
    /// (a corrupt or missing file) in `failed`, whose block holds no valid KV.
    pub fn apply(&mut self, moves: Vec<TierMove>, runner: &mut impl ModelRunner) -> Applied {
        let layers = runner.kv_shape().num_layers;
        let mut applied = Applied::default();
        for m in moves {
            match m {
                TierMove::Offload { hash, block } => {
                    let mut bytes = Vec::new();
                    let read = (0..layers)
                        .try_for_each(|layer| runner.read_kv_blocks(layer, &[block], &mut bytes));
                    match read {
                        Ok(()) => {
                            self.host.insert(hash, bytes);
                        }
                        Err(e) => {
                            tracing::warn!(%e, "host tier: cannot copy a block; forgetting it");
                            applied.lost.push(hash);
                        }
                    }
                }
                TierMove::Demote { hash } => {
                    let bytes = self.host.remove(&hash).unwrap_or_default();
                    if let Err(e) = self.write_file(hash, &bytes) {
                        tracing::warn!(%e, "disk tier: cannot keep a block; forgetting it");
                        applied.lost.push(hash);
                    }
                }
                TierMove::Promote { hash, block, from } => {
                    let copied = match from {
                        Tier::Disk => self.take_file(hash),
                        _ => self.host.remove(&hash).ok_or(TierError::HostMissing(hash)),
                    }
                    .and_then(|bytes| Ok(runner.write_kv_blocks(0..layers, &[block], &bytes)?));
                    if let Err(e) = copied {
                        tracing::warn!(%e, "a cached block cannot be brought back; recomputing it");
                        applied.failed.push((block, e));
                    }
                }
                TierMove::Drop { hash, tier } => match tier {
                    Tier::Disk => {
                        if let Some(path) = self.path(hash) {
                            let _ = std::fs::remove_file(path);
                        }
                    }
                    _ => {
                        self.host.remove(&hash);
                    }
                },
            }
        }
        applied
    }

    fn path(&self, hash: SequenceHash) -> Option<PathBuf> {
        self.disk
            .as_ref()
            .map(|d| d.join(format!("{:016x}.kv", hash.0)))
    }

    fn write_file(&self, hash: SequenceHash, payload: &[u8]) -> io::Result<()> {
        let path = self
            .path(hash)
            .ok_or_else(|| io::Error::other("no disk tier directory"))?;
        let tmp = path.with_extension("tmp");
        let mut bytes = Vec::with_capacity(HEADER + payload.len());
        bytes.extend_from_slice(MAGIC);
        bytes.extend_from_slice(&xxh3_64(payload).to_le_bytes());
        bytes.extend_from_slice(payload);
        std::fs::write(&tmp, &bytes)?;
        std::fs::rename(&tmp, &path)
    }

    /// Reads, checks and deletes `hash`'s file.
    fn take_file(&self, hash: SequenceHash) -> Result<Vec<u8>, TierError> {
        let payload = self.read_file(hash);
        if let Some(path) = self.path(hash) {
            let _ = std::fs::remove_file(path);
        }
        payload
    }

    /// Reads and checks `hash`'s file.
    fn read_file(&self, hash: SequenceHash) -> Result<Vec<u8>, TierError> {
        let path = self
            .path(hash)
            .ok_or_else(|| TierError::Disk("no disk tier directory".into()))?;
        let bad = |why: String| TierError::Disk(format!("{}: {why}", path.display()));
        let mut bytes = std::fs::read(&path).map_err(|e| bad(e.to_string()))?;
        if bytes.len() < HEADER || &bytes[..8] != MAGIC {
            return Err(bad("not a kvmesh KV block file".into()));
        }
        let sum = u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes"));
        let payload = bytes.split_off(HEADER);
        if xxh3_64(&payload) != sum {
            return Err(bad("checksum mismatch (corrupt file)".into()));
        }
        Ok(payload)
    }

    /// A copy of `hash`'s KV in `tier` (every layer, transfer layout), left in place.
    pub fn read(&self, hash: SequenceHash, tier: Tier) -> Result<Vec<u8>, TierError> {
        match tier {
            Tier::Disk => self.read_file(hash),
            _ => self
                .host
                .get(&hash)
                .cloned()
                .ok_or(TierError::HostMissing(hash)),
        }
    }
}

/// Whether `dir` can hold a disk tier (exists or can be made, and is writable).
fn check_disk_dir(dir: &Path) -> io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let probe = dir.join(".kvmesh-write-probe");
    std::fs::write(&probe, b"")?;
    std::fs::remove_file(probe)
}
