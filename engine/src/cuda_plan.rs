//! The host-side plans of the CUDA backend, as pure functions of shapes and steps, so they
//! are tested without a GPU: the order of work on the compute and copy streams in a step
//! ([`kv_pipeline`]), which decode steps replay a CUDA graph and with what padded inputs
//! ([`graph_buckets`]), and the pinned host staging of KV read out for the transport
//! ([`staging`]). `cuda_backend` follows them.

pub mod graph_buckets;
pub mod kv_pipeline;
pub mod staging;
