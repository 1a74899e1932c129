//! Valid streams (random chunk shapes and payloads) with random bytes flipped: checksums keep
//! plain random bytes from reaching the frame body, so this target starts from streams that
//! do. Unmutated streams must round-trip; mutated ones must never yield an altered chunk.

#![no_main]

use kvmesh_common::{BlockId, NodeId, RequestId};
use kvmesh_transfer::codec::{FrameDecoder, FrameEncoder};
use kvmesh_transfer::{BlockShape, KvChunk};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (Vec<(u8, u8, u8)>, Vec<(u16, u8)>, u16)| {
    let (specs, flips, step) = input;
    let shape = BlockShape {
        num_kv_heads: 1,
        block_size: 2,
        head_dim: 2,
    };
    let chunks: Vec<KvChunk> = specs
        .iter()
        .take(8)
        .map(|&(layer, blocks, fill)| {
            let layer = usize::from(layer);
            let blocks: Vec<BlockId> = (0..u32::from(blocks % 8) + 1).map(BlockId).collect();
            let len = blocks.len() * 16;
            KvChunk::seal(RequestId(7), layer..layer + 1, blocks, shape, vec![fill; len]).unwrap()
        })
        .collect();
    let mut encoder = FrameEncoder::new(NodeId(1), RequestId(7));
    let mut bytes = Vec::new();
    for c in &chunks {
        encoder.encode(c, &mut bytes).unwrap();
    }
    for &(at, mask) in &flips {
        if let Some(b) = bytes.get_mut(usize::from(at)) {
            *b ^= mask;
        }
    }
    let mut decoder = FrameDecoder::default();
    let mut got = Vec::new();
    for piece in bytes.chunks(usize::from(step).max(1)) {
        decoder.push(piece);
        loop {
            match decoder.next_chunk() {
                Ok(Some(c)) => got.push(c),
                Ok(None) => break,
                Err(_) => return,
            }
        }
    }
    if decoder.finish().is_err() {
        return;
    }
    for c in &got {
        assert!(chunks.contains(c), "a mutated stream yielded an altered chunk");
    }
    if flips.iter().all(|&(at, mask)| mask == 0 || usize::from(at) >= bytes.len()) {
        assert_eq!(got, chunks);
    }
});
