//! Whether one probe's run met the SLO: a verdict from its [`SloReport`].

use serde::Serialize;

use crate::slo::{wilson, Class, Judge, Objective, RequestOutcome, SloReport, SloSpec, Z_95};

/// What a probe must show to pass.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Criteria {
    /// The share that must be within target (`0 < t <= 1`): of completed requests meeting
    /// every objective, or of each objective's samples, as [`Criteria::judge`] says.
    pub target_attainment: f64,
    /// What the attainment counts.
    pub judge: Judge,
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
            judge: Judge::PerRequest,
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
    /// [`Judge::Percentiles`]: even the high bound of the 95% interval on the share of this
    /// objective's samples within its target is below the target.
    Percentile { objective: Objective, high: f64 },
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
    /// Each objective of the SLO's samples, by `Objective as usize` (`None`: not in the
    /// SLO): one per completed request, one per gap between tokens for ITL. (A literal
    /// length: rustc 1.95 fails to compile a closure capturing a struct whose array length is a
    /// path to a constant.)
    pub samples: [Option<Samples>; 4],
}

const _: () = assert!(Objective::COUNT == 4);

/// Samples of one objective's statistic, and how many were within its target.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Samples {
    pub met: usize,
    pub total: usize,
}

impl Samples {
    fn add(&mut self, met: usize, total: usize) {
        self.met += met;
        self.total += total;
    }
}

impl Tally {
    /// Nothing counted yet, for the objectives of `slo`.
    pub fn new(slo: &SloSpec) -> Tally {
        let mut tally = Tally::default();
        for (objective, _) in slo.targets() {
            tally.samples[objective as usize] = Some(Samples::default());
        }
        tally
    }

    pub fn of(report: &SloReport) -> Tally {
        let mut tally = Tally {
            met: report.all.met,
            missed: report.ok - report.all.met,
            shed: report.shed,
            failed: report.failed,
            samples: Default::default(),
        };
        for o in &report.objectives {
            let samples = match &o.gaps {
                Some(gaps) => Samples {
                    met: gaps.met,
                    total: report.itl.as_ref().map_or(0, |s| s.count),
                },
                None => Samples {
                    met: o.attainment.met,
                    total: report.ok,
                },
            };
            tally.samples[o.objective as usize] = Some(samples);
        }
        tally
    }

    /// Counts one more request; whether it met every objective.
    pub fn add(&mut self, outcome: &RequestOutcome, slo: &SloSpec) -> bool {
        let class = outcome.class();
        let met = class == Class::Ok && outcome.meets_all(slo);
        match class {
            Class::Ok if met => self.met += 1,
            Class::Ok => self.missed += 1,
            Class::Shed => self.shed += 1,
            Class::Failed => self.failed += 1,
        }
        if class == Class::Ok {
            for (objective, target) in slo.targets() {
                let (met, total) = outcome.samples_within(objective, target);
                if let Some(s) = &mut self.samples[objective as usize] {
                    s.add(met, total);
                }
            }
        }
        met
    }

    pub fn requests(&self) -> usize {
        self.met + self.missed + self.shed + self.failed
    }

    /// The best this tally can end as after `planned` requests: every one still to come
    /// completed and met every objective. Its gaps are not known before it streams: each is
    /// taken to bring as many as the completed requests did on average (rounded up).
    pub fn best_case(self, planned: usize) -> Tally {
        let to_come = planned.saturating_sub(self.requests());
        let completed = self.met + self.missed;
        let mut best = Tally {
            met: self.met + to_come,
            ..self
        };
        for (objective, samples) in Objective::ALL.into_iter().zip(&mut best.samples) {
            let Some(s) = samples else { continue };
            let each = match objective {
                Objective::Itl => s.total.div_ceil(completed.max(1)),
                _ => 1,
            };
            s.add(to_come * each, to_come * each);
        }
        best
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
    let completed = tally.met + tally.missed;
    if completed == 0 {
        return Verdict::fail(Why::NothingCompleted);
    }
    let target = criteria.target_attainment;
    match criteria.judge {
        Judge::PerRequest => {
            let interval = wilson(tally.met, completed, Z_95).expect("completed > 0");
            if interval.low >= target {
                Verdict::Pass
            } else if interval.high < target {
                Verdict::fail(Why::Attainment {
                    high: interval.high,
                })
            } else {
                Verdict::Inconclusive
            }
        }
        // Every objective must pass; any that fails fails the probe, else any still
        // undecided leaves it inconclusive. An objective with no sample (ITL when every
        // request streamed one token) is met, as it is per request.
        Judge::Percentiles => {
            let mut verdict = Verdict::Pass;
            for (objective, s) in Objective::ALL.into_iter().zip(tally.samples) {
                let Some(interval) = s.and_then(|s| wilson(s.met, s.total, Z_95)) else {
                    continue;
                };
                if interval.high < target {
                    return Verdict::fail(Why::Percentile {
                        objective,
                        high: interval.high,
                    });
                }
                if interval.low < target {
                    verdict = Verdict::Inconclusive;
                }
            }
            verdict
        }
    }
}
