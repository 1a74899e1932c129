//! The unit of KV transfer.

use kvmesh_common::{BlockId, RequestId};
use std::ops::Range;
use xxhash_rust::xxh3::xxh3_64;

/// Element type of the payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvDtype {
    F16,
}

impl KvDtype {
    pub fn size_bytes(self) -> usize {
        match self {
            KvDtype::F16 => 2,
        }
    }
}

/// Shape of K (or V) of one block in one layer: `[num_kv_heads, block_size, head_dim]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockShape {
    pub num_kv_heads: u32,
    pub block_size: u32,
    pub head_dim: u32,
}

impl BlockShape {
    /// Bytes of K plus V of one block in one layer.
    pub fn block_bytes_per_layer(&self, dtype: KvDtype) -> usize {
        2 * self.num_kv_heads as usize
            * self.block_size as usize
            * self.head_dim as usize
            * dtype.size_bytes()
    }
}

/// Everything a receiver needs to check and place a payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvChunkHeader {
    pub request_id: RequestId,
    /// First layer of the payload.
    pub first_layer: u32,
    /// Layers in the payload (consecutive from `first_layer`).
    pub num_layers: u32,
    /// Destination blocks on the receiving node, in payload order.
    pub blocks: Vec<BlockId>,
    pub dtype: KvDtype,
    pub shape: BlockShape,
    /// xxh3-64 of the payload.
    pub checksum: u64,
}

impl KvChunkHeader {
    pub fn layers(&self) -> Range<usize> {
        self.first_layer as usize..(self.first_layer + self.num_layers) as usize
    }

    /// Payload bytes this header describes.
    pub fn payload_len(&self) -> usize {
        self.num_layers as usize * self.blocks.len() * self.shape.block_bytes_per_layer(self.dtype)
    }
}

/// One request's KV for some layers and blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvChunk {
    pub header: KvChunkHeader,
    pub payload: Vec<u8>,
}

/// Why a chunk cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ChunkError {
    #[error("the payload has {got} bytes; its header describes {expected}")]
    PayloadSize { expected: usize, got: usize },
    #[error("checksum mismatch: header says {expected:016x}, payload hashes to {got:016x}")]
    Checksum { expected: u64, got: u64 },
    #[error("a chunk must carry at least one layer and one block")]
    Empty,
}

impl KvChunk {
    /// The element type [`KvChunk::seal`] declares: the engines keep their KV in f16.
    pub const DTYPE: KvDtype = KvDtype::F16;

    /// A chunk of `payload` (transfer layout) for `layers` × `blocks`, with its checksum.
    pub fn seal(
        request_id: RequestId,
        layers: Range<usize>,
        blocks: Vec<BlockId>,
        shape: BlockShape,
        payload: Vec<u8>,
    ) -> Result<KvChunk, ChunkError> {
        let header = KvChunkHeader {
            request_id,
            first_layer: layers.start as u32,
            num_layers: layers.len() as u32,
            blocks,
            dtype: KvChunk::DTYPE,
            shape,
            checksum: xxh3_64(&payload),
        };
        let chunk = KvChunk { header, payload };
        chunk.check_size()?;
        Ok(chunk)
    }

    /// Checks that the payload is whole and intact. Call before using any byte of it.
    pub fn verify(&self) -> Result<(), ChunkError> {
        self.check_size()?;
        let got = xxh3_64(&self.payload);
        if got != self.header.checksum {
            return Err(ChunkError::Checksum {
                expected: self.header.checksum,
                got,
            });
        }
        Ok(())
    }

    fn check_size(&self) -> Result<(), ChunkError> {
        if self.header.num_layers == 0 || self.header.blocks.is_empty() {
            return Err(ChunkError::Empty);
        }
        let expected = self.header.payload_len();
        if self.payload.len() != expected {
            return Err(ChunkError::PayloadSize {
                expected,
                got: self.payload.len(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> BlockShape {
        BlockShape {
            num_kv_heads: 2,
            block_size: 4,
            head_dim: 8,
        }
    }

    fn chunk() -> KvChunk {
        let blocks = vec![BlockId(7), BlockId(3)];
        let len = 3 * 2 * shape().block_bytes_per_layer(KvDtype::F16);
        let payload = (0..len).map(|i| (i * 31 % 251) as u8).collect();
        KvChunk::seal(RequestId(9), 2..5, blocks, shape(), payload).unwrap()
    }

    #[test]
    fn a_sealed_chunk_verifies() {
        let c = chunk();
        assert_eq!(c.header.layers(), 2..5);
        assert_eq!(c.header.payload_len(), 3 * 2 * 256);
        c.verify().unwrap();
    }

    #[test]
    fn any_flipped_bit_fails_the_checksum() {
        let good = chunk();
        for i in [0, 17, good.payload.len() - 1] {
            let mut bad = good.clone();
            bad.payload[i] ^= 0x10;
            assert!(matches!(bad.verify(), Err(ChunkError::Checksum { .. })));
        }
    }

    #[test]
    fn truncated_or_mislabelled_payloads_are_rejected() {
        let mut c = chunk();
        c.payload.pop();
        assert!(matches!(c.verify(), Err(ChunkError::PayloadSize { .. })));
        let mut c = chunk();
        c.header.blocks.push(BlockId(1));
        assert!(matches!(c.verify(), Err(ChunkError::PayloadSize { .. })));
        let sealed = KvChunk::seal(RequestId(1), 0..1, vec![], shape(), vec![]);
        assert_eq!(sealed, Err(ChunkError::Empty));
        let sealed = KvChunk::seal(RequestId(1), 0..1, vec![BlockId(0)], shape(), vec![0; 3]);
        assert!(matches!(
            sealed,
            Err(ChunkError::PayloadSize {
                expected: 256,
                got: 3
            })
        ));
    }
}
