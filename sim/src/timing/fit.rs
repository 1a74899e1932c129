//! Fitting a [`TimingProfile`] to measured steps (what `kvmesh profile` does with its
//! measurements).
//!
//! Non-negative least squares on relative error: each sample's terms are divided by its
//! measured time, so a 5 ms decode step weighs as much as a 2 s prefill, and the fit minimises
//! `sum(((predicted - measured) / measured)^2)` with every coefficient at least 0.
//!
//! Six unknowns are few enough to solve exactly by enumeration. Some optimum of a
//! non-negative least-squares problem is the unconstrained least-squares solution on a set of
//! linearly independent columns (its support), so the best non-negative candidate over all
//! subsets of the identified terms is an optimum. Each candidate is solved by Gram-Schmidt QR
//! on unit-scaled columns rather than through the normal equations, whose condition number is
//! the square of the columns' (which range from 1 to millions of token pairs).

use super::{StepShape, TimingError, TimingProfile, NUM_TERMS};
use std::time::Duration;

/// A fitted profile and how well it matches the samples it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct Fit {
    pub profile: TimingProfile,
    /// Terms the samples cannot identify: no sample varies them, or they vary only as a
    /// combination of the terms before them (in [`TimingProfile::TERMS`] order), as the
    /// context of decodes all measured at one context does with their batch size. Their
    /// coefficient is 0.
    pub unidentified: Vec<&'static str>,
    /// Identified terms held at 0 by the non-negativity constraint.
    pub at_zero: Vec<&'static str>,
    /// `1 - SS_res / SS_tot` of the predicted against the measured times, unweighted.
    pub r_squared: f64,
    /// The largest `|predicted - measured| / measured` over the samples.
    pub max_rel_error: f64,
    /// The median of the same.
    pub median_rel_error: f64,
}

/// A column is independent of those before it when more than this share of its norm is left
/// after projecting them out. Measured times leave orders of magnitude more; an exact
/// dependence (every decode at one context) leaves rounding error, about 1e-16.
const INDEPENDENCE_TOLERANCE: f64 = 1e-9;

impl TimingProfile {
    /// The profile, named `name` with `source`, whose step times best match `samples` in
    /// relative error, with every coefficient non-negative; see the module documentation.
    pub fn fit(
        name: &str,
        source: &str,
        samples: &[(StepShape, Duration)],
    ) -> Result<Fit, TimingError> {
        if samples.is_empty() {
            return Err(TimingError::NoSamples);
        }
        for (index, (shape, time)) in samples.iter().enumerate() {
            if shape.is_empty() {
                return Err(TimingError::EmptyStep { index });
            }
            if time.is_zero() {
                return Err(TimingError::ZeroTime { index });
            }
        }
        let times: Vec<f64> = samples.iter().map(|(_, t)| t.as_secs_f64() * 1e6).collect();

        // Column j holds term j of every sample over its time; the target is 1 everywhere.
        let mut columns = vec![vec![0.0; samples.len()]; NUM_TERMS];
        for (i, ((shape, _), t)) in samples.iter().zip(&times).enumerate() {
            for (column, x) in columns.iter_mut().zip(shape.terms()) {
                column[i] = x / t;
            }
        }
        let scales: Vec<f64> = columns.iter().map(|c| norm(c)).collect();
        for (column, &scale) in columns.iter_mut().zip(&scales) {
            if scale > 0.0 {
                column.iter_mut().for_each(|x| *x /= scale);
            }
        }
        let identified = independent(&columns);
        let beta = nnls(&columns, &identified, &vec![1.0; samples.len()]);

        let mut coefficients = [0.0; NUM_TERMS];
        for (j, c) in coefficients.iter_mut().enumerate() {
            if beta[j] > 0.0 {
                *c = beta[j] / scales[j];
            }
            if !c.is_finite() {
                return Err(TimingError::NotFinite {
                    field: Self::TERMS[j],
                    value: *c,
                });
            }
        }
        let profile = TimingProfile::with_coefficients(name, source, coefficients);
        let terms = |keep: fn(bool, f64) -> bool| -> Vec<&'static str> {
            (0..NUM_TERMS)
                .filter(|&j| keep(identified[j], beta[j]))
                .map(|j| Self::TERMS[j])
                .collect()
        };
        let unidentified = terms(|identified, _| !identified);
        let at_zero = terms(|identified, beta| identified && beta == 0.0);

        let predicted: Vec<f64> = samples.iter().map(|(s, _)| profile.micros(s)).collect();
        let mut errors: Vec<f64> = predicted
            .iter()
            .zip(&times)
            .map(|(p, t)| (p - t).abs() / t)
            .collect();
        errors.sort_by(f64::total_cmp);
        let mean = times.iter().sum::<f64>() / times.len() as f64;
        let ss_tot: f64 = times.iter().map(|t| (t - mean).powi(2)).sum();
        let ss_res: f64 = predicted
            .iter()
            .zip(&times)
            .map(|(p, t)| (p - t).powi(2))
            .sum();
        let r_squared = if ss_tot > 0.0 {
            1.0 - ss_res / ss_tot
        } else if ss_res <= f64::EPSILON * mean * mean {
            1.0 // one distinct time, matched
        } else {
            0.0
        };
        Ok(Fit {
            profile,
            unidentified,
            at_zero,
            r_squared,
            max_rel_error: errors[errors.len() - 1],
            median_rel_error: median(&errors),
        })
    }
}

/// The median of sorted, non-empty `v`.
fn median(v: &[f64]) -> f64 {
    let mid = v.len() / 2;
    if v.len() % 2 == 1 {
        v[mid]
    } else {
        (v[mid - 1] + v[mid]) / 2.0
    }
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn norm(a: &[f64]) -> f64 {
    dot(a, a).sqrt()
}

/// Which columns are independent of the identified columns before them.
fn independent(columns: &[Vec<f64>]) -> [bool; NUM_TERMS] {
    let mut basis = Basis::default();
    let mut identified = [false; NUM_TERMS];
    for (j, column) in columns.iter().enumerate() {
        identified[j] = basis.push(column).is_some();
    }
    identified
}

/// The non-negative `beta` (zero outside `allowed`) minimising `|sum_j beta_j c_j - b|`:
/// the best non-negative unconstrained solution over every subset of the allowed columns.
fn nnls(columns: &[Vec<f64>], allowed: &[bool; NUM_TERMS], b: &[f64]) -> [f64; NUM_TERMS] {
    let allowed: Vec<usize> = (0..NUM_TERMS).filter(|&j| allowed[j]).collect();
    let mut best = ([0.0; NUM_TERMS], dot(b, b));
    for mask in 1u32..1 << allowed.len() {
        let support: Vec<usize> = (0..allowed.len())
            .filter(|k| mask >> k & 1 == 1)
            .map(|k| allowed[k])
            .collect();
        let cols: Vec<&[f64]> = support.iter().map(|&j| columns[j].as_slice()).collect();
        let Some(x) = least_squares(&cols, b) else {
            continue;
        };
        if x.iter().any(|&v| v < 0.0) {
            continue;
        }
        let mut beta = [0.0; NUM_TERMS];
        for (&j, v) in support.iter().zip(x) {
            beta[j] = v;
        }
        let mut residual = b.to_vec();
        for (column, &v) in columns.iter().zip(&beta) {
            residual
                .iter_mut()
                .zip(column)
                .for_each(|(r, c)| *r -= v * c);
        }
        let sq = dot(&residual, &residual);
        if sq < best.1 {
            best = (beta, sq);
        }
    }
    best.0
}

/// The `x` minimising `|sum_j x_j cols[j] - b|`, or `None` if the columns are dependent.
fn least_squares(cols: &[&[f64]], b: &[f64]) -> Option<Vec<f64>> {
    let mut basis = Basis::default();
    // r[j]: column j of R (its coordinates in the basis), so cols = Q R.
    let r: Vec<Vec<f64>> = cols.iter().map(|c| basis.push(c)).collect::<Option<_>>()?;
    let y = basis.reduce(&mut b.to_vec());
    let mut x = vec![0.0; cols.len()];
    for j in (0..cols.len()).rev() {
        let rest: f64 = (j + 1..cols.len()).map(|l| r[l][j] * x[l]).sum();
        x[j] = (y[j] - rest) / r[j][j];
    }
    Some(x)
}

/// An orthonormal basis built by modified Gram-Schmidt, projecting twice for orthogonality.
#[derive(Default)]
struct Basis {
    q: Vec<Vec<f64>>,
}

impl Basis {
    /// Removes the basis directions from `v`, returning `v`'s coordinates along them.
    fn reduce(&self, v: &mut [f64]) -> Vec<f64> {
        let mut coords = vec![0.0; self.q.len()];
        for _ in 0..2 {
            for (q, c) in self.q.iter().zip(&mut coords) {
                let d = dot(q, v);
                *c += d;
                v.iter_mut().zip(q).for_each(|(x, q)| *x -= d * q);
            }
        }
        coords
    }

    /// Adds `column`'s direction and returns its coordinates in the grown basis (the last
    /// is its norm outside the old basis), or `None` if too little of it is left.
    fn push(&mut self, column: &[f64]) -> Option<Vec<f64>> {
        let mut v = column.to_vec();
        let mut coords = self.reduce(&mut v);
        let n = norm(&v);
        if n <= INDEPENDENCE_TOLERANCE * norm(column) || n == 0.0 {
            return None;
        }
        v.iter_mut().for_each(|x| *x /= n);
        self.q.push(v);
        coords.push(n);
        Some(coords)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::timing::tests::chunk;
    use kvmesh_engine::runner::StepInput;

    fn prefill(n: usize, cached: usize) -> StepShape {
        StepShape::of(&StepInput {
            chunks: vec![chunk(cached, n)],
        })
    }

    fn decode(batch: usize, context: usize) -> StepShape {
        StepShape::of(&StepInput {
            chunks: (0..batch).map(|_| chunk(context - 1, 1)).collect(),
        })
    }

    fn mixed(n: usize, cached: usize, batch: usize, context: usize) -> StepShape {
        let mut chunks = vec![chunk(cached, n)];
        chunks.extend((0..batch).map(|_| chunk(context - 1, 1)));
        StepShape::of(&StepInput { chunks })
    }

    /// Whole nanoseconds for every shape (each coefficient a multiple of 1 ns), so the
    /// samples carry no rounding.
    fn truth() -> TimingProfile {
        TimingProfile::with_coefficients("truth", "", [4000.0, 50.0, 0.5, 300.0, 0.2, 0.01])
    }

    fn grid(cached: &[usize], contexts: &[usize]) -> Vec<StepShape> {
        let mut shapes = Vec::new();
        for &c in cached {
            shapes.extend([16, 64, 256, 1024].map(|n| prefill(n, c)));
        }
        for &ctx in contexts {
            shapes.extend([1, 4, 16].map(|b| decode(b, ctx)));
        }
        shapes.push(mixed(256, 0, 8, contexts[0]));
        shapes
    }

    fn measure(p: &TimingProfile, shapes: &[StepShape]) -> Vec<(StepShape, Duration)> {
        shapes
            .iter()
            .map(|s| (*s, Duration::from_secs_f64(p.micros(s) / 1e6)))
            .collect()
    }

    fn assert_close(got: f64, want: f64, what: &str) {
        assert!(
            (got - want).abs() <= 1e-9 * want.abs().max(1e-9),
            "{what}: got {got}, want {want}"
        );
    }

    #[test]
    fn recovers_known_coefficients_from_noiseless_samples() {
        let samples = measure(&truth(), &grid(&[0, 512], &[128, 1024]));
        let fit = TimingProfile::fit("cpu", "synthetic", &samples).unwrap();
        assert_eq!(fit.profile.name, "cpu");
        assert_eq!(fit.profile.source, "synthetic");
        for ((term, got), want) in TimingProfile::TERMS
            .iter()
            .zip(fit.profile.coefficients())
            .zip(truth().coefficients())
        {
            assert_close(got, want, term);
        }
        assert!(fit.unidentified.is_empty(), "{fit:?}");
        assert!(fit.at_zero.is_empty(), "{fit:?}");
        assert!(fit.max_rel_error < 1e-9, "{fit:?}");
        assert!(fit.median_rel_error <= fit.max_rel_error);
        assert_close(fit.r_squared, 1.0, "R²");
    }

    #[test]
    fn a_term_no_sample_varies_is_zero_and_reported() {
        // No prefill reads cached tokens: that column is all zeros.
        let samples = measure(&truth(), &grid(&[0], &[128, 1024]));
        let fit = TimingProfile::fit("cpu", "", &samples).unwrap();
        assert_eq!(fit.unidentified, ["prefill_per_cached_token_us"]);
        assert_eq!(fit.profile.prefill_per_cached_token_us, 0.0);
        let want = truth().coefficients();
        for (j, got) in fit.profile.coefficients().into_iter().enumerate() {
            if j != 2 {
                assert_close(got, want[j], TimingProfile::TERMS[j]);
            }
        }
        assert!(fit.max_rel_error < 1e-9, "{fit:?}");
    }

    #[test]
    fn a_term_that_only_moves_with_another_is_zero_and_reported() {
        // Every decode at one context: its context is 512 times its batch size.
        let samples = measure(&truth(), &grid(&[0, 512], &[512]));
        let fit = TimingProfile::fit("cpu", "", &samples).unwrap();
        assert_eq!(fit.unidentified, ["decode_per_context_token_us"]);
        assert_eq!(fit.profile.decode_per_context_token_us, 0.0);
        // The per-sequence term absorbs it, and every sample is still priced exactly.
        assert_close(
            fit.profile.decode_per_seq_us,
            300.0 + 0.2 * 512.0,
            "per seq",
        );
        assert!(fit.max_rel_error < 1e-9, "{fit:?}");
    }

    #[test]
    fn one_sample_identifies_only_the_overhead() {
        let samples = measure(&truth(), &[prefill(64, 0)]);
        let fit = TimingProfile::fit("cpu", "", &samples).unwrap();
        assert_eq!(fit.unidentified.len(), NUM_TERMS - 1);
        assert_eq!(fit.profile.step_time(&samples[0].0), samples[0].1);
        assert_eq!(fit.r_squared, 1.0);
    }

    #[test]
    fn coefficients_stay_non_negative() {
        // Decode steps that get cheaper with context: least squares would go negative.
        let mut c = truth().coefficients();
        c[4] = -0.05;
        let falling = TimingProfile::with_coefficients("falling", "", c);
        let samples = measure(&falling, &grid(&[0, 512], &[128, 1024]));
        let fit = TimingProfile::fit("cpu", "", &samples).unwrap();
        assert_eq!(fit.at_zero, ["decode_per_context_token_us"]);
        assert_eq!(fit.profile.decode_per_context_token_us, 0.0);
        fit.profile.validate().unwrap();
        assert!(fit.max_rel_error > 0.0 && fit.r_squared < 1.0, "{fit:?}");
    }

    #[test]
    fn small_steps_weigh_as_much_as_large_ones() {
        // One 1,024-token prefill 20% slow: an unweighted fit would bend the small decode
        // steps to it; on relative error they stay priced within a few percent.
        let shapes = grid(&[0, 512], &[128, 1024]);
        let mut samples = measure(&truth(), &shapes);
        let big = shapes
            .iter()
            .position(|s| *s == prefill(1024, 512))
            .unwrap();
        samples[big].1 = samples[big].1 * 6 / 5;
        let fit = TimingProfile::fit("cpu", "", &samples).unwrap();
        for (shape, time) in &samples {
            if shape.decode_seqs > 0 && shape.prefill_tokens == 0 {
                let err = (fit.profile.micros(shape) / 1e6 - time.as_secs_f64()).abs()
                    / time.as_secs_f64();
                assert!(err < 0.05, "{shape:?}: {err}");
            }
        }
    }

    #[test]
    fn rejects_input_it_cannot_weigh() {
        // A `Duration` cannot be NaN; a zero one is what would make a weight infinite.
        let ok = (decode(1, 128), Duration::from_millis(5));
        assert!(matches!(
            TimingProfile::fit("cpu", "", &[]),
            Err(TimingError::NoSamples)
        ));
        assert!(matches!(
            TimingProfile::fit("cpu", "", &[ok, (decode(2, 128), Duration::ZERO)]),
            Err(TimingError::ZeroTime { index: 1 })
        ));
        assert!(matches!(
            TimingProfile::fit(
                "cpu",
                "",
                &[(StepShape::default(), Duration::from_millis(1)), ok]
            ),
            Err(TimingError::EmptyStep { index: 0 })
        ));
        let err = TimingProfile::fit("cpu", "", &[]).unwrap_err().to_string();
        assert!(err.contains("at least one measured step"), "{err}");
    }
}
