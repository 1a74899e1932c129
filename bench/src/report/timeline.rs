//! A run over time: fixed-width bins of what was sent, what ended and how, what was in flight,
//! and the TTFT of what was sent, so a plot shows when a server fell behind and what it shed.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::arrivals::LoadShape;
use crate::slo::{Class, RequestOutcome};
use crate::stats::{percentile, sorted};
use crate::trace::Pacing;

/// At most about this many bins over a run: enough to see a ramp, few enough that the JSON
/// stays small.
pub const TARGET_BINS: usize = 60;

/// Sends per bin, on average, at least: fewer and the per-bin rates and percentiles are
/// mostly noise (a bin of 0 or 1 sends).
pub const SENDS_PER_BIN: usize = 4;

/// One bin, `[start_s, start_s + bin_s)` of the run. Counts are per bin; divide by
/// [`Timeline::bin_s`] for per-second rates ([`Timeline::per_s`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Bin {
    /// The bin's start, in seconds from the run's start.
    pub start_s: f64,
    /// Requests sent in the bin (the offered load the server saw).
    pub sent: usize,
    /// Requests that completed ([`Class::Ok`]) in the bin.
    pub completed: usize,
    /// Requests refused with 429 that ended in the bin.
    pub shed: usize,
    /// Requests that failed otherwise and ended in the bin.
    pub failed: usize,
    /// Requests in flight, averaged over the bin (each counts from its send to its end).
    pub in_flight: f64,
    /// TTFT percentiles, in seconds, of the completed requests *sent* in the bin (so a
    /// latency lines up with the load that caused it); `None` where none was.
    pub ttft_p50_s: Option<f64>,
    pub ttft_p99_s: Option<f64>,
    /// The load shape's mean offered rate over the bin (requests per second), where the shape
    /// defines a rate; `None` for closed loops, speed-up trace replay, and after the last send.
    pub shape_rate: Option<f64>,
}

/// A run in bins of equal width; the last bin ends at or after the last request's end.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Timeline {
    /// The width of every bin, in seconds.
    pub bin_s: f64,
    pub bins: Vec<Bin>,
}

/// A "nice" bin width (1, 2 or 5 times a power of ten seconds, at least 1 ms) giving about
/// [`TARGET_BINS`] bins over `span`, or fewer where `requests` would leave fewer than
/// [`SENDS_PER_BIN`] to a bin.
pub fn bin_width(span: Duration, requests: usize) -> Duration {
    let bins = (requests / SENDS_PER_BIN).clamp(1, TARGET_BINS);
    let raw = (span.as_secs_f64() / bins as f64).max(1e-3);
    let decade = 10f64.powf(raw.log10().floor());
    let nice = [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * decade)
        .find(|w| *w >= raw * (1.0 - 1e-9))
        .unwrap_or(10.0 * decade);
    Duration::from_secs_f64(nice)
}

/// The rate the shape offers on average over `[a, b)` seconds, where it defines one.
fn shape_rate(shape: &LoadShape, a: f64, b: f64) -> Option<f64> {
    match shape {
        LoadShape::Open(open) => {
            Some((open.profile.expected_arrivals(b) - open.profile.expected_arrivals(a)) / (b - a))
        }
        LoadShape::Trace(Pacing::RequestsPerSecond(rate)) => Some(*rate),
        LoadShape::Concurrency(_) | LoadShape::Trace(Pacing::Speedup(_)) => None,
    }
}

impl Timeline {
    /// The timeline of a run of `duration`, in bins of [`bin_width`].
    pub fn new(shape: &LoadShape, outcomes: &[RequestOutcome], duration: Duration) -> Timeline {
        let span = outcomes
            .iter()
            .map(|o| o.ended)
            .fold(duration, Duration::max);
        Timeline::with_bin(shape, outcomes, duration, bin_width(span, outcomes.len()))
    }

    /// The timeline in bins of `bin` (a zero width is taken as 1 ms).
    pub fn with_bin(
        shape: &LoadShape,
        outcomes: &[RequestOutcome],
        duration: Duration,
        bin: Duration,
    ) -> Timeline {
        let bin_s = bin.max(Duration::from_millis(1)).as_secs_f64();
        let end = outcomes
            .iter()
            .map(|o| o.ended.max(o.sent))
            .fold(duration, Duration::max)
            .as_secs_f64();
        let n = ((end / bin_s).ceil() as usize).max(1);
        // An instant's bin; one at the run's very end falls in the last bin.
        let index = |t: Duration| ((t.as_secs_f64() / bin_s) as usize).min(n - 1);
        let last_send = outcomes.iter().map(|o| o.sent).max();
        let mut bins: Vec<Bin> = (0..n)
            .map(|i| {
                let (a, b) = (i as f64 * bin_s, (i + 1) as f64 * bin_s);
                Bin {
                    start_s: a,
                    sent: 0,
                    completed: 0,
                    shed: 0,
                    failed: 0,
                    in_flight: 0.0,
                    ttft_p50_s: None,
                    ttft_p99_s: None,
                    shape_rate: last_send
                        .filter(|last| a <= last.as_secs_f64())
                        .and_then(|_| shape_rate(shape, a, b)),
                }
            })
            .collect();
        let mut ttfts: Vec<Vec<f64>> = vec![Vec::new(); n];
        for o in outcomes {
            let class = o.class();
            bins[index(o.sent)].sent += 1;
            let ended = &mut bins[index(o.ended.max(o.sent))];
            match class {
                Class::Ok => ended.completed += 1,
                Class::Shed => ended.shed += 1,
                Class::Failed => ended.failed += 1,
            }
            if let (Class::Ok, Some(ttft)) = (class, o.ttft) {
                ttfts[index(o.sent)].push(ttft.as_secs_f64());
            }
            // In flight over [sent, ended): its overlap with each bin it spans.
            let (s, e) = (o.sent.as_secs_f64(), o.ended.as_secs_f64());
            if e > s {
                for (i, bin) in bins
                    .iter_mut()
                    .enumerate()
                    .take(index(o.ended) + 1)
                    .skip(index(o.sent))
                {
                    let (a, b) = (i as f64 * bin_s, (i + 1) as f64 * bin_s);
                    bin.in_flight += (e.min(b) - s.max(a)).max(0.0) / bin_s;
                }
            }
        }
        for (bin, values) in bins.iter_mut().zip(ttfts) {
            let v = sorted(values);
            bin.ttft_p50_s = percentile(&v, 50.0);
            bin.ttft_p99_s = percentile(&v, 99.0);
        }
        Timeline { bin_s, bins }
    }

    /// `count` per bin as a rate per second.
    pub fn per_s(&self, count: usize) -> f64 {
        count as f64 / self.bin_s
    }
}
