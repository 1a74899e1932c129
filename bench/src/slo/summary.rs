//! The summary of one latency series.

use serde::{Deserialize, Serialize};

use crate::stats::{percentile, sorted};

/// Percentiles (linear interpolation, [`percentile`]), mean, population standard deviation
/// (numpy's default, as vLLM and aiperf report it), extremes and count of a series, in the
/// series' unit (seconds in a report).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub count: usize,
    pub mean: f64,
    pub std: f64,
    pub min: f64,
    pub max: f64,
    pub p50: f64,
    pub p90: f64,
    pub p95: f64,
    pub p99: f64,
    pub p99_9: f64,
}

impl Summary {
    /// `None` for no values.
    pub fn of(values: Vec<f64>) -> Option<Summary> {
        let v = sorted(values);
        let count = v.len();
        let n = count as f64;
        let mean = v.iter().sum::<f64>() / n;
        let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n;
        let p = |q| percentile(&v, q);
        Some(Summary {
            count,
            mean,
            std: var.sqrt(),
            min: *v.first()?,
            max: *v.last()?,
            p50: p(50.0)?,
            p90: p(90.0)?,
            p95: p(95.0)?,
            p99: p(99.0)?,
            p99_9: p(99.9)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summarizes_known_data() {
        assert_eq!(Summary::of(Vec::new()), None);
        // 1..=1000 shuffled by a stride coprime to 1000: percentiles interpolate over ranks.
        let values = (0..1000).map(|i| f64::from((i * 373) % 1000 + 1)).collect();
        let s = Summary::of(values).unwrap();
        assert_eq!((s.count, s.min, s.max, s.mean), (1000, 1.0, 1000.0, 500.5));
        assert_eq!((s.p50, s.p90), (500.5, 900.1));
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        assert!(close(s.p95, 950.05), "{}", s.p95);
        assert!(close(s.p99, 990.01), "{}", s.p99);
        assert!(close(s.p99_9, 999.001), "{}", s.p99_9);
        // Population variance of 1..=n is (n² - 1) / 12.
        assert!(close(s.std, ((1000.0f64 * 1000.0 - 1.0) / 12.0).sqrt()));
    }

    #[test]
    fn one_value_and_two() {
        let s = Summary::of(vec![0.25]).unwrap();
        assert_eq!(
            (s.count, s.min, s.p50, s.p99_9, s.max),
            (1, 0.25, 0.25, 0.25, 0.25)
        );
        assert_eq!((s.mean, s.std), (0.25, 0.0));
        let s = Summary::of(vec![3.0, 1.0]).unwrap();
        assert_eq!(
            (s.mean, s.std, s.p50, s.min, s.max),
            (2.0, 1.0, 2.0, 1.0, 3.0)
        );
    }
}
