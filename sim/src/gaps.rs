//! The gaps between tokens of a run's completed requests, pooled (the report's ITL), without
//! a list of every gap: a simulated hour at 1,000 nodes delivers hundreds of millions of
//! tokens, and bench's summary would sort them all.
//!
//! Gaps are counted in log-linear bins of whole nanoseconds: exact below 2^14 ns, then 2^14
//! bins per power of two (each at most 1/16,384 of its values wide, 0.006%). Each bin keeps
//! its count and sum, and reads as its mean, so a bin holding one distinct value reads as
//! exactly that value. The count, minimum, maximum, mean and standard deviation are exact
//! (the mean and deviation from integer sums, so they may differ from a float sum over the
//! sorted gaps in the last digits); percentiles interpolate between ranks as bench's
//! [`percentile`](kvmesh_bench::stats::percentile) does, each rank read as its bin's mean.

use kvmesh_bench::report::{Cdf, QUANTILES};
use kvmesh_bench::slo::Summary;
use std::time::Duration;

/// Bins per power of two (and exact bins below it).
const SUB_BITS: u32 = 14;
const SUB: u64 = 1 << SUB_BITS;

#[derive(Clone, Debug, Default)]
pub struct GapHistogram {
    /// Per bin: gaps and their sum, in nanoseconds.
    bins: Vec<(u64, u64)>,
    totals: Totals,
}

/// The exact statistics of some gaps, in nanoseconds.
#[derive(Clone, Copy, Debug)]
struct Totals {
    count: u64,
    sum: u128,
    sum_squares: u128,
    min: u64,
    max: u64,
}

impl Default for Totals {
    fn default() -> Self {
        Totals {
            count: 0,
            sum: 0,
            sum_squares: 0,
            min: u64::MAX,
            max: 0,
        }
    }
}

impl Totals {
    fn add(&mut self, nanos: u64) {
        self.count += 1;
        self.sum += u128::from(nanos);
        let square = u128::from(nanos) * u128::from(nanos);
        self.sum_squares = self.sum_squares.saturating_add(square);
        self.min = self.min.min(nanos);
        self.max = self.max.max(nanos);
    }

    fn merge(&mut self, other: Totals) {
        self.count += other.count;
        self.sum += other.sum;
        self.sum_squares = self.sum_squares.saturating_add(other.sum_squares);
        self.min = self.min.min(other.min);
        self.max = self.max.max(other.max);
    }
}

/// A bin being filled: its values `lo..hi` and the gaps it got so far.
#[derive(Clone, Copy, Debug, Default)]
struct OpenBin {
    bin: usize,
    lo: u64,
    hi: u64,
    count: u64,
    sum: u64,
}

impl OpenBin {
    fn of(nanos: u64) -> Self {
        let (bin, lo, width) = bin_span(nanos);
        OpenBin {
            bin,
            lo,
            // Saturated for the last bin, whose largest value is then binned alone.
            hi: lo.saturating_add(width),
            count: 0,
            sum: 0,
        }
    }

    fn holds(&self, nanos: u64) -> bool {
        (self.lo..self.hi).contains(&nanos)
    }
}

/// When a live request's tokens reached its client, kept as the report reads them: how many,
/// the first and the last, and the gaps between them folded as they come into runs of one
/// bin each, for [`GapHistogram::pool`] to pool if the request completes. A request gets
/// hundreds of tokens, mostly a run of decode steps at a time, and a run's gaps mostly
/// fall into one bin: folding them as they arrive neither copies nor keeps a time a token.
/// Where every gap is wanted, every time is kept too ([`TokenTimes::every`]).
#[derive(Clone, Debug, Default)]
pub struct TokenTimes {
    count: usize,
    first: Duration,
    /// The last, in nanoseconds.
    last: u64,
    gaps: Totals,
    /// Filled bins, in the order the gaps filled them; then the one being filled.
    runs: Vec<Filled>,
    open: OpenBin,
    every: Option<Vec<Duration>>,
}

/// A run of a request's gaps in one bin: the bin, how many and their sum.
#[derive(Clone, Copy, Debug)]
struct Filled {
    bin: u32,
    count: u32,
    sum: u64,
}

impl TokenTimes {
    /// No token yet; `every`: keep every time as well.
    pub fn new(every: bool) -> Self {
        TokenTimes {
            // Room for a request's usual runs (tens), so that they are not copied as they grow.
            runs: Vec::with_capacity(64),
            every: every.then(Vec::new),
            ..TokenTimes::default()
        }
    }

    /// A token reached the client at `at` (no earlier than the last).
    pub fn push(&mut self, at: Duration) {
        self.extend_nanos(&[crate::clock::nanos(at)]);
    }

    /// Tokens reached the client at `nanos` (in whole nanoseconds, in order, none before
    /// the last).
    pub fn extend_nanos(&mut self, nanos: &[u64]) {
        let Some((&first, _)) = nanos.split_first() else {
            return;
        };
        if let Some(every) = &mut self.every {
            every.extend(nanos.iter().map(|&t| Duration::from_nanos(t)));
        }
        // One subtraction a gap. The totals and the bin being filled stay in registers
        // until the last time (a run of decode steps puts many gaps in a row into one bin).
        let rest = match self.count {
            0 => {
                self.first = Duration::from_nanos(first);
                self.last = first;
                &nanos[1..]
            }
            _ => nanos,
        };
        self.count += nanos.len();
        let (mut last, mut gaps, mut open) = (self.last, self.gaps, self.open);
        for &now in rest {
            let gap = now - last;
            last = now;
            gaps.add(gap);
            if !open.holds(gap) {
                if open.count > 0 {
                    self.runs.push(Filled {
                        bin: u32::try_from(open.bin).expect("bins fit u32"),
                        count: u32::try_from(open.count).expect("a request's gaps fit u32"),
                        sum: open.sum,
                    });
                }
                open = OpenBin::of(gap);
            }
            open.count += 1;
            open.sum = open.sum.saturating_add(gap);
        }
        (self.last, self.gaps, self.open) = (last, gaps, open);
    }

    /// How many tokens reached the client.
    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// When the first token reached the client.
    pub fn first(&self) -> Option<Duration> {
        (self.count > 0).then_some(self.first)
    }

    /// When the last token reached the client.
    pub fn last(&self) -> Option<Duration> {
        (self.count > 0).then(|| Duration::from_nanos(self.last))
    }

    /// Every time, where they are kept ([`TokenTimes::new`]).
    pub fn every(&self) -> Option<&[Duration]> {
        self.every.as_deref()
    }
}

fn bin_of(nanos: u64) -> usize {
    bin_span(nanos).0
}

/// The bin of `nanos`, its lowest value and its width.
fn bin_span(nanos: u64) -> (usize, u64, u64) {
    if nanos < SUB {
        return (nanos as usize, nanos, 1);
    }
    let top = 63 - nanos.leading_zeros();
    let shift = top - SUB_BITS;
    let sub = (nanos >> shift) - SUB;
    let bin = (SUB + u64::from(shift) * SUB + sub) as usize;
    (bin, nanos >> shift << shift, 1 << shift)
}

impl GapHistogram {
    pub fn record(&mut self, gap: Duration) {
        let nanos = u64::try_from(gap.as_nanos()).unwrap_or(u64::MAX);
        self.add_to_bin(bin_of(nanos), 1, nanos);
        self.totals.add(nanos);
    }

    /// `count` gaps summing to `sum` into bin `bin`.
    fn add_to_bin(&mut self, bin: usize, count: u64, sum: u64) {
        if count == 0 {
            return;
        }
        if bin >= self.bins.len() {
            self.bins.resize(bin + 1, (0, 0));
        }
        let b = &mut self.bins[bin];
        b.0 += count;
        b.1 = b.1.saturating_add(sum);
    }

    /// Pools the gaps of a completed request's `times`; returns the longest (`None` for
    /// fewer than two tokens).
    pub fn pool(&mut self, times: &TokenTimes) -> Option<Duration> {
        for run in &times.runs {
            self.add_to_bin(run.bin as usize, u64::from(run.count), run.sum);
        }
        let open = &times.open;
        self.add_to_bin(open.bin, open.count, open.sum);
        self.totals.merge(times.gaps);
        (times.gaps.count > 0).then(|| Duration::from_nanos(times.gaps.max))
    }

    pub fn count(&self) -> u64 {
        self.totals.count
    }

    /// As bench's [`Summary`] of the gaps in seconds; `None` for none.
    pub fn summary(&self) -> Option<Summary> {
        let ranks = self.ranks()?;
        let t = &self.totals;
        let n = t.count as f64;
        let mean_ns = t.sum as f64 / n;
        // n * sum of squares - sum^2, exact while it fits, is n^2 times the variance.
        let var_ns = u128::from(t.count)
            .checked_mul(t.sum_squares)
            .and_then(|a| t.sum.checked_mul(t.sum).map(|b| a.saturating_sub(b)))
            .map(|d| d as f64 / (n * n))
            .unwrap_or_else(|| (t.sum_squares as f64 / n - mean_ns * mean_ns).max(0.0));
        let p = |q| ranks.percentile(q);
        Some(Summary {
            count: t.count as usize,
            mean: mean_ns / 1e9,
            std: var_ns.sqrt() / 1e9,
            min: secs(t.min),
            max: secs(t.max),
            p50: p(50.0),
            p90: p(90.0),
            p95: p(95.0),
            p99: p(99.0),
            p99_9: p(99.9),
        })
    }

    /// As bench's [`Cdf`] of the gaps in seconds; `None` for none.
    pub fn cdf(&self) -> Option<Cdf> {
        let ranks = self.ranks()?;
        let quantiles = (0..QUANTILES)
            .map(|i| ranks.percentile(100.0 * i as f64 / (QUANTILES - 1) as f64))
            .collect();
        Some(Cdf {
            count: self.totals.count as usize,
            quantiles,
        })
    }

    fn ranks(&self) -> Option<Ranks> {
        if self.totals.count == 0 {
            return None;
        }
        let mut ends = Vec::new();
        let mut reads = Vec::new();
        let mut seen = 0;
        for &(count, sum) in self.bins.iter().filter(|b| b.0 > 0) {
            seen += count;
            ends.push(seen);
            reads.push(secs((sum as f64 / count as f64).round() as u64));
        }
        Some(Ranks {
            ends,
            reads,
            min: secs(self.totals.min),
            max: secs(self.totals.max),
        })
    }
}

fn secs(nanos: u64) -> f64 {
    Duration::from_nanos(nanos).as_secs_f64()
}

/// The sorted gaps, by rank: bin `i` holds ranks `ends[i - 1]..ends[i]`.
struct Ranks {
    ends: Vec<u64>,
    reads: Vec<f64>,
    min: f64,
    max: f64,
}

impl Ranks {
    fn at(&self, rank: u64) -> f64 {
        let last = self.ends.last().expect("not empty") - 1;
        if rank == 0 {
            return self.min;
        }
        if rank >= last {
            return self.max;
        }
        self.reads[self.ends.partition_point(|&e| e <= rank)]
    }

    /// As bench's `percentile`: linear between the closest ranks.
    fn percentile(&self, p: f64) -> f64 {
        let last = self.ends.last().expect("not empty") - 1;
        let rank = p.clamp(0.0, 100.0) / 100.0 * last as f64;
        let (lo, hi) = (rank.floor() as u64, rank.ceil() as u64);
        let (a, b) = (self.at(lo), self.at(hi.min(last)));
        a + (b - a) * (rank - lo as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NS: fn(u64) -> Duration = Duration::from_nanos;

    fn of(gaps: &[Duration]) -> GapHistogram {
        let mut h = GapHistogram::default();
        for &g in gaps {
            h.record(g);
        }
        h
    }

    /// `times` as a request's, delivered in `chunks` of at most that many.
    fn times_of(times: &[Duration], chunk: usize) -> TokenTimes {
        let mut t = TokenTimes::new(false);
        let nanos: Vec<u64> = times.iter().map(|d| d.as_nanos() as u64).collect();
        nanos.chunks(chunk.max(1)).for_each(|c| t.extend_nanos(c));
        t
    }

    fn secs_of(gaps: &[Duration]) -> Vec<f64> {
        gaps.iter().map(Duration::as_secs_f64).collect()
    }

    #[test]
    fn bins_grow_with_the_value_and_keep_their_order() {
        let values = [0, 1, SUB - 1, SUB, SUB + 1, 2 * SUB, 5_000_000, u64::MAX];
        let bins: Vec<usize> = values.iter().map(|&v| bin_of(v)).collect();
        assert!(bins.windows(2).all(|w| w[0] < w[1]), "{bins:?}");
        assert_eq!(bin_of(SUB - 1), SUB as usize - 1);
        // Within a power of two a bin is 1/SUB of its values wide.
        assert_eq!(bin_of(4 * SUB), bin_of(4 * SUB + 3));
        assert_ne!(bin_of(4 * SUB), bin_of(4 * SUB + 4));
    }

    #[test]
    fn distinct_values_read_exactly_as_bench_reads_them() {
        // Step-like gaps (a few ms, some repeated) and one long stall: each bin holds one
        // distinct value, so every percentile is bench's to the bit.
        let mut gaps: Vec<Duration> = (0..500).map(|i| NS(4_400_000 + (i % 37) * 9_000)).collect();
        gaps.push(Duration::from_millis(1_250));
        gaps.extend((0..40).map(|i| NS(20_000_000 + i * 1_000_000)));
        let h = of(&gaps);
        let (ours, bench) = (h.summary().unwrap(), Summary::of(secs_of(&gaps)).unwrap());
        assert_eq!(
            (ours.count, ours.min, ours.max, ours.p50, ours.p90, ours.p95, ours.p99, ours.p99_9),
            (
                bench.count,
                bench.min,
                bench.max,
                bench.p50,
                bench.p90,
                bench.p95,
                bench.p99,
                bench.p99_9
            )
        );
        assert!((ours.mean - bench.mean).abs() < 1e-12 * bench.mean);
        assert!(
            (ours.std - bench.std).abs() < 1e-12,
            "{} {}",
            ours.std,
            bench.std
        );
        assert_eq!(h.cdf().unwrap(), Cdf::of(secs_of(&gaps)).unwrap());
    }

    #[test]
    fn crowded_bins_stay_within_their_width() {
        // 100,000 gaps 7 ns apart from 5 ms: several to a bin.
        let gaps: Vec<Duration> = (0..100_000).map(|i| NS(5_000_000 + i * 7)).collect();
        let (ours, bench) = (
            of(&gaps).summary().unwrap(),
            Summary::of(secs_of(&gaps)).unwrap(),
        );
        for (a, b) in [
            (ours.p50, bench.p50),
            (ours.p99, bench.p99),
            (ours.p90, bench.p90),
        ] {
            assert!((a - b).abs() <= b / SUB as f64, "{a} against {b}");
            assert_ne!(a, 0.0);
        }
        assert_eq!((ours.min, ours.max), (bench.min, bench.max));
    }

    #[test]
    fn pooled_times_read_as_each_gap_recorded_alone() {
        // Repeated gaps, zero gaps and changes, over several requests delivered in chunks.
        let mut rng = 0x2545_f491_4f6c_dd1d_u64;
        let (mut pooled, mut alone) = (GapHistogram::default(), GapHistogram::default());
        for (len, chunk) in [(0, 1), (1, 1), (2, 1), (3, 2), (50, 7), (400, 1), (400, 64)] {
            let mut times = vec![NS(1_000)];
            for _ in 1..len {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                // Around the exact bins' end, within one bin, across bins and powers of two.
                let gap = [
                    0,
                    SUB - 1,
                    SUB,
                    SUB + 1,
                    2 * SUB - 1,
                    2 * SUB,
                    5_000_000,
                    5_000_000,
                    5_000_001,
                    5_000_300,
                    5_000_400,
                    70_000_000,
                ];
                let gap = gap[rng as usize % gap.len()];
                times.push(*times.last().unwrap() + NS(gap));
            }
            let gaps: Vec<Duration> = times.windows(2).map(|w| w[1] - w[0]).collect();
            gaps.iter().for_each(|&g| alone.record(g));
            let t = times_of(&times, chunk);
            assert_eq!(pooled.pool(&t), gaps.iter().max().copied());
            assert_eq!(
                (t.len(), t.first(), t.last()),
                (times.len(), times.first().copied(), times.last().copied())
            );
        }
        assert_eq!(pooled.summary(), alone.summary());
        assert_eq!(pooled.cdf(), alone.cdf());
        assert_eq!(pooled.bins, alone.bins);
    }

    #[test]
    fn every_time_is_kept_only_when_asked() {
        let times = [NS(10), NS(15), NS(35)];
        let mut every = TokenTimes::new(true);
        every.push(times[0]);
        every.extend_nanos(&[15, 35]);
        assert_eq!(every.every(), Some(&times[..]));
        assert_eq!(times_of(&times, 2).every(), None);
    }

    #[test]
    fn nothing_recorded_reads_as_nothing() {
        let h = GapHistogram::default();
        assert_eq!((h.summary(), h.cdf(), h.count()), (None, None, 0));
        let one = of(&[NS(3)]);
        assert_eq!(one.summary().unwrap().p99_9, 3e-9);
        let mut pooled = GapHistogram::default();
        assert_eq!(
            pooled.pool(&times_of(&[NS(10), NS(15), NS(35)], 3)),
            Some(NS(20))
        );
        assert_eq!(pooled.pool(&times_of(&[NS(40)], 1)), None);
        assert_eq!(pooled.pool(&TokenTimes::new(false)), None);
        let s = pooled.summary().unwrap();
        let p50 = kvmesh_bench::stats::percentile(&[5e-9, 20e-9], 50.0).unwrap();
        assert_eq!((s.count, s.min, s.max, s.p50), (2, 5e-9, 20e-9, p50));
    }
}
