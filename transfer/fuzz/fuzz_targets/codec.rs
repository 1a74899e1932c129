//! Arbitrary bytes, cut into arbitrary pieces, into the stream decoder: it must never panic,
//! never allocate past its limits, and hand out only chunks that verify.

#![no_main]

use kvmesh_transfer::codec::{CodecLimits, FrameDecoder};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (Vec<u16>, &[u8])| {
    let (cuts, mut bytes) = input;
    let mut decoder = FrameDecoder::new(CodecLimits {
        max_blocks: 1024,
        max_layers: 64,
        max_payload_bytes: 1 << 20,
    });
    let mut cuts = cuts.into_iter().map(|c| usize::from(c).max(1)).cycle();
    while !bytes.is_empty() {
        let n = cuts.next().unwrap_or(bytes.len()).min(bytes.len());
        decoder.push(&bytes[..n]);
        bytes = &bytes[n..];
        loop {
            match decoder.next_chunk() {
                Ok(Some(chunk)) => chunk.verify().expect("decoded chunks are verified"),
                Ok(None) => break,
                Err(_) => return,
            }
        }
    }
    let _ = decoder.finish();
});
