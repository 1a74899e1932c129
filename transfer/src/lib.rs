//! KV transfer between prefill and decode nodes: the chunk a prefill node pushes for each
//! layer it computes, and the transports that carry chunks behind one trait.
//!
//! - [`KvChunk`]: one request's KV for a range of layers and a list of destination blocks,
//!   with a header (request id, layers, blocks, dtype, block shape, xxh3 checksum) and the
//!   payload bytes in the *transfer layout* (per layer, per block: K then V, each
//!   `[num_kv_heads, block_size, head_dim]` little-endian f16). The engine's runners produce
//!   and consume that layout (`kvmesh_engine::kv_blocks`); this crate checks sizes and
//!   checksums and never looks inside.
//! - [`codec`]: the versioned wire format, sans-IO (bytes in, verified chunks out), bounded
//!   before it allocates; property-tested here and fuzzed under `transfer/fuzz`.
//! - [`Transport`]: send a chunk to a node, with backpressure; receive the chunks addressed to
//!   this node on a queue; end a transfer. [`InProcessTransport`] connects the workers of one
//!   process (`kvmesh serve`, tests); [`QuicTransport`] (quinn, rustls on ring) connects
//!   processes and hosts; [`RdmaTransport`] (feature `rdma`) writes one-sided into the
//!   receiver's registered memory. [`NetworkTransport`] is what a node runs: QUIC to every
//!   peer, RDMA to those it exchanged RDMA details with over the control plane.
//!
//! [`bench`](mod@bench) measures the QUIC transport against raw TCP and memcpy between two
//! processes (`kvmesh bench transfer`).
//!
//! A receiver verifies every chunk (`KvChunk::verify`; the network transports do it in the
//! codec) before using it, and never decodes on partial or corrupt KV: a failed transfer is
//! recomputed.

pub mod bench;
mod chunk;
pub mod codec;
mod in_process;
mod network;
pub mod quic;
pub mod rdma;
mod transport;

pub use chunk::{BlockShape, ChunkError, KvChunk, KvChunkHeader, KvDtype};
pub use crossbeam_channel;
pub use in_process::{InProcessTransport, SlowTo};
pub use network::{NetworkTransport, RdmaPeering};
pub use quic::{QuicConfig, QuicError, QuicTransport, TlsConfig};
pub use rdma::{
    LoopbackFabric, LoopbackRdma, RdmaConfig, RdmaEndpoint, RdmaError, RdmaPeerInfo, RdmaRegion,
    RdmaSendError, RdmaTransport, Undelivered,
};
pub use transport::{KvReceiver, Transport, TransportError};
