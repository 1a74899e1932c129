//! Types shared by every kvmesh crate: identifiers, sampling parameters, finish reasons and
//! the prefix-block hashing that router, engine and kvstore must agree on.

pub mod block_hash;
pub mod fast_hash;
pub mod grpc;
pub mod hash_slots;
pub mod ids;
pub mod kv_tier;
pub mod metrics;
pub mod net;
pub mod prefetch;
pub mod protocol;
pub mod sampling;
pub mod shutdown;
pub mod tls;

pub use block_hash::{BlockHasher, ModelFingerprint, PromptHashes};
pub use ids::{BlockHash, BlockId, NodeId, RequestId, SequenceHash, TokenId};
pub use protocol::{
    GenerateEvent, GenerateRequest, KvEvent, LoadReport, NodeInfo, NodeRole, StepTotals,
    TokenEvent, Usage, WorkerError,
};
pub use sampling::{Constraint, FinishReason, SamplingParams, SamplingParamsError};
