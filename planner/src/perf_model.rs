//! The SLO policy's performance model: how long an engine step takes, linear in its shape.
//!
//! ```text
//! step = step_overhead
//!      + prefill_per_token        * new prefill tokens
//!      + prefill_per_cached_token * cached tokens the prefill chunks read
//!      + decode_per_seq           * decode sequences
//!      + decode_per_context_token * their total context
//! ```
//!
//! The same shape and field names as the simulator's `TimingProfile` (`sim/src/timing.rs`),
//! without its prefill-attention term, so a profile measured by `kvmesh profile` can seed it.
//! Online, [`PerfModel::refit`] refits the coefficients to the last `window` measured steps
//! by least squares, shrunk gently toward the seed so that a window holding only decode
//! steps leaves the prefill coefficients where they were.

use crate::observation::StepSample;
use serde::Deserialize;
use std::collections::VecDeque;

const NUM_TERMS: usize = 5;

/// The model's coefficients, in microseconds.
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PerfCoefficients {
    pub step_overhead_us: f64,
    pub prefill_per_token_us: f64,
    #[serde(default)]
    pub prefill_per_cached_token_us: f64,
    pub decode_per_seq_us: f64,
    pub decode_per_context_token_us: f64,
}

impl Default for PerfCoefficients {
    /// Illustrative numbers of the order of an 8B model on one H200 (a 4 ms step floor, about
    /// 20k prefill tokens a second). Replace them with a measured profile.
    fn default() -> Self {
        PerfCoefficients {
            step_overhead_us: 4000.0,
            prefill_per_token_us: 50.0,
            prefill_per_cached_token_us: 0.0,
            decode_per_seq_us: 20.0,
            decode_per_context_token_us: 0.03,
        }
    }
}

impl PerfCoefficients {
    pub(crate) fn to_array(self) -> [f64; NUM_TERMS] {
        [
            self.step_overhead_us,
            self.prefill_per_token_us,
            self.prefill_per_cached_token_us,
            self.decode_per_seq_us,
            self.decode_per_context_token_us,
        ]
    }

    fn from_array(a: [f64; NUM_TERMS]) -> PerfCoefficients {
        PerfCoefficients {
            step_overhead_us: a[0],
            prefill_per_token_us: a[1],
            prefill_per_cached_token_us: a[2],
            decode_per_seq_us: a[3],
            decode_per_context_token_us: a[4],
        }
    }

    /// The first field that is negative or not finite.
    pub fn problem(&self) -> Option<(&'static str, f64)> {
        const NAMES: [&str; NUM_TERMS] = [
            "step_overhead_us",
            "prefill_per_token_us",
            "prefill_per_cached_token_us",
            "decode_per_seq_us",
            "decode_per_context_token_us",
        ];
        NAMES
            .into_iter()
            .zip(self.to_array())
            .find(|(_, v)| !(v.is_finite() && *v >= 0.0))
    }
}

fn terms(s: &StepSample) -> [f64; NUM_TERMS] {
    [
        s.steps as f64,
        s.prefill_tokens as f64,
        s.prefill_cached_tokens as f64,
        s.decode_seqs as f64,
        s.decode_context_tokens as f64,
    ]
}

/// A step-time model refitted online from measured steps.
#[derive(Clone, Debug)]
pub struct PerfModel {
    prior: PerfCoefficients,
    coefficients: PerfCoefficients,
    window: usize,
    samples: VecDeque<StepSample>,
}

impl PerfModel {
    /// Seeded with `prior`, refitted to at most the last `window` steps.
    pub fn new(prior: PerfCoefficients, window: usize) -> PerfModel {
        PerfModel {
            prior,
            coefficients: prior,
            window: window.max(1),
            samples: VecDeque::new(),
        }
    }

    pub fn coefficients(&self) -> PerfCoefficients {
        self.coefficients
    }

    /// Keep a measured sample for the next [`refit`](Self::refit). Empty steps and steps that
    /// took no time carry no information and are dropped.
    pub fn observe(&mut self, sample: StepSample) {
        let empty = sample.steps == 0 || (sample.prefill_tokens == 0 && sample.decode_seqs == 0);
        if empty || sample.duration.is_zero() {
            return;
        }
        if self.samples.len() == self.window {
            self.samples.pop_front();
        }
        self.samples.push_back(sample);
    }

    /// Least squares over the window, each term scaled to unit RMS, with a ridge of 1e-6
    /// (relative) toward the prior; negative coefficients are clamped to 0. Keeps the old
    /// coefficients if the solve fails.
    pub fn refit(&mut self) {
        let n = self.samples.len();
        if n == 0 {
            return;
        }
        let rows: Vec<([f64; NUM_TERMS], f64)> = self
            .samples
            .iter()
            .map(|s| (terms(s), s.duration.as_secs_f64() * 1e6))
            .collect();
        let mut scale = [0.0; NUM_TERMS];
        for (x, _) in &rows {
            for j in 0..NUM_TERMS {
                scale[j] += x[j] * x[j];
            }
        }
        for s in &mut scale {
            *s = if *s > 0.0 {
                (*s / n as f64).sqrt()
            } else {
                1.0
            };
        }
        let prior = self.prior.to_array();
        let ridge = 1e-6 * n as f64;
        let mut a = [[0.0; NUM_TERMS]; NUM_TERMS];
        let mut b = [0.0; NUM_TERMS];
        for (x, y) in &rows {
            let u: [f64; NUM_TERMS] = std::array::from_fn(|j| x[j] / scale[j]);
            for i in 0..NUM_TERMS {
                b[i] += u[i] * y;
                for j in 0..NUM_TERMS {
                    a[i][j] += u[i] * u[j];
                }
            }
        }
        for i in 0..NUM_TERMS {
            a[i][i] += ridge;
            b[i] += ridge * prior[i] * scale[i];
        }
        let Some(u) = solve(a, b) else { return };
        let theta: [f64; NUM_TERMS] = std::array::from_fn(|j| (u[j] / scale[j]).max(0.0));
        if theta.iter().all(|v| v.is_finite()) {
            self.coefficients = PerfCoefficients::from_array(theta);
        }
    }

    /// Seconds for a prefill-only step of `new_tokens` computed after `cached_tokens` read.
    pub fn prefill_step_s(&self, new_tokens: f64, cached_tokens: f64) -> f64 {
        let c = &self.coefficients;
        (c.step_overhead_us
            + c.prefill_per_token_us * new_tokens
            + c.prefill_per_cached_token_us * cached_tokens)
            / 1e6
    }

    /// Seconds for a decode-only step of `batch` sequences holding `context_tokens` in all.
    pub fn decode_step_s(&self, batch: f64, context_tokens: f64) -> f64 {
        let c = &self.coefficients;
        (c.step_overhead_us
            + c.decode_per_seq_us * batch
            + c.decode_per_context_token_us * context_tokens)
            / 1e6
    }

    /// Seconds the model gives a measured sample's shape (all of its steps).
    pub fn step_s(&self, s: &StepSample) -> f64 {
        let x = terms(s);
        let c = self.coefficients.to_array();
        x.iter().zip(c).map(|(x, c)| x * c).sum::<f64>() / 1e6
    }
}

/// Gaussian elimination with partial pivoting; `None` when singular.
fn solve(
    mut a: [[f64; NUM_TERMS]; NUM_TERMS],
    mut b: [f64; NUM_TERMS],
) -> Option<[f64; NUM_TERMS]> {
    for col in 0..NUM_TERMS {
        let pivot =
            (col..NUM_TERMS).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[pivot][col].abs() < 1e-300 {
            return None;
        }
        a.swap(col, pivot);
        b.swap(col, pivot);
        for row in col + 1..NUM_TERMS {
            let f = a[row][col] / a[col][col];
            let pivot_row = a[col];
            for (x, p) in a[row][col..].iter_mut().zip(&pivot_row[col..]) {
                *x -= f * p;
            }
            b[row] -= f * b[col];
        }
    }
    let mut x = [0.0; NUM_TERMS];
    for row in (0..NUM_TERMS).rev() {
        let rest: f64 = (row + 1..NUM_TERMS).map(|k| a[row][k] * x[k]).sum();
        x[row] = (b[row] - rest) / a[row][row];
    }
    Some(x)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn truth() -> PerfCoefficients {
        PerfCoefficients {
            step_overhead_us: 3000.0,
            prefill_per_token_us: 40.0,
            prefill_per_cached_token_us: 2.0,
            decode_per_seq_us: 25.0,
            decode_per_context_token_us: 0.05,
        }
    }

    fn sample(prefill: u64, cached: u64, seqs: u64, context: u64) -> StepSample {
        let mut s = StepSample {
            steps: 1,
            prefill_tokens: prefill,
            prefill_cached_tokens: cached,
            decode_seqs: seqs,
            decode_context_tokens: context,
            duration: Duration::ZERO,
        };
        let model = PerfModel::new(truth(), 1);
        s.duration = Duration::from_secs_f64(model.step_s(&s));
        s
    }

    #[test]
    fn recovers_known_coefficients_from_noiseless_samples() {
        // Start far from the truth.
        let mut m = PerfModel::new(PerfCoefficients::default(), 256);
        // Prefill-only, decode-only and mixed steps, spread over the shapes a mesh sees.
        for i in 0..60u64 {
            m.observe(sample(256 + 97 * i, (i % 7) * 512, 0, 0));
            m.observe(sample(
                0,
                0,
                1 + (i * 13) % 128,
                (1 + i) * 3000 + (i % 5) * 20_000,
            ));
            m.observe(sample(
                128 + (i % 3) * 64,
                (i % 4) * 100,
                1 + i % 32,
                500 * (i + 1),
            ));
        }
        m.refit();
        let got = m.coefficients().to_array();
        for (g, t) in got.iter().zip(truth().to_array()) {
            assert!((g - t).abs() <= 1e-3 * t, "got {got:?}");
        }
    }

    #[test]
    fn a_window_of_decode_steps_leaves_prefill_coefficients_at_the_prior() {
        let prior = PerfCoefficients {
            prefill_per_token_us: 77.0,
            ..truth()
        };
        let mut m = PerfModel::new(prior, 64);
        for i in 0..64u64 {
            m.observe(sample(0, 0, 1 + i % 40, 2000 * (1 + i) + (i % 3) * 9000));
        }
        m.refit();
        let c = m.coefficients();
        assert!((c.prefill_per_token_us - 77.0).abs() < 1e-6, "{c:?}");
        assert!((c.decode_per_seq_us - 25.0).abs() < 0.1, "{c:?}");
        assert!((c.decode_per_context_token_us - 0.05).abs() < 1e-3, "{c:?}");
    }

    #[test]
    fn the_window_forgets_old_behaviour() {
        let mut m = PerfModel::new(truth(), 50);
        for i in 0..50u64 {
            m.observe(sample(100 + 50 * i, 0, 0, 0));
        }
        // The engine slows down by half.
        for i in 0..50u64 {
            let mut s = sample(100 + 50 * i, 0, 0, 0);
            s.duration = s.duration.mul_f64(1.5);
            m.observe(s);
        }
        m.refit();
        let c = m.coefficients();
        assert!((c.prefill_per_token_us - 60.0).abs() < 0.1, "{c:?}");
        assert!((c.step_overhead_us - 4500.0).abs() < 10.0, "{c:?}");
    }

    #[test]
    fn samples_summing_several_steps_fit_as_the_steps_do() {
        // The same steps, one by one and summed in threes: both fits find the truth.
        let steps: Vec<StepSample> = (0..60u64)
            .map(|i| {
                let (prefill, cached) = if i % 4 == 0 {
                    (50 + 7 * i, (37 * i) % 200)
                } else {
                    (0, 0)
                };
                let seqs = i % 9 + 1;
                sample(prefill, cached, seqs, 300 * seqs + (53 * i) % 700)
            })
            .collect();
        let summed: Vec<StepSample> = steps
            .chunks(3)
            .map(|c| {
                c.iter().fold(
                    StepSample {
                        steps: 0,
                        ..StepSample::default()
                    },
                    |a, s| StepSample {
                        steps: a.steps + s.steps,
                        prefill_tokens: a.prefill_tokens + s.prefill_tokens,
                        prefill_cached_tokens: a.prefill_cached_tokens + s.prefill_cached_tokens,
                        decode_seqs: a.decode_seqs + s.decode_seqs,
                        decode_context_tokens: a.decode_context_tokens + s.decode_context_tokens,
                        duration: a.duration + s.duration,
                    },
                )
            })
            .collect();
        for samples in [steps, summed] {
            let mut m = PerfModel::new(PerfCoefficients::default(), 256);
            for s in samples {
                m.observe(s);
            }
            m.refit();
            let (fit, want) = (m.coefficients().to_array(), truth().to_array());
            for (f, w) in fit.iter().zip(want) {
                assert!(
                    (f - w).abs() <= 1e-3 * w.max(1.0),
                    "{fit:?} against {want:?}"
                );
            }
        }
    }

    #[test]
    fn empty_and_instant_steps_are_ignored() {
        let mut m = PerfModel::new(truth(), 8);
        m.observe(StepSample::default());
        m.observe(StepSample {
            prefill_tokens: 10,
            ..StepSample::default()
        });
        m.observe(StepSample {
            steps: 0,
            prefill_tokens: 10,
            duration: Duration::from_millis(5),
            ..StepSample::default()
        });
        m.refit();
        assert_eq!(m.coefficients(), truth());
    }

    #[test]
    fn predictions_follow_the_formula() {
        let m = PerfModel::new(truth(), 1);
        assert!(
            (m.prefill_step_s(1000.0, 500.0) - (3000.0 + 40_000.0 + 1000.0) / 1e6).abs() < 1e-12
        );
        assert!((m.decode_step_s(10.0, 20_000.0) - (3000.0 + 250.0 + 1000.0) / 1e6).abs() < 1e-12);
    }
}
