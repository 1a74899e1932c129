//! The trade-off between goodput and tail latency: the candidates no other one beats on
//! both, for a report beside the single winner.

/// What a measured candidate achieved.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Point {
    /// Requests per second within the SLO at the highest load that passed (higher is better).
    pub goodput: f64,
    /// TTFT p99 at that load, in seconds (lower is better).
    pub ttft_p99: f64,
}

impl Point {
    /// At least as good on both and better on one.
    pub fn dominates(&self, other: &Point) -> bool {
        self.goodput >= other.goodput
            && self.ttft_p99 <= other.ttft_p99
            && (self.goodput > other.goodput || self.ttft_p99 < other.ttft_p99)
    }
}

/// The indices of the points no other point dominates, by goodput from the highest (ties:
/// the lower TTFT, then the lower index). Equal points are all kept; a point with a NaN is
/// left out (it has no place in the order).
pub fn pareto_front(points: &[Point]) -> Vec<usize> {
    let valid = |p: &Point| !(p.goodput.is_nan() || p.ttft_p99.is_nan());
    let mut front: Vec<usize> = (0..points.len())
        .filter(|&i| valid(&points[i]))
        .filter(|&i| {
            !points
                .iter()
                .any(|other| valid(other) && other.dominates(&points[i]))
        })
        .collect();
    front.sort_by(|&a, &b| {
        let (pa, pb) = (points[a], points[b]);
        pb.goodput
            .total_cmp(&pa.goodput)
            .then(pa.ttft_p99.total_cmp(&pb.ttft_p99))
            .then(a.cmp(&b))
    });
    front
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(goodput: f64, ttft_p99: f64) -> Point {
        Point { goodput, ttft_p99 }
    }

    #[test]
    fn keeps_only_the_undominated_in_goodput_order() {
        let points = [
            p(10.0, 0.5), // 0: front
            p(8.0, 0.3),  // 1: front (faster, less goodput)
            p(9.0, 0.6),  // 2: dominated by 0
            p(12.0, 0.9), // 3: front (most goodput)
            p(8.0, 0.4),  // 4: dominated by 1 (same goodput, slower)
            p(5.0, 0.2),  // 5: front (fastest)
        ];
        assert_eq!(pareto_front(&points), [3, 0, 1, 5]);
    }

    #[test]
    fn equal_points_are_both_kept_and_nan_is_left_out() {
        let points = [p(4.0, 0.1), p(4.0, 0.1), p(f64::NAN, 0.0), p(3.0, f64::NAN)];
        assert_eq!(pareto_front(&points), [0, 1]);
        assert!(!points[0].dominates(&points[1]));
        assert!(p(4.0, 0.1).dominates(&p(4.0, 0.2)));
        assert!(pareto_front(&[]).is_empty());
        // A single point is its own front.
        assert_eq!(pareto_front(&[p(0.0, 1.0)]), [0]);
    }
}
