//! Statistical checks that the sampler draws from the distribution it claims: a chi-square
//! goodness-of-fit over a small vocabulary with fixed seeds and generous bounds (the critical
//! value for p = 1e-4 at 3 degrees of freedom is about 21.1).

use kvmesh_common::SamplingParams;
use kvmesh_engine::sampler::Sampler;

const DRAWS: usize = 40_000;
const CHI2_BOUND: f64 = 21.1;

/// Draws `DRAWS` tokens from `logits` under `params` and returns the chi-square statistic
/// against `expected` probabilities.
fn chi_square(params: &SamplingParams, logits: &[f32], expected: &[f64]) -> f64 {
    let mut sampler = Sampler::new(params, None);
    let mut counts = vec![0usize; logits.len()];
    for _ in 0..DRAWS {
        let token = sampler.sample(params, &mut logits.to_vec(), &[], &[]).token;
        counts[token as usize] += 1;
    }
    counts
        .iter()
        .zip(expected)
        .map(|(&seen, &p)| {
            let want = p * DRAWS as f64;
            if want == 0.0 {
                assert_eq!(seen, 0, "drew a token with probability 0");
                0.0
            } else {
                (seen as f64 - want).powi(2) / want
            }
        })
        .sum()
}

fn ln(p: &[f64]) -> Vec<f32> {
    p.iter().map(|&x| x.ln() as f32).collect()
}

fn with_seed(seed: u64) -> SamplingParams {
    SamplingParams {
        seed: Some(seed),
        ..Default::default()
    }
}

#[test]
fn temperature_one_draws_the_softmax() {
    let p = [0.1, 0.2, 0.3, 0.4];
    for seed in [1, 2, 3] {
        let chi2 = chi_square(&with_seed(seed), &ln(&p), &p);
        assert!(chi2 < CHI2_BOUND, "seed {seed}: chi2 = {chi2}");
    }
}

#[test]
fn temperature_sharpens_and_flattens() {
    let p = [0.1, 0.2, 0.3, 0.4];
    // Temperature 0.5 squares the probabilities; 2.0 takes their square roots.
    for (temperature, power) in [(0.5f32, 2.0f64), (2.0, 0.5)] {
        let raw: Vec<f64> = p.iter().map(|x: &f64| x.powf(power)).collect();
        let total: f64 = raw.iter().sum();
        let expected: Vec<f64> = raw.iter().map(|x| x / total).collect();
        let params = SamplingParams {
            temperature,
            ..with_seed(11)
        };
        let chi2 = chi_square(&params, &ln(&p), &expected);
        assert!(
            chi2 < CHI2_BOUND,
            "temperature {temperature}: chi2 = {chi2}"
        );
    }
}

#[test]
fn top_p_renormalises_the_nucleus() {
    // Sorted: 0.4, then 0.3 passes 0.65, so only those two remain, as 4/7 and 3/7.
    let p = [0.1, 0.2, 0.3, 0.4];
    let params = SamplingParams {
        top_p: 0.65,
        ..with_seed(5)
    };
    let chi2 = chi_square(&params, &ln(&p), &[0.0, 0.0, 3.0 / 7.0, 4.0 / 7.0]);
    assert!(chi2 < CHI2_BOUND, "chi2 = {chi2}");
}

#[test]
fn top_k_and_min_p_renormalise_what_they_keep() {
    let p = [0.1, 0.2, 0.3, 0.4];
    let top_k = SamplingParams {
        top_k: 3,
        ..with_seed(8)
    };
    let chi2 = chi_square(&top_k, &ln(&p), &[0.0, 2.0 / 9.0, 3.0 / 9.0, 4.0 / 9.0]);
    assert!(chi2 < CHI2_BOUND, "top_k chi2 = {chi2}");
    // min_p 0.6: keep p >= 0.24, i.e. 0.3 and 0.4.
    let min_p = SamplingParams {
        min_p: 0.6,
        ..with_seed(9)
    };
    let chi2 = chi_square(&min_p, &ln(&p), &[0.0, 0.0, 3.0 / 7.0, 4.0 / 7.0]);
    assert!(chi2 < CHI2_BOUND, "min_p chi2 = {chi2}");
}
