//! Summary statistics shared by every benchmark.

/// The `p`-th percentile (`p` in 0..=100) of `sorted` (ascending), interpolating linearly
/// between the closest ranks (numpy's default); `None` for no samples.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    let last = sorted.len().checked_sub(1)?;
    let rank = p.clamp(0.0, 100.0) / 100.0 * last as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    let (a, b) = (sorted[lo], sorted[hi.min(last)]);
    Some(a + (b - a) * (rank - lo as f64))
}

/// `values` sorted ascending (NaNs last), ready for [`percentile`].
pub fn sorted(mut values: Vec<f64>) -> Vec<f64> {
    values.sort_by(f64::total_cmp);
    values
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_between_ranks() {
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(percentile(&[3.0], 99.0), Some(3.0));
        let v = sorted(vec![4.0, 1.0, 3.0, 2.0, 5.0]);
        assert_eq!(v, [1.0, 2.0, 3.0, 4.0, 5.0]);
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        assert_eq!(percentile(&v, 50.0), Some(3.0));
        assert_eq!(percentile(&v, 100.0), Some(5.0));
        assert!((percentile(&v, 90.0).unwrap() - 4.6).abs() < 1e-12);
        assert_eq!(percentile(&v, 150.0), Some(5.0));
        let hundred = sorted((1..=100).map(f64::from).collect());
        assert!((percentile(&hundred, 99.0).unwrap() - 99.01).abs() < 1e-9);
        assert!((percentile(&[1.0, 2.0], 50.0).unwrap() - 1.5).abs() < 1e-12);
    }
}
