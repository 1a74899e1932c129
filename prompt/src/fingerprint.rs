//! The model fingerprint: a hash of the bytes that define a model (weights, tokenizer,
//! config), the root of every prefix-hash chain. Files are streamed rather than mapped, so
//! reading a fingerprint does not keep the weights resident.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use kvmesh_common::ModelFingerprint;
use xxhash_rust::xxh3::Xxh3;

use crate::error::ModelFileError;

/// One part of a model's definition.
pub enum Part<'a> {
    Bytes(&'a [u8]),
    File(&'a Path),
}

/// Hashes `parts` in order, each prefixed with its length so that moving bytes between
/// parts changes the hash.
pub fn fingerprint(parts: &[Part<'_>]) -> Result<ModelFingerprint, ModelFileError> {
    let mut h = Xxh3::new();
    for part in parts {
        match part {
            Part::Bytes(bytes) => {
                h.update(&(bytes.len() as u64).to_le_bytes());
                h.update(bytes);
            }
            Part::File(path) => hash_file(&mut h, path).map_err(|source| ModelFileError::Io {
                path: PathBuf::from(path),
                source,
            })?,
        }
    }
    Ok(ModelFingerprint::from_bytes(&h.digest128().to_le_bytes()))
}

fn hash_file(h: &mut Xxh3, path: &Path) -> std::io::Result<()> {
    let mut file = File::open(path)?;
    let len = file.metadata()?.len();
    h.update(&len.to_le_bytes());
    let mut buf = vec![0u8; 1 << 20];
    let mut read = 0u64;
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        read += n as u64;
    }
    if read != len {
        return Err(std::io::Error::other(format!(
            "the file changed while it was hashed ({len} bytes at the start, {read} read)"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_streamed_file_hashes_like_its_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("part");
        // Longer than the read buffer, so the stream takes several reads.
        let bytes: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &bytes).unwrap();
        let streamed = fingerprint(&[Part::Bytes(b"head"), Part::File(&path)]).unwrap();
        let in_memory = fingerprint(&[Part::Bytes(b"head"), Part::Bytes(&bytes)]).unwrap();
        assert_eq!(streamed, in_memory);
    }

    #[test]
    fn moving_bytes_between_parts_changes_the_hash() {
        let a = fingerprint(&[Part::Bytes(b"ab"), Part::Bytes(b"c")]).unwrap();
        let b = fingerprint(&[Part::Bytes(b"a"), Part::Bytes(b"bc")]).unwrap();
        assert_ne!(a, b);
    }

    #[test]
    fn a_missing_file_names_its_path() {
        let err = fingerprint(&[Part::File(Path::new("/nonexistent/model.gguf"))]).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/model.gguf"), "{err}");
    }
}
