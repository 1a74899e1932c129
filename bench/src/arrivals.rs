//! Load shapes of the load generator, as a pure core: send offsets from a run's start, drawn
//! from a seeded RNG. No clocks, no I/O; the driver sleeps until each offset.
//!
//! Every open-loop shape is a rate profile λ(t) and an arrival process. Arrivals are drawn in
//! *operational time* τ (unit mean gaps) and mapped to wall time by t = Λ⁻¹(τ), where
//! Λ(t) = ∫λ is the expected number of arrivals by t (time-rescaling, not thinning: one draw
//! per arrival, and a constant rate gives exactly equal gaps). With exponential gaps this is a
//! (non-homogeneous) Poisson process; with gamma gaps a renewal process of the same local rate.
//!
//! Grammar ([`LoadShape::from_str`](std::str::FromStr)), rates per second, durations with a
//! unit (`ms`, `s`, `m`, `h`):
//! `concurrency:32`, `poisson:rate=4`, `constant:rate=4`, `gamma:rate=4,burstiness=0.5`,
//! `steps:2@30s,8@30s`, `ramp:1..10@2m`, `day:1..10@10m` (the three profiles take an optional
//! `,burstiness=K`), `trace`, `trace:speedup=4`, `trace:rate=2`.

use crate::grammar::{positive, ParseError};
use std::fmt;
use std::iter::FusedIterator;
use std::num::NonZeroUsize;
use std::str::FromStr;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::trace::Pacing;

/// How gaps between arrivals are drawn around the mean rate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arrivals {
    /// Equal gaps.
    Constant,
    /// Exponential gaps (coefficient of variation 1).
    Poisson,
    /// Gamma gaps of shape `burstiness` (vLLM's `--burstiness`): 1 is Poisson, below 1
    /// burstier, above 1 more regular; CV = 1/sqrt(burstiness).
    Gamma { burstiness: f64 },
}

impl Arrivals {
    /// One gap in operational time (mean 1).
    fn unit_gap(&self, rng: &mut StdRng) -> f64 {
        match *self {
            Arrivals::Constant => 1.0,
            Arrivals::Poisson => exponential(rng),
            // Shape k, scale 1/k: mean 1, variance 1/k.
            Arrivals::Gamma { burstiness } => gamma(rng, burstiness) / burstiness,
        }
    }
}

/// One phase of [`RateProfile::Steps`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Step {
    /// Requests per second (0 is a pause).
    pub rate: f64,
    pub duration: Duration,
}

/// The offered rate over time.
#[derive(Clone, Debug, PartialEq)]
pub enum RateProfile {
    /// This many requests per second, without end.
    Fixed(f64),
    /// Each rate for its duration, in turn.
    Steps(Vec<Step>),
    /// Rising (or falling) linearly from `from` to `to` over `over`.
    Ramp { from: f64, to: f64, over: Duration },
    /// A day compressed into `period`: a sine from `min` at the start (midnight) to `max` at
    /// the middle (noon) and back.
    Day {
        min: f64,
        max: f64,
        period: Duration,
    },
}

impl RateProfile {
    /// How long the profile lasts (`None`: without end).
    pub fn duration(&self) -> Option<Duration> {
        match self {
            RateProfile::Fixed(_) => None,
            RateProfile::Steps(steps) => Some(steps.iter().map(|s| s.duration).sum()),
            RateProfile::Ramp { over, .. } => Some(*over),
            RateProfile::Day { period, .. } => Some(*period),
        }
    }

    /// The offered rate `t` seconds in (for a timeline of offered load); 0 after the end.
    pub fn rate_at(&self, t: f64) -> f64 {
        if t < 0.0 || self.duration().is_some_and(|d| t > d.as_secs_f64()) {
            return 0.0;
        }
        match self {
            RateProfile::Fixed(r) => *r,
            RateProfile::Steps(steps) => {
                let mut start = 0.0;
                for s in steps {
                    start += s.duration.as_secs_f64();
                    if t < start {
                        return s.rate;
                    }
                }
                steps.last().map_or(0.0, |s| s.rate)
            }
            RateProfile::Ramp { from, to, over } => from + (to - from) * t / over.as_secs_f64(),
            RateProfile::Day { min, max, period } => {
                let phase = std::f64::consts::TAU * t / period.as_secs_f64();
                min + (max - min) * (1.0 - phase.cos()) / 2.0
            }
        }
    }

    /// Λ(t): the expected number of arrivals in the first `t` seconds.
    pub fn expected_arrivals(&self, t: f64) -> f64 {
        let t = t.clamp(
            0.0,
            self.duration().map_or(f64::INFINITY, |d| d.as_secs_f64()),
        );
        match self {
            RateProfile::Fixed(r) => r * t,
            RateProfile::Steps(steps) => {
                let (mut start, mut sum) = (0.0, 0.0);
                for s in steps {
                    let d = s.duration.as_secs_f64();
                    sum += s.rate * (t - start).clamp(0.0, d);
                    start += d;
                }
                sum
            }
            RateProfile::Ramp { from, to, over } => {
                from * t + (to - from) * t * t / (2.0 * over.as_secs_f64())
            }
            RateProfile::Day { min, max, period } => {
                let p = period.as_secs_f64();
                let phase = std::f64::consts::TAU * t / p;
                min * t + (max - min) / 2.0 * (t - p / std::f64::consts::TAU * phase.sin())
            }
        }
    }

    /// Λ⁻¹(τ): when the expected count reaches `tau` (seconds), or `None` past the end.
    fn time_of(&self, tau: f64) -> Option<f64> {
        let total = self.expected_arrivals(f64::INFINITY);
        if !(tau.is_finite() && tau <= total && total > 0.0) {
            return None;
        }
        Some(match self {
            RateProfile::Fixed(r) => tau / r,
            RateProfile::Steps(steps) => {
                let (mut start, mut sum) = (0.0, 0.0);
                for s in steps {
                    let d = s.duration.as_secs_f64();
                    if s.rate > 0.0 && tau <= sum + s.rate * d {
                        return Some(start + (tau - sum) / s.rate);
                    }
                    sum += s.rate * d;
                    start += d;
                }
                return None;
            }
            RateProfile::Ramp { from, to, over } => {
                // The root of a·t² + from·t = τ, in the form stable for a = 0 and a < 0.
                let a = (to - from) / (2.0 * over.as_secs_f64());
                let disc = (from * from + 4.0 * a * tau).max(0.0);
                2.0 * tau / (from + disc.sqrt())
            }
            RateProfile::Day { period, .. } => {
                // No closed form; Λ is monotone, so bisect to the last representable step.
                let (mut lo, mut hi) = (0.0, period.as_secs_f64());
                loop {
                    let mid = (lo + hi) / 2.0;
                    if mid <= lo || mid >= hi {
                        break hi;
                    }
                    if self.expected_arrivals(mid) < tau {
                        lo = mid;
                    } else {
                        hi = mid;
                    }
                }
            }
        })
    }
}

/// An open-loop load: a rate profile and how arrivals scatter around it.
#[derive(Clone, Debug, PartialEq)]
pub struct OpenLoop {
    pub profile: RateProfile,
    pub arrivals: Arrivals,
}

impl OpenLoop {
    /// The send offsets, from `seed`. Without end for [`RateProfile::Fixed`] (bound it with
    /// `take` or `take_while`); the same seed gives the same schedule with this build's `rand`.
    pub fn schedule(&self, seed: u64) -> Schedule {
        Schedule {
            rng: StdRng::seed_from_u64(seed),
            load: self.clone(),
            tau: 0.0,
        }
    }
}

/// Send offsets from the run's start, in order; the first comes one gap in.
#[derive(Clone, Debug)]
pub struct Schedule {
    rng: StdRng,
    load: OpenLoop,
    tau: f64,
}

impl Iterator for Schedule {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        self.tau += self.load.arrivals.unit_gap(&mut self.rng);
        let t = self.load.profile.time_of(self.tau)?;
        Some(Duration::from_nanos((t * 1e9).round() as u64))
    }
}

// τ only grows, so once past the end it stays there.
impl FusedIterator for Schedule {}

/// What the load generator offers.
#[derive(Clone, Debug, PartialEq)]
pub enum LoadShape {
    /// Closed loop: this many requests in flight, each sent when one ends (no schedule).
    Concurrency(NonZeroUsize),
    /// Open loop: sent at the offsets of [`OpenLoop::schedule`].
    Open(OpenLoop),
    /// The trace's own timestamps, paced ([`crate::trace::paced_offsets`]).
    Trace(Pacing),
}

/// Uniform on (0, 1]: never 0, so its logarithm is finite.
fn unit_open(rng: &mut StdRng) -> f64 {
    1.0 - rng.gen::<f64>()
}

/// Exponential of mean 1, by inversion.
fn exponential(rng: &mut StdRng) -> f64 {
    -unit_open(rng).ln()
}

/// Standard normal, by Box–Muller (one of the pair).
pub(crate) fn normal(rng: &mut StdRng) -> f64 {
    let (u1, u2) = (unit_open(rng), unit_open(rng));
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// Gamma of shape `k` and scale 1 by Marsaglia–Tsang (2000); below shape 1 by the boost
/// Gamma(k) = Gamma(k + 1)·U^(1/k).
fn gamma(rng: &mut StdRng, k: f64) -> f64 {
    if k < 1.0 {
        return gamma(rng, k + 1.0) * unit_open(rng).powf(1.0 / k);
    }
    let d = k - 1.0 / 3.0;
    let c = 1.0 / (9.0 * d).sqrt();
    loop {
        let x = normal(rng);
        let v = (1.0 + c * x).powi(3);
        if v <= 0.0 {
            continue;
        }
        if unit_open(rng).ln() < 0.5 * x * x + d - d * v + d * v.ln() {
            return d * v;
        }
    }
}

/// This grammar's name in its errors.
const GRAMMAR: &str = "load shape";

fn bad(part: &str, problem: impl Into<String>) -> ParseError {
    ParseError::new(GRAMMAR, part, problem)
}

const KINDS: &str = "concurrency, poisson, constant, gamma, steps, ramp, day, trace";

impl FromStr for LoadShape {
    type Err = ParseError;

    fn from_str(s: &str) -> Result<Self, ParseError> {
        let s = s.trim();
        let (kind, params) = s.split_once(':').unwrap_or((s, ""));
        let (kind, params) = (kind.trim(), params.trim());
        let open = |profile, arrivals| Ok(LoadShape::Open(OpenLoop { profile, arrivals }));
        match kind {
            "concurrency" => {
                let n: usize = params
                    .parse()
                    .map_err(|_| bad(params, "the concurrency must be a whole number"))?;
                NonZeroUsize::new(n)
                    .map(LoadShape::Concurrency)
                    .ok_or_else(|| bad(params, "the concurrency must be at least 1"))
            }
            "poisson" | "constant" => {
                let kv = keys(params, &["rate"], &["rate"])?;
                let arrivals = if kind == "poisson" {
                    Arrivals::Poisson
                } else {
                    Arrivals::Constant
                };
                open(
                    RateProfile::Fixed(positive(GRAMMAR, kv[0].unwrap())?),
                    arrivals,
                )
            }
            "gamma" => {
                let kv = keys(params, &["rate", "burstiness"], &["rate", "burstiness"])?;
                let burstiness = positive(GRAMMAR, kv[1].unwrap())?;
                open(
                    RateProfile::Fixed(positive(GRAMMAR, kv[0].unwrap())?),
                    Arrivals::Gamma { burstiness },
                )
            }
            "steps" | "ramp" | "day" => {
                let (phases, arrivals) = profile_options(params)?;
                let profile = match kind {
                    "steps" => {
                        if phases.is_empty() {
                            return Err(bad(s, "no steps (expected RATE@DURATION,...)"));
                        }
                        let steps = phases
                            .iter()
                            .map(|p| {
                                let (rate, d) = at(p)?;
                                Ok(Step {
                                    rate: non_negative(rate)?,
                                    duration: duration(d)?,
                                })
                            })
                            .collect::<Result<Vec<_>, ParseError>>()?;
                        if steps.iter().all(|s| s.rate == 0.0) {
                            return Err(bad(s, "every step has rate 0"));
                        }
                        RateProfile::Steps(steps)
                    }
                    _ => {
                        let [phase] = phases[..] else {
                            return Err(bad(s, "expected one FROM..TO@DURATION"));
                        };
                        let (range, d) = at(phase)?;
                        let (a, b) = range
                            .split_once("..")
                            .ok_or_else(|| bad(range, "expected a range FROM..TO"))?;
                        let (a, b, d) = (non_negative(a)?, non_negative(b)?, duration(d)?);
                        if a == 0.0 && b == 0.0 {
                            return Err(bad(range, "the rate is 0 throughout"));
                        }
                        if kind == "ramp" {
                            RateProfile::Ramp {
                                from: a,
                                to: b,
                                over: d,
                            }
                        } else if a > b {
                            return Err(bad(range, "the minimum is above the maximum"));
                        } else {
                            RateProfile::Day {
                                min: a,
                                max: b,
                                period: d,
                            }
                        }
                    }
                };
                open(profile, arrivals)
            }
            "trace" if params.is_empty() => Ok(LoadShape::Trace(Pacing::Speedup(1.0))),
            "trace" => {
                let kv = keys(params, &["speedup", "rate"], &[])?;
                match (kv[0], kv[1]) {
                    (Some(f), None) => Ok(LoadShape::Trace(Pacing::Speedup(positive(GRAMMAR, f)?))),
                    (None, Some(r)) => Ok(LoadShape::Trace(Pacing::RequestsPerSecond(positive(
                        GRAMMAR, r,
                    )?))),
                    _ => Err(bad(params, "give one of speedup and rate")),
                }
            }
            _ => Err(bad(kind, format!("unknown kind (expected one of {KINDS})"))),
        }
    }
}

/// The values of `allowed` keys in `key=value,...`, refusing unknown, repeated and missing
/// (`required`) ones.
fn keys<'a>(
    params: &'a str,
    allowed: &[&str],
    required: &[&str],
) -> Result<Vec<Option<&'a str>>, ParseError> {
    let mut values = vec![None; allowed.len()];
    for item in params.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let (k, v) = item
            .split_once('=')
            .ok_or_else(|| bad(item, "expected key=value"))?;
        let i = allowed.iter().position(|a| *a == k.trim()).ok_or_else(|| {
            bad(
                item,
                format!("unknown key (expected {})", allowed.join(", ")),
            )
        })?;
        if values[i].replace(v.trim()).is_some() {
            return Err(bad(item, "given twice"));
        }
    }
    for (i, k) in allowed.iter().enumerate() {
        if values[i].is_none() && required.contains(k) {
            return Err(bad(params, format!("missing {k}=")));
        }
    }
    Ok(values)
}

/// A profile's phases and its arrivals (Poisson unless `burstiness=K` is given).
fn profile_options(params: &str) -> Result<(Vec<&str>, Arrivals), ParseError> {
    let mut phases = Vec::new();
    let mut arrivals = Arrivals::Poisson;
    for item in params.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        match item.split_once('=') {
            None => phases.push(item),
            Some(("burstiness", v)) if arrivals == Arrivals::Poisson => {
                arrivals = Arrivals::Gamma {
                    burstiness: positive(GRAMMAR, v.trim())?,
                }
            }
            Some(("burstiness", _)) => return Err(bad(item, "given twice")),
            Some(_) => return Err(bad(item, "unknown key (expected burstiness)")),
        }
    }
    Ok((phases, arrivals))
}

fn at(phase: &str) -> Result<(&str, &str), ParseError> {
    phase
        .split_once('@')
        .map(|(a, b)| (a.trim(), b.trim()))
        .ok_or_else(|| bad(phase, "expected RATE@DURATION"))
}

fn non_negative(s: &str) -> Result<f64, ParseError> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() && x >= 0.0 => Ok(x),
        _ => Err(bad(s, "expected a non-negative number")),
    }
}

/// `500ms`, `30s`, `1.5m`, `1h`: a unit is required (a bare number is ambiguous).
fn duration(s: &str) -> Result<Duration, ParseError> {
    let split = s
        .find(|c: char| c.is_ascii_alphabetic())
        .ok_or_else(|| bad(s, "a duration needs a unit (ms, s, m, h)"))?;
    let (num, unit) = s.split_at(split);
    let scale = match unit {
        "ms" => 1e-3,
        "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        _ => return Err(bad(s, "unknown unit (expected ms, s, m, h)")),
    };
    match num.parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 && x * scale < 1e9 => {
            Ok(Duration::from_nanos((x * scale * 1e9).round() as u64))
        }
        _ => Err(bad(s, "expected a positive duration")),
    }
}

/// Writes the grammar back, so a report can name its load and the name parses again.
impl fmt::Display for LoadShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let secs = |d: &Duration| format!("{}s", d.as_secs_f64());
        match self {
            LoadShape::Concurrency(n) => write!(f, "concurrency:{n}"),
            LoadShape::Trace(Pacing::Speedup(x)) => write!(f, "trace:speedup={x}"),
            LoadShape::Trace(Pacing::RequestsPerSecond(r)) => write!(f, "trace:rate={r}"),
            LoadShape::Open(OpenLoop { profile, arrivals }) => {
                if let RateProfile::Fixed(r) = profile {
                    return match arrivals {
                        Arrivals::Constant => write!(f, "constant:rate={r}"),
                        Arrivals::Poisson => write!(f, "poisson:rate={r}"),
                        Arrivals::Gamma { burstiness } => {
                            write!(f, "gamma:rate={r},burstiness={burstiness}")
                        }
                    };
                }
                match profile {
                    RateProfile::Steps(steps) => {
                        let steps: Vec<String> = steps
                            .iter()
                            .map(|s| format!("{}@{}", s.rate, secs(&s.duration)))
                            .collect();
                        write!(f, "steps:{}", steps.join(","))?;
                    }
                    RateProfile::Ramp { from, to, over } => {
                        write!(f, "ramp:{from}..{to}@{}", secs(over))?
                    }
                    RateProfile::Day { min, max, period } => {
                        write!(f, "day:{min}..{max}@{}", secs(period))?
                    }
                    RateProfile::Fixed(_) => unreachable!("written above"),
                }
                match arrivals {
                    Arrivals::Gamma { burstiness } => write!(f, ",burstiness={burstiness}"),
                    // A profile is Poisson unless told otherwise; constant has no syntax.
                    _ => Ok(()),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
