//! The HTTP gateway: an OpenAI-compatible API (`/v1/chat/completions`, `/v1/completions`,
//! `/v1/models`), health, Prometheus metrics, API-key auth and request ids, in front of a
//! [`Backend`] that serves tokens.
//!
//! ```text
//! client ──HTTP──> Router (axum) ──GenerateRequest──> dyn Backend ──GenerateEvent*──> Router ──SSE/JSON──> client
//! ```
//!
//! The router authenticates, rate-limits per API key, validates (a clear OpenAI-style 4xx on
//! bad input), applies the chat template, tokenizes, admits or refuses (429 when the
//! estimated time to first token would break the TTFT target), fans out `n` backend requests
//! and turns their event streams into OpenAI responses. Every error goes through one
//! classifier, [`ApiError`].
//! Dropping the HTTP response body (client gone) drops the backend receivers, which is the
//! cancellation signal.
//!
//! Where a request goes is [`routing`] (the [`policy`] over the prompt's cached prefix and the
//! nodes' load, and the disaggregation rule); [`MeshBackend`] routes over the decode nodes,
//! retries the unavailable ones and migrates a request whose decode node fails mid-stream,
//! whatever reaches the nodes (a [`DecodeConnector`]: gRPC for the multi-process mesh,
//! [`RemoteBackend`], or the in-process workers of `kvmesh serve`). This crate's seam to the
//! workers is [`Backend`].

mod admission;
mod auth;
mod backend;
mod config;
mod error;
mod generation;
mod json;
mod mesh;
mod metrics;
mod openai;
pub mod policy;
mod prompt;
mod rate_limit;
mod remote;
mod request_id;
pub mod routing;
mod server;
mod sse;
mod stream_idle;

pub use crate::metrics::exporter as metrics_exporter;
pub use async_trait::async_trait;
pub use backend::Backend;
pub use config::{ConfigError, RouterConfig};
pub use error::ApiError;
pub use mesh::{BrokenStream, DecodeConnector, DecodeEvents, MeshBackend, MeshBackendConfig};
pub use stream_idle::StreamIdleConfig;

pub use remote::{GrpcConnector, RemoteBackend, RemoteConfig};
pub use server::Router;
