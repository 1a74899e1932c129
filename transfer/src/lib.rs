//! KV transfer between prefill and decode nodes: the chunk a prefill node pushes for each
//! layer it computes, and the transports that carry chunks behind one trait.
//!
//! - [`KvChunk`]: one request's KV for a range of layers and a list of destination blocks,
//!   with a header (request id, layers, blocks, dtype, block shape, xxh3 checksum) and the
//!   payload bytes in the *transfer layout* (per layer, per block: K then V, each
//!   `[num_kv_heads, block_size, head_dim]` little-endian f16). The engine's runners produce
//!   and consume that layout (`kvmesh_engine::kv_blocks`); this crate checks sizes and
//!   checksums and never looks inside. The versioned wire framing (and its fuzzing) comes with
//!   the cross-host transports; the header holds everything it will need.
//! - [`Transport`]: send a chunk to a node, with backpressure; receive the chunks addressed to
//!   this node on a queue. [`InProcessTransport`] connects the workers of one process (`kvmesh
//!   serve`, tests); QUIC and RDMA implementations come with the multi-process mesh.
//!
//! A receiver verifies every chunk (`KvChunk::verify`) before using it, and never decodes on
//! partial or corrupt KV: a failed transfer is recomputed.

mod chunk;
pub mod codec;
mod in_process;
pub mod quic;
mod transport;

pub use chunk::{BlockShape, ChunkError, KvChunk, KvChunkHeader, KvDtype};
pub use crossbeam_channel;
pub use in_process::InProcessTransport;
pub use quic::{QuicConfig, QuicError, QuicTransport, TlsConfig};
pub use transport::{KvReceiver, Transport, TransportError};
