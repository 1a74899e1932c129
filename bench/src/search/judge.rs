//! Whether one probe's run met the SLO: a verdict from its [`SloReport`].

use serde::Serialize;

use crate::slo::{wilson, Class, RequestOutcome, SloReport, SloSpec, Z_95};

/// What a probe must show to pass.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Criteria {
    /// The share of completed requests that must meet every objective (`0 < t <= 1`).
    pub target_attainment: f64,
    /// The most of the requests sent that the server may shed (429) and still pass: a server
    /// that refuses the load has not carried it, however well it served the rest.
    pub max_shed_share: f64,
    /// The same for requests that failed otherwise (timeouts, broken streams, 5xx):
    /// attainment is over completed requests only, so without this bound a server that
    /// drops half its requests could pass.
    pub max_failed_share: f64,
}

impl Default for Criteria {
    fn default() -> Self {
        Criteria {
            target_attainment: 0.95,
            max_shed_share: 0.01,
            max_failed_share: 0.01,
        }
    }
}

/// Why a probe failed.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(tag = "reason", rename_all = "snake_case")]
pub enum Why {
    /// More than [`Criteria::max_shed_share`] of the requests were shed.
    Shed { share: f64 },
    /// More than [`Criteria::max_failed_share`] of the requests failed.
    Failed { share: f64 },
    /// No request completed (or none was sent): there is no attainment to judge.
    NothingCompleted,
    /// Even the high bound of the attainment's 95% interval is below the target.
    Attainment { high: f64 },
}

/// A probe's verdict.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(tag = "verdict", rename_all = "snake_case")]
pub enum Verdict {
    /// The low bound of the all-objective attainment's 95% interval reaches the target:
    /// the load is carried, with 95% confidence.
    Pass,
    Fail {
        #[serde(flatten)]
        why: Why,
    },
    /// The target lies inside the interval: too few requests to tell. See
    /// [`MaxGoodputSearch`](super::MaxGoodputSearch) for what follows.
    Inconclusive,
}

impl Verdict {
    pub fn fail(why: Why) -> Verdict {
        Verdict::Fail { why }
    }
}

/// A probe's requests as the judge counts them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    /// Completed, meeting every objective.
    pub met: usize,
    /// Completed, missing one objective or more.
    pub missed: usize,
    pub shed: usize,
    pub failed: usize,
}

impl Tally {
    pub fn of(report: &SloReport) -> Tally {
        Tally {
            met: report.all.met,
            missed: report.ok - report.all.met,
            shed: report.shed,
            failed: report.failed,
        }
    }

    /// Counts one more request; whether it met every objective.
    pub fn add(&mut self, outcome: &RequestOutcome, slo: &SloSpec) -> bool {
        match outcome.class() {
            Class::Ok if outcome.meets_all(slo) => self.met += 1,
            Class::Ok => self.missed += 1,
            Class::Shed => self.shed += 1,
            Class::Failed => self.failed += 1,
        }
        outcome.class() == Class::Ok && outcome.meets_all(slo)
    }

    pub fn requests(&self) -> usize {
        self.met + self.missed + self.shed + self.failed
    }

    /// The best this tally can end as after `planned` requests: every one still to come
    /// completed and met every objective.
    pub fn best_case(self, planned: usize) -> Tally {
        Tally {
            met: self.met + planned.saturating_sub(self.requests()),
            ..self
        }
    }

    /// Whether a probe of `planned` requests that has counted this so far can still pass.
    /// Once it cannot, running it on only costs time: its verdict is the best case's.
    pub fn can_pass(self, planned: usize, criteria: &Criteria) -> bool {
        judge_tally(self.best_case(planned), criteria) == Verdict::Pass
    }
}

/// Judges a probe's report. Refusals are checked first: they are the server saying the load
/// is too much, whatever the attainment of what it did serve.
pub fn judge(report: &SloReport, criteria: &Criteria) -> Verdict {
    judge_tally(Tally::of(report), criteria)
}

/// [`judge`] on the counts alone.
pub fn judge_tally(tally: Tally, criteria: &Criteria) -> Verdict {
    let share = |n: usize| n as f64 / tally.requests().max(1) as f64;
    if share(tally.shed) > criteria.max_shed_share {
        return Verdict::fail(Why::Shed {
            share: share(tally.shed),
        });
    }
    if share(tally.failed) > criteria.max_failed_share {
        return Verdict::fail(Why::Failed {
            share: share(tally.failed),
        });
    }
    let Some(interval) = wilson(tally.met, tally.met + tally.missed, Z_95) else {
        return Verdict::fail(Why::NothingCompleted);
    };
    if interval.low >= criteria.target_attainment {
        Verdict::Pass
    } else if interval.high < criteria.target_attainment {
        Verdict::fail(Why::Attainment {
            high: interval.high,
        })
    } else {
        Verdict::Inconclusive
    }
}
