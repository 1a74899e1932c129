//! Compact distributions: a latency series as its quantiles at evenly spaced ranks, enough to
//! redraw a CDF from the report alone.

use serde::{Deserialize, Serialize};

use crate::stats::{percentile, sorted};

/// Quantiles per CDF: every whole percentile, p0 (the minimum) to p100 (the maximum).
pub const QUANTILES: usize = 101;

/// A series' distribution: `quantiles[i]` is its percentile at `100 * i / (len - 1)`
/// (interpolated as [`percentile`] does), in the series' unit (seconds in a report).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Cdf {
    /// Samples it was drawn from.
    pub count: usize,
    pub quantiles: Vec<f64>,
}

impl Cdf {
    /// `None` for no values; otherwise [`QUANTILES`] quantiles.
    pub fn of(values: Vec<f64>) -> Option<Cdf> {
        Cdf::with_quantiles(values, QUANTILES)
    }

    /// `n` quantiles (at least 2: the extremes); `None` for no values.
    pub fn with_quantiles(values: Vec<f64>, n: usize) -> Option<Cdf> {
        let v = sorted(values);
        let n = n.max(2);
        let quantiles = (0..n)
            .map(|i| percentile(&v, 100.0 * i as f64 / (n - 1) as f64))
            .collect::<Option<Vec<f64>>>()?;
        Some(Cdf {
            count: v.len(),
            quantiles,
        })
    }

    /// `(value, cumulative share)` pairs, ready to plot.
    pub fn points(&self) -> impl Iterator<Item = (f64, f64)> + '_ {
        let last = self.quantiles.len().saturating_sub(1).max(1) as f64;
        self.quantiles
            .iter()
            .enumerate()
            .map(move |(i, &q)| (q, i as f64 / last))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_at_every_percentile() {
        assert_eq!(Cdf::of(Vec::new()), None);
        // 0..=100: the i-th percentile is i itself.
        let cdf = Cdf::of((0..=100).rev().map(f64::from).collect()).unwrap();
        assert_eq!(cdf.count, 101);
        assert_eq!(cdf.quantiles.len(), QUANTILES);
        for (i, q) in cdf.quantiles.iter().enumerate() {
            assert!((q - i as f64).abs() < 1e-9, "quantile {i}: {q}");
        }
        assert_eq!((cdf.quantiles[0], cdf.quantiles[100]), (0.0, 100.0));
        let pts: Vec<_> = cdf.points().collect();
        assert_eq!(
            (pts[0], pts[50], pts[100]),
            ((0.0, 0.0), (50.0, 0.5), (100.0, 1.0))
        );
        let three = Cdf::with_quantiles(vec![4.0, 2.0], 3).unwrap();
        assert_eq!(three.quantiles, [2.0, 3.0, 4.0]);
    }
}
