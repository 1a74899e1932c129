//! Unit tests of each processing stage. The statistical checks of the draw itself are in
//! `tests/sampler_distribution.rs`.

use super::*;

fn params() -> SamplingParams {
    SamplingParams {
        seed: Some(7),
        ..Default::default()
    }
}

fn greedy() -> SamplingParams {
    SamplingParams::greedy(16)
}

fn sample(p: &SamplingParams, logits: &[f32], prompt: &[TokenId], output: &[TokenId]) -> Sampled {
    Sampler::new(p, Some(0)).sample(p, &mut logits.to_vec(), prompt, output)
}

#[test]
fn greedy_picks_the_argmax_and_the_lowest_id_on_ties() {
    assert_eq!(sample(&greedy(), &[0.1, 2.0, -1.0, 1.9], &[], &[]).token, 1);
    assert_eq!(sample(&greedy(), &[1.0, 3.0, 3.0, 3.0], &[], &[]).token, 1);
    assert_eq!(sample(&greedy(), &[f32::NAN, 0.5, 0.2], &[], &[]).token, 1);
}

proptest::proptest! {
    /// The two-pass argmax is the first strict maximum a plain scan finds, with NaN, ±inf,
    /// signed zeros and ties in the mix.
    #[test]
    fn argmax_matches_a_scan(picks in proptest::collection::vec(0usize..8, 0..100)) {
        const V: [f32; 8] = [f32::NAN, f32::NEG_INFINITY, f32::INFINITY, -0.0, 0.0, 1.5, -2.0, 1.5];
        let logits: Vec<f32> = picks.iter().map(|&i| V[i]).collect();
        let mut want = 0;
        let mut best = f32::NEG_INFINITY;
        for (i, &l) in logits.iter().enumerate() {
            if l > best {
                (want, best) = (i, l);
            }
        }
        proptest::prop_assert_eq!(argmax(&logits), want as TokenId);
    }
}

#[test]
fn top_k_one_equals_greedy() {
    let logits: Vec<f32> = (0..500).map(|i| ((i * 37) % 101) as f32 / 10.0).collect();
    let want = sample(&greedy(), &logits, &[], &[]).token;
    for seed in 0..20 {
        let p = SamplingParams {
            top_k: 1,
            seed: Some(seed),
            ..Default::default()
        };
        assert_eq!(sample(&p, &logits, &[], &[]).token, want);
    }
}

#[test]
fn tiny_top_p_or_large_min_p_keeps_only_the_argmax() {
    let logits = [1.0, 1.5, 3.0, 2.9, 0.0];
    for seed in 0..20 {
        let top_p = SamplingParams {
            top_p: 1e-6,
            seed: Some(seed),
            ..Default::default()
        };
        assert_eq!(sample(&top_p, &logits, &[], &[]).token, 2);
        let min_p = SamplingParams {
            min_p: 0.99,
            seed: Some(seed),
            ..Default::default()
        };
        assert_eq!(sample(&min_p, &logits, &[], &[]).token, 2);
    }
}

#[test]
fn the_same_seed_gives_the_same_tokens() {
    let logits: Vec<f32> = (0..64).map(|i| (i % 7) as f32 * 0.3).collect();
    let run = |seed| {
        let p = SamplingParams {
            seed: Some(seed),
            ..Default::default()
        };
        let mut s = Sampler::new(&p, None);
        (0..50)
            .map(|_| s.sample(&p, &mut logits.clone(), &[], &[]).token)
            .collect::<Vec<_>>()
    };
    assert_eq!(run(1), run(1));
    assert_ne!(run(1), run(2));
    let drawn = Sampler::new(&SamplingParams::default(), None);
    assert_eq!(Sampler::with_seed(drawn.seed(), None).seed(), drawn.seed());
}

#[test]
fn top_k_never_leaves_the_top_k() {
    let logits = [0.0, 5.0, 1.0, 4.9, 4.8, 0.5];
    let p = SamplingParams {
        top_k: 2,
        temperature: 2.0,
        ..params()
    };
    let mut s = Sampler::new(&p, None);
    let mut seen = [0u32; 6];
    for _ in 0..2_000 {
        seen[s.sample(&p, &mut logits.to_vec(), &[], &[]).token as usize] += 1;
    }
    assert_eq!((seen[0], seen[2], seen[4], seen[5]), (0, 0, 0, 0));
    assert!(seen[1] > 0 && seen[3] > 0);
}

#[test]
fn logit_bias_applies_before_everything() {
    let p = SamplingParams {
        logit_bias: vec![(0, 5.0), (99, 1.0)],
        ..greedy()
    };
    assert_eq!(sample(&p, &[0.0, 2.0, 1.0], &[], &[]).token, 0);
}

#[test]
fn repetition_penalty_divides_positive_and_multiplies_negative_logits() {
    let p = SamplingParams {
        repetition_penalty: 2.0,
        ..greedy()
    };
    let mut logits = vec![4.0, -1.0, 3.0, 1.0];
    Sampler::new(&p, None).sample(&p, &mut logits, &[0, 0], &[1]);
    assert_eq!(logits, vec![2.0, -2.0, 3.0, 1.0]);
}

#[test]
fn frequency_and_presence_penalties_count_output_only() {
    let p = SamplingParams {
        frequency_penalty: 0.5,
        presence_penalty: 1.0,
        ..greedy()
    };
    let mut logits = vec![4.0, 4.0, 4.0];
    Sampler::new(&p, None).sample(&p, &mut logits, &[2, 2, 2], &[0, 0, 1]);
    // token 0: 4 - 2*0.5 - 1; token 1: 4 - 0.5 - 1; token 2 is only in the prompt.
    assert_eq!(logits, vec![2.0, 2.5, 4.0]);
}

#[test]
fn output_counts_follow_a_growing_output() {
    let p = SamplingParams {
        frequency_penalty: 1.0,
        ..greedy()
    };
    let mut s = Sampler::new(&p, None);
    let mut logits = vec![0.0; 3];
    s.sample(&p, &mut logits, &[], &[1]);
    let mut logits = vec![0.0; 3];
    s.sample(&p, &mut logits, &[], &[1, 1, 2]);
    assert_eq!(logits, vec![0.0, -2.0, -1.0]);
}

#[test]
fn min_tokens_masks_eos_and_stop_tokens() {
    let p = SamplingParams {
        min_tokens: 2,
        stop_token_ids: vec![1],
        ..greedy()
    };
    let logits = [9.0, 8.0, 1.0];
    let mut s = Sampler::new(&p, Some(0));
    assert_eq!(s.sample(&p, &mut logits.to_vec(), &[], &[2]).token, 2);
    assert_eq!(s.sample(&p, &mut logits.to_vec(), &[], &[2, 2]).token, 0);
    // With ignore_eos, EOS is an ordinary token and is not masked.
    let p = SamplingParams {
        ignore_eos: true,
        ..p
    };
    assert_eq!(sample(&p, &logits, &[], &[]).token, 0);
}

#[test]
fn logprobs_form_a_distribution_and_list_the_top_tokens() {
    let p = SamplingParams {
        logprobs: Some(2),
        ..greedy()
    };
    let logits = [1.0, 3.0, 2.0, 0.0];
    let s = sample(&p, &logits, &[], &[]);
    let total: f32 = [1.0f32, 3.0, 2.0, 0.0].iter().map(|l| l.exp()).sum();
    assert!((s.logprob.unwrap() - (3.0 - total.ln())).abs() < 1e-5);
    let top: Vec<TokenId> = s.top_logprobs.iter().map(|t| t.0).collect();
    assert_eq!(top, vec![1, 2]);
    assert_eq!(Some(s.top_logprobs[0].1), s.logprob);
    // Not asked for: none computed.
    let plain = sample(&greedy(), &logits, &[], &[]);
    assert_eq!((plain.token, plain.logprob), (1, None));
    assert!(plain.top_logprobs.is_empty());
    // Asked for with no alternatives: the chosen token's alone.
    let own = SamplingParams {
        logprobs: Some(0),
        ..greedy()
    };
    let s0 = sample(&own, &logits, &[], &[]);
    assert_eq!((s0.logprob, s0.top_logprobs.len()), (s.logprob, 0));
}

#[test]
fn logprobs_use_the_temperature_but_not_the_truncation() {
    let p = SamplingParams {
        temperature: 0.5,
        top_k: 1,
        logprobs: Some(3),
        ..params()
    };
    let s = sample(&p, &[0.0, 1.0, 0.0], &[], &[]);
    let total = 2.0f32 + 2.0f32.exp();
    assert!((s.logprob.unwrap() - (2.0 - total.ln())).abs() < 1e-5);
    assert!(s.top_logprobs.iter().all(|t| t.1.is_finite()));
}
