//! Measured points over the driver: one run at one load, a sweep of loads, or a max-goodput
//! search, each run judged against the SLO into a report [`Point`] with the generator's own
//! CPU use beside it. `kvmesh bench serve` and `kvmesh tune` both measure through this.

use std::time::Duration;

use crate::arrivals::{Arrivals, LoadShape};
use crate::cpu::CpuClock;
use crate::load::{self, LoadError, Run, RunEvent, RunPlan, Target};
use crate::report::{MaxGoodput, Point};
use crate::search::{
    Criteria, Found, MaxGoodputSearch, Probe, RecordError, SearchConfig, SearchConfigError, Tally,
};
use crate::slo::RequestOutcome;
use crate::slo::SloSpec;
use crate::workload::Workload;

/// What every point of a measurement shares.
#[derive(Clone, Debug, PartialEq)]
pub struct Bench {
    pub target: Target,
    pub workload: Workload,
    pub slo: SloSpec,
    pub seed: u64,
    /// Each point's length: requests sent, wall time, or both (the first reached ends it).
    pub requests: Option<usize>,
    pub duration: Option<Duration>,
    /// The driver's safety valve (see [`RunPlan::max_in_flight`]).
    pub max_in_flight: usize,
    pub follow_turns: bool,
}

/// What [`Bench`] reports as it goes, for a live display.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Progress<'a> {
    /// Point `index` starts, offering `shape`.
    Point {
        index: usize,
        label: &'a str,
        shape: &'a LoadShape,
    },
    /// A request of the current point was sent or ended.
    Request(RunEvent<'a>),
}

/// A point and the run behind it (its outcomes, for the per-request CSV).
#[derive(Clone, Debug, PartialEq)]
pub struct Measured {
    pub point: Point,
    pub run: Run,
}

/// What a max-goodput search found.
#[derive(Clone, Debug, PartialEq)]
pub struct Search {
    /// Every probe, in the order run.
    pub points: Vec<Measured>,
    /// Each point's verdict, in step with `points`.
    pub probes: Vec<Probe>,
    /// The search's answer; `None` when even the start failed.
    pub found: Option<Found>,
    /// The answer's point, for the report.
    pub max_goodput: Option<MaxGoodput>,
}

/// Why a search could not run.
#[derive(Debug, thiserror::Error)]
pub enum SearchError {
    #[error(transparent)]
    Config(#[from] SearchConfigError),
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error("the search refused a probe it asked for: {0}")]
    Record(#[from] RecordError),
    #[error("the search asked for a load that is no shape: {0}")]
    BadLoad(f64),
}

type Observer<'o> = dyn FnMut(Progress<'_>) + Send + 'o;

impl Bench {
    /// The plan of one point at `shape`, `length` times the configured length (a search
    /// re-runs an inconclusive probe longer).
    fn plan(&self, shape: &LoadShape, length: u32, first_item: usize) -> RunPlan {
        RunPlan {
            shape: shape.clone(),
            seed: self.seed,
            max_requests: self.planned(length),
            duration: self.duration.map(|d| d * length),
            max_in_flight: self.max_in_flight,
            follow_turns: self.follow_turns,
            first_item,
        }
    }

    /// The requests a point `length` times the configured length sends, if bounded by them.
    fn planned(&self, length: u32) -> Option<usize> {
        self.requests.map(|n| n.saturating_mul(length as usize))
    }

    /// Point `index`, its first request the workload's item `first_item` (the requests sent
    /// before it, so that it sends fresh prompts). With `criteria`, a probe of a planned
    /// number of requests stops sending at the first miss after which it cannot pass.
    async fn measure(
        &self,
        (index, first_item): (usize, usize),
        shape: &LoadShape,
        length: u32,
        criteria: Option<&Criteria>,
        observer: &mut Observer<'_>,
    ) -> Result<Measured, LoadError> {
        // Labels are unique in a report (compare matches points by them): a search's retry
        // of an inconclusive probe runs the same shape again.
        let label = match length {
            1 => shape.to_string(),
            _ => format!("{shape} retry"),
        };
        observer(Progress::Point {
            index,
            label: &label,
            shape,
        });
        let plan = self.plan(shape, length, first_item);
        let mut tally = Tally::new(&self.slo);
        let mut settled = |outcome: &RequestOutcome| match (criteria, plan.max_requests) {
            (Some(criteria), Some(planned)) => {
                // Only a miss settles a probe: one too short to pass even if every request
                // meets the SLO runs its length (and the search runs it again, longer).
                let met = tally.add(outcome, &self.slo);
                !met && !tally.can_pass(planned, criteria)
            }
            _ => false,
        };
        let clock = CpuClock::start();
        let run = load::run_until(
            &self.target,
            &self.workload,
            &plan,
            &mut |event| observer(Progress::Request(event)),
            &mut settled,
        )
        .await?;
        let point = Point::new(label, shape, &self.slo, &run.outcomes, run.duration)
            .with_generator(clock.stop());
        Ok(Measured { point, run })
    }

    /// One point at `shape`.
    pub async fn point(
        &self,
        shape: &LoadShape,
        observer: &mut Observer<'_>,
    ) -> Result<Measured, LoadError> {
        self.measure((0, 0), shape, 1, None, observer).await
    }

    /// One point per shape, in order.
    pub async fn sweep(
        &self,
        shapes: &[LoadShape],
        observer: &mut Observer<'_>,
    ) -> Result<Vec<Measured>, LoadError> {
        let mut points: Vec<Measured> = Vec::with_capacity(shapes.len());
        for (index, shape) in shapes.iter().enumerate() {
            let measured = self
                .measure((index, sent(&points)), shape, 1, None, observer)
                .await?;
            points.push(measured);
        }
        Ok(points)
    }

    /// GuideLLM's max-goodput search (see [`crate::search`]), open-loop probes drawn with
    /// `arrivals` when it searches a rate.
    pub async fn max_goodput(
        &self,
        config: SearchConfig,
        arrivals: Arrivals,
        observer: &mut Observer<'_>,
    ) -> Result<Search, SearchError> {
        let criteria = config.criteria;
        let axis = config.axis;
        let mut search = MaxGoodputSearch::new(config)?;
        let mut points: Vec<Measured> = Vec::new();
        while let Some(request) = search.next_probe() {
            let shape = axis
                .shape(request.load, arrivals)
                .ok_or(SearchError::BadLoad(request.load))?;
            let measured = self
                .measure(
                    (points.len(), sent(&points)),
                    &shape,
                    request.length,
                    Some(&criteria),
                    observer,
                )
                .await?;
            let stopped_short_of = self
                .planned(request.length)
                .filter(|_| measured.run.stopped);
            let probe = Probe::judged(request, &measured.point.slo, &criteria, stopped_short_of);
            points.push(measured);
            search.record(probe)?;
        }
        let found = search.result();
        let max_goodput = search
            .answer()
            .map(|i| MaxGoodput::of(&points[i].point, criteria.judge));
        Ok(Search {
            points,
            probes: search.probes().to_vec(),
            found,
            max_goodput,
        })
    }
}

/// Requests sent by `points`: where the next point starts in the workload.
fn sent(points: &[Measured]) -> usize {
    points.iter().map(|m| m.run.outcomes.len()).sum()
}
