//! What the load generator sends: a list of requests (prompt, output length, and for trace
//! sources the arrival time and conversation links), built from a source before the clock
//! starts, so building requests never delays a send.
//!
//! Sources (see [`WorkloadSpec`]'s grammar): synthetic lengths, a JSONL file of prompts or
//! chat messages, a ShareGPT file, the Mooncake trace (`hash_ids`, so shared prefixes are real
//! shared prefixes) and the Azure conversation trace.
//!
//! # Grammar
//!
//! `KIND[:PATH][,key=value...]`, lengths in tokens:
//!
//! - `synthetic:input=LEN,output=LEN[,prefix=N][,scale=F][,max_input=N][,max_output=N]`, where
//!   `LEN` is `128` (fixed), `uniform(64,512)` (whole numbers, both ends included),
//!   `normal(256,64)` (mean, standard deviation; rounded, clipped to at least 1) or `azure`
//!   (drawn from the bundled Azure conversation trace; `input=azure,output=azure` draws one
//!   request's (ContextTokens, GeneratedTokens) pair, jointly). `prefix=N`: every prompt
//!   starts with the same N tokens (a shared system prompt; for chat, a system message), and
//!   `input` counts the tokens after it. `scale=F` divides azure lengths (rounding up);
//!   `max_input`/`max_output` cap every drawn length (after scaling).
//! - `jsonl:PATH`: one JSON object per line, `{"prompt": "text"}`, `{"prompt": [token ids]}`
//!   (completions only) or `{"messages": [{"role": .., "content": ..}, ..]}` (chat only),
//!   with an optional `max_tokens` or `output_tokens`. Blank lines are skipped.
//! - `sharegpt:PATH`: a ShareGPT JSON array of `{"conversations": [{"from", "value"}, ..]}`.
//!   A conversation's first human turn is the prompt (for chat: the messages up to it, a
//!   system turn included); its output length is the following gpt reply's, estimated as one
//!   token per [`CHARS_PER_TOKEN`] characters (rounded up), the usual rule for English text in
//!   BPE vocabularies. Conversations without a human turn followed by a reply are skipped.
//! - `mooncake[:PATH][,scale=S][,conversations=N]`: the Mooncake FAST'25 trace ([`trace`]; the
//!   bundled one without a path), lengths divided by `S` (default 16; it divides 512), hash ids
//!   turned into prompts block by block so a shared id is a shared prefix, arrivals from the
//!   timestamps, follow-up turns linked. `conversations=N`: N whole multi-turn conversations
//!   spread over the trace instead of its first requests.
//! - `azure[:PATH][,scale=F]`: the Azure LLM inference 2023 conversation CSV
//!   (`TIMESTAMP,ContextTokens,GeneratedTokens`; the bundled one without a path), arrivals from
//!   the timestamps, synthetic prompts of its lengths divided by `F` (rounding up).
//!
//! A path after `mooncake:` or `azure:` ends at the first comma.
//!
//! # Requests and output lengths
//!
//! [`WorkloadOptions::requests`] is how many requests a synthetic workload has, and the most
//! any other source gives (its first ones, in file or arrival order; a driver cycles a shorter
//! workload). [`WorkloadOptions::max_tokens`] replaces output lengths the source lacks or only
//! estimates (JSONL lines without one, ShareGPT) and caps those it gives (synthetic draws,
//! traces, a JSONL line's own).
//!
//! # Prompt content
//!
//! For the completions API synthetic and trace prompts are token ids ([`Prompt::Tokens`]), of
//! exact lengths, from [`trace::DEFAULT_TOKEN_IDS`]; each synthetic or Azure prompt starts
//! (after any `prefix=`) with a token no other prompt of the workload starts with there (up to
//! the range's 39,000 prompts), so prompts share no prefix by chance. For chat they are text of
//! [`ONE_TOKEN_WORDS`], one word per token (see [`text`] for why that is about,
//! not exactly, the token count; the server's `usage.prompt_tokens` is exact). Content is
//! deterministic from [`WorkloadOptions::seed`]; Mooncake content depends only on the hash
//! ids (same id, same tokens or text).

use std::ops::Range;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::load::Api;
use crate::trace::{self, TraceError};

mod azure;
mod files;
mod mooncake;
mod spec;
mod synthetic;
pub mod text;

pub use azure::{parse_azure, AzureRecord, BUNDLED_AZURE_TRACE, BUNDLED_AZURE_TRACE_PATH};
pub use files::CHARS_PER_TOKEN;
pub use spec::{Length, SyntheticSpec, WorkloadSpec, DEFAULT_MOONCAKE_SCALE};
pub use text::ONE_TOKEN_WORDS;

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

/// The output length of a JSONL line that gives none, without [`WorkloadOptions::max_tokens`].
pub const DEFAULT_MAX_TOKENS: u32 = 128;

/// How a [`WorkloadSpec`] becomes requests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkloadOptions {
    /// Chat prompts must be text; completions prompts may be token ids.
    pub api: Api,
    /// How many requests a synthetic workload has; the most any other source gives.
    pub requests: usize,
    /// Seeds lengths and prompt content.
    pub seed: u64,
    /// Replaces output lengths a source lacks or estimates, caps those it gives.
    pub max_tokens: Option<u32>,
    /// Token ids synthetic and trace prompts are drawn from.
    pub token_ids: Range<u32>,
}

impl WorkloadOptions {
    /// `requests` requests for `api`, seed 0, the source's own output lengths.
    pub fn new(api: Api, requests: usize) -> Self {
        WorkloadOptions {
            api,
            requests,
            seed: 0,
            max_tokens: None,
            token_ids: trace::DEFAULT_TOKEN_IDS,
        }
    }

    /// A length the source gives, capped by `max_tokens`.
    fn cap_output(&self, len: u32) -> u32 {
        self.max_tokens.map_or(len, |m| len.min(m)).max(1)
    }
}

/// Why a workload could not be built.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    #[error(transparent)]
    Spec(#[from] crate::grammar::ParseError),
    #[error("opening {path}: {error}")]
    Open {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{file} line {line}: {error}")]
    Read {
        file: String,
        line: usize,
        error: std::io::Error,
    },
    #[error("{file} line {line}: longer than {max} bytes")]
    LineTooLong {
        file: String,
        line: usize,
        max: usize,
    },
    #[error("{file} line {line}: {message}")]
    Malformed {
        file: String,
        line: usize,
        message: String,
    },
    #[error("{file} line {line}: a prompt of token ids needs the completions API, not chat")]
    TokensForChat { file: String, line: usize },
    #[error("{file} line {line}: chat messages need the chat API, not completions")]
    MessagesForCompletions { file: String, line: usize },
    #[error("{0} holds no requests")]
    Empty(String),
    #[error("a workload needs at least one request (requests is 0)")]
    ZeroRequests,
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    #[error("the token id range {0:?} is empty")]
    EmptyTokenIds(Range<u32>),
    #[error(transparent)]
    Trace(#[from] TraceError),
}

impl WorkloadSpec {
    /// Builds the requests, all of them, before any is sent.
    pub fn load(&self, opts: &WorkloadOptions) -> Result<Workload, WorkloadError> {
        if opts.requests == 0 {
            return Err(WorkloadError::ZeroRequests);
        }
        if opts.max_tokens == Some(0) {
            return Err(WorkloadError::ZeroMaxTokens);
        }
        if opts.token_ids.is_empty() {
            return Err(WorkloadError::EmptyTokenIds(opts.token_ids.clone()));
        }
        let items = match self {
            WorkloadSpec::Synthetic(spec) => synthetic::items(spec, opts)?,
            WorkloadSpec::Jsonl(path) => files::jsonl_items(path, opts)?,
            WorkloadSpec::ShareGpt(path) => files::sharegpt_items(path, opts)?,
            WorkloadSpec::Mooncake {
                path,
                scale,
                conversations,
            } => mooncake::items(path.as_deref(), *scale, *conversations, opts)?,
            WorkloadSpec::Azure { path, scale } => azure::items(path.as_deref(), *scale, opts)?,
        };
        if items.is_empty() {
            return Err(WorkloadError::Empty(self.to_string()));
        }
        Ok(Workload {
            name: self.to_string(),
            items,
        })
    }
}

impl Workload {
    /// The best prefix-cache hit rate its requests allow, sent in order
    /// ([`trace::ideal_hit_rate`]); 0 for sources without hash ids.
    pub fn ideal_hit_rate(&self) -> f64 {
        trace::block_hit_rate(self.items.iter().map(|i| i.hash_ids.as_slice()))
    }
}

/// A trace's length divided by `scale`, rounded up, at least 1.
fn scaled(len: u64, scale: f64) -> u32 {
    ((len as f64 / scale).ceil() as u64).clamp(1, u64::from(u32::MAX)) as u32
}

/// Maps a bounded-line failure to the file and line at fault.
fn line_error(file: &str, line: usize, e: trace::LineError) -> WorkloadError {
    match e {
        trace::LineError::Io(error) => WorkloadError::Read {
            file: file.to_owned(),
            line,
            error,
        },
        trace::LineError::TooLong => WorkloadError::LineTooLong {
            file: file.to_owned(),
            line,
            max: trace::MAX_LINE_BYTES,
        },
    }
}

fn open(path: &std::path::Path) -> Result<std::fs::File, WorkloadError> {
    std::fs::File::open(path).map_err(|error| WorkloadError::Open {
        path: path.to_owned(),
        error,
    })
}
