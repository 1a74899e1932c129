//! The host-side plans of the CUDA backend, as pure functions of shapes and steps, so they
//! are tested without a GPU: the order of work on the compute and copy streams in a step
//! ([`kv_pipeline`]), which decode steps replay a CUDA graph and with what padded inputs
//! ([`graph_buckets`]), the pinned host staging of KV read out for the transport
//! ([`staging`]) and the pieces KV arriving from it is written in ([`unstaging`]).
//! `cuda_backend` follows them.

pub mod graph_buckets;
pub mod kv_pipeline;
pub mod staging;
pub mod unstaging;
