//! The metric core of the SLO report: per-request outcomes in, latency summaries, SLO
//! attainment and goodput out. Pure: no I/O, no clocks; the load generator measures, this
//! judges.
//!
//! Semantics, as vLLM's `bench serve --goodput` and aiperf count them:
//! - Each objective is judged per request, on the statistic [`Objective`] names.
//! - Attainment is over *completed* requests only ([`Class::Ok`]): a shed request (HTTP 429,
//!   the server's admission control saying no) and a failed one are counted apart and are
//!   not in its denominator. Read attainment with the shed and failed counts beside it.
//! - Goodput: completed requests meeting every objective, per second of the run.
//!
//! A search for the most goodput can judge a run by its percentiles instead
//! ([`Judge::Percentiles`]): each objective over its own samples, ITL over every gap.

mod spec;
mod summary;
mod wilson;

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use spec::{Objective, SloSpec, SloSpecError};
pub use summary::Summary;
pub use wilson::{wilson, Interval, Z_95};

/// The version of [`SloReport`]'s JSON; bumped when a field changes meaning or goes.
pub const SCHEMA_VERSION: u32 = 1;

/// One request as the load generator saw it. Times are from the start of the run (`sent`)
/// or from the send.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RequestOutcome {
    /// Which request of the workload this was (an index into [`crate::workload::Workload::items`]).
    pub item: usize,
    pub sent: Duration,
    /// When it ended however it ended (completed, refused, failed), from the run's start;
    /// for a completed request `sent + e2e`.
    pub ended: Duration,
    /// The response's HTTP status; `None` when none came (connect error, timeout before it).
    pub status: Option<u16>,
    /// Why it did not complete (`connect`, `timeout`, `stream_error`, `truncated`, an HTTP
    /// status...); `None` for a completed request.
    pub error: Option<String>,
    /// To the first token.
    pub ttft: Option<Duration>,
    /// Every gap between two consecutive token-bearing chunks, in order.
    pub gaps: Vec<Duration>,
    /// To the end of the stream.
    pub e2e: Option<Duration>,
    /// Token counts from the usage chunk, where the server sent one.
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    pub output_tokens: u64,
}

/// What became of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    /// Completed: a 2xx status, no error and an end-to-end time.
    Ok,
    /// Refused with 429 by the server's admission control: load it chose not to take.
    Shed,
    /// Anything else.
    Failed,
}

impl RequestOutcome {
    pub fn class(&self) -> Class {
        match self.status {
            Some(429) => Class::Shed,
            Some(200..=299) if self.error.is_none() && self.e2e.is_some() => Class::Ok,
            _ => Class::Failed,
        }
    }

    /// The longest gap between its tokens (what the ITL objective judges); `None` without
    /// gaps.
    pub fn longest_gap(&self) -> Option<Duration> {
        self.gaps.iter().max().copied()
    }

    /// `(e2e - ttft) / (output_tokens - 1)` in seconds (vLLM's TPOT); `None` with fewer
    /// than two output tokens or without the times.
    pub fn tpot_s(&self) -> Option<f64> {
        let decode = self.e2e?.checked_sub(self.ttft?)?;
        (self.output_tokens > 1).then(|| decode.as_secs_f64() / (self.output_tokens - 1) as f64)
    }

    /// The statistic of this request that `objective` judges, in seconds (see
    /// [`Objective`]); `None` where the request has none.
    pub fn statistic_s(&self, objective: Objective) -> Option<f64> {
        match objective {
            Objective::Ttft => self.ttft.map(|t| t.as_secs_f64()),
            Objective::Itl => self.longest_gap().map(|g| g.as_secs_f64()),
            Objective::Tpot => self.tpot_s(),
            Objective::E2e => self.e2e.map(|t| t.as_secs_f64()),
        }
    }

    /// Whether this (completed) request meets `objective` at `target`. ITL and TPOT are met
    /// by a request with no gap (one token); TTFT and E2E are not met without a time.
    pub fn meets(&self, objective: Objective, target: Duration) -> bool {
        match (self.statistic_s(objective), objective) {
            (Some(s), _) => s <= target.as_secs_f64(),
            (None, Objective::Itl | Objective::Tpot) => true,
            (None, Objective::Ttft | Objective::E2e) => false,
        }
    }

    /// This (completed) request's samples of `objective` as `(within target, all)`: each
    /// gap for ITL (the pooled percentile's samples), else the request itself.
    pub fn samples_within(&self, objective: Objective, target: Duration) -> (usize, usize) {
        match objective {
            Objective::Itl => (
                self.gaps.iter().filter(|&&g| g <= target).count(),
                self.gaps.len(),
            ),
            _ => (usize::from(self.meets(objective, target)), 1),
        }
    }

    /// Whether this (completed) request meets every objective of `slo`.
    pub fn meets_all(&self, slo: &SloSpec) -> bool {
        slo.targets().all(|(objective, t)| self.meets(objective, t))
    }
}

/// The share of completed requests meeting an objective (or all of them).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Attainment {
    /// Completed requests that met it.
    pub met: usize,
    /// `met / completed`; `None` with nothing completed.
    pub share: Option<f64>,
    /// The 95% Wilson interval on `share`.
    pub interval: Option<Interval>,
}

impl Attainment {
    fn new(met: usize, completed: usize) -> Attainment {
        Attainment {
            met,
            share: (completed > 0).then(|| met as f64 / completed as f64),
            interval: wilson(met, completed, Z_95),
        }
    }
}

/// What a share of attainment counts when a run is judged against an SLO.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Judge {
    /// Requests, each meeting every objective (ITL on its longest gap): the share of
    /// requests served within the SLO. Goodput counts those requests.
    #[default]
    PerRequest,
    /// Each objective over its own samples (TTFT, TPOT and E2E one per request, ITL every
    /// gap of every request), each share judged apart: at attainment 0.99, the run's TTFT
    /// p99 and ITL p99 within their targets. The run, not the request, meets the SLO, so
    /// goodput counts every completed request of a run that does.
    Percentiles,
}

/// One objective's result.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ObjectiveReport {
    pub objective: Objective,
    pub target_s: f64,
    #[serde(flatten)]
    pub attainment: Attainment,
    /// ITL only: the share of every gap of every completed request within the target (the
    /// pooled gaps' percentile, which [`Judge::Percentiles`] judges).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gaps: Option<Attainment>,
}

/// Goodput in requests per second, with the bounds of the attainment's interval carried over
/// (`interval × completed / duration`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Goodput {
    pub rate: f64,
    pub low: Option<f64>,
    pub high: Option<f64>,
}

/// A run judged against its SLO. Times are in seconds; a summary is `null` for no samples.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SloReport {
    pub schema_version: u32,
    /// The spec in `--slo` form.
    pub slo: String,
    /// The run's length, as the caller measured it (first send to last end).
    pub duration_s: f64,
    pub requests: usize,
    pub ok: usize,
    pub shed: usize,
    pub failed: usize,
    /// Failed requests by error kind (`http_<status>` for an error status without another).
    pub errors: BTreeMap<String, usize>,
    /// Completed requests per second.
    pub request_throughput: f64,
    /// Output tokens of completed requests per second.
    pub output_token_throughput: f64,
    /// Summed over completed requests.
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub output_tokens: u64,
    /// Latencies of completed requests. `itl` pools every gap of every request (vLLM's ITL);
    /// `tpot` has one value per request with two tokens or more (aiperf's ITL).
    pub ttft: Option<Summary>,
    pub itl: Option<Summary>,
    pub tpot: Option<Summary>,
    pub e2e: Option<Summary>,
    /// Each objective of the spec, in [`Objective`] order.
    pub objectives: Vec<ObjectiveReport>,
    /// Every objective at once.
    pub all: Attainment,
    pub goodput: Goodput,
}

fn per_s(count: f64, duration_s: f64) -> f64 {
    if duration_s > 0.0 {
        count / duration_s
    } else {
        0.0
    }
}

impl SloReport {
    /// Judges `outcomes` against `slo` over a run of `duration`.
    pub fn new(slo: &SloSpec, outcomes: &[RequestOutcome], duration: Duration) -> SloReport {
        let duration_s = duration.as_secs_f64();
        let ok: Vec<&RequestOutcome> = outcomes.iter().filter(|o| o.class() == Class::Ok).collect();
        let shed = outcomes.iter().filter(|o| o.class() == Class::Shed).count();
        let mut errors = BTreeMap::new();
        for o in outcomes.iter().filter(|o| o.class() == Class::Failed) {
            let kind = o.error.clone().unwrap_or_else(|| match o.status {
                Some(status) => format!("http_{status}"),
                None => "unknown".into(),
            });
            *errors.entry(kind).or_insert(0) += 1;
        }
        let series = |f: &dyn Fn(&RequestOutcome) -> Option<f64>| {
            Summary::of(ok.iter().filter_map(|o| f(o)).collect())
        };
        let itl_gaps = ok
            .iter()
            .flat_map(|o| o.gaps.iter().map(Duration::as_secs_f64))
            .collect();
        let objectives: Vec<ObjectiveReport> = slo
            .targets()
            .map(|(objective, target)| ObjectiveReport {
                objective,
                target_s: target.as_secs_f64(),
                attainment: Attainment::new(
                    ok.iter().filter(|o| o.meets(objective, target)).count(),
                    ok.len(),
                ),
                gaps: (objective == Objective::Itl).then(|| {
                    let (met, total) = ok
                        .iter()
                        .map(|o| o.samples_within(objective, target))
                        .fold((0, 0), |(m, n), (a, b)| (m + a, n + b));
                    Attainment::new(met, total)
                }),
            })
            .collect();
        let good = ok.iter().filter(|o| o.meets_all(slo)).count();
        let all = Attainment::new(good, ok.len());
        let completed_rate = per_s(ok.len() as f64, duration_s);
        let output_tokens = ok.iter().map(|o| o.output_tokens).sum();
        SloReport {
            schema_version: SCHEMA_VERSION,
            slo: slo.to_string(),
            duration_s,
            requests: outcomes.len(),
            ok: ok.len(),
            shed,
            failed: outcomes.len() - ok.len() - shed,
            errors,
            request_throughput: completed_rate,
            output_token_throughput: per_s(output_tokens as f64, duration_s),
            prompt_tokens: ok.iter().filter_map(|o| o.prompt_tokens).sum(),
            cached_tokens: ok.iter().filter_map(|o| o.cached_tokens).sum(),
            output_tokens,
            ttft: series(&|o| o.statistic_s(Objective::Ttft)),
            itl: Summary::of(itl_gaps),
            tpot: series(&|o| o.tpot_s()),
            e2e: series(&|o| o.statistic_s(Objective::E2e)),
            objectives,
            goodput: Goodput {
                rate: per_s(good as f64, duration_s),
                low: all.interval.map(|i| i.low * completed_rate),
                high: all.interval.map(|i| i.high * completed_rate),
            },
            all,
        }
    }

    /// The goodput as `judge` counts it: the requests meeting every objective, or, judged by
    /// percentiles, every completed request (whether the run met the SLO is the verdict's
    /// to say).
    pub fn goodput_by(&self, judge: Judge) -> Goodput {
        match judge {
            Judge::PerRequest => self.goodput.clone(),
            Judge::Percentiles => Goodput {
                rate: self.request_throughput,
                low: None,
                high: None,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: fn(u64) -> Duration = Duration::from_millis;

    /// A completed request: TTFT, then `gaps` between its tokens (one token per chunk).
    fn done(sent_ms: u64, ttft_ms: u64, gaps_ms: &[u64]) -> RequestOutcome {
        let gaps: Vec<Duration> = gaps_ms.iter().copied().map(MS).collect();
        RequestOutcome {
            sent: MS(sent_ms),
            status: Some(200),
            ttft: Some(MS(ttft_ms)),
            e2e: Some(MS(ttft_ms) + gaps.iter().sum::<Duration>()),
            output_tokens: gaps.len() as u64 + 1,
            prompt_tokens: Some(100),
            cached_tokens: Some(40),
            gaps,
            ..RequestOutcome::default()
        }
    }

    fn refused(status: Option<u16>, error: &str) -> RequestOutcome {
        RequestOutcome {
            status,
            error: Some(error.into()),
            ..RequestOutcome::default()
        }
    }

    #[test]
    fn itl_judges_the_longest_gap_and_tpot_the_mean() {
        // Gaps 10, 10, 70 ms: mean 30 ms, longest 70 ms.
        let r = done(0, 100, &[10, 10, 70]);
        assert_eq!(r.statistic_s(Objective::Itl), Some(0.07));
        assert!((r.tpot_s().unwrap() - 0.03).abs() < 1e-12);
        assert!(r.meets(Objective::Tpot, MS(50)));
        assert!(!r.meets(Objective::Itl, MS(50)));
        assert!(
            r.meets(Objective::Itl, MS(70)),
            "the target itself meets it"
        );
        // One token: no gap, so ITL and TPOT hold; TTFT is still judged.
        let one = done(0, 600, &[]);
        assert_eq!(
            (one.tpot_s(), one.statistic_s(Objective::Itl)),
            (None, None)
        );
        assert!(one.meets(Objective::Itl, MS(1)) && one.meets(Objective::Tpot, MS(1)));
        assert!(!one.meets(Objective::Ttft, MS(500)));
    }

    #[test]
    fn a_429_is_shed_not_failed() {
        assert_eq!(done(0, 1, &[1]).class(), Class::Ok);
        assert_eq!(refused(Some(429), "429").class(), Class::Shed);
        assert_eq!(refused(Some(503), "503").class(), Class::Failed);
        assert_eq!(refused(None, "connect").class(), Class::Failed);
        // A 200 whose stream broke off did not complete.
        let mut cut = done(0, 1, &[1]);
        cut.error = Some("truncated".into());
        assert_eq!(cut.class(), Class::Failed);
    }

    #[test]
    fn goodput_and_attainment_on_a_scripted_run() {
        let slo: SloSpec = "ttft=500ms,itl=50ms,e2e=1s".parse().unwrap();
        let outcomes = vec![
            done(0, 200, &[20, 30, 40]), // meets all: e2e 290 ms
            done(100, 500, &[50, 50]),   // meets all, exactly at TTFT and ITL: e2e 600 ms
            done(200, 600, &[10]),       // misses TTFT
            done(300, 100, &[20, 80]),   // misses ITL (80 ms gap), TPOT 50 ms
            done(400, 400, &[40; 20]),   // misses E2E: 1.2 s
            refused(Some(429), "429"),   // shed: not in the denominator
            refused(Some(429), "429"),
            refused(None, "timeout"),       // failed
            refused(Some(500), "http_500"), // failed
        ];
        let r = SloReport::new(&slo, &outcomes, MS(2_000));
        assert_eq!(r.schema_version, SCHEMA_VERSION);
        assert_eq!(r.slo, "ttft=500ms,itl=50ms,e2e=1s");
        assert_eq!((r.requests, r.ok, r.shed, r.failed), (9, 5, 2, 2));
        assert_eq!(
            r.errors,
            BTreeMap::from([("http_500".into(), 1), ("timeout".into(), 1)])
        );
        let met: Vec<(Objective, usize)> = r
            .objectives
            .iter()
            .map(|o| (o.objective, o.attainment.met))
            .collect();
        assert_eq!(
            met,
            [
                (Objective::Ttft, 4),
                (Objective::Itl, 4),
                (Objective::E2e, 4)
            ]
        );
        assert_eq!(r.objectives[0].target_s, 0.5);
        assert_eq!(r.objectives[0].attainment.share, Some(0.8));
        assert_eq!((r.all.met, r.all.share), (2, Some(0.4)));
        // 2 good requests in 2.000 s; 5 completed: 2.5 req/s.
        assert_eq!(r.goodput.rate, 1.0);
        assert_eq!(r.request_throughput, 2.5);
        let interval = wilson(2, 5, Z_95).unwrap();
        assert_eq!(r.all.interval, Some(interval));
        assert_eq!(r.goodput.low, Some(interval.low * 2.5));
        assert_eq!(r.goodput.high, Some(interval.high * 2.5));
        assert!(r.goodput.low.unwrap() < 1.0 && 1.0 < r.goodput.high.unwrap());
        // Tokens: 4 + 3 + 2 + 3 + 21 output, over completed requests only.
        assert_eq!(r.output_tokens, 33);
        assert_eq!(r.output_token_throughput, 16.5);
        assert_eq!((r.prompt_tokens, r.cached_tokens), (500, 200));
        // Latencies: TTFT of the 5 completed, every gap pooled for ITL.
        let ttft = r.ttft.as_ref().unwrap();
        assert_eq!(
            (ttft.count, ttft.min, ttft.p50, ttft.max),
            (5, 0.1, 0.4, 0.6)
        );
        let itl = r.itl.as_ref().unwrap();
        assert_eq!((itl.count, itl.max), (28, 0.08));
        assert_eq!(r.tpot.as_ref().unwrap().count, 5);
        assert_eq!(r.e2e.as_ref().unwrap().max, 1.2);
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["schema_version"], SCHEMA_VERSION);
        assert_eq!(json["objectives"][1]["objective"], "itl");
        assert_eq!(json["objectives"][1]["met"], 4);
        assert_eq!(json["all"]["interval"]["low"], interval.low);
        assert_eq!(json["ttft"]["p99_9"], ttft.p99_9);
    }

    #[test]
    fn a_run_with_nothing_completed() {
        let slo: SloSpec = "ttft=1s".parse().unwrap();
        let r = SloReport::new(&slo, &[refused(Some(429), "429")], MS(1_000));
        assert_eq!((r.ok, r.shed, r.failed), (0, 1, 0));
        assert_eq!((r.all.share, r.all.interval), (None, None));
        assert_eq!((r.goodput.rate, r.goodput.low), (0.0, None));
        assert_eq!(r.ttft, None);
        let r = SloReport::new(&slo, &[], Duration::ZERO);
        assert_eq!((r.requests, r.request_throughput), (0, 0.0));
    }
}
