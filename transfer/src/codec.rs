//! The versioned wire codec for KV chunks: sans-IO (bytes in, chunks out), so it can be fuzzed
//! and driven by tests without sockets. The QUIC and RDMA transports both speak it.
//!
//! A stream carries one request's chunks to one node:
//!
//! ```text
//! preamble (32 B): magic "KVMX" | version u16 | flags u16 (0) | dest NodeId u64
//!                  | request id u64 | xxh3 of the previous 24 bytes u64
//! frame*:          header (64 B) | block ids (u32 each) | payload
//! header:          seq u32 | first_layer u32 | num_layers u32 | num_blocks u32
//!                  | dtype u8 | reserved [u8; 3] (0) | num_kv_heads u32 | block_size u32
//!                  | head_dim u32 | payload_len u64 | payload xxh3 u64 | block ids xxh3 u64
//!                  | xxh3 of the previous 56 bytes u64
//! ```
//!
//! All integers are little-endian. Frame `seq` starts at 0 and grows by one per frame, so a
//! reordered, dropped or duplicated frame is detected even though receivers do not care about
//! order. Header fields are bounded by [`CodecLimits`] and checked against the header's own
//! checksum before anything is allocated for the frame's body.

use crate::chunk::{BlockShape, ChunkError, KvChunk, KvChunkHeader, KvDtype};
use bytes::{Buf, BytesMut};
use kvmesh_common::{BlockId, NodeId, RequestId};
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// The first bytes of every stream.
pub const MAGIC: [u8; 4] = *b"KVMX";
/// The wire version this build writes and reads.
pub const WIRE_VERSION: u16 = 1;
/// Bytes of the stream preamble.
pub const PREAMBLE_LEN: usize = 32;
/// Bytes of a frame header.
pub const FRAME_HEADER_LEN: usize = 64;

// Distinct seeds so a preamble can never pass as a frame header's checksum or vice versa.
const PREAMBLE_SEED: u64 = 0x6b76_6d65_7368_0001;
const HEADER_SEED: u64 = 0x6b76_6d65_7368_0002;

const DTYPE_F16: u8 = 1;

/// Upper bounds on what a decoder accepts (and an encoder writes), checked before allocating.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CodecLimits {
    /// Destination blocks in one chunk.
    pub max_blocks: u32,
    /// Layers in one chunk.
    pub max_layers: u32,
    /// Payload bytes of one chunk.
    pub max_payload_bytes: u64,
}

impl Default for CodecLimits {
    /// 64 MiB payloads and 64Ki blocks: a whole 2,000-token prompt of a 30-layer model (about
    /// 45 MiB) fits one chunk, while a hostile header cannot make a receiver reserve more.
    fn default() -> Self {
        CodecLimits {
            max_blocks: 65_536,
            max_layers: 1024,
            max_payload_bytes: 64 << 20,
        }
    }
}

/// Why bytes could not be decoded (or a chunk encoded). Every malformed input maps to one.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    #[error("not a kvmesh KV stream (bad magic {got:02x?})")]
    BadMagic { got: [u8; 4] },
    #[error("unsupported wire version {got} (this build speaks {WIRE_VERSION})")]
    UnsupportedVersion { got: u16 },
    #[error("frame out of order: expected seq {expected}, got {got}")]
    OutOfOrder { expected: u32, got: u32 },
    #[error("{what} is {got}, over the limit of {max}")]
    TooLarge {
        what: &'static str,
        got: u64,
        max: u64,
    },
    #[error("stream preamble checksum mismatch")]
    PreambleChecksum,
    #[error("frame header checksum mismatch")]
    HeaderChecksum,
    #[error("block id list checksum mismatch")]
    BlockListChecksum,
    #[error("the stream ended inside a preamble or frame")]
    Truncated,
    #[error("invalid {0}")]
    InvalidField(&'static str),
    #[error("corrupt chunk: {0}")]
    Corrupt(#[from] ChunkError),
    #[error("chunk of request {got} on the stream of request {expected}")]
    WrongRequest { expected: RequestId, got: RequestId },
}

/// The start of a stream: who it is for and which request it carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Preamble {
    pub dest: NodeId,
    pub request: RequestId,
}

impl Preamble {
    fn write(&self, out: &mut Vec<u8>) {
        let start = out.len();
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&WIRE_VERSION.to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&self.dest.0.to_le_bytes());
        out.extend_from_slice(&self.request.0.to_le_bytes());
        let sum = xxh3_64_with_seed(&out[start..], PREAMBLE_SEED);
        out.extend_from_slice(&sum.to_le_bytes());
    }

    fn parse(b: &[u8; PREAMBLE_LEN]) -> Result<Preamble, CodecError> {
        let magic = [b[0], b[1], b[2], b[3]];
        if magic != MAGIC {
            return Err(CodecError::BadMagic { got: magic });
        }
        // The version comes before the checksum: a future layout may checksum differently.
        let version = u16_at(b, 4);
        if version != WIRE_VERSION {
            return Err(CodecError::UnsupportedVersion { got: version });
        }
        if xxh3_64_with_seed(&b[..24], PREAMBLE_SEED) != u64_at(b, 24) {
            return Err(CodecError::PreambleChecksum);
        }
        if u16_at(b, 6) != 0 {
            return Err(CodecError::InvalidField("preamble flags"));
        }
        Ok(Preamble {
            dest: NodeId(u64_at(b, 8)),
            request: RequestId(u64_at(b, 16)),
        })
    }
}

/// A frame header as it travels; `parse` checks everything that can be checked before the
/// body arrives.
#[derive(Clone, Copy, Debug)]
struct FrameHeader {
    seq: u32,
    first_layer: u32,
    num_layers: u32,
    num_blocks: u32,
    shape: BlockShape,
    payload_len: u64,
    payload_checksum: u64,
    blocks_checksum: u64,
}

impl FrameHeader {
    fn write(&self, out: &mut Vec<u8>) {
        let start = out.len();
        for v in [self.seq, self.first_layer, self.num_layers, self.num_blocks] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&[DTYPE_F16, 0, 0, 0]);
        let s = self.shape;
        for v in [s.num_kv_heads, s.block_size, s.head_dim] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        for v in [
            self.payload_len,
            self.payload_checksum,
            self.blocks_checksum,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        let sum = xxh3_64_with_seed(&out[start..], HEADER_SEED);
        out.extend_from_slice(&sum.to_le_bytes());
    }

    fn parse(b: &[u8; FRAME_HEADER_LEN], limits: &CodecLimits) -> Result<FrameHeader, CodecError> {
        if xxh3_64_with_seed(&b[..56], HEADER_SEED) != u64_at(b, 56) {
            return Err(CodecError::HeaderChecksum);
        }
        if b[16] != DTYPE_F16 {
            return Err(CodecError::InvalidField("dtype"));
        }
        if b[17..20] != [0, 0, 0] {
            return Err(CodecError::InvalidField("reserved header bytes"));
        }
        let h = FrameHeader {
            seq: u32_at(b, 0),
            first_layer: u32_at(b, 4),
            num_layers: u32_at(b, 8),
            num_blocks: u32_at(b, 12),
            shape: BlockShape {
                num_kv_heads: u32_at(b, 20),
                block_size: u32_at(b, 24),
                head_dim: u32_at(b, 28),
            },
            payload_len: u64_at(b, 32),
            payload_checksum: u64_at(b, 40),
            blocks_checksum: u64_at(b, 48),
        };
        h.check(limits)?;
        Ok(h)
    }

    /// Bounds and internal consistency; shared by the encoder and the decoder.
    fn check(&self, limits: &CodecLimits) -> Result<(), CodecError> {
        check_max("layers", self.num_layers.into(), limits.max_layers.into())?;
        check_max("blocks", self.num_blocks.into(), limits.max_blocks.into())?;
        check_max("payload bytes", self.payload_len, limits.max_payload_bytes)?;
        if self.num_layers == 0 {
            return Err(CodecError::InvalidField("num_layers (zero)"));
        }
        if self.num_blocks == 0 {
            return Err(CodecError::InvalidField("num_blocks (zero)"));
        }
        if self.first_layer.checked_add(self.num_layers).is_none() {
            return Err(CodecError::InvalidField("layer range (overflows)"));
        }
        let s = self.shape;
        if s.num_kv_heads == 0 || s.block_size == 0 || s.head_dim == 0 {
            return Err(CodecError::InvalidField("shape (zero dimension)"));
        }
        let expected = [
            2,
            KvDtype::F16.size_bytes() as u64,
            s.num_kv_heads.into(),
            s.block_size.into(),
            s.head_dim.into(),
            self.num_layers.into(),
            self.num_blocks.into(),
        ]
        .iter()
        .try_fold(1u64, |acc, &v| acc.checked_mul(v));
        if expected != Some(self.payload_len) {
            return Err(CodecError::InvalidField(
                "payload_len (does not match the shape)",
            ));
        }
        Ok(())
    }
}

fn check_max(what: &'static str, got: u64, max: u64) -> Result<(), CodecError> {
    if got > max {
        return Err(CodecError::TooLarge { what, got, max });
    }
    Ok(())
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn blocks_checksum(blocks: &[BlockId]) -> u64 {
    let mut bytes = Vec::with_capacity(blocks.len() * 4);
    for b in blocks {
        bytes.extend_from_slice(&b.0.to_le_bytes());
    }
    xxh3_64(&bytes)
}

/// Writes one request's stream to one node: the preamble before the first frame, then a
/// frame per chunk.
#[derive(Clone, Debug)]
pub struct FrameEncoder {
    preamble: Preamble,
    limits: CodecLimits,
    next_seq: u32,
}

impl FrameEncoder {
    pub fn new(dest: NodeId, request: RequestId) -> Self {
        Self::with_limits(dest, request, CodecLimits::default())
    }

    pub fn with_limits(dest: NodeId, request: RequestId, limits: CodecLimits) -> Self {
        FrameEncoder {
            preamble: Preamble { dest, request },
            limits,
            next_seq: 0,
        }
    }

    pub fn preamble(&self) -> Preamble {
        self.preamble
    }

    /// Appends `chunk` (after the preamble, if this is the stream's first frame) to `out`.
    pub fn encode(&mut self, chunk: &KvChunk, out: &mut Vec<u8>) -> Result<(), CodecError> {
        out.reserve(PREAMBLE_LEN + FRAME_HEADER_LEN + chunk.header.blocks.len() * 4);
        self.encode_head(chunk, out)?;
        out.extend_from_slice(&chunk.payload);
        Ok(())
    }

    /// Like [`encode`](Self::encode) without the payload: the caller sends `chunk.payload`
    /// right after `out`, which spares copying megabytes into a frame buffer.
    pub fn encode_head(&mut self, chunk: &KvChunk, out: &mut Vec<u8>) -> Result<(), CodecError> {
        let h = &chunk.header;
        if h.request_id != self.preamble.request {
            return Err(CodecError::WrongRequest {
                expected: self.preamble.request,
                got: h.request_id,
            });
        }
        let num_blocks = u32::try_from(h.blocks.len()).map_err(|_| CodecError::TooLarge {
            what: "blocks",
            got: h.blocks.len() as u64,
            max: self.limits.max_blocks.into(),
        })?;
        let header = FrameHeader {
            seq: self.next_seq,
            first_layer: h.first_layer,
            num_layers: h.num_layers,
            num_blocks,
            shape: h.shape,
            payload_len: chunk.payload.len() as u64,
            payload_checksum: h.checksum,
            blocks_checksum: blocks_checksum(&h.blocks),
        };
        header.check(&self.limits)?;
        if self.next_seq == 0 {
            self.preamble.write(out);
        }
        header.write(out);
        for b in &h.blocks {
            out.extend_from_slice(&b.0.to_le_bytes());
        }
        // A stream of 2^32 frames is far beyond any prompt; wrapping would be caught as
        // out-of-order by the receiver rather than silently accepted.
        self.next_seq = self.next_seq.wrapping_add(1);
        Ok(())
    }
}

enum State {
    Preamble,
    Header,
    /// Header parsed; block ids and payload (preallocated to the checked size) accumulate.
    Body {
        header: FrameHeader,
        blocks: Vec<BlockId>,
        payload: Vec<u8>,
    },
}

/// Reads one stream: push bytes as they come, take chunks out.
///
/// Call [`next_chunk`](Self::next_chunk) until it returns `Ok(None)` after each
/// [`push`](Self::push); the decoder then holds at most one partial frame (bounded by the
/// limits) plus the bytes of the last push. After an error it keeps returning that error.
pub struct FrameDecoder {
    limits: CodecLimits,
    buf: BytesMut,
    state: State,
    preamble: Option<Preamble>,
    next_seq: u32,
    failed: Option<CodecError>,
}

impl Default for FrameDecoder {
    fn default() -> Self {
        Self::new(CodecLimits::default())
    }
}

impl FrameDecoder {
    pub fn new(limits: CodecLimits) -> Self {
        FrameDecoder {
            limits,
            buf: BytesMut::new(),
            state: State::Preamble,
            preamble: None,
            next_seq: 0,
            failed: None,
        }
    }

    /// The stream's preamble, once its bytes have been decoded by `next_chunk`.
    pub fn preamble(&self) -> Option<Preamble> {
        self.preamble
    }

    /// Hands the decoder more bytes of the stream.
    pub fn push(&mut self, mut input: &[u8]) {
        if self.failed.is_some() {
            return;
        }
        // Fast path for the bulk of the bytes: straight into the payload being assembled.
        if let State::Body {
            header, payload, ..
        } = &mut self.state
        {
            if self.buf.is_empty() && payload.capacity() > 0 {
                let want = header.payload_len as usize - payload.len();
                let n = want.min(input.len());
                payload.extend_from_slice(&input[..n]);
                input = &input[n..];
            }
        }
        self.buf.extend_from_slice(input);
    }

    /// The next complete, verified chunk; `Ok(None)` when more bytes are needed.
    pub fn next_chunk(&mut self) -> Result<Option<KvChunk>, CodecError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let r = self.step();
        if let Err(e) = &r {
            self.failed = Some(e.clone());
            self.buf = BytesMut::new();
            self.state = State::Header;
        }
        r
    }

    /// Declares the end of the stream: an error if it stopped inside a preamble or frame.
    pub fn finish(&self) -> Result<(), CodecError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        // A stream that never started carries nothing and is not an error.
        if matches!(self.state, State::Body { .. }) || !self.buf.is_empty() {
            return Err(CodecError::Truncated);
        }
        Ok(())
    }

    fn step(&mut self) -> Result<Option<KvChunk>, CodecError> {
        loop {
            match &mut self.state {
                State::Preamble => {
                    if self.buf.len() < PREAMBLE_LEN {
                        // Reject garbage as soon as the magic is visible.
                        let n = self.buf.len().min(4);
                        if self.buf[..n] != MAGIC[..n] {
                            let mut got = [0u8; 4];
                            got[..n].copy_from_slice(&self.buf[..n]);
                            return Err(CodecError::BadMagic { got });
                        }
                        return Ok(None);
                    }
                    let bytes: [u8; PREAMBLE_LEN] =
                        self.buf[..PREAMBLE_LEN].try_into().expect("length checked");
                    self.preamble = Some(Preamble::parse(&bytes)?);
                    self.buf.advance(PREAMBLE_LEN);
                    self.state = State::Header;
                }
                State::Header => {
                    if self.buf.len() < FRAME_HEADER_LEN {
                        return Ok(None);
                    }
                    let bytes: [u8; FRAME_HEADER_LEN] = self.buf[..FRAME_HEADER_LEN]
                        .try_into()
                        .expect("length checked");
                    let header = FrameHeader::parse(&bytes, &self.limits)?;
                    if header.seq != self.next_seq {
                        return Err(CodecError::OutOfOrder {
                            expected: self.next_seq,
                            got: header.seq,
                        });
                    }
                    self.buf.advance(FRAME_HEADER_LEN);
                    // Bounded by the limits checked in `parse`.
                    self.state = State::Body {
                        header,
                        blocks: Vec::with_capacity(header.num_blocks as usize),
                        payload: Vec::new(),
                    };
                }
                State::Body {
                    header,
                    blocks,
                    payload,
                } => {
                    while blocks.len() < header.num_blocks as usize && self.buf.len() >= 4 {
                        blocks.push(BlockId(self.buf.get_u32_le()));
                    }
                    if blocks.len() < header.num_blocks as usize {
                        return Ok(None);
                    }
                    if payload.capacity() == 0 {
                        let sum = blocks_checksum(blocks);
                        if sum != header.blocks_checksum {
                            return Err(CodecError::BlockListChecksum);
                        }
                        payload.reserve_exact(header.payload_len as usize);
                    }
                    let want = header.payload_len as usize - payload.len();
                    let n = want.min(self.buf.len());
                    payload.extend_from_slice(&self.buf[..n]);
                    self.buf.advance(n);
                    if payload.len() < header.payload_len as usize {
                        return Ok(None);
                    }
                    let request_id = self.preamble.expect("body follows preamble").request;
                    let chunk = KvChunk {
                        header: KvChunkHeader {
                            request_id,
                            first_layer: header.first_layer,
                            num_layers: header.num_layers,
                            blocks: std::mem::take(blocks),
                            dtype: KvDtype::F16,
                            shape: header.shape,
                            checksum: header.payload_checksum,
                        },
                        payload: std::mem::take(payload),
                    };
                    self.state = State::Header;
                    self.next_seq = self.next_seq.wrapping_add(1);
                    chunk.verify()?;
                    return Ok(Some(chunk));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
