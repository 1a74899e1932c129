//! The live progress line of `kvmesh bench serve`, on stderr: the point running, requests
//! done and sent, in flight, ok/shed/failed, and TTFT and ITL medians so far.
//!
//! The observer runs on the driver's event loop, between sends, so each event costs O(1):
//! the medians come from a log-bucketed histogram (buckets 2% wide), drawn at most a few
//! times a second. They are for watching; the report's percentiles are exact.

use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kvmesh_bench::probe::Progress;
use kvmesh_bench::slo::Class;
use kvmesh_bench::RunEvent;

/// How often the message is rebuilt.
const REFRESH: Duration = Duration::from_millis(200);

pub struct Live {
    bar: ProgressBar,
    /// Each point's length in requests, where bounded by a count.
    requests: Option<usize>,
    counts: Counts,
    ttft: Histogram,
    itl: Histogram,
    drawn: Option<Instant>,
}

#[derive(Default)]
struct Counts {
    sent: usize,
    ok: usize,
    shed: usize,
    failed: usize,
}

impl Counts {
    fn ended(&self) -> usize {
        self.ok + self.shed + self.failed
    }
}

impl Live {
    /// A progress line on stderr; hidden when `show` is false or stderr is not a terminal.
    pub fn new(show: bool, requests: Option<usize>) -> Live {
        let target = if show {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        };
        let bar = ProgressBar::with_draw_target(requests.map(|n| n as u64), target);
        let template = if requests.is_some() {
            "{prefix:.bold} [{bar:24}] {pos}/{len} {msg} ({elapsed})"
        } else {
            "{prefix:.bold} {spinner} {pos} done {msg} ({elapsed})"
        };
        bar.set_style(
            ProgressStyle::with_template(template)
                .expect("the template is valid")
                .progress_chars("=> "),
        );
        Live {
            bar,
            requests,
            counts: Counts::default(),
            ttft: Histogram::default(),
            itl: Histogram::default(),
            drawn: None,
        }
    }

    pub fn observe(&mut self, progress: Progress<'_>) {
        match progress {
            Progress::Point { label, .. } => {
                self.counts = Counts::default();
                self.ttft = Histogram::default();
                self.itl = Histogram::default();
                self.bar.reset();
                if let Some(n) = self.requests {
                    self.bar.set_length(n as u64);
                }
                self.bar.set_prefix(label.to_owned());
                self.draw();
            }
            Progress::Request(RunEvent::Sent { .. }) => {
                self.counts.sent += 1;
                // A search's retry runs longer than one point's count.
                if self.requests.is_some() && self.bar.length() < Some(self.counts.sent as u64) {
                    self.bar.set_length(self.counts.sent as u64);
                }
                self.maybe_draw();
            }
            Progress::Request(RunEvent::Ended(outcome)) => {
                match outcome.class() {
                    Class::Ok => {
                        self.counts.ok += 1;
                        if let Some(t) = outcome.ttft {
                            self.ttft.add(t);
                        }
                        for &gap in &outcome.gaps {
                            self.itl.add(gap);
                        }
                    }
                    Class::Shed => self.counts.shed += 1,
                    Class::Failed => self.counts.failed += 1,
                }
                let ended = self.counts.ended();
                self.bar.set_position(ended as u64);
                // Nothing in flight (as at a point's end): the counts as they stand, not
                // the last throttled ones.
                if ended == self.counts.sent {
                    self.draw();
                } else {
                    self.maybe_draw();
                }
            }
        }
    }

    fn maybe_draw(&mut self) {
        if self.drawn.is_none_or(|at| at.elapsed() >= REFRESH) {
            self.draw();
        }
    }

    fn draw(&mut self) {
        let c = &self.counts;
        let ms = |h: &Histogram| {
            h.median()
                .map_or("-".into(), |d| format!("{:.1}ms", d.as_secs_f64() * 1e3))
        };
        self.bar.set_message(format!(
            "sent {} · in flight {} · ok {} shed {} failed {} · TTFT p50 {} · ITL p50 {}",
            c.sent,
            c.sent.saturating_sub(c.ended()),
            c.ok,
            c.shed,
            c.failed,
            ms(&self.ttft),
            ms(&self.itl),
        ));
        self.drawn = Some(Instant::now());
    }

    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// Durations in buckets 2% wide from 1 µs up (about 1,000 buckets to an hour).
#[derive(Default)]
struct Histogram {
    buckets: Vec<u64>,
    count: u64,
}

const GROWTH: f64 = 1.02;
const FLOOR_S: f64 = 1e-6;

impl Histogram {
    fn add(&mut self, d: Duration) {
        let s = d.as_secs_f64().max(FLOOR_S);
        let i = ((s / FLOOR_S).ln() / GROWTH.ln()) as usize;
        if self.buckets.len() <= i {
            self.buckets.resize(i + 1, 0);
        }
        self.buckets[i] += 1;
        self.count += 1;
    }

    /// The middle of the bucket holding the median.
    fn median(&self) -> Option<Duration> {
        let half = self.count.div_ceil(2).max(1);
        let mut seen = 0;
        for (i, &n) in self.buckets.iter().enumerate() {
            seen += n;
            if seen >= half && n > 0 {
                let s = FLOOR_S * GROWTH.powf(i as f64 + 0.5);
                return Some(Duration::from_secs_f64(s));
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_histogram_median_is_within_its_bucket_width() {
        let mut h = Histogram::default();
        assert_eq!(h.median(), None);
        for ms in [1, 2, 3, 50, 51, 52, 53, 900, 1000] {
            h.add(Duration::from_millis(ms));
        }
        let m = h.median().unwrap().as_secs_f64();
        assert!((m - 0.051).abs() / 0.051 < 0.02, "{m}");
        let mut zero = Histogram::default();
        zero.add(Duration::ZERO);
        assert!(zero.median().unwrap() < Duration::from_micros(2));
    }
}
