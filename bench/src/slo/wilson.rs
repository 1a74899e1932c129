//! The Wilson score interval on a share of successes.

use serde::{Deserialize, Serialize};

/// The normal quantile of a two-sided 95% interval.
pub const Z_95: f64 = 1.959964;

/// A closed interval of shares, `0 <= low <= high <= 1`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Interval {
    pub low: f64,
    pub high: f64,
}

/// The Wilson score interval of `successes` out of `n` at the normal quantile `z`; `None`
/// for no trials. Unlike the normal approximation it stays inside [0, 1] and keeps a width
/// at 0/n and n/n, where the bound at the observed edge is exactly 0 or 1.
pub fn wilson(successes: usize, n: usize, z: f64) -> Option<Interval> {
    if n == 0 {
        return None;
    }
    let (k, n) = (successes.min(n) as f64, n as f64);
    let p = k / n;
    let z2 = z * z;
    let denom = 1.0 + z2 / n;
    let center = (p + z2 / (2.0 * n)) / denom;
    let half = z / denom * (p * (1.0 - p) / n + z2 / (4.0 * n * n)).sqrt();
    // At the edges `center ∓ half` is 0 or 1 only up to rounding.
    let low = if k == 0.0 { 0.0 } else { center - half };
    let high = if k == n { 1.0 } else { center + half };
    Some(Interval {
        low: low.clamp(0.0, 1.0),
        high: high.clamp(0.0, 1.0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at4(i: Interval) -> (f64, f64) {
        let r = |x: f64| (x * 1e4).round() / 1e4;
        (r(i.low), r(i.high))
    }

    #[test]
    fn matches_hand_computed_bounds() {
        // p = 0.8, z²/n = 0.38415: center 0.71674, half-width 0.22658.
        assert_eq!(at4(wilson(8, 10, Z_95).unwrap()), (0.4902, 0.9433));
        assert_eq!(at4(wilson(50, 100, Z_95).unwrap()), (0.4038, 0.5962));
        assert_eq!(at4(wilson(1, 1, Z_95).unwrap()), (0.2065, 1.0));
    }

    #[test]
    fn edges_are_exact() {
        // 0/10: high = (z²/n) / (1 + z²/n); 10/10: low = 1 / (1 + z²/n).
        let none = wilson(0, 10, Z_95).unwrap();
        assert_eq!(none.low, 0.0);
        assert_eq!(at4(none), (0.0, 0.2775));
        let all = wilson(10, 10, Z_95).unwrap();
        assert_eq!(all.high, 1.0);
        assert_eq!(at4(all), (0.7225, 1.0));
        assert_eq!(wilson(0, 0, Z_95), None);
    }
}
