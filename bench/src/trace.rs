//! Mooncake traces (FAST'25) and their scaling to a small model.
//!
//! A trace is JSON Lines, one request per line:
//! `{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [..]}`,
//! where each hash id names one 512-token block of the prompt and a repeated id is a shared
//! prefix. Scaling by `s` turns every block into a fixed pseudo-random run of `512 / s` token
//! ids (the same run wherever the id appears), so prompts shrink by `s` but share exactly
//! the prefixes the trace shares.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

/// Tokens behind one hash id in the trace.
pub const TRACE_BLOCK_TOKENS: u32 = 512;

/// The Mooncake conversation trace bundled with the repository, built into the binary so that
/// a replay finds it from any working directory and with no checkout beside the binary.
pub const BUNDLED_TRACE: &str = include_str!("../../data/traces/mooncake_conversation_trace.jsonl");

/// Where the bundled trace lives in the repository (its source and licence: `data/README.md`).
pub const BUNDLED_TRACE_PATH: &str = "data/traces/mooncake_conversation_trace.jsonl";

/// A longer line is an error, not a reason to buffer without bound.
pub(crate) const MAX_LINE_BYTES: usize = 1 << 20;

/// Token ids drawn for prompts by default: clear of the special and byte tokens at the low
/// end of the vocabulary and inside SmolLM2's 49,152.
pub const DEFAULT_TOKEN_IDS: Range<u32> = 1000..40_000;

/// One line of a trace.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct TraceRecord {
    /// Arrival time, milliseconds from an arbitrary origin.
    pub timestamp: u64,
    pub input_length: u64,
    pub output_length: u64,
    /// One id per 512-token block of the prompt; the last block may be partial.
    pub hash_ids: Vec<u64>,
}

/// Why a trace could not be read or scaled.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("opening trace {path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("trace line {line}: {source}")]
    Read { line: usize, source: std::io::Error },
    #[error("trace line {line}: longer than {max} bytes")]
    LineTooLong { line: usize, max: usize },
    #[error("trace line {line}: {message}")]
    Malformed { line: usize, message: String },
    #[error("trace line {line}: {reason}")]
    Invalid { line: usize, reason: String },
    #[error("the trace holds no requests")]
    Empty,
    #[error("scale {0} must divide {TRACE_BLOCK_TOKENS} (1, 2, 4, ... 512)")]
    BadScale(u32),
    #[error("{0}")]
    BadConfig(String),
}

/// Where a trace is read from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TraceSource {
    /// [`BUNDLED_TRACE`], the conversation trace built into the binary.
    Bundled,
    /// A JSON Lines file.
    File(PathBuf),
}

impl TraceSource {
    /// The file at `path`, or the bundled trace without one.
    pub fn from_path(path: Option<PathBuf>) -> Self {
        path.map_or(TraceSource::Bundled, TraceSource::File)
    }

    /// Reads at most `limit` requests (all with `None`).
    pub fn read(&self, limit: Option<usize>) -> Result<Vec<TraceRecord>, TraceError> {
        match self {
            TraceSource::Bundled => parse_trace(BUNDLED_TRACE.as_bytes(), limit),
            TraceSource::File(path) => read_trace(path, limit),
        }
    }
}

impl std::fmt::Display for TraceSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TraceSource::Bundled => write!(f, "the bundled trace ({BUNDLED_TRACE_PATH})"),
            TraceSource::File(path) => write!(f, "{}", path.display()),
        }
    }
}

/// Reads at most `limit` requests (all with `None`) from the trace at `path`.
pub fn read_trace(path: &Path, limit: Option<usize>) -> Result<Vec<TraceRecord>, TraceError> {
    let file = File::open(path).map_err(|source| TraceError::Open {
        path: path.to_owned(),
        source,
    })?;
    parse_trace(BufReader::new(file), limit)
}

/// Parses at most `limit` requests from JSON Lines; blank lines are skipped, and errors
/// name the (1-based) line.
pub fn parse_trace<R: BufRead>(
    mut reader: R,
    limit: Option<usize>,
) -> Result<Vec<TraceRecord>, TraceError> {
    let limit = limit.unwrap_or(usize::MAX);
    let mut records = Vec::new();
    let mut buf = Vec::new();
    let mut line = 0;
    while records.len() < limit {
        line += 1;
        match read_bounded_line(&mut reader, &mut buf, MAX_LINE_BYTES) {
            Ok(true) => {}
            Ok(false) => break,
            Err(LineError::Io(source)) => return Err(TraceError::Read { line, source }),
            Err(LineError::TooLong) => {
                return Err(TraceError::LineTooLong {
                    line,
                    max: MAX_LINE_BYTES,
                })
            }
        }
        if buf.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let record: TraceRecord =
            serde_json::from_slice(&buf).map_err(|e| TraceError::Malformed {
                line,
                message: e.to_string(),
            })?;
        validate(&record).map_err(|reason| TraceError::Invalid { line, reason })?;
        records.push(record);
    }
    Ok(records)
}

/// Why [`read_bounded_line`] found no line.
#[derive(Debug)]
pub(crate) enum LineError {
    Io(std::io::Error),
    /// Longer than the bound: the file is not what it claims to be.
    TooLong,
}

/// Reads the next line (with its `\n`) into `buf`, refusing one longer than `max` bytes so a
/// file without newlines is not buffered whole; `Ok(false)` at the end. Shared by every line
/// format the bench reads (Mooncake, JSONL prompts, the Azure CSV).
pub(crate) fn read_bounded_line<R: BufRead>(
    reader: &mut R,
    buf: &mut Vec<u8>,
    max: usize,
) -> Result<bool, LineError> {
    buf.clear();
    let read = std::io::Read::take(reader, max as u64 + 1)
        .read_until(b'\n', buf)
        .map_err(LineError::Io)?;
    if buf.len() > max {
        return Err(LineError::TooLong);
    }
    Ok(read > 0)
}

fn validate(r: &TraceRecord) -> Result<(), String> {
    if r.input_length == 0 {
        return Err("input_length must be positive".into());
    }
    let blocks = r.input_length.div_ceil(u64::from(TRACE_BLOCK_TOKENS));
    if blocks != r.hash_ids.len() as u64 {
        return Err(format!(
            "input_length {} needs {blocks} hash_ids (one per {TRACE_BLOCK_TOKENS} tokens), got {}",
            r.input_length,
            r.hash_ids.len()
        ));
    }
    Ok(())
}

/// How arrival times are compressed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Pacing {
    /// Every gap between arrivals divided by this factor (1 = the trace's own pace).
    Speedup(f64),
    /// Gaps scaled so the requests arrive at this mean rate (per second), keeping the
    /// trace's burstiness.
    RequestsPerSecond(f64),
}

/// How a trace becomes requests for a small model.
#[derive(Clone, Debug, PartialEq)]
pub struct ScaleConfig {
    /// Prompt and output lengths are divided by this; must divide 512.
    pub scale: u32,
    pub pacing: Pacing,
    /// Cap on each request's `max_tokens` (after scaling).
    pub max_output_tokens: u32,
    /// Prompts longer than this (after scaling) are cut, dropping their trailing blocks.
    pub max_prompt_tokens: Option<usize>,
    /// Prompt token ids are drawn from this range.
    pub token_ids: Range<u32>,
}

impl Default for ScaleConfig {
    fn default() -> Self {
        ScaleConfig {
            scale: 16,
            pacing: Pacing::Speedup(1.0),
            max_output_tokens: 32,
            max_prompt_tokens: None,
            token_ids: DEFAULT_TOKEN_IDS,
        }
    }
}

impl ScaleConfig {
    /// Prompt tokens behind one hash id.
    pub fn block_tokens(&self) -> u32 {
        TRACE_BLOCK_TOKENS / self.scale.max(1)
    }

    fn check(&self) -> Result<(), TraceError> {
        if self.scale == 0 || !TRACE_BLOCK_TOKENS.is_multiple_of(self.scale) {
            return Err(TraceError::BadScale(self.scale));
        }
        let pace = match self.pacing {
            Pacing::Speedup(f) | Pacing::RequestsPerSecond(f) => f,
        };
        if !(pace.is_finite() && pace > 0.0) {
            return Err(TraceError::BadConfig(format!(
                "the pacing ({pace}) must be a positive number"
            )));
        }
        if self.max_output_tokens == 0 {
            return Err(TraceError::BadConfig(
                "max_output_tokens must be positive".into(),
            ));
        }
        if self.max_prompt_tokens == Some(0) {
            return Err(TraceError::BadConfig(
                "max_prompt_tokens must be positive".into(),
            ));
        }
        if self.token_ids.is_empty() {
            return Err(TraceError::BadConfig(format!(
                "the token id range {:?} is empty",
                self.token_ids
            )));
        }
        Ok(())
    }
}

/// One request ready to send.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScaledRequest {
    /// When to send it, from the start of the replay.
    pub at: Duration,
    pub prompt_tokens: Vec<u32>,
    pub max_tokens: u32,
    /// The trace's block ids behind the prompt (fewer when `max_prompt_tokens` cut it).
    pub hash_ids: Vec<u64>,
    /// The previous turn of its conversation (an index into the same list): the prompt
    /// holds that turn's answer, so it cannot be sent before that turn has ended.
    pub previous_turn: Option<usize>,
}

/// Reads at most `limit` requests from `path` and scales them.
/// The requests of `conversations` multi-turn conversations spread evenly over the trace
/// (by when they start), in time order.
///
/// Consecutive windows of the conversation trace share little (about 4% of blocks in any
/// 100 requests): a conversation's turns are spread over the hour the trace covers. A turn's
/// prompt extends the previous turn's, so turns of one conversation share their first
/// blocks after the common system block: grouping by the second hash id (the first for
/// one-block prompts) finds them, and replaying whole conversations keeps the reuse a real
/// deployment sees while fitting in a short run.
///
/// Spread, not the first ones: the first 20 conversations all start within 12 s of a
/// 3,500 s trace while their later turns stretch over half an hour, so compressed to a
/// replay they would open with a burst of every first turn at 20 times the mean rate, an
/// arrival pattern the trace itself never has.
pub fn sample_conversations(records: &[TraceRecord], conversations: usize) -> Vec<TraceRecord> {
    let mut order: Vec<u64> = Vec::new();
    let mut turns: std::collections::HashMap<u64, Vec<&TraceRecord>> = Default::default();
    for r in records {
        let Some(k) = conversation_key(r) else {
            continue;
        };
        let group = turns.entry(k).or_default();
        if group.is_empty() {
            order.push(k);
        }
        group.push(r);
    }
    let multi_turn: Vec<&Vec<&TraceRecord>> = order
        .iter()
        .map(|k| &turns[k])
        .filter(|g| g.len() >= 2)
        .collect();
    let n = conversations.min(multi_turn.len());
    let mut sample: Vec<TraceRecord> = (0..n)
        .flat_map(|i| multi_turn[i * multi_turn.len() / n].iter())
        .map(|r| (*r).clone())
        .collect();
    sample.sort_by_key(|r| r.timestamp);
    sample
}

/// Reads at most `limit` requests from `source` and scales them by `config`.
pub fn load_trace(
    source: &TraceSource,
    limit: Option<usize>,
    config: &ScaleConfig,
) -> Result<Vec<ScaledRequest>, TraceError> {
    scale_trace(&source.read(limit)?, config)
}

/// Scales `records` by `config`, in order of arrival.
pub fn scale_trace(
    records: &[TraceRecord],
    config: &ScaleConfig,
) -> Result<Vec<ScaledRequest>, TraceError> {
    config.check()?;
    // Arrival order (stable, so ties keep the trace's order).
    let mut records: Vec<&TraceRecord> = records.iter().collect();
    records.sort_by_key(|r| r.timestamp);
    if records.is_empty() {
        return Err(TraceError::Empty);
    }
    let timestamps: Vec<u64> = records.iter().map(|r| r.timestamp).collect();
    let offsets = paced_offsets(&timestamps, config.pacing);
    let previous = previous_turns(&records);
    let block = config.block_tokens() as usize;
    let scale = u64::from(config.scale);
    let prompt_len = |r: &TraceRecord| {
        let len = r.input_length.div_ceil(scale) as usize;
        config.max_prompt_tokens.map_or(len, |max| len.min(max))
    };
    let mut blocks = BlockTokens::new(
        records
            .iter()
            .flat_map(|r| &r.hash_ids[..prompt_len(r).div_ceil(block)]),
        block,
        &config.token_ids,
    );
    Ok(records
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let len = prompt_len(r);
            let hash_ids = r.hash_ids[..len.div_ceil(block)].to_vec();
            let mut prompt_tokens = Vec::with_capacity(len);
            for (&id, start) in hash_ids.iter().zip((0..len).step_by(block)) {
                blocks.extend(&mut prompt_tokens, id, (len - start).min(block));
            }
            let max_tokens = r
                .output_length
                .div_ceil(scale)
                .clamp(1, u64::from(config.max_output_tokens)) as u32;
            ScaledRequest {
                at: offsets[i],
                prompt_tokens,
                max_tokens,
                hash_ids,
                previous_turn: previous[i],
            }
        })
        .collect())
}

/// Send offsets for trace timestamps (milliseconds, in arrival order), from the first one:
/// a linear map, so order and relative gaps are kept (to the nanosecond it rounds to).
///
/// With a pacing that is not a positive number the offsets are those of the trace's own pace.
/// All at one instant, [`Pacing::RequestsPerSecond`] spreads them evenly at the rate.
pub fn paced_offsets(timestamps_ms: &[u64], pacing: Pacing) -> Vec<Duration> {
    let (Some(&first), Some(&last)) = (timestamps_ms.iter().min(), timestamps_ms.iter().max())
    else {
        return Vec::new();
    };
    let span_ms = (last - first) as f64;
    // Nanoseconds per trace millisecond: whole-nanosecond arithmetic, so a speed-up by a power
    // of two keeps every gap exactly.
    let ns_per_ms = match pacing {
        Pacing::Speedup(f) if f.is_finite() && f > 0.0 => 1e6 / f,
        Pacing::RequestsPerSecond(rate) if rate.is_finite() && rate > 0.0 && span_ms > 0.0 => {
            (timestamps_ms.len() - 1) as f64 / rate * 1e9 / span_ms
        }
        Pacing::RequestsPerSecond(rate) if rate.is_finite() && rate > 0.0 => {
            return (0..timestamps_ms.len())
                .map(|i| Duration::from_nanos((i as f64 * 1e9 / rate).round() as u64))
                .collect();
        }
        _ => 1e6,
    };
    timestamps_ms
        .iter()
        .map(|&t| Duration::from_nanos(((t - first) as f64 * ns_per_ms).round() as u64))
        .collect()
}

/// Which conversation a request belongs to: its second hash id, the first after the common
/// system block (the first for a one-block prompt).
fn conversation_key(r: &TraceRecord) -> Option<u64> {
    r.hash_ids.get(1).or(r.hash_ids.first()).copied()
}

/// For each of `records` (in arrival order), the latest earlier one of its conversation
/// whose prompt, but for its last (possibly partial) block, begins this one's: the turn
/// this one follows up on. A one-block prompt has nothing to follow up on.
fn previous_turns(records: &[&TraceRecord]) -> Vec<Option<usize>> {
    let mut by_key: std::collections::HashMap<u64, Vec<usize>> = Default::default();
    records
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let earlier = by_key.entry(conversation_key(r)?).or_default();
            let previous = earlier.iter().rev().copied().find(|&j| {
                let full = &records[j].hash_ids[..records[j].hash_ids.len() - 1];
                !full.is_empty() && r.hash_ids.len() > full.len() && r.hash_ids.starts_with(full)
            });
            earlier.push(i);
            previous
        })
        .collect()
}

/// Blocks' token ids ([`block_token_ids`]) for a trace's prompts: a block named by more
/// than one prompt (a conversation's earlier turns, a shared system prompt) is generated once
/// and copied after, the others are generated in place. Generating costs some 30
/// instructions a token, a copy a fraction of one.
struct BlockTokens<'a> {
    block: usize,
    ids: &'a Range<u32>,
    /// Every hash id named more than once, with its whole block once generated.
    shared: std::collections::HashMap<u64, Vec<u32>>,
}

impl<'a> BlockTokens<'a> {
    /// For the blocks `hash_ids` name (every use, in any order).
    fn new<'r>(hash_ids: impl Iterator<Item = &'r u64>, block: usize, ids: &'a Range<u32>) -> Self {
        let mut uses: std::collections::HashMap<u64, bool> = Default::default();
        for &id in hash_ids {
            uses.entry(id)
                .and_modify(|again| *again = true)
                .or_insert(false);
        }
        let shared = uses
            .into_iter()
            .filter(|&(_, again)| again)
            .map(|(id, _)| (id, Vec::new()))
            .collect();
        BlockTokens { block, ids, shared }
    }

    /// Appends the first `len` tokens of block `hash_id` to `out`: the same as
    /// `block_token_ids(hash_id, len, ids)`, since a shorter block is a longer one's start.
    fn extend(&mut self, out: &mut Vec<u32>, hash_id: u64, len: usize) {
        match self.shared.get_mut(&hash_id) {
            Some(tokens) => {
                if tokens.is_empty() {
                    tokens.extend(block_token_ids(hash_id, self.block, self.ids));
                }
                out.extend_from_slice(&tokens[..len]);
            }
            None => out.extend(block_token_ids(hash_id, len, self.ids)),
        }
    }
}

/// The first `len` token ids of the block named `hash_id`: a fixed pseudo-random sequence
/// (splitmix64, so it never changes with a dependency's version) drawn from `ids`.
pub fn block_token_ids(hash_id: u64, len: usize, ids: &Range<u32>) -> impl Iterator<Item = u32> {
    let span = u64::from(ids.end.saturating_sub(ids.start)).max(1);
    let start = ids.start;
    let mut state = hash_id ^ 0x6b76_6d65_7368_0001;
    (0..len).map(move |_| {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        start + (z % span) as u32
    })
}

/// The best prefix-cache hit rate the requests allow: the fraction of prompt blocks whose
/// hash id appeared in an earlier request (0 when there are no blocks). It counts blocks,
/// not tokens, so a partial last block weighs as much as a full one.
pub fn ideal_hit_rate<'a>(requests: impl IntoIterator<Item = &'a ScaledRequest>) -> f64 {
    block_hit_rate(requests.into_iter().map(|r| r.hash_ids.as_slice()))
}

/// [`ideal_hit_rate`] of requests given by their hash ids, in order of sending.
pub fn block_hit_rate<'a>(requests: impl IntoIterator<Item = &'a [u64]>) -> f64 {
    let mut seen = std::collections::HashSet::new();
    let (mut blocks, mut hits) = (0usize, 0usize);
    for hash_ids in requests {
        blocks += hash_ids.len();
        hits += hash_ids.iter().filter(|id| seen.contains(*id)).count();
        seen.extend(hash_ids.iter().copied());
    }
    if blocks == 0 {
        0.0
    } else {
        hits as f64 / blocks as f64
    }
}

#[cfg(test)]
mod conversation_tests {
    use super::*;

    fn rec(t: u64, ids: &[u64]) -> TraceRecord {
        TraceRecord {
            timestamp: t,
            input_length: 512 * ids.len() as u64,
            output_length: 1,
            hash_ids: ids.to_vec(),
        }
    }

    #[test]
    fn whole_multi_turn_conversations_are_kept_in_time_order() {
        let records = [
            rec(0, &[0, 1]),
            rec(1, &[0, 5]),
            rec(2, &[0, 1, 2]),
            rec(3, &[0, 7]),
            rec(4, &[0, 7, 8]),
            rec(5, &[0, 1, 2, 3]),
        ];
        let s = sample_conversations(&records, 1);
        let times: Vec<u64> = s.iter().map(|r| r.timestamp).collect();
        assert_eq!(times, [0, 2, 5]);
        let s = sample_conversations(&records, 5);
        let times: Vec<u64> = s.iter().map(|r| r.timestamp).collect();
        assert_eq!(
            times,
            [0, 2, 3, 4, 5],
            "one-turn conversations are left out"
        );
    }

    #[test]
    fn a_follow_up_waits_for_the_turn_it_extends() {
        let records = [
            rec(0, &[0, 1, 2]),
            rec(1, &[0, 5]),
            rec(2, &[0, 1, 2, 3]),
            // Shares the second block but not the first turn's whole prompt: a branch of
            // the first turn (its last block may differ), not of the second.
            rec(3, &[0, 1, 4, 8, 9]),
            rec(4, &[0, 6, 7]),
            rec(5, &[0, 1, 2, 3, 10]),
        ];
        let scaled = scale_trace(&records, &ScaleConfig::default()).unwrap();
        let previous: Vec<Option<usize>> = scaled.iter().map(|r| r.previous_turn).collect();
        assert_eq!(previous, [None, None, Some(0), Some(0), None, Some(2)]);
    }

    #[test]
    fn sampled_conversations_are_spread_over_the_trace() {
        // Four two-turn conversations starting at 0, 10, 20 and 30.
        let records: Vec<TraceRecord> = (0..4)
            .flat_map(|c| [rec(10 * c, &[0, c + 1]), rec(10 * c + 5, &[0, c + 1, 9])])
            .collect();
        let starts = |n| {
            let s = sample_conversations(&records, n);
            s.iter().step_by(2).map(|r| r.timestamp).collect::<Vec<_>>()
        };
        assert_eq!(starts(2), [0, 20]);
        assert_eq!(starts(4), [0, 10, 20, 30]);
        assert_eq!(starts(9), [0, 10, 20, 30], "no more than there are");
        assert!(sample_conversations(&records, 0).is_empty());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(timestamp: u64, input_length: u64, output_length: u64, ids: &[u64]) -> TraceRecord {
        TraceRecord {
            timestamp,
            input_length,
            output_length,
            hash_ids: ids.to_vec(),
        }
    }

    const GOOD: &str = r#"{"timestamp": 0, "input_length": 1000, "output_length": 500, "hash_ids": [0, 1]}
{"timestamp": 0, "input_length": 600, "output_length": 8, "hash_ids": [0, 2]}

{"timestamp": 3000, "input_length": 1536, "output_length": 100, "hash_ids": [0, 1, 3]}
"#;

    #[test]
    fn parses_good_lines_and_skips_blank_ones() {
        let records = parse_trace(GOOD.as_bytes(), None).unwrap();
        assert_eq!(
            records,
            vec![
                record(0, 1000, 500, &[0, 1]),
                record(0, 600, 8, &[0, 2]),
                record(3000, 1536, 100, &[0, 1, 3]),
            ]
        );
        assert_eq!(parse_trace(GOOD.as_bytes(), Some(2)).unwrap().len(), 2);
        assert!(parse_trace("".as_bytes(), None).unwrap().is_empty());
    }

    #[test]
    fn malformed_lines_are_named() {
        let text = format!(
            "{}\n{{\"timestamp\": 1, \"input_length\": \n",
            GOOD.trim_end()
        );
        match parse_trace(text.as_bytes(), None) {
            Err(TraceError::Malformed { line: 5, message }) => assert!(!message.is_empty()),
            other => panic!("{other:?}"),
        }
        let missing = r#"{"timestamp": 1, "input_length": 10, "hash_ids": [1]}"#;
        let err = parse_trace(missing.as_bytes(), None).unwrap_err();
        assert!(
            matches!(err, TraceError::Malformed { line: 1, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("output_length"), "{err}");
        let mismatch =
            r#"{"timestamp": 1, "input_length": 513, "output_length": 1, "hash_ids": [1]}"#;
        let err = parse_trace(mismatch.as_bytes(), None).unwrap_err();
        assert!(matches!(err, TraceError::Invalid { line: 1, .. }), "{err}");
        assert!(err
            .to_string()
            .starts_with("trace line 1: input_length 513 needs 2 hash_ids"));
    }

    #[test]
    fn overlong_lines_are_refused() {
        let long = format!("{}\n", " ".repeat(MAX_LINE_BYTES + 10));
        assert!(matches!(
            parse_trace(long.as_bytes(), None),
            Err(TraceError::LineTooLong { line: 1, .. })
        ));
    }

    #[test]
    fn scaling_lengths() {
        let records = parse_trace(GOOD.as_bytes(), None).unwrap();
        let config = ScaleConfig::default(); // 32 tokens per block, output <= 32
        let reqs = scale_trace(&records, &config).unwrap();
        let lens: Vec<_> = reqs.iter().map(|r| r.prompt_tokens.len()).collect();
        assert_eq!(lens, [63, 38, 96]); // ceil(1000/16), ceil(600/16), 1536/16
        let outs: Vec<_> = reqs.iter().map(|r| r.max_tokens).collect();
        assert_eq!(outs, [32, 1, 7]);
        let ats: Vec<_> = reqs.iter().map(|r| r.at).collect();
        assert_eq!(
            ats,
            [Duration::ZERO, Duration::ZERO, Duration::from_secs(3)]
        );
        assert!(reqs
            .iter()
            .flat_map(|r| &r.prompt_tokens)
            .all(|t| DEFAULT_TOKEN_IDS.contains(t)));

        let cut = ScaleConfig {
            max_prompt_tokens: Some(40),
            pacing: Pacing::Speedup(2.0),
            ..ScaleConfig::default()
        };
        let reqs = scale_trace(&records, &cut).unwrap();
        assert_eq!(reqs[0].prompt_tokens.len(), 40);
        assert_eq!(reqs[0].hash_ids, [0, 1]);
        assert_eq!(reqs[1].prompt_tokens.len(), 38);
        assert_eq!(reqs[2].hash_ids, [0, 1]);
        assert_eq!(reqs[2].at, Duration::from_millis(1500));
    }

    #[test]
    fn pacing_by_request_rate_keeps_the_shape() {
        let records = vec![
            record(0, 10, 1, &[0]),
            record(1000, 10, 1, &[1]),
            record(4000, 10, 1, &[2]),
        ];
        let config = ScaleConfig {
            pacing: Pacing::RequestsPerSecond(2.0),
            ..ScaleConfig::default()
        };
        let ats: Vec<_> = scale_trace(&records, &config)
            .unwrap()
            .iter()
            .map(|r| r.at)
            .collect();
        assert_eq!(ats, [0.0, 0.25, 1.0].map(Duration::from_secs_f64));
        // All at once: spread evenly at the rate.
        let burst = vec![record(5, 10, 1, &[0]), record(5, 10, 1, &[1])];
        let ats: Vec<_> = scale_trace(&burst, &config)
            .unwrap()
            .iter()
            .map(|r| r.at)
            .collect();
        assert_eq!(ats, [Duration::ZERO, Duration::from_millis(500)]);
    }

    #[test]
    fn shared_hash_ids_give_identical_blocks() {
        let records = parse_trace(GOOD.as_bytes(), None).unwrap();
        let config = ScaleConfig::default();
        let a = scale_trace(&records, &config).unwrap();
        let b = scale_trace(&records, &config).unwrap();
        assert_eq!(a, b, "scaling is deterministic");
        // Block 0 is shared by all three prompts, block 1 by the first and third (where
        // the first cuts it short at 31 tokens).
        assert_eq!(a[0].prompt_tokens[..32], a[1].prompt_tokens[..32]);
        assert_eq!(a[0].prompt_tokens[..32], a[2].prompt_tokens[..32]);
        assert_eq!(a[0].prompt_tokens[32..], a[2].prompt_tokens[32..63]);
        assert_ne!(a[1].prompt_tokens[32..], a[2].prompt_tokens[32..38]);
        assert_ne!(a[2].prompt_tokens[32..64], a[2].prompt_tokens[64..]);
        let first: Vec<u32> = block_token_ids(7, 10, &DEFAULT_TOKEN_IDS).collect();
        let longer: Vec<u32> = block_token_ids(7, 20, &DEFAULT_TOKEN_IDS).collect();
        assert_eq!(first, longer[..10]);
        // Each prompt is its blocks generated one by one, shared blocks (copied from one
        // generation) and partial last blocks included.
        for r in &a {
            let expected: Vec<u32> = r
                .hash_ids
                .iter()
                .enumerate()
                .flat_map(|(k, &id)| {
                    let len = (r.prompt_tokens.len() - k * 32).min(32);
                    block_token_ids(id, len, &DEFAULT_TOKEN_IDS)
                })
                .collect();
            assert_eq!(r.prompt_tokens, expected);
        }
    }

    #[test]
    fn ideal_hit_rate_counts_repeated_blocks() {
        let records = parse_trace(GOOD.as_bytes(), None).unwrap();
        let reqs = scale_trace(&records, &ScaleConfig::default()).unwrap();
        // Blocks [0 1] [0 2] [0 1 3]: hits 0, 1, 2 of 7.
        assert!((ideal_hit_rate(&reqs) - 3.0 / 7.0).abs() < 1e-12);
        assert_eq!(ideal_hit_rate(&reqs[..1]), 0.0);
        assert_eq!(ideal_hit_rate(&[]), 0.0);
        assert_eq!(ideal_hit_rate(reqs[1..].iter().rev()), 1.0 / 5.0);
    }

    #[test]
    fn bad_configs_are_refused() {
        let records = vec![record(0, 10, 1, &[0])];
        let bad = |config: ScaleConfig| scale_trace(&records, &config).unwrap_err();
        assert!(matches!(
            bad(ScaleConfig {
                scale: 3,
                ..ScaleConfig::default()
            }),
            TraceError::BadScale(3)
        ));
        assert!(matches!(
            bad(ScaleConfig {
                pacing: Pacing::RequestsPerSecond(0.0),
                ..ScaleConfig::default()
            }),
            TraceError::BadConfig(_)
        ));
        assert!(matches!(
            scale_trace(&[], &ScaleConfig::default()),
            Err(TraceError::Empty)
        ));
        let backwards = vec![record(5, 10, 1, &[0]), record(4, 10, 1, &[1])];
        let sorted = scale_trace(&backwards, &ScaleConfig::default()).unwrap();
        assert_eq!(sorted[0].hash_ids, [1]);
    }
}
