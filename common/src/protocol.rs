//! Messages between the router and the workers. The in-process mesh passes them over
//! channels; the multi-process mesh carries the same messages over gRPC.

use crate::block_hash::ModelFingerprint;
use crate::ids::{NodeId, RequestId, SequenceHash, TokenId};
use crate::sampling::{FinishReason, SamplingParams};
use serde::{Deserialize, Serialize};

/// Router -> decode worker: generate a continuation of `prompt`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GenerateRequest {
    pub request_id: RequestId,
    pub prompt: Vec<TokenId>,
    pub params: SamplingParams,
    /// Tokens already generated and delivered for this request by a decode node that then
    /// failed: the request is migrated and continues right after them (their KV is
    /// recomputed; their text is not sent again). `params` are the original ones, so
    /// `max_tokens` counts these tokens too. Empty for a new request.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub resume: Vec<TokenId>,
}

/// One generated token with the text it completes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenEvent {
    pub token: TokenId,
    /// Text that is final with this token (may be empty while a character or a possible stop
    /// string is held back).
    pub text: String,
    /// Log-probability of `token` (when `params.logprobs` is set).
    pub logprob: Option<f32>,
    /// The most likely alternatives at this position, best first.
    pub top_logprobs: Vec<(TokenId, f32)>,
}

/// Token counts of a finished request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    /// Prompt tokens served from a prefix cache instead of being computed.
    pub cached_tokens: u32,
}

/// Decode worker -> router: the stream of one request. Ends with `Finished` or `Error`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum GenerateEvent {
    Token(TokenEvent),
    /// The last event: why it stopped, trailing text held back until now, and usage.
    Finished {
        reason: FinishReason,
        text: String,
        usage: Usage,
    },
    Error(WorkerError),
}

/// Why a worker could not serve a request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum WorkerError {
    /// The request itself is unservable (bad parameters, prompt too long): a client error.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The worker's queue is full: retry later.
    #[error("overloaded: {0}")]
    Overloaded(String),
    /// The worker is draining or stopped.
    #[error("unavailable: {0}")]
    Unavailable(String),
    #[error("internal error: {0}")]
    Internal(String),
}

/// A change in which prefixes a node's KV pool can serve from cache; nodes publish these and
/// the prefix index consumes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum KvEvent {
    /// A full block with this hash was cached and can now be a prefix hit.
    Stored(SequenceHash),
    /// The block with this hash was reallocated; the prefix is gone from this pool.
    Removed(SequenceHash),
}

/// What a node does in the mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeRole {
    Router,
    Prefill,
    Decode,
}

impl NodeRole {
    pub fn as_str(self) -> &'static str {
        match self {
            NodeRole::Router => "router",
            NodeRole::Prefill => "prefill",
            NodeRole::Decode => "decode",
        }
    }
}

/// How a node announces itself in discovery.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    pub node_id: NodeId,
    pub role: NodeRole,
    /// Where its control plane (gRPC) listens (`in-process` for the embedded mesh).
    pub address: String,
    /// Where it receives KV (QUIC, UDP); empty for nodes that receive none.
    #[serde(default)]
    pub transfer_address: String,
    /// The model it serves; nodes only share KV with the same fingerprint, and a router
    /// routes only to nodes serving its model.
    pub model_fingerprint: ModelFingerprint,
    /// Tokens per KV block: prefix hashes (and KV transfers) are in blocks of this size.
    pub block_size: usize,
    pub kv_blocks_total: usize,
}

/// A node's load as last reported.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LoadReport {
    pub running: usize,
    pub waiting: usize,
    pub kv_blocks_used: usize,
    /// Prompt tokens its requests wait to have computed here: the uncomputed part of every
    /// waiting prompt and of every prompt still being prefilled in chunks (a decode node's
    /// local prefills included, its remote ones not). The planner sizes prefill on it.
    #[serde(default)]
    pub queued_prompt_tokens: u64,
    /// Every engine step the node has run and what they held, summed since it started: a
    /// planner differences two reports into the steps between them and refits its
    /// performance model to them.
    #[serde(default)]
    pub steps: StepTotals,
}

/// Engine steps summed: how many, what they computed and how long they took. A step's
/// one-token chunks are decodes, its longer chunks prefill.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepTotals {
    pub steps: u64,
    /// Tokens the prefill chunks computed.
    pub prefill_tokens: u64,
    /// Tokens of KV the prefill chunks read but did not compute (the prompt before them).
    pub prefill_cached_tokens: u64,
    /// Decode chunks: one sequence, one token, a step.
    pub decode_seqs: u64,
    /// The decode chunks' contexts (positions, the new token's included).
    pub decode_context_tokens: u64,
    /// Time the steps took, planning to sampled outputs.
    pub micros: u64,
}

impl StepTotals {
    /// Both readings' steps together.
    pub fn plus(self, other: StepTotals) -> StepTotals {
        StepTotals {
            steps: self.steps + other.steps,
            prefill_tokens: self.prefill_tokens + other.prefill_tokens,
            prefill_cached_tokens: self.prefill_cached_tokens + other.prefill_cached_tokens,
            decode_seqs: self.decode_seqs + other.decode_seqs,
            decode_context_tokens: self.decode_context_tokens + other.decode_context_tokens,
            micros: self.micros + other.micros,
        }
    }

    /// The steps of `self` that `before` (an earlier reading of the same node) had not seen;
    /// `None` if `before` is not earlier (the node restarted and counts from zero again).
    pub fn since(&self, before: &StepTotals) -> Option<StepTotals> {
        Some(StepTotals {
            steps: self.steps.checked_sub(before.steps)?,
            prefill_tokens: self.prefill_tokens.checked_sub(before.prefill_tokens)?,
            prefill_cached_tokens: self
                .prefill_cached_tokens
                .checked_sub(before.prefill_cached_tokens)?,
            decode_seqs: self.decode_seqs.checked_sub(before.decode_seqs)?,
            decode_context_tokens: self
                .decode_context_tokens
                .checked_sub(before.decode_context_tokens)?,
            micros: self.micros.checked_sub(before.micros)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_info_keeps_the_fingerprint_a_plain_number_in_json() {
        let info = NodeInfo {
            node_id: NodeId(3),
            role: NodeRole::Decode,
            address: "10.0.0.1:7000".into(),
            transfer_address: String::new(),
            model_fingerprint: ModelFingerprint(u64::MAX),
            block_size: 16,
            kv_blocks_total: 100,
        };
        let json = serde_json::to_value(&info).unwrap();
        assert_eq!(json["model_fingerprint"], serde_json::json!(u64::MAX));
        assert_eq!(json["block_size"], 16);
        let back: NodeInfo = serde_json::from_value(json).unwrap();
        assert_eq!(back, info);
    }
}
