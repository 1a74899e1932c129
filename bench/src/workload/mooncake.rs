//! `mooncake:` workloads, through [`crate::trace`]: its reading, sampling and scaling, so the
//! load generator and `kvmesh bench trace` see the same requests.

use std::path::Path;

use super::text::block_text;
use super::{Prompt, WorkItem, WorkloadError, WorkloadOptions};
use crate::load::Api;
use crate::trace::{sample_conversations, scale_trace, Pacing, ScaleConfig, TraceSource};

pub(super) fn items(
    path: Option<&Path>,
    scale: u32,
    conversations: Option<usize>,
    opts: &WorkloadOptions,
) -> Result<Vec<WorkItem>, WorkloadError> {
    let source = TraceSource::from_path(path.map(Path::to_owned));
    let records = match conversations {
        // Conversations are found over the whole trace, then cut to the request count (a
        // turn's previous turn is earlier, so the links stay inside the cut).
        Some(n) => sample_conversations(&source.read(None)?, n),
        None => source.read(Some(opts.requests))?,
    };
    let config = ScaleConfig {
        scale,
        // The trace's own times; a trace-timed load shape paces them.
        pacing: Pacing::Speedup(1.0),
        max_output_tokens: opts.max_tokens.unwrap_or(u32::MAX),
        max_prompt_tokens: None,
        token_ids: opts.token_ids.clone(),
    };
    let block = config.block_tokens() as usize;
    let mut requests = scale_trace(&records, &config)?;
    requests.truncate(opts.requests);
    Ok(requests
        .into_iter()
        .map(|r| {
            let prompt = match opts.api {
                Api::Completions => Prompt::Tokens(r.prompt_tokens),
                // The same walk over blocks as the token ids: each id's text, the last one
                // cut to the prompt's length.
                Api::Chat => {
                    let len = r.prompt_tokens.len();
                    Prompt::Text(
                        r.hash_ids
                            .iter()
                            .zip((0..len).step_by(block))
                            .map(|(&id, start)| block_text(id, (len - start).min(block)))
                            .collect(),
                    )
                }
            };
            WorkItem {
                prompt,
                max_tokens: r.max_tokens,
                at: Some(r.at),
                previous_turn: r.previous_turn,
                hash_ids: r.hash_ids,
            }
        })
        .collect())
}
