//! What the load generator sends: a list of requests (prompt, output length, and for trace
//! sources the arrival time and conversation links), built from a source before the clock
//! starts, so building requests never delays a send.
//!
//! Sources (see [`WorkloadSpec`]'s grammar): synthetic lengths, a JSONL file of prompts or
//! chat messages, a ShareGPT file, the Mooncake trace (`hash_ids`, so shared prefixes are real
//! shared prefixes) and the Azure conversation trace.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// One request's input.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Prompt {
    /// A text prompt (completions: `prompt`; chat: one user message).
    Text(String),
    /// Token ids (completions only: `prompt: [ids]`, so the server tokenizes nothing and the
    /// prompt's length is exact).
    Tokens(Vec<u32>),
    /// A conversation (chat only).
    Messages(Vec<Message>),
}

/// One chat message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// One request of a workload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkItem {
    pub prompt: Prompt,
    /// Sent as `max_tokens` (with `ignore_eos` where asked, the output length).
    pub max_tokens: u32,
    /// Arrival in the source trace, from its first request (before any pacing); `None` for
    /// sources without times. A trace-timed load shape paces these.
    pub at: Option<Duration>,
    /// The previous turn of its conversation (an index into the same list): its prompt holds
    /// that turn's answer, so it is not sent before that turn has ended.
    pub previous_turn: Option<usize>,
    /// The trace's block ids behind the prompt (for the ideal prefix-hit rate); empty for
    /// sources without them.
    pub hash_ids: Vec<u64>,
}

/// The requests of a run, in the order they are sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Workload {
    /// Where it came from, for the report (the spec in its parsed form).
    pub name: String,
    pub items: Vec<WorkItem>,
}
