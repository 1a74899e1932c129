//! Bench's workloads as simulator input: a [`Workload`] (from any `WorkloadSpec`, a
//! Mooncake trace with its hash ids included) and a [`LoadShape`] become timed
//! [`SimRequest`]s, with the same arrival offsets the load generator would send them at.

use crate::mesh::{simulate, simulate_closed, MeshConfig, MeshError, MeshRun, SimRequest};
use kvmesh_bench::arrivals::LoadShape;
use kvmesh_bench::trace::paced_offsets;
use kvmesh_bench::workload::Workload;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    #[error("request {0} has no trace time, which trace pacing needs")]
    NoTraceTime(usize),
    #[error(transparent)]
    Mesh(MeshError),
    #[error("request {item}: {source}")]
    Item { item: usize, source: MeshError },
}

/// The workload's requests at their send offsets under `shape` (open-loop offsets drawn from
/// `seed`, as bench draws them), sorted by arrival. An open loop whose profile ends before
/// the workload does takes the requests that fit. A closed loop has no offsets: every
/// request is at zero, in workload order, for [`simulate_closed`].
///
/// A turn's `previous_turn` becomes its [`SimRequest::after`]: the mesh holds it until the
/// previous turn has ended.
pub fn requests(
    workload: &Workload,
    shape: &LoadShape,
    seed: u64,
) -> Result<Vec<SimRequest>, WorkloadError> {
    let offsets: Vec<_> = match shape {
        LoadShape::Concurrency(_) => vec![Duration::ZERO; workload.items.len()],
        LoadShape::Open(open) => open.schedule(seed).take(workload.items.len()).collect(),
        LoadShape::Trace(pacing) => {
            let ms = workload
                .items
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
    };
    let out = workload
        .items
        .iter()
        .zip(offsets)
        .enumerate()
        .map(|(item, (w, at))| {
            SimRequest::from_work_item(w, at).map_err(|source| WorkloadError::Item { item, source })
        })
        .collect::<Result<Vec<_>, _>>()?;
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
    Ok(sorted)
}

/// Runs `workload` under `shape` through the mesh `config` describes.
pub fn simulate_workload(
    config: &MeshConfig,
    workload: &Workload,
    shape: &LoadShape,
    seed: u64,
) -> Result<MeshRun, WorkloadError> {
    let reqs = requests(workload, shape, seed)?;
    let run = match shape {
        LoadShape::Concurrency(n) => simulate_closed(config, &reqs, *n),
        _ => simulate(config, &reqs),
    };
    run.map_err(WorkloadError::Mesh)
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
        let r = requests(&w, &LoadShape::Trace(Pacing::Speedup(2.0)), 0).unwrap();
        let at: Vec<_> = r.iter().map(|r| r.at).collect();
        assert_eq!(at, [0, 50, 250].map(Duration::from_millis));
        assert_eq!(r[0].max_tokens, 4);
        assert_eq!(r[0].prompt, [1, 2, 3]);
    }

    #[test]
    fn sorting_by_arrival_renumbers_previous_turns() {
        let mut follows = tokens(60);
        follows.previous_turn = Some(0);
        let w = workload(vec![tokens(50), tokens(0), follows]);
        let r = requests(&w, &LoadShape::Trace(Pacing::Speedup(1.0)), 0).unwrap();
        let at: Vec<_> = r.iter().map(|r| r.at).collect();
        assert_eq!(at, [0, 50, 60].map(Duration::from_millis));
        assert_eq!(
            r.iter().map(|r| r.after).collect::<Vec<_>>(),
            [None, None, Some(1)]
        );
    }

    #[test]
    fn open_loop_offsets_are_benchs_for_the_seed() {
        let open = OpenLoop {
            profile: RateProfile::Fixed(10.0),
            arrivals: Arrivals::Poisson,
        };
        let w = workload((0..5).map(|_| tokens(0)).collect());
        let r = requests(&w, &LoadShape::Open(open.clone()), 3).unwrap();
        let expected: Vec<_> = open.schedule(3).take(5).collect();
        assert_eq!(r.iter().map(|r| r.at).collect::<Vec<_>>(), expected);
    }

    #[test]
    fn unsupported_input_is_a_clear_error() {
        let w = workload(vec![item(Prompt::Text("hi".into()), Some(0))]);
        let err = requests(&w, &LoadShape::Trace(Pacing::Speedup(1.0)), 0).unwrap_err();
        assert!(matches!(
            err,
            WorkloadError::Item {
                item: 0,
                source: MeshError::TextPrompt
            }
        ));
        let closed = LoadShape::Concurrency(NonZeroUsize::new(4).unwrap());
        let timed = workload(vec![tokens(5), tokens(9)]);
        let r = requests(&timed, &closed, 0).unwrap();
        assert!(r.iter().all(|r| r.at == Duration::ZERO));
        assert!(matches!(
            requests(&w, &closed, 0),
            Err(WorkloadError::Item { item: 0, .. })
        ));
        let untimed = workload(vec![tokens(0), item(Prompt::Tokens(vec![1]), None)]);
        assert!(matches!(
            requests(&untimed, &LoadShape::Trace(Pacing::Speedup(1.0)), 0),
            Err(WorkloadError::NoTraceTime(1))
        ));
    }
}
