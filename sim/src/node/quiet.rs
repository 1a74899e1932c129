//! Runs of quiet decode steps: a node plans the quiet steps ahead at once
//! ([`Scheduler::quiet_decode_steps`]), each timed on its own, and applies them when the
//! driver touches it ([`SimNode::catch_up`]) or when the last one ends
//! ([`SimNode::finish_run`]). See the `node` module docs.

use super::{NodeError, SimNode};
use crate::timing::StepShape;
use kvmesh_engine::mock_runner::MockRunner;
use kvmesh_engine::runner::SeqId;
#[cfg(doc)]
use kvmesh_engine::scheduler::Scheduler;
use std::time::Duration;

/// Quiet decode steps planned at once (see the module docs).
#[derive(Debug)]
pub(super) struct DecodeRun {
    started: Duration,
    /// When each step ends, in whole nanoseconds: a run writes one a token and its client
    /// reads them back, hundreds of millions an hour, so they take half a `Duration`'s room
    /// and no conversion.
    pub(super) end_nanos: Vec<u64>,
    batch: u64,
    /// The context of the first step's decodes; each later step's is `batch` more.
    context: u64,
}

impl DecodeRun {
    /// When step `step` ends.
    pub(super) fn end(&self, step: usize) -> Duration {
        Duration::from_nanos(self.end_nanos[step])
    }

    fn shape(&self, step: usize) -> StepShape {
        StepShape {
            decode_seqs: self.batch,
            decode_context_tokens: self.context + step as u64 * self.batch,
            ..StepShape::default()
        }
    }
}

/// The fewest quiet steps worth planning at once (one is an ordinary step).
const MIN_RUN: usize = 2;

/// The tokens of quiet steps applied at once: each of `seqs` got one at each of `end_nanos`
/// (in whole nanoseconds).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RunTokens {
    pub seqs: Vec<SeqId>,
    pub end_nanos: Vec<u64>,
}

impl SimNode {
    /// Plans the quiet decode steps ahead at once, when at least [`MIN_RUN`] are and none
    /// of them finishes a sequence; returns when the last ends.
    pub(super) fn start_run(&mut self, now: Duration) -> Option<Duration> {
        let mut steps = self.scheduler.quiet_decode_steps();
        if steps < MIN_RUN {
            return None;
        }
        let mut context = 0;
        for id in self.scheduler.running() {
            let t = self.requests.get(id)?;
            // The step that gives its last token finishes it: not a quiet one.
            steps = steps.min(t.max_tokens.saturating_sub(t.generated + 1));
            let tokens = self.scheduler.sequence_tokens(*id)?;
            context += (tokens.prompt.len() + tokens.output.len()) as u64;
        }
        if steps < MIN_RUN {
            return None;
        }
        let mut run = DecodeRun {
            started: now,
            end_nanos: Vec::with_capacity(steps),
            batch: self.scheduler.num_running() as u64,
            context,
        };
        // Summed in nanoseconds, exactly as durations would sum.
        let mut end = crate::clock::nanos(now);
        for time in self
            .timing
            .decode_step_nanos(run.batch, run.context)
            .take(steps)
        {
            end += time;
            run.end_nanos.push(end);
        }
        self.run = Some(run);
        Some(Duration::from_nanos(end))
    }

    /// Plan runs of quiet decode steps at once (see the module docs).
    pub fn set_coalesce(&mut self, on: bool) {
        self.coalesce = on;
    }

    /// The run of quiet steps in flight: when it started and when each of its steps ends
    /// (in whole nanoseconds).
    pub fn run(&self) -> Option<(Duration, &[u64])> {
        self.run.as_ref().map(|r| (r.started, &r.end_nanos[..]))
    }

    /// Applies the first `steps` steps of the run in flight (fewer than it has) and puts the
    /// next in flight as an ordinary step, planned when the last applied one ended, as it
    /// would have been. Returns the applied steps' tokens.
    ///
    /// # Panics
    /// Without a run in flight, or if `steps` would apply all of it ([`Self::finish_run`]).
    pub fn catch_up(&mut self, steps: usize) -> RunTokens {
        let run = self.run.take().expect("a run of quiet steps is in flight");
        assert!(
            steps < run.end_nanos.len(),
            "catch_up past the run's last step"
        );
        let tokens = RunTokens {
            seqs: self.apply(&run, steps),
            end_nanos: run.end_nanos[..steps].to_vec(),
        };
        let start = steps.checked_sub(1).map_or(run.started, |s| run.end(s));
        let output = self.scheduler.schedule();
        let ends_at = self.begin(output, start);
        debug_assert_eq!(ends_at, run.end(steps), "the step as the run timed it");
        tokens
    }

    /// Ends the run in flight, its last step having ended; returns its tokens.
    pub fn finish_run(&mut self) -> Result<RunTokens, NodeError> {
        let run = self.run.take().ok_or(NodeError::NoStepInFlight)?;
        let seqs = self.apply(&run, run.end_nanos.len());
        Ok(RunTokens {
            seqs,
            end_nanos: run.end_nanos,
        })
    }

    /// The first `steps` steps of `run`, as their ends would have absorbed them; returns
    /// the sequences that got their tokens.
    fn apply(&mut self, run: &DecodeRun, steps: usize) -> Vec<SeqId> {
        let vocab = self.vocab_size;
        self.scheduler.advance_decode(steps, |_, last, len| {
            MockRunner::favoured_token(last, len, vocab)
        });
        let seqs = self.scheduler.running().to_vec();
        for id in &seqs {
            let t = self
                .requests
                .get_mut(id)
                .expect("running sequences are tracked");
            t.generated += steps;
            t.prefilled = t.prefilled.max(
                self.scheduler
                    .sequence_tokens(*id)
                    .map_or(0, |s| s.prompt.len() + s.output.len() - 1),
            );
        }
        if self.keep_steps > 0 {
            let mut start = run.started;
            for i in 0..steps {
                let end = run.end(i);
                self.record_step(run.shape(i), end - start);
                start = end;
            }
        }
        if steps > 0 {
            self.busy += run.end(steps - 1) - run.started;
        }
        self.steps += steps as u64;
        seqs
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::tests::config;
    use crate::node::Started;
    use crate::timing::TimingProfile;
    use std::collections::BTreeMap;

    /// Each sequence's token times and the runs of quiet steps planned, running `node` alone
    /// until it has no work; with `cut`, every run is caught up after that many of its
    /// steps, as a submission would cut it.
    fn token_times(
        node: &mut SimNode,
        cut: Option<usize>,
    ) -> (BTreeMap<SeqId, Vec<Duration>>, usize) {
        let mut now = Duration::ZERO;
        let mut times: BTreeMap<SeqId, Vec<Duration>> = BTreeMap::new();
        let mut runs = 0;
        while let Some(Started::Step(end)) = node.start_step(now) {
            let mut deliver = |t: RunTokens| {
                for seq in t.seqs {
                    let ends = t.end_nanos.iter().map(|&n| Duration::from_nanos(n));
                    times.entry(seq).or_default().extend(ends);
                }
            };
            if node.run().is_some() {
                runs += 1;
                match cut.filter(|&c| c < node.run().unwrap().1.len()) {
                    Some(c) => deliver(node.catch_up(c)),
                    None => {
                        deliver(node.finish_run().unwrap());
                        now = end;
                        continue;
                    }
                }
            }
            now = node.step_ends_at().unwrap();
            for (seq, _) in node.finish_step().unwrap().tokens {
                times.entry(seq).or_default().push(now);
            }
        }
        (times, runs)
    }

    #[test]
    fn quiet_steps_planned_at_once_keep_every_token_and_its_time() {
        // Step times that grow with the context, so every step's time differs.
        let timing = TimingProfile::named("h200-llama8b").unwrap();
        let nodes = [false, true, true].map(|coalesce| {
            let mut node = SimNode::new(config(timing.clone())).unwrap();
            node.set_coalesce(coalesce);
            // Prompts of the same phase in their blocks: their quiet steps line up.
            node.submit(1, (1..=9).collect(), 30).unwrap();
            node.submit(2, (1..=5).collect(), 21).unwrap();
            node
        });
        let [mut stepped, mut quiet, mut cut] = nodes;
        let (expected, none) = token_times(&mut stepped, None);
        assert_eq!((expected[&1].len(), expected[&2].len(), none), (30, 21, 0));
        for (node, cut_at) in [(&mut quiet, None), (&mut cut, Some(1))] {
            let (times, runs) = token_times(node, cut_at);
            assert_eq!(times, expected);
            assert!(runs >= 3, "{runs} runs");
            assert_eq!(node.steps(), stepped.steps());
            assert_eq!(node.busy_time(), stepped.busy_time());
            assert_eq!(node.pool().num_free(), node.pool().num_blocks());
        }
    }
}
