//! How far a role's demand swings within a node's start-up: the scale-down headroom that
//! follows the demand instead of a fixed share.
//!
//! A node started for a burst serves only after its start-up; until then the nodes already
//! there serve the burst. So the room a scale-down should leave follows how far the demand
//! has lately swung within a start-up: none on a smooth day (its demand moves a few percent
//! in that time, within the measurement's noise), much when the mix swings by half within a
//! minute. A spread over many plans, not the largest swing, so that a calm stretch of a
//! swinging day keeps its room. A drop counts as well as a rise: a demand that has just
//! fallen that fast may come back as fast.

use crate::config::SwingHeadroom;
use std::collections::VecDeque;
use std::time::Duration;

/// One role's demand as the plans saw it, and the swings it made.
#[derive(Clone, Debug)]
pub(crate) struct Swing {
    config: SwingHeadroom,
    /// (when, demand), oldest first: those of the last `remember` and the ones they are
    /// compared with.
    samples: VecDeque<(Duration, f64)>,
}

impl Swing {
    pub fn new(config: SwingHeadroom) -> Swing {
        Swing {
            config,
            samples: VecDeque::new(),
        }
    }

    /// The demand a plan sized a role from at `now`.
    pub fn record(&mut self, now: Duration, demand: f64) {
        let demand = if demand.is_finite() {
            demand.max(0.0)
        } else {
            0.0
        };
        self.samples.push_back((now, demand));
        let horizon = self.config.remember + 2 * self.config.over;
        while self
            .samples
            .front()
            .is_some_and(|&(t, _)| now.saturating_sub(t) > horizon)
        {
            self.samples.pop_front();
        }
    }

    /// The share of a replica's planned share a scale-down keeps free: `deviations` times
    /// the spread of the demand's swings over `over` at the plans of the last `remember`,
    /// less the spread a steady demand shows (`noise`, taken out in quadrature), at most
    /// `max`. The swing at a plan is `1 - low / high` of the mean demand of the plans
    /// within `over` up to it and the mean of as many plans before them: the room that
    /// lets the nodes sized for the lower serve the higher. Means over a span, not single
    /// plans: one window's mean prompt length is noisy, a turn of the mix lasts. Plans
    /// further apart than `over` compare with their predecessor.
    pub fn headroom(&self, now: Duration) -> f64 {
        let c = &self.config;
        let mean = |from: usize, to: usize| {
            self.samples.range(from..to).map(|&(_, d)| d).sum::<f64>() / (to - from) as f64
        };
        let (mut sum_of_squares, mut swings) = (0.0, 0u32);
        for (i, &(t, _)) in self.samples.iter().enumerate() {
            if now.saturating_sub(t) > c.remember {
                continue;
            }
            let span = self
                .samples
                .range(..=i)
                .rev()
                .take_while(|&&(s, _)| t.saturating_sub(s) < c.over)
                .count();
            let Some(before) = (i + 1).checked_sub(2 * span) else {
                continue;
            };
            let after = i + 1 - span;
            sum_of_squares += swing(mean(before, after), mean(after, i + 1)).powi(2);
            swings += 1;
        }
        if swings == 0 {
            return 0.0;
        }
        let mean_square = sum_of_squares / f64::from(swings);
        let beyond_noise = (mean_square - c.noise * c.noise).max(0.0).sqrt();
        (c.deviations * beyond_noise).min(c.max)
    }
}

/// `1 - low / high` of two demands; zero when both are zero.
fn swing(a: f64, b: f64) -> f64 {
    let (low, high) = if a <= b { (a, b) } else { (b, a) };
    if high > 0.0 {
        1.0 - low / high
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> SwingHeadroom {
        SwingHeadroom {
            over: Duration::from_secs(30),
            remember: Duration::from_secs(300),
            noise: 0.0,
            deviations: 1.0,
            max: 0.5,
        }
    }

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    /// Plans every 15 s with these demands; the headroom at the last.
    fn recorded(config: SwingHeadroom, demands: &[f64]) -> (Swing, Duration) {
        let mut s = Swing::new(config);
        for (i, &d) in demands.iter().enumerate() {
            s.record(secs(15 * i as u64), d);
        }
        (s, secs(15 * (demands.len() as u64 - 1)))
    }

    /// Root mean square.
    fn rms(swings: &[f64]) -> f64 {
        (swings.iter().map(|s| s * s).sum::<f64>() / swings.len() as f64).sqrt()
    }

    #[test]
    fn a_constant_demand_has_no_swing() {
        let (s, now) = recorded(config(), &[100.0; 40]);
        assert_eq!(s.headroom(now), 0.0);
    }

    /// Over 30 s at 15 s plans: the mean of two plans against the two before, at every plan
    /// with four before it.
    #[test]
    fn a_step_is_measured_between_spans_and_forgotten_after_remember() {
        let mut demands = vec![100.0; 4];
        demands.extend([150.0; 4]);
        let (mut s, now) = recorded(config(), &demands);
        // Plans at 45..105 s: 100/100, 125/100 (the step at 60 s), 150/100, 150/125, 150/150.
        let swings = [0.0, 0.2, 1.0 / 3.0, 1.0 / 6.0, 0.0];
        assert!((s.headroom(now) - rms(&swings)).abs() < 1e-12);
        // A flat demand since: each swing counts while its plan is within 300 s.
        for i in 8..=25 {
            s.record(secs(15 * i), 150.0);
        }
        let flat = |n: usize| vec![0.0; n];
        let at_375 = [[1.0 / 3.0, 1.0 / 6.0].as_slice(), &flat(19)].concat();
        assert!((s.headroom(secs(375)) - rms(&at_375)).abs() < 1e-12);
        s.record(secs(390), 150.0);
        let at_390 = [[1.0 / 6.0].as_slice(), &flat(20)].concat();
        assert!((s.headroom(secs(390)) - rms(&at_390)).abs() < 1e-12);
        s.record(secs(405), 150.0);
        assert_eq!(s.headroom(secs(405)), 0.0);
    }

    #[test]
    fn a_drop_counts_as_a_swing() {
        let (s, now) = recorded(config(), &[200.0, 200.0, 100.0, 100.0]);
        assert!((s.headroom(now) - 0.5).abs() < 1e-12);
    }

    /// The noise comes off in quadrature, then the rest counts `deviations` times.
    #[test]
    fn the_spread_beyond_the_noise_is_scaled_by_deviations() {
        let config = SwingHeadroom {
            noise: 0.3,
            deviations: 1.2,
            ..config()
        };
        // One swing of 0.5: sqrt(0.5^2 - 0.3^2) = 0.4, times 1.2.
        let (s, now) = recorded(config, &[200.0, 200.0, 100.0, 100.0]);
        assert!((s.headroom(now) - 0.48).abs() < 1e-12);
        let (s, now) = recorded(config, &[100.0, 100.0, 80.0, 80.0]);
        assert_eq!(s.headroom(now), 0.0);
    }

    #[test]
    fn one_noisy_plan_counts_for_its_share_of_the_span() {
        // 130 among 100s: each span that holds it (115) against one that does not.
        let (s, now) = recorded(config(), &[100.0, 100.0, 100.0, 130.0, 100.0, 100.0]);
        assert!((s.headroom(now) - (1.0 - 100.0 / 115.0)).abs() < 1e-12);
    }

    #[test]
    fn a_slow_ramp_of_the_same_size_is_no_swing() {
        // 100 -> 150 over 10 minutes at 15 s plans: under 2.5% between two 30 s spans.
        let demands: Vec<f64> = (0..=40).map(|i| 100.0 + 50.0 * i as f64 / 40.0).collect();
        let (s, now) = recorded(config(), &demands);
        let h = s.headroom(now);
        assert!(h > 0.0 && h < 0.025, "{h}");
        let with_noise = Swing {
            config: SwingHeadroom {
                noise: 0.03,
                ..config()
            },
            ..s
        };
        assert_eq!(with_noise.headroom(now), 0.0);
    }

    #[test]
    fn plans_further_apart_than_over_compare_with_their_predecessor() {
        let mut s = Swing::new(config());
        s.record(secs(0), 100.0);
        s.record(secs(60), 200.0);
        s.record(secs(120), 200.0);
        assert!((s.headroom(secs(120)) - rms(&[0.5, 0.0])).abs() < 1e-12);
    }

    #[test]
    fn the_headroom_is_at_most_max() {
        let (s, now) = recorded(config(), &[10.0, 10.0, 100.0, 100.0]);
        assert_eq!(s.headroom(now), 0.5);
    }
}
