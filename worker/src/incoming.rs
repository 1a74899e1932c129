//! One incoming KV transfer: which (layer, block) pieces have arrived intact. No I/O; the
//! receiving worker (a decode worker taking a prompt's KV, or any worker pulling a prefix)
//! feeds it chunks and asks whether the KV is whole.

use kvmesh_common::{BlockId, RequestId};
use kvmesh_engine::runner::KvShape;
use kvmesh_transfer::{BlockShape, ChunkError, KvChunk, KvDtype};
use std::collections::HashMap;

/// Why a chunk was refused. Any of these fails the whole transfer: the prompt is then
/// recomputed locally rather than decoded on partial KV.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum IncomingError {
    #[error(transparent)]
    Corrupt(#[from] ChunkError),
    #[error("chunk for request {got}, expected {expected}")]
    WrongRequest { expected: RequestId, got: RequestId },
    #[error(
        "chunk has dtype {got:?} and block shape {shape:?}; this node stores f16 {expected:?}"
    )]
    Layout {
        got: KvDtype,
        shape: BlockShape,
        expected: BlockShape,
    },
    #[error("chunk carries layers {start}..{end}; the model has {num_layers}")]
    Layers {
        start: usize,
        end: usize,
        num_layers: usize,
    },
    #[error("chunk writes block {} that this transfer did not reserve", .0 .0)]
    UnexpectedBlock(BlockId),
}

/// See the module docs.
#[derive(Clone, Debug)]
pub struct IncomingTransfer {
    request_id: RequestId,
    num_layers: usize,
    shape: BlockShape,
    /// Index of each reserved block in `received`'s rows.
    slots: HashMap<BlockId, usize>,
    /// `received[layer * blocks + slot]`.
    received: Vec<bool>,
    missing: usize,
    bytes: u64,
}

impl IncomingTransfer {
    /// A transfer of `blocks` (all layers) of this node's KV, shaped `shape`.
    pub fn new(request_id: RequestId, shape: &KvShape, blocks: &[BlockId]) -> Self {
        let slots: HashMap<BlockId, usize> =
            blocks.iter().enumerate().map(|(i, &b)| (b, i)).collect();
        let missing = shape.num_layers * slots.len();
        IncomingTransfer {
            request_id,
            num_layers: shape.num_layers,
            shape: block_shape(shape),
            slots,
            received: vec![false; missing],
            missing,
            bytes: 0,
        }
    }

    /// Checks that `chunk` is intact and belongs here; only then may its payload be written.
    pub fn check(&self, chunk: &KvChunk) -> Result<(), IncomingError> {
        let h = &chunk.header;
        if h.request_id != self.request_id {
            return Err(IncomingError::WrongRequest {
                expected: self.request_id,
                got: h.request_id,
            });
        }
        if h.dtype != KvDtype::F16 || h.shape != self.shape {
            return Err(IncomingError::Layout {
                got: h.dtype,
                shape: h.shape,
                expected: self.shape,
            });
        }
        let layers = h.layers();
        if layers.end > self.num_layers {
            return Err(IncomingError::Layers {
                start: layers.start,
                end: layers.end,
                num_layers: self.num_layers,
            });
        }
        if let Some(&b) = h.blocks.iter().find(|b| !self.slots.contains_key(b)) {
            return Err(IncomingError::UnexpectedBlock(b));
        }
        chunk.verify()?;
        Ok(())
    }

    /// Records a chunk that passed `check` and was written.
    pub fn record(&mut self, chunk: &KvChunk) {
        let n = self.slots.len();
        for layer in chunk.header.layers() {
            for b in &chunk.header.blocks {
                let cell = &mut self.received[layer * n + self.slots[b]];
                if !std::mem::replace(cell, true) {
                    self.missing -= 1;
                }
            }
        }
        self.bytes += chunk.payload.len() as u64;
    }

    /// Every layer of every reserved block has arrived.
    pub fn is_complete(&self) -> bool {
        self.missing == 0
    }

    /// Every layer of the first `n` reserved blocks (in the order given to `new`) has
    /// arrived: a pull whose holder had only part of what was asked for.
    pub fn is_complete_upto(&self, n: usize) -> bool {
        let blocks = self.slots.len();
        let n = n.min(blocks);
        self.received
            .chunks(blocks.max(1))
            .all(|layer| layer[..n].iter().all(|&r| r))
    }

    /// Payload bytes received intact.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// The block shape a chunk for this node must carry.
pub fn block_shape(shape: &KvShape) -> BlockShape {
    BlockShape {
        num_kv_heads: shape.num_kv_heads as u32,
        block_size: shape.block_size as u32,
        head_dim: shape.head_dim as u32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> KvShape {
        KvShape {
            num_layers: 2,
            num_kv_heads: 1,
            head_dim: 2,
            block_size: 2,
            num_blocks: 16,
        }
    }

    fn chunk(layer: usize, blocks: &[u32]) -> KvChunk {
        let blocks: Vec<BlockId> = blocks.iter().map(|&b| BlockId(b)).collect();
        let len = blocks.len() * 16;
        KvChunk::seal(
            RequestId(5),
            layer..layer + 1,
            blocks,
            block_shape(&shape()),
            vec![3; len],
        )
        .unwrap()
    }

    #[test]
    fn complete_only_when_every_layer_of_every_block_arrived() {
        let mut t = IncomingTransfer::new(RequestId(5), &shape(), &[BlockId(4), BlockId(9)]);
        for c in [chunk(0, &[4, 9]), chunk(1, &[4]), chunk(1, &[4])] {
            t.check(&c).unwrap();
            t.record(&c);
            assert!(!t.is_complete());
        }
        let last = chunk(1, &[9]);
        t.check(&last).unwrap();
        t.record(&last);
        assert!(t.is_complete());
        assert_eq!(t.bytes(), 4 * 16 + 16);
    }

    #[test]
    fn a_leading_run_completes_when_each_of_its_layers_arrived() {
        let mut t = IncomingTransfer::new(RequestId(5), &shape(), &[BlockId(4), BlockId(9)]);
        assert!(t.is_complete_upto(0));
        let c = chunk(0, &[4]);
        t.check(&c).unwrap();
        t.record(&c);
        assert!(!t.is_complete_upto(1), "layer 1 of block 4 is missing");
        let c = chunk(1, &[4]);
        t.check(&c).unwrap();
        t.record(&c);
        assert!(t.is_complete_upto(1));
        assert!(!t.is_complete_upto(2) && !t.is_complete());
    }

    #[test]
    fn foreign_misplaced_or_corrupt_chunks_are_refused() {
        let t = IncomingTransfer::new(RequestId(5), &shape(), &[BlockId(4)]);
        assert_eq!(
            t.check(&chunk(0, &[5])),
            Err(IncomingError::UnexpectedBlock(BlockId(5)))
        );
        assert!(matches!(
            t.check(&chunk(2, &[4])),
            Err(IncomingError::Layers { end: 3, .. })
        ));
        let mut c = chunk(0, &[4]);
        c.header.request_id = RequestId(6);
        assert!(matches!(
            t.check(&c),
            Err(IncomingError::WrongRequest { .. })
        ));
        let mut c = chunk(0, &[4]);
        c.payload[3] ^= 1;
        assert!(matches!(
            t.check(&c),
            Err(IncomingError::Corrupt(ChunkError::Checksum { .. }))
        ));
        let mut c = chunk(0, &[4]);
        c.header.shape.head_dim = 4;
        assert!(matches!(t.check(&c), Err(IncomingError::Layout { .. })));
    }
}
