//! Load predictors: one value per planning interval in, the next interval's value out.
//!
//! The SLO policy keeps one predictor per input (arrival rate, prompt and output length,
//! prefix hit rate), all of the configured kind.

use serde::Deserialize;
use std::collections::VecDeque;

/// Forecasts a series sampled once per interval.
pub trait Predictor: Send {
    /// Absorb this interval's value.
    fn observe(&mut self, value: f64);
    /// The next interval's value; `None` before the first observation.
    fn predict(&self) -> Option<f64>;
}

/// Which predictor, with its parameters (`predictor = { kind = "kalman", ... }` in TOML).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum PredictorConfig {
    /// The next value is the last one.
    Constant,
    /// The mean of the last `window` values.
    MovingAverage { window: usize },
    /// Exponentially weighted: `s = alpha * x + (1 - alpha) * s`.
    Ewma { alpha: f64 },
    /// A constant-velocity Kalman filter (level and slope); follows ramps without lag.
    Kalman {
        /// Variance of the slope's change per interval (how fast the trend may bend).
        process_noise: f64,
        /// Variance of one observation around the true level.
        measurement_noise: f64,
    },
}

impl Default for PredictorConfig {
    fn default() -> Self {
        PredictorConfig::Ewma { alpha: 0.5 }
    }
}

impl PredictorConfig {
    /// Why the parameters are unusable, if they are.
    pub fn problem(&self) -> Option<String> {
        match *self {
            PredictorConfig::Constant => None,
            PredictorConfig::MovingAverage { window: 0 } => {
                Some("moving_average window must be at least 1".into())
            }
            PredictorConfig::MovingAverage { .. } => None,
            PredictorConfig::Ewma { alpha } if !(alpha > 0.0 && alpha <= 1.0) => {
                Some(format!("ewma alpha must be in (0, 1], got {alpha}"))
            }
            PredictorConfig::Ewma { .. } => None,
            PredictorConfig::Kalman {
                process_noise,
                measurement_noise,
            } => {
                let ok = |v: f64| v.is_finite() && v > 0.0;
                if ok(process_noise) && ok(measurement_noise) {
                    None
                } else {
                    Some(format!(
                        "kalman noises must be finite and positive, got process {process_noise}, measurement {measurement_noise}"
                    ))
                }
            }
        }
    }

    pub fn build(&self) -> Box<dyn Predictor> {
        match *self {
            PredictorConfig::Constant => Box::new(Constant::default()),
            PredictorConfig::MovingAverage { window } => Box::new(MovingAverage::new(window)),
            PredictorConfig::Ewma { alpha } => Box::new(Ewma::new(alpha)),
            PredictorConfig::Kalman {
                process_noise,
                measurement_noise,
            } => Box::new(Kalman::new(process_noise, measurement_noise)),
        }
    }
}

/// The last value.
#[derive(Clone, Debug, Default)]
pub struct Constant {
    last: Option<f64>,
}

impl Predictor for Constant {
    fn observe(&mut self, value: f64) {
        self.last = Some(value);
    }
    fn predict(&self) -> Option<f64> {
        self.last
    }
}

/// The mean of the last `window` values.
#[derive(Clone, Debug)]
pub struct MovingAverage {
    window: usize,
    values: VecDeque<f64>,
}

impl MovingAverage {
    pub fn new(window: usize) -> MovingAverage {
        MovingAverage {
            window: window.max(1),
            values: VecDeque::new(),
        }
    }
}

impl Predictor for MovingAverage {
    fn observe(&mut self, value: f64) {
        if self.values.len() == self.window {
            self.values.pop_front();
        }
        self.values.push_back(value);
    }
    fn predict(&self) -> Option<f64> {
        (!self.values.is_empty())
            .then(|| self.values.iter().sum::<f64>() / self.values.len() as f64)
    }
}

/// Exponentially weighted moving average.
#[derive(Clone, Debug)]
pub struct Ewma {
    alpha: f64,
    value: Option<f64>,
}

impl Ewma {
    pub fn new(alpha: f64) -> Ewma {
        Ewma { alpha, value: None }
    }
}

impl Predictor for Ewma {
    fn observe(&mut self, value: f64) {
        self.value = Some(match self.value {
            None => value,
            Some(s) => self.alpha * value + (1.0 - self.alpha) * s,
        });
    }
    fn predict(&self) -> Option<f64> {
        self.value
    }
}

/// A 1-D constant-velocity Kalman filter: state (level, slope per interval), transition
/// `level += slope`, the level observed with variance `r`, and white-noise acceleration of
/// variance `q` (process covariance `q * [[1/4, 1/2], [1/2, 1]]`). Predicts `level + slope`.
#[derive(Clone, Debug)]
pub struct Kalman {
    q: f64,
    r: f64,
    /// (level, slope) and its covariance, after the last update.
    state: Option<([f64; 2], [[f64; 2]; 2])>,
}

impl Kalman {
    pub fn new(process_noise: f64, measurement_noise: f64) -> Kalman {
        Kalman {
            q: process_noise,
            r: measurement_noise,
            state: None,
        }
    }

    /// The estimated slope per interval.
    pub fn slope(&self) -> Option<f64> {
        self.state.map(|(x, _)| x[1])
    }
}

impl Predictor for Kalman {
    fn observe(&mut self, z: f64) {
        let Some((x, p)) = self.state else {
            // Level known to the measurement's accuracy; the slope barely known at all.
            self.state = Some(([z, 0.0], [[self.r, 0.0], [0.0, self.r * 100.0]]));
            return;
        };
        // Predict: x = F x, P = F P F^T + Q with F = [[1, 1], [0, 1]].
        let xp = [x[0] + x[1], x[1]];
        let p00 = p[0][0] + p[0][1] + p[1][0] + p[1][1] + self.q * 0.25;
        let p01 = p[0][1] + p[1][1] + self.q * 0.5;
        let p10 = p[1][0] + p[1][1] + self.q * 0.5;
        let p11 = p[1][1] + self.q;
        // Update with H = [1, 0].
        let s = p00 + self.r;
        let k = [p00 / s, p10 / s];
        let y = z - xp[0];
        let xn = [xp[0] + k[0] * y, xp[1] + k[1] * y];
        let pn = [
            [(1.0 - k[0]) * p00, (1.0 - k[0]) * p01],
            [p10 - k[1] * p00, p11 - k[1] * p01],
        ];
        self.state = Some((xn, pn));
    }

    fn predict(&self) -> Option<f64> {
        self.state.map(|(x, _)| x[0] + x[1])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_is_predicted_before_the_first_value() {
        for config in [
            PredictorConfig::Constant,
            PredictorConfig::MovingAverage { window: 3 },
            PredictorConfig::Ewma { alpha: 0.5 },
            PredictorConfig::Kalman {
                process_noise: 1.0,
                measurement_noise: 1.0,
            },
        ] {
            assert_eq!(config.build().predict(), None, "{config:?}");
        }
    }

    #[test]
    fn constant_repeats_the_last_value() {
        let mut p = Constant::default();
        p.observe(3.0);
        p.observe(7.0);
        assert_eq!(p.predict(), Some(7.0));
    }

    #[test]
    fn moving_average_forgets_values_outside_its_window() {
        let mut p = MovingAverage::new(2);
        for v in [100.0, 1.0, 3.0] {
            p.observe(v);
        }
        assert_eq!(p.predict(), Some(2.0));
    }

    #[test]
    fn ewma_smooths_a_step() {
        let mut p = Ewma::new(0.3);
        for _ in 0..5 {
            p.observe(0.0);
        }
        let mut last = 0.0;
        for i in 0..20 {
            p.observe(100.0);
            let v = p.predict().unwrap();
            // Strictly between the old and new level, rising monotonically.
            assert!(v > last && v < 100.0, "step {i}: {v}");
            if i == 0 {
                assert!((v - 30.0).abs() < 1e-9);
            }
            last = v;
        }
        assert!(last > 99.0);
    }

    #[test]
    fn kalman_tracks_a_ramp_without_lag() {
        let mut k = Kalman::new(0.01, 1.0);
        let ramp = |i: usize| 10.0 + 2.5 * i as f64;
        for i in 0..40 {
            k.observe(ramp(i));
        }
        let next = ramp(40);
        let predicted = k.predict().unwrap();
        assert!(
            (predicted - next).abs() < 0.01 * next,
            "{predicted} vs {next}"
        );
        assert!((k.slope().unwrap() - 2.5).abs() < 0.05);
        // An EWMA lags a ramp by slope * (1 - alpha) / alpha.
        let mut e = Ewma::new(0.5);
        for i in 0..40 {
            e.observe(ramp(i));
        }
        assert!(next - e.predict().unwrap() > 4.0);
    }

    #[test]
    fn kalman_settles_on_a_constant() {
        let mut k = Kalman::new(0.01, 1.0);
        for i in 0..50 {
            // A constant with alternating noise.
            k.observe(50.0 + if i % 2 == 0 { 1.0 } else { -1.0 });
        }
        assert!((k.predict().unwrap() - 50.0).abs() < 1.0);
    }

    #[test]
    fn bad_parameters_are_named() {
        assert!(PredictorConfig::Ewma { alpha: 0.0 }.problem().is_some());
        assert!(PredictorConfig::Ewma { alpha: 1.5 }.problem().is_some());
        assert!(PredictorConfig::MovingAverage { window: 0 }
            .problem()
            .is_some());
        let k = PredictorConfig::Kalman {
            process_noise: -1.0,
            measurement_noise: 1.0,
        };
        assert!(k.problem().is_some());
        assert!(PredictorConfig::default().problem().is_none());
    }
}
