//! `--max-goodput`: the highest load a server carries within its SLO, found by probing, as a
//! pure state machine. The driver asks [`MaxGoodputSearch::next_probe`] what to offer, runs
//! it, judges the run ([`judge`]) and [`records`](MaxGoodputSearch::record) the verdict.
//!
//! The search (as GuideLLM's): double the load from `start` until a probe fails (or `max`
//! passes), then bisect between the highest pass and the lowest fail until the two are within
//! the resolution: one for a concurrency, a share of the failing load for a rate. Every probe
//! counts against `max_probes`; when they run out the highest pass so far is the answer.
//!
//! An inconclusive probe (the target inside the attainment's 95% interval) is run again once
//! at twice the length, and counted a fail if still inconclusive. Measuring longer is what
//! narrows the interval (its width falls as 1/√n); counting it a fail at once would bias the
//! answer low near every threshold, and a pass would risk reporting a load not shown to be
//! carried. A second inconclusive counts as a fail so that the answer is always a load that
//! passed, and the retry budget stays bounded.
//!
//! A start that fails ends the search without an answer rather than searching below it: the
//! caller chose the start as the least load of interest, and a lower one is its call.
//!
//! [`sweep`] parses `--sweep`: a fixed list of loads instead of a search.

mod judge;
pub mod sweep;

use std::num::NonZeroUsize;

use serde::Serialize;

use crate::arrivals::{Arrivals, LoadShape, OpenLoop, RateProfile};
use crate::slo::SloReport;

pub use judge::{judge, judge_tally, Criteria, Samples, Tally, Verdict, Why};
pub use sweep::{parse_sweep, Sweep};

/// What the search varies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Axis {
    /// Requests in flight (closed loop); loads are whole numbers.
    Concurrency,
    /// Requests per second (open loop).
    Rate,
}

impl Axis {
    /// The load shape that offers `load` on this axis: a closed loop at `load` requests in
    /// flight, or an open loop at `load` per second with `arrivals`. `None` for a load that is
    /// no shape (not positive; for a concurrency, not a whole number).
    pub fn shape(self, load: f64, arrivals: Arrivals) -> Option<LoadShape> {
        if !(load.is_finite() && load > 0.0) {
            return None;
        }
        match self {
            Axis::Concurrency if load.fract() == 0.0 && load <= usize::MAX as f64 => {
                NonZeroUsize::new(load as usize).map(LoadShape::Concurrency)
            }
            Axis::Concurrency => None,
            Axis::Rate => Some(LoadShape::Open(OpenLoop {
                profile: RateProfile::Fixed(load),
                arrivals,
            })),
        }
    }
}

/// How to search.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SearchConfig {
    pub axis: Axis,
    /// The first load probed (for a concurrency, a whole number).
    pub start: f64,
    /// The most load probed: doubling stops here, and a pass here ends the search.
    pub max: f64,
    /// When bisection stops: the gap between pass and fail, in requests in flight for a
    /// concurrency (a whole number, at least 1), as a share of the failing load for a rate.
    pub resolution: f64,
    /// The most probes run (retries of inconclusive ones included).
    pub max_probes: usize,
    pub criteria: Criteria,
}

/// A setting of [`SearchConfig`] out of range: its name and what is wrong.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("search: {field} {problem}")]
pub struct SearchConfigError {
    pub field: &'static str,
    pub problem: String,
}

impl SearchConfig {
    fn check(&self) -> Result<(), SearchConfigError> {
        let bad = |field, problem: &str| {
            Err(SearchConfigError {
                field,
                problem: problem.into(),
            })
        };
        let whole = |x: f64| x.fract() == 0.0;
        if !(self.start.is_finite() && self.start > 0.0) {
            return bad("start", "must be a positive number");
        }
        if !(self.max.is_finite() && self.max >= self.start) {
            return bad("max", "must be a number no less than start");
        }
        if !(self.resolution.is_finite() && self.resolution > 0.0) {
            return bad("resolution", "must be a positive number");
        }
        if self.axis == Axis::Concurrency {
            if !(whole(self.start) && whole(self.max)) {
                return bad("start", "and max must be whole numbers for a concurrency");
            }
            if !(whole(self.resolution) && self.resolution >= 1.0) {
                return bad(
                    "resolution",
                    "must be a whole number >= 1 for a concurrency",
                );
            }
        } else if self.resolution >= 1.0 {
            return bad("resolution", "must be a share below 1 for a rate");
        }
        if self.max_probes == 0 {
            return bad("max_probes", "must be at least 1");
        }
        let c = &self.criteria;
        if !(c.target_attainment > 0.0 && c.target_attainment <= 1.0) {
            return bad("target_attainment", "must be in (0, 1]");
        }
        for (field, share) in [
            ("max_shed_share", c.max_shed_share),
            ("max_failed_share", c.max_failed_share),
        ] {
            if !(0.0..=1.0).contains(&share) {
                return bad(field, "must be in [0, 1]");
            }
        }
        Ok(())
    }
}

/// What to run next.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct ProbeRequest {
    pub load: f64,
    /// How many times the normal probe length to run: 2 for the retry of an inconclusive
    /// probe, else 1.
    pub length: u32,
}

/// One probe as run and judged.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Probe {
    pub load: f64,
    pub length: u32,
    #[serde(flatten)]
    pub verdict: Verdict,
    /// Requests per second within the SLO, as the criteria judge them
    /// ([`SloReport::goodput_by`]).
    pub goodput: f64,
    /// It stopped before its planned length, once it could no longer pass.
    pub ended_early: bool,
}

impl Probe {
    /// The probe `request` asked for, judged from its report. `stopped_short_of`: the
    /// requests it was planned to send, when it stopped early because it could no longer
    /// pass ([`Tally::can_pass`]); its verdict is then the best case's, as if every request
    /// not sent had met the SLO.
    pub fn judged(
        request: ProbeRequest,
        report: &SloReport,
        criteria: &Criteria,
        stopped_short_of: Option<usize>,
    ) -> Probe {
        let tally = Tally::of(report);
        let judged = stopped_short_of.map_or(tally, |planned| tally.best_case(planned));
        Probe {
            load: request.load,
            length: request.length,
            verdict: judge_tally(judged, criteria),
            goodput: report.goodput_by(criteria.judge).rate,
            ended_early: stopped_short_of.is_some(),
        }
    }
}

/// Why the search ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Stop {
    /// Pass and fail are within the resolution.
    Resolved,
    /// `max` passed: the limit, if any, is above it.
    ReachedMax,
    /// `max_probes` were run first.
    ProbeLimit,
    /// The first load failed.
    FailsAtStart,
}

/// The search's answer: the highest load that passed.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Found {
    pub load: f64,
    /// The goodput of the (last) passing probe at `load`.
    pub goodput: f64,
    /// The lowest load that failed, if one did: the limit lies between the two.
    pub lowest_fail: Option<f64>,
    pub stop: Stop,
    pub probes: usize,
}

/// [`MaxGoodputSearch::record`] given a probe it did not ask for.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum RecordError {
    #[error("the search has ended")]
    Ended,
    #[error("expected a probe at load {expected} (length {length}), got load {got}")]
    Unexpected {
        expected: f64,
        length: u32,
        got: f64,
    },
}

/// The search's state: see the [module](self) for the rules.
#[derive(Clone, Debug)]
pub struct MaxGoodputSearch {
    config: SearchConfig,
    probes: Vec<Probe>,
    /// The highest passing probe, an index into `probes`.
    pass: Option<usize>,
    lowest_fail: Option<f64>,
    /// The last probe was inconclusive and is to be run again, longer.
    retry: bool,
    stop: Option<Stop>,
}

impl MaxGoodputSearch {
    pub fn new(config: SearchConfig) -> Result<Self, SearchConfigError> {
        config.check()?;
        Ok(MaxGoodputSearch {
            config,
            probes: Vec::new(),
            pass: None,
            lowest_fail: None,
            retry: false,
            stop: None,
        })
    }

    pub fn config(&self) -> &SearchConfig {
        &self.config
    }

    /// What to run next; `None` once the search has ended.
    pub fn next_probe(&self) -> Option<ProbeRequest> {
        if self.stop.is_some() {
            return None;
        }
        if self.retry {
            let last = self.probes.last()?;
            return Some(ProbeRequest {
                load: last.load,
                length: 2,
            });
        }
        let load = match (self.pass_load(), self.lowest_fail) {
            (None, None) => self.config.start,
            (Some(pass), None) => (pass * 2.0).min(self.config.max),
            (Some(pass), Some(fail)) => match self.config.axis {
                // At least 2 apart (else resolved), so strictly between the two.
                Axis::Concurrency => ((pass + fail) / 2.0).floor(),
                Axis::Rate => (pass + fail) / 2.0,
            },
            (None, Some(_)) => return None, // FailsAtStart: stopped above
        };
        Some(ProbeRequest { load, length: 1 })
    }

    /// Records the run of the probe [`next_probe`](Self::next_probe) asked for.
    pub fn record(&mut self, probe: Probe) -> Result<(), RecordError> {
        let request = self.next_probe().ok_or(RecordError::Ended)?;
        let same = (probe.load - request.load).abs() <= 1e-9 * request.load.abs();
        if !same || probe.length != request.length {
            return Err(RecordError::Unexpected {
                expected: request.load,
                length: request.length,
                got: probe.load,
            });
        }
        let was_retry = std::mem::take(&mut self.retry);
        self.probes.push(probe);
        match probe.verdict {
            Verdict::Inconclusive if !was_retry => self.retry = true,
            Verdict::Pass => {
                self.pass = Some(self.probes.len() - 1);
                if probe.load >= self.config.max {
                    self.stop = Some(Stop::ReachedMax);
                }
            }
            // A fail, or inconclusive twice.
            Verdict::Fail { .. } | Verdict::Inconclusive => {
                self.lowest_fail = Some(probe.load);
                if self.pass.is_none() {
                    self.stop = Some(Stop::FailsAtStart);
                }
            }
        }
        if self.stop.is_none() && self.resolved() {
            self.stop = Some(Stop::Resolved);
        }
        if self.stop.is_none() && self.probes.len() >= self.config.max_probes {
            self.stop = Some(Stop::ProbeLimit);
        }
        Ok(())
    }

    fn pass_load(&self) -> Option<f64> {
        self.pass.map(|i| self.probes[i].load)
    }

    fn resolved(&self) -> bool {
        let (Some(pass), Some(fail)) = (self.pass_load(), self.lowest_fail) else {
            return false;
        };
        match self.config.axis {
            Axis::Concurrency => fail - pass <= self.config.resolution,
            Axis::Rate => fail - pass <= self.config.resolution * fail,
        }
    }

    /// Why the search ended; `None` while it runs.
    pub fn stop(&self) -> Option<Stop> {
        self.stop
    }

    /// Every probe run, in order.
    pub fn probes(&self) -> &[Probe] {
        &self.probes
    }

    /// The probe behind the answer, an index into [`probes`](Self::probes) (and into the
    /// driver's points, recorded in step): the last pass, at the highest load passed.
    /// `None` while the search runs, or when nothing passed.
    pub fn answer(&self) -> Option<usize> {
        self.stop.and(self.pass)
    }

    /// The answer once the search has ended; `None` while it runs, or when nothing passed.
    pub fn result(&self) -> Option<Found> {
        let stop = self.stop?;
        let pass = self.probes[self.pass?];
        Some(Found {
            load: pass.load,
            goodput: pass.goodput,
            lowest_fail: self.lowest_fail,
            stop,
            probes: self.probes.len(),
        })
    }
}

#[cfg(test)]
mod tests;
