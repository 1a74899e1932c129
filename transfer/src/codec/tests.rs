use super::*;
use proptest::prelude::*;

const DEST: NodeId = NodeId(0xd);
const REQ: RequestId = RequestId(0x42);

fn shape() -> BlockShape {
    BlockShape {
        num_kv_heads: 2,
        block_size: 4,
        head_dim: 8,
    }
}

/// A sealed chunk of `REQ` for `layers` with `n_blocks` blocks, payload bytes derived from
/// `tag`.
fn chunk(first_layer: usize, n_blocks: u32, tag: u8) -> KvChunk {
    let blocks: Vec<BlockId> = (0..n_blocks).map(|b| BlockId(b * 3 + 1)).collect();
    let len = n_blocks as usize * shape().block_bytes_per_layer(KvDtype::F16);
    let payload = (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(tag))
        .collect();
    KvChunk::seal(REQ, first_layer..first_layer + 1, blocks, shape(), payload).unwrap()
}

fn chunks() -> Vec<KvChunk> {
    vec![chunk(0, 2, 1), chunk(1, 3, 2), chunk(2, 1, 3)]
}

/// The encoded stream and the offset where each frame starts.
fn stream(chunks: &[KvChunk]) -> (Vec<u8>, Vec<usize>) {
    let mut enc = FrameEncoder::new(DEST, REQ);
    let mut out = Vec::new();
    let mut starts = Vec::new();
    for c in chunks {
        starts.push(if out.is_empty() {
            PREAMBLE_LEN
        } else {
            out.len()
        });
        enc.encode(c, &mut out).unwrap();
    }
    (out, starts)
}

/// Everything the decoder makes of `bytes` pushed in pieces of `step`, then `finish`.
fn decode(bytes: &[u8], step: usize) -> Result<Vec<KvChunk>, CodecError> {
    let mut dec = FrameDecoder::default();
    let mut got = Vec::new();
    for piece in bytes.chunks(step.max(1)) {
        dec.push(piece);
        while let Some(c) = dec.next_chunk()? {
            got.push(c);
        }
    }
    dec.finish()?;
    Ok(got)
}

#[test]
fn round_trip_in_any_piece_size() {
    let (bytes, _) = stream(&chunks());
    for step in [1, 3, 7, 31, 64, 1000, bytes.len()] {
        assert_eq!(decode(&bytes, step).unwrap(), chunks(), "step {step}");
    }
    let mut dec = FrameDecoder::default();
    dec.push(&bytes);
    assert!(dec.next_chunk().unwrap().is_some());
    assert_eq!(
        dec.preamble(),
        Some(Preamble {
            dest: DEST,
            request: REQ
        })
    );
}

#[test]
fn head_plus_payload_equals_encode() {
    let c = chunk(0, 2, 9);
    let mut whole = Vec::new();
    FrameEncoder::new(DEST, REQ).encode(&c, &mut whole).unwrap();
    let mut split = Vec::new();
    FrameEncoder::new(DEST, REQ)
        .encode_head(&c, &mut split)
        .unwrap();
    split.extend_from_slice(&c.payload);
    assert_eq!(whole, split);
}

#[test]
fn a_payload_bit_flip_is_corrupt() {
    let (mut bytes, starts) = stream(&chunks());
    let at = starts[1] + FRAME_HEADER_LEN + 3 * 4 + 5;
    bytes[at] ^= 0x01;
    assert!(matches!(
        decode(&bytes, 100),
        Err(CodecError::Corrupt(ChunkError::Checksum { .. }))
    ));
}

#[test]
fn a_header_bit_flip_fails_the_header_checksum() {
    let (bytes, starts) = stream(&chunks());
    for field_byte in [0, 5, 9, 13, 21, 33, 41, 49, 60] {
        let mut bad = bytes.clone();
        bad[starts[1] + field_byte] ^= 0x80;
        assert_eq!(
            decode(&bad, 100),
            Err(CodecError::HeaderChecksum),
            "byte {field_byte}"
        );
    }
}

#[test]
fn a_block_id_bit_flip_fails_the_block_list_checksum() {
    let (mut bytes, starts) = stream(&chunks());
    bytes[starts[0] + FRAME_HEADER_LEN + 1] ^= 0x04;
    assert_eq!(decode(&bytes, 100), Err(CodecError::BlockListChecksum));
}

#[test]
fn a_preamble_bit_flip_fails_the_preamble_checksum() {
    let (mut bytes, _) = stream(&chunks());
    bytes[9] ^= 0x02; // inside the destination node id
    assert_eq!(decode(&bytes, 100), Err(CodecError::PreambleChecksum));
}

#[test]
fn a_truncated_stream_is_reported_by_finish() {
    let (bytes, starts) = stream(&chunks());
    for cut in [
        1,
        PREAMBLE_LEN - 1,
        starts[1] + 10,
        starts[2] + 70,
        bytes.len() - 1,
    ] {
        assert_eq!(
            decode(&bytes[..cut], 16),
            Err(CodecError::Truncated),
            "cut {cut}"
        );
    }
    // Cutting exactly between frames loses frames, which only the transport can tell.
    assert_eq!(decode(&bytes[..starts[2]], 16).unwrap().len(), 2);
    assert_eq!(decode(&[], 16).unwrap(), vec![]);
}

#[test]
fn oversized_headers_are_rejected_before_allocating() {
    let limits = CodecLimits {
        max_blocks: 2,
        max_layers: 1,
        max_payload_bytes: 1 << 20,
    };
    let (bytes, _) = stream(&chunks());
    let mut dec = FrameDecoder::new(limits);
    dec.push(&bytes);
    assert!(dec.next_chunk().unwrap().is_some());
    assert_eq!(
        dec.next_chunk(),
        Err(CodecError::TooLarge {
            what: "blocks",
            got: 3,
            max: 2
        })
    );
    // A header claiming a huge payload (correctly checksummed, as a hostile peer would).
    let mut out = Vec::new();
    Preamble {
        dest: DEST,
        request: REQ,
    }
    .write(&mut out);
    FrameHeader {
        seq: 0,
        first_layer: 0,
        num_layers: 1,
        num_blocks: 1,
        shape: BlockShape {
            num_kv_heads: 1 << 20,
            block_size: 1 << 10,
            head_dim: 128,
        },
        payload_len: 1 << 39,
        payload_checksum: 0,
        blocks_checksum: 0,
    }
    .write(&mut out);
    let mut dec = FrameDecoder::default();
    dec.push(&out);
    assert!(matches!(
        dec.next_chunk(),
        Err(CodecError::TooLarge {
            what: "payload bytes",
            ..
        })
    ));
    // The encoder applies the same limits.
    let mut enc = FrameEncoder::with_limits(DEST, REQ, limits);
    assert!(matches!(
        enc.encode(&chunk(0, 3, 0), &mut Vec::new()),
        Err(CodecError::TooLarge { what: "blocks", .. })
    ));
}

#[test]
fn swapped_frames_are_out_of_order() {
    let (bytes, starts) = stream(&chunks());
    let mut swapped = bytes[..starts[1]].to_vec();
    swapped.extend_from_slice(&bytes[starts[2]..]);
    swapped.extend_from_slice(&bytes[starts[1]..starts[2]]);
    assert_eq!(
        decode(&swapped, 100),
        Err(CodecError::OutOfOrder {
            expected: 1,
            got: 2
        })
    );
    // A replayed frame too.
    let mut replayed = bytes[..starts[2]].to_vec();
    replayed.extend_from_slice(&bytes[starts[1]..starts[2]]);
    assert_eq!(
        decode(&replayed, 100),
        Err(CodecError::OutOfOrder {
            expected: 2,
            got: 1
        })
    );
}

#[test]
fn wrong_magic_or_version_is_rejected() {
    let (bytes, _) = stream(&chunks());
    let mut bad = bytes.clone();
    bad[0] = b'H';
    assert!(matches!(
        decode(&bad[..2], 1),
        Err(CodecError::BadMagic { .. })
    ));
    let mut bad = bytes.clone();
    bad[4..6].copy_from_slice(&7u16.to_le_bytes());
    assert_eq!(
        decode(&bad, 100),
        Err(CodecError::UnsupportedVersion { got: 7 })
    );
}

#[test]
fn the_encoder_refuses_another_requests_chunk() {
    let mut enc = FrameEncoder::new(DEST, RequestId(1));
    assert_eq!(
        enc.encode(&chunk(0, 1, 0), &mut Vec::new()),
        Err(CodecError::WrongRequest {
            expected: RequestId(1),
            got: REQ
        })
    );
}

#[test]
fn errors_are_sticky() {
    let (mut bytes, _) = stream(&chunks());
    bytes[0] = 0;
    let mut dec = FrameDecoder::default();
    dec.push(&bytes);
    let e = dec.next_chunk().unwrap_err();
    dec.push(&bytes);
    assert_eq!(dec.next_chunk(), Err(e.clone()));
    assert_eq!(dec.finish(), Err(e));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..600), step in 1usize..80) {
        let _ = decode(&bytes, step);
        // The same with a valid preamble in front, so the header parser gets exercised.
        let mut with_preamble = Vec::new();
        Preamble { dest: DEST, request: REQ }.write(&mut with_preamble);
        with_preamble.extend_from_slice(&bytes);
        let _ = decode(&with_preamble, step);
    }

    #[test]
    fn mutated_streams_never_panic_and_never_yield_altered_chunks(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        cut in any::<prop::sample::Index>(),
        step in 1usize..300,
    ) {
        let (mut bytes, _) = stream(&chunks());
        for (at, v) in &edits {
            let i = at.index(bytes.len());
            bytes[i] ^= v | 1;
        }
        let bytes = &bytes[..cut.index(bytes.len() + 1)];
        // Whatever decodes must be one of the original chunks: corruption is caught, not passed on.
        if let Ok(got) = decode(bytes, step) {
            for c in got {
                prop_assert!(chunks().contains(&c));
            }
        }
    }
}

/// A stream whose only frame header is `header` (checksummed, as a hostile peer would).
fn with_header(header: FrameHeader) -> Vec<u8> {
    let mut out = Vec::new();
    Preamble {
        dest: DEST,
        request: REQ,
    }
    .write(&mut out);
    header.write(&mut out);
    out
}

#[test]
fn inconsistent_headers_are_invalid_fields() {
    let good = FrameHeader {
        seq: 0,
        first_layer: 0,
        num_layers: 1,
        num_blocks: 1,
        shape: shape(),
        payload_len: 256,
        payload_checksum: 0,
        blocks_checksum: 0,
    };
    let cases = [
        (
            FrameHeader {
                num_layers: 0,
                ..good
            },
            "num_layers (zero)",
        ),
        (
            FrameHeader {
                num_blocks: 0,
                ..good
            },
            "num_blocks (zero)",
        ),
        (
            FrameHeader {
                payload_len: 255,
                ..good
            },
            "payload_len (does not match the shape)",
        ),
        (
            FrameHeader {
                first_layer: u32::MAX,
                ..good
            },
            "layer range (overflows)",
        ),
        (
            FrameHeader {
                shape: BlockShape {
                    head_dim: 0,
                    ..shape()
                },
                payload_len: 0,
                ..good
            },
            "shape (zero dimension)",
        ),
    ];
    for (header, field) in cases {
        let mut dec = FrameDecoder::default();
        dec.push(&with_header(header));
        assert_eq!(dec.next_chunk(), Err(CodecError::InvalidField(field)));
    }
    // An unknown dtype or reserved bits, behind a correct header checksum.
    for (at, field) in [(16, "dtype"), (18, "reserved header bytes")] {
        let mut bytes = with_header(good);
        let h = PREAMBLE_LEN;
        bytes[h + at] = 9;
        let sum = xxh3_64_with_seed(&bytes[h..h + 56], HEADER_SEED);
        bytes[h + 56..h + 64].copy_from_slice(&sum.to_le_bytes());
        let mut dec = FrameDecoder::default();
        dec.push(&bytes);
        assert_eq!(dec.next_chunk(), Err(CodecError::InvalidField(field)));
    }
}
