//! Bench's workloads as simulator input: a [`Workload`] (from any `WorkloadSpec`, a
//! Mooncake trace with its hash ids included) and a [`LoadShape`] become timed
//! [`SimRequest`]s, with the same arrival offsets the load generator would send them at;
//! [`multiply`] makes one trace load a cluster many times the size it was recorded on.

use crate::mesh::{
    simulate, simulate_closed, MeshConfig, MeshError, MeshRun, SimPrompt, SimRequest,
};
use kvmesh_bench::arrivals::LoadShape;
use kvmesh_bench::trace::paced_offsets;
use kvmesh_bench::workload::{Prompt, WorkItem, Workload};
use kvmesh_common::TokenId;
use std::num::NonZeroUsize;
use std::time::Duration;

/// What separates one copy's prompts from another's in [`multiply`]: copy `k` adds
/// `k * COPY_TOKEN_STRIDE` to each prompt's first token, above any vocabulary's ids.
pub const COPY_TOKEN_STRIDE: TokenId = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    #[error("request {0} has no trace time, which trace pacing needs")]
    NoTraceTime(usize),
    #[error(transparent)]
    Mesh(MeshError),
    #[error("request {item}: {source}")]
    Item { item: usize, source: MeshError },
}

/// The requests of a workload's `items` at their send offsets under `shape` (open-loop offsets drawn from
/// `seed`, as bench draws them), sorted by arrival. An open loop whose profile ends before
/// the workload does takes the requests that fit. A closed loop has no offsets: every
/// request is at zero, in workload order, for [`simulate_closed`].
///
/// A turn's `previous_turn` becomes its [`SimRequest::after`]: the mesh holds it until the
/// previous turn has ended.
pub fn requests(
    items: &[WorkItem],
    shape: &LoadShape,
    seed: u64,
) -> Result<Vec<SimRequest>, WorkloadError> {
    let offsets = offsets(items, shape, seed)?;
    // Only those an open loop sends need a token prompt.
    let sent = &items[..offsets.len().min(items.len())];
    Ok(in_order(sent, &prompts(sent)?, offsets))
}

/// As [`requests`], each request sharing its prompt with `prompts` (the [`prompts`] of
/// `items`, whatever the items hold now): a caller that simulates the same items at several
/// points keeps one copy of each prompt.
pub fn requests_sharing(
    items: &[WorkItem],
    prompts: &[SimPrompt],
    shape: &LoadShape,
    seed: u64,
) -> Result<Vec<SimRequest>, WorkloadError> {
    let offsets = offsets(items, shape, seed)?;
    Ok(in_order(items, prompts, offsets))
}

/// Each item's token prompt in a buffer its requests share ([`requests_sharing`]).
pub fn prompts(items: &[WorkItem]) -> Result<Vec<SimPrompt>, WorkloadError> {
    let prompt = |(item, w): (usize, &WorkItem)| match &w.prompt {
        Prompt::Tokens(ids) => Ok(SimPrompt::from(&ids[..])),
        _ => Err(WorkloadError::Item {
            item,
            source: MeshError::TextPrompt,
        }),
    };
    items.iter().enumerate().map(prompt).collect()
}

/// As [`prompts`], moving each item's tokens out (the item keeps an empty prompt): each
/// prompt is freed as it is copied, so a large trace is never held twice.
pub fn take_prompts(items: &mut [WorkItem]) -> Result<Vec<SimPrompt>, WorkloadError> {
    let take = |(item, w): (usize, &mut WorkItem)| match &mut w.prompt {
        Prompt::Tokens(ids) => Ok(SimPrompt::from(std::mem::take(ids))),
        _ => Err(WorkloadError::Item {
            item,
            source: MeshError::TextPrompt,
        }),
    };
    items.iter_mut().enumerate().map(take).collect()
}

/// The send offsets of `items` under `shape`.
fn offsets(
    items: &[WorkItem],
    shape: &LoadShape,
    seed: u64,
) -> Result<Vec<Duration>, WorkloadError> {
    Ok(match shape {
        LoadShape::Concurrency(_) => vec![Duration::ZERO; items.len()],
        LoadShape::Open(open) => open.schedule(seed).take(items.len()).collect(),
        LoadShape::Trace(pacing) => {
            let ms = items
                .iter()
                .enumerate()
                .map(|(i, item)| {
                    item.at
                        .map(|at| at.as_millis() as u64)
                        .ok_or(WorkloadError::NoTraceTime(i))
                })
                .collect::<Result<Vec<_>, _>>()?;
            paced_offsets(&ms, *pacing)
        }
    })
}

/// `items` with their `prompts` at `offsets` (an open loop may have fewer than items), in
/// arrival order.
fn in_order(items: &[WorkItem], prompts: &[SimPrompt], offsets: Vec<Duration>) -> Vec<SimRequest> {
    let out: Vec<SimRequest> = items
        .iter()
        .zip(prompts)
        .zip(offsets)
        .map(|((w, prompt), at)| SimRequest {
            at,
            prompt: prompt.clone(),
            max_tokens: w.max_tokens as usize,
            after: w.previous_turn,
        })
        .collect();
    // Arrival order, renumbering the turns each request follows.
    let mut order: Vec<usize> = (0..out.len()).collect();
    order.sort_by_key(|&i| out[i].at);
    let mut position = vec![0; out.len()];
    for (new, &old) in order.iter().enumerate() {
        position[old] = new;
    }
    let mut sorted: Vec<SimRequest> = order.iter().map(|&i| out[i].clone()).collect();
    for r in &mut sorted {
        r.after = r.after.and_then(|p| position.get(p).copied());
    }
    sorted
}

/// Runs `workload` under `shape` through the mesh `config` describes.
pub fn simulate_workload(
    config: &MeshConfig,
    workload: &Workload,
    shape: &LoadShape,
    seed: u64,
) -> Result<MeshRun, WorkloadError> {
    let reqs = requests(&workload.items, shape, seed)?;
    let run = match shape {
        LoadShape::Concurrency(n) => simulate_closed(config, &reqs, *n),
        _ => simulate(config, &reqs),
    };
    run.map_err(WorkloadError::Mesh)
}

/// `copies` copies of `requests` (in arrival order), as if that many independent user
/// populations sent the same traffic: copy `k`'s prompts share prefixes with each other as
/// the original's do, and none with another copy's (its first token is moved by
/// `k * COPY_TOKEN_STRIDE`, so every block hash differs); its conversations start
/// `k / copies` of the trace's span later, wrapping round to its start, so the copies
/// together keep the trace's span at `copies` times its rate instead of stacking its bursts.
/// A conversation moves whole: its turns keep their gaps and order. Copy 0 is the original.
/// The result is in arrival order, each request's `after` pointing into it.
pub fn multiply(requests: &[SimRequest], copies: NonZeroUsize) -> Vec<SimRequest> {
    let copies = copies.get();
    // The span the copies are spread over: a conversation started at its end wraps to zero.
    let span = requests.iter().map(|r| r.at).max().unwrap_or_default() + Duration::from_millis(1);
    // Each request's conversation start: turns come after the turns they follow.
    let mut start = Vec::with_capacity(requests.len());
    for r in requests {
        let s = r.after.map_or(r.at, |p| start[p]);
        start.push(s);
    }
    let mut out: Vec<(Duration, usize, usize)> = Vec::with_capacity(requests.len() * copies);
    for k in 0..copies {
        let shift = span.mul_f64(k as f64 / copies as f64);
        for (i, r) in requests.iter().enumerate() {
            let begins = (start[i] + shift).as_nanos() % span.as_nanos();
            let at = Duration::from_nanos(begins as u64) + (r.at - start[i]);
            out.push((at, k, i));
        }
    }
    in_arrival_order(requests, out)
}

/// `copies` copies of `requests` (in arrival order) that keep the workload's shape over
/// time: copy `k` is the original `k / copies` of `window` later (no wrapping), where
/// [`multiply`] spreads copies over the whole span and evens the shape out. On scales
/// longer than `window` the rate is `copies` times the original's and the mix of lengths
/// follows the original's; within it the copies interleave as independent users would.
/// Copies differ as in [`multiply`]. In arrival order, each `after` pointing into it.
pub fn multiply_within(
    requests: &[SimRequest],
    copies: NonZeroUsize,
    window: Duration,
) -> Vec<SimRequest> {
    let copies = copies.get();
    let n = requests.len();
    let mut out: Vec<(Duration, usize, usize)> = Vec::with_capacity(n * copies);
    for k in 0..copies {
        let shift = window.mul_f64(k as f64 / copies as f64);
        out.extend(
            requests
                .iter()
                .enumerate()
                .map(|(i, r)| (r.at + shift, k, i)),
        );
    }
    in_arrival_order(requests, out)
}

/// The copies `(at, copy k, original i)` of `requests` as requests in arrival order, each
/// `after` pointing at its copy's own earlier turn.
fn in_arrival_order(
    requests: &[SimRequest],
    mut out: Vec<(Duration, usize, usize)>,
) -> Vec<SimRequest> {
    let n = requests.len();
    out.sort();
    let mut position = vec![0; out.len()];
    for (new, &(_, k, i)) in out.iter().enumerate() {
        position[k * n + i] = new;
    }
    out.iter()
        .map(|&(at, k, i)| {
            let r = &requests[i];
            // Every copy shares the original's tokens but for the first.
            SimRequest {
                at,
                prompt: copy_prompt(r, k),
                max_tokens: r.max_tokens,
                after: r.after.map(|p| position[k * n + p]),
            }
        })
        .collect()
}

/// Copy `k`'s prompt: the original's tokens but for the first, moved by `k` strides.
fn copy_prompt(r: &SimRequest, k: usize) -> SimPrompt {
    match r.prompt.first() {
        Some(first) if k > 0 => r
            .prompt
            .with_first(first + k as TokenId * COPY_TOKEN_STRIDE),
        _ => r.prompt.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvmesh_bench::arrivals::{Arrivals, OpenLoop, RateProfile};
    use kvmesh_bench::trace::Pacing;
    use kvmesh_bench::workload::{Prompt, WorkItem};
    use std::num::NonZeroUsize;

    fn item(prompt: Prompt, at_ms: Option<u64>) -> WorkItem {
        WorkItem {
            prompt,
            max_tokens: 4,
            at: at_ms.map(Duration::from_millis),
            previous_turn: None,
            hash_ids: vec![],
        }
    }

    fn tokens(at_ms: u64) -> WorkItem {
        item(Prompt::Tokens(vec![1, 2, 3]), Some(at_ms))
    }

    fn workload(items: Vec<WorkItem>) -> Workload {
        Workload {
            name: "test".into(),
            items,
        }
    }

    #[test]
    fn trace_pacing_keeps_the_traces_gaps_scaled() {
        let w = workload(vec![tokens(1000), tokens(1100), tokens(1500)]);
        let r = requests(&w.items, &LoadShape::Trace(Pacing::Speedup(2.0)), 0).unwrap();
        let at: Vec<_> = r.iter().map(|r| r.at).collect();
        assert_eq!(at, [0, 50, 250].map(Duration::from_millis));
        assert_eq!(r[0].max_tokens, 4);
        assert_eq!(r[0].prompt.to_vec(), [1, 2, 3]);
    }

    #[test]
    fn sorting_by_arrival_renumbers_previous_turns() {
        let mut follows = tokens(60);
        follows.previous_turn = Some(0);
        let w = workload(vec![tokens(50), tokens(0), follows]);
        let r = requests(&w.items, &LoadShape::Trace(Pacing::Speedup(1.0)), 0).unwrap();
        let at: Vec<_> = r.iter().map(|r| r.at).collect();
        assert_eq!(at, [0, 50, 60].map(Duration::from_millis));
        assert_eq!(
            r.iter().map(|r| r.after).collect::<Vec<_>>(),
            [None, None, Some(1)]
        );
    }

    #[test]
    fn shared_prompts_make_the_same_requests_whatever_the_items_hold() {
        let mut follows = item(Prompt::Tokens(vec![7, 8]), Some(60));
        follows.previous_turn = Some(0);
        let mut w = workload(vec![tokens(50), tokens(0), follows]);
        let shape = LoadShape::Trace(Pacing::Speedup(1.0));
        let expected = requests(&w.items, &shape, 0).unwrap();
        let shared = take_prompts(&mut w.items).unwrap();
        assert!(w
            .items
            .iter()
            .all(|i| matches!(&i.prompt, Prompt::Tokens(t) if t.is_empty())));
        assert_eq!(
            requests_sharing(&w.items, &shared, &shape, 0).unwrap(),
            expected
        );
        assert_eq!(expected[2].prompt.to_vec(), [7, 8]);
        assert!(matches!(
            take_prompts(&mut [item(Prompt::Text("hi".into()), None)]),
            Err(WorkloadError::Item { item: 0, .. })
        ));
    }

    #[test]
    fn open_loop_offsets_are_benchs_for_the_seed() {
        let open = OpenLoop {
            profile: RateProfile::Fixed(10.0),
            arrivals: Arrivals::Poisson,
        };
        let w = workload((0..5).map(|_| tokens(0)).collect());
        let r = requests(&w.items, &LoadShape::Open(open.clone()), 3).unwrap();
        let expected: Vec<_> = open.schedule(3).take(5).collect();
        assert_eq!(r.iter().map(|r| r.at).collect::<Vec<_>>(), expected);
    }

    fn req(at_ms: u64, prompt: Vec<TokenId>, after: Option<usize>) -> SimRequest {
        SimRequest {
            at: Duration::from_millis(at_ms),
            prompt: prompt.into(),
            max_tokens: 2,
            after,
        }
    }

    #[test]
    fn copies_spread_over_the_span_with_disjoint_prompts() {
        // Two conversations: 0 -> 2 (turn at +300 ms), and 1 alone.
        let original = vec![
            req(0, vec![5, 6], None),
            req(200, vec![7], None),
            req(300, vec![5, 6, 8], Some(0)),
        ];
        let copies = multiply(&original, NonZeroUsize::new(2).unwrap());
        assert_eq!(copies.len(), 6);
        // Span 301 ms; copy 1 starts its conversations 150.5 ms later (wrapping at 301).
        let at: Vec<_> = copies.iter().map(|r| r.at.as_micros()).collect();
        assert_eq!(at, [0, 49_500, 150_500, 200_000, 300_000, 450_500]);
        let s = COPY_TOKEN_STRIDE;
        let prompts: Vec<_> = copies.iter().map(|r| r.prompt.to_vec()).collect();
        assert_eq!(
            prompts,
            [
                vec![5, 6],
                vec![7 + s],
                vec![5 + s, 6],
                vec![7],
                vec![5, 6, 8],
                vec![5 + s, 6, 8],
            ]
        );
        // Each follow-up turn follows its own copy's first turn.
        let after: Vec<_> = copies.iter().map(|r| r.after).collect();
        assert_eq!(after, [None, None, None, None, Some(0), Some(2)]);
        assert_eq!(multiply(&original, NonZeroUsize::MIN), original);
    }

    #[test]
    fn copies_hash_as_their_own_tokens_do() {
        use kvmesh_common::{BlockHasher, ModelFingerprint, PromptHashes};
        let hasher = BlockHasher::new(ModelFingerprint(3), 4);
        let other = BlockHasher::new(ModelFingerprint(4), 4);
        let original = req(0, (1..=14).collect(), None);
        let copies = multiply(&[original], NonZeroUsize::new(3).unwrap());
        // The last copy first: whichever prompt hashes first fills the shared hashes.
        for r in copies.iter().rev().chain(&copies) {
            let tokens = r.prompt.tokens();
            for h in [hasher, other] {
                assert_eq!(r.prompt.hashes(h, &tokens), PromptHashes::new(h, &tokens));
            }
        }
        let short = SimPrompt::from(vec![1, 2, 3]).with_first(9);
        let tokens = short.tokens();
        assert_eq!(
            short.hashes(hasher, &tokens),
            PromptHashes::new(hasher, &tokens)
        );
    }

    #[test]
    fn unsupported_input_is_a_clear_error() {
        let w = workload(vec![item(Prompt::Text("hi".into()), Some(0))]);
        let err = requests(&w.items, &LoadShape::Trace(Pacing::Speedup(1.0)), 0).unwrap_err();
        assert!(matches!(
            err,
            WorkloadError::Item {
                item: 0,
                source: MeshError::TextPrompt
            }
        ));
        let closed = LoadShape::Concurrency(NonZeroUsize::new(4).unwrap());
        let timed = workload(vec![tokens(5), tokens(9)]);
        let r = requests(&timed.items, &closed, 0).unwrap();
        assert!(r.iter().all(|r| r.at == Duration::ZERO));
        assert!(matches!(
            requests(&w.items, &closed, 0),
            Err(WorkloadError::Item { item: 0, .. })
        ));
        let untimed = workload(vec![tokens(0), item(Prompt::Tokens(vec![1]), None)]);
        assert!(matches!(
            requests(&untimed.items, &LoadShape::Trace(Pacing::Speedup(1.0)), 0),
            Err(WorkloadError::NoTraceTime(1))
        ));
    }

    #[test]
    fn copies_within_a_window_keep_the_shape() {
        let mut follows = tokens(300);
        follows.previous_turn = Some(0);
        let w = workload(vec![tokens(0), tokens(100), follows]);
        let r = requests(&w.items, &LoadShape::Trace(Pacing::Speedup(1.0)), 0).unwrap();
        let s = multiply_within(
            &r,
            NonZeroUsize::new(2).unwrap(),
            Duration::from_millis(120),
        );
        let at: Vec<_> = s.iter().map(|r| r.at.as_millis()).collect();
        // Copy 1 is 60 ms later; nothing wraps round.
        assert_eq!(at, [0, 60, 100, 160, 300, 360]);
        // Request 2 follows request 0, copy for copy.
        assert_eq!(
            s.iter().map(|r| r.after).collect::<Vec<_>>(),
            [None, None, None, None, Some(0), Some(1)]
        );
        assert_eq!(s[0].prompt, r[0].prompt);
        assert_eq!(s[1].prompt.first(), Some(1 + COPY_TOKEN_STRIDE));
        assert_eq!(s[1].prompt.to_vec()[1..], [2, 3]);
    }
}
