//! Turns one sequence's logits into its next token.
//!
//! Processing order (vLLM's): logit bias, repetition penalty (prompt and output), frequency
//! and presence penalties (output only), `min_tokens` masking of EOS and stop tokens; then
//! greedy argmax when `temperature == 0` (or `top_k == 1`), else temperature, top-k, top-p,
//! min-p and a seeded draw. Greedy is one pass over the vocabulary; top-k selects with
//! `select_nth_unstable` instead of sorting; only top-p without top-k sorts the vocabulary.

pub mod device_draw;

use kvmesh_common::{SamplingParams, TokenId};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::cmp::Ordering;
use std::collections::HashMap;

/// The chosen token and its log-probabilities.
///
/// Log-probabilities come from the processed distribution: after bias, penalties, masking and
/// temperature (0 counts as 1), before top-k/top-p/min-p truncation, so alternatives the
/// truncation removed still get finite values. They are computed only when asked for
/// (`params.logprobs`): their normalization is an exponential per vocabulary entry, a
/// noticeable share of a small model's decode step.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub token: TokenId,
    /// The chosen token's log-probability; `None` when not asked for.
    pub logprob: Option<f32>,
    /// The `params.logprobs` most likely tokens, most likely first (empty when not asked for).
    pub top_logprobs: Vec<(TokenId, f32)>,
}

/// One sequence's sampler: its random stream and the output-token counts that penalties need.
/// Create one per sequence and keep it for the sequence's life.
#[derive(Debug)]
pub struct Sampler {
    seed: u64,
    rng: StdRng,
    eos: Option<TokenId>,
    /// Occurrences of each token in `output[..num_counted]`.
    output_counts: HashMap<TokenId, u32>,
    num_counted: usize,
    /// The prompt's distinct tokens, sorted; built on first use by the repetition penalty.
    prompt_set: Option<Vec<TokenId>>,
    /// Scratch list of candidate token ids, reused across calls.
    candidates: Vec<u32>,
}

impl Sampler {
    /// Seeds from `params.seed`, or draws a seed when it is `None` (see [`Sampler::seed`]).
    /// `eos` is the model's end-of-sequence token, masked until `min_tokens` are generated.
    pub fn new(params: &SamplingParams, eos: Option<TokenId>) -> Self {
        Self::with_seed(params.seed.unwrap_or_else(rand::random), eos)
    }

    pub fn with_seed(seed: u64, eos: Option<TokenId>) -> Self {
        Sampler {
            seed,
            rng: StdRng::seed_from_u64(seed),
            eos,
            output_counts: HashMap::new(),
            num_counted: 0,
            prompt_set: None,
            candidates: Vec::new(),
        }
    }

    /// The next number in [0, 1) of this sequence's random stream, for a draw made elsewhere
    /// (on the device: `device_draw`). A seeded sequence stays reproducible on either path,
    /// though the two paths pick differently from the same number.
    pub fn uniform(&mut self) -> f32 {
        self.rng.gen::<f32>()
    }

    /// The seed in use: log it to reproduce a run whose seed was drawn.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Picks the next token. `logits` (one per vocabulary entry) is overwritten with the
    /// processed values; `prompt` and `output` are the sequence's tokens so far.
    pub fn sample(
        &mut self,
        params: &SamplingParams,
        logits: &mut [f32],
        prompt: &[TokenId],
        output: &[TokenId],
    ) -> Sampled {
        self.count_output(output);
        apply_logit_bias(params, logits);
        if params.repetition_penalty != 1.0 {
            self.apply_repetition_penalty(params.repetition_penalty, logits, prompt);
        }
        if params.frequency_penalty != 0.0 || params.presence_penalty != 0.0 {
            for (&t, &n) in &self.output_counts {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l -= params.frequency_penalty * n as f32 + params.presence_penalty;
                }
            }
        }
        if (output.len() as u64) < u64::from(params.min_tokens) {
            self.mask_stop_tokens(params, logits);
        }
        if params.temperature > 0.0 && params.temperature != 1.0 {
            let inv = 1.0 / params.temperature;
            logits.iter_mut().for_each(|l| *l *= inv);
        }

        let token = if params.is_greedy() {
            argmax(logits)
        } else {
            self.draw(params, logits)
        };
        let Some(n) = params.logprobs else {
            return Sampled {
                token,
                logprob: None,
                top_logprobs: Vec::new(),
            };
        };
        let lse = log_sum_exp(logits);
        let top_logprobs = match n {
            0 => Vec::new(),
            n => self
                .top_n(logits, n as usize)
                .into_iter()
                .map(|t| (t, logits[t as usize] - lse))
                .collect(),
        };
        Sampled {
            token,
            logprob: Some(
                logits
                    .get(token as usize)
                    .map_or(f32::NEG_INFINITY, |l| l - lse),
            ),
            top_logprobs,
        }
    }

    /// Brings `output_counts` up to date with `output`, counting only what is new.
    fn count_output(&mut self, output: &[TokenId]) {
        if output.len() < self.num_counted {
            self.output_counts.clear();
            self.num_counted = 0;
        }
        for &t in &output[self.num_counted..] {
            *self.output_counts.entry(t).or_insert(0) += 1;
        }
        self.num_counted = output.len();
    }

    /// CTRL's penalty on every token seen in prompt or output: shrinks positive logits and
    /// grows negative ones, so a seen token always becomes less likely.
    fn apply_repetition_penalty(&mut self, penalty: f32, logits: &mut [f32], prompt: &[TokenId]) {
        let prompt_set = self.prompt_set.get_or_insert_with(|| {
            let mut set = prompt.to_vec();
            set.sort_unstable();
            set.dedup();
            set
        });
        let penalize = |l: &mut f32| {
            *l = if *l > 0.0 { *l / penalty } else { *l * penalty };
        };
        for &t in prompt_set.iter() {
            if let Some(l) = logits.get_mut(t as usize) {
                penalize(l);
            }
        }
        for &t in self.output_counts.keys() {
            if prompt_set.binary_search(&t).is_err() {
                if let Some(l) = logits.get_mut(t as usize) {
                    penalize(l);
                }
            }
        }
    }

    fn mask_stop_tokens(&self, params: &SamplingParams, logits: &mut [f32]) {
        let eos = self.eos.filter(|_| !params.ignore_eos);
        for &t in eos.iter().chain(&params.stop_token_ids) {
            if let Some(l) = logits.get_mut(t as usize) {
                *l = f32::NEG_INFINITY;
            }
        }
    }

    /// Top-k, top-p and min-p truncation of the (temperature-scaled) logits, then a draw.
    fn draw(&mut self, params: &SamplingParams, logits: &[f32]) -> TokenId {
        let cand = &mut self.candidates;
        cand.clear();
        cand.extend(0..logits.len() as u32);
        let desc = |a: &u32, b: &u32| descending(logits, *a, *b);

        let k = params.top_k as usize;
        if k > 0 && k < cand.len() {
            cand.select_nth_unstable_by(k - 1, desc);
            cand.truncate(k);
        }
        if params.top_p < 1.0 && cand.len() > 1 {
            cand.sort_unstable_by(desc);
            let max = logits[cand[0] as usize];
            let weights: Vec<f64> = cand
                .iter()
                .map(|&t| f64::from(logits[t as usize] - max).exp())
                .collect();
            let threshold = f64::from(params.top_p) * weights.iter().sum::<f64>();
            let mut cumulative = 0.0;
            let keep = weights
                .iter()
                .position(|w| {
                    cumulative += w;
                    cumulative >= threshold
                })
                .map_or(cand.len(), |i| i + 1);
            cand.truncate(keep);
        }
        if params.min_p > 0.0 {
            let max = cand
                .iter()
                .map(|&t| logits[t as usize])
                .fold(f32::NEG_INFINITY, f32::max);
            // p / p_max >= min_p  <=>  logit >= max_logit + ln(min_p)
            let threshold = max + params.min_p.ln();
            cand.retain(|&t| logits[t as usize] >= threshold);
        }

        let max = cand
            .iter()
            .map(|&t| logits[t as usize])
            .fold(f32::NEG_INFINITY, f32::max);
        if cand.is_empty() || max == f32::NEG_INFINITY {
            return argmax(logits);
        }
        let total: f64 = cand
            .iter()
            .map(|&t| f64::from(logits[t as usize] - max).exp())
            .sum();
        let mut r = self.rng.gen::<f64>() * total;
        for &t in cand.iter() {
            r -= f64::from(logits[t as usize] - max).exp();
            if r < 0.0 {
                return t;
            }
        }
        // Rounding left a sliver of mass: the last candidate with any weight takes it.
        *cand
            .iter()
            .rev()
            .find(|&&t| logits[t as usize] > f32::NEG_INFINITY)
            .expect("max is finite, so one candidate is")
    }

    /// The `n` highest logits' token ids, highest first (ties: lower id first).
    fn top_n(&mut self, logits: &[f32], n: usize) -> Vec<TokenId> {
        let cand = &mut self.candidates;
        cand.clear();
        cand.extend(0..logits.len() as u32);
        let desc = |a: &u32, b: &u32| descending(logits, *a, *b);
        if n < cand.len() {
            cand.select_nth_unstable_by(n - 1, desc);
            cand.truncate(n);
        }
        cand.sort_unstable_by(desc);
        cand.clone()
    }
}

fn apply_logit_bias(params: &SamplingParams, logits: &mut [f32]) {
    for &(t, bias) in &params.logit_bias {
        if let Some(l) = logits.get_mut(t as usize) {
            *l += bias;
        }
    }
}

/// Higher logit first; NaN counts as lowest; ties go to the lower token id, so every
/// selection is deterministic.
fn descending(logits: &[f32], a: u32, b: u32) -> Ordering {
    let key = |t: u32| {
        let l = logits[t as usize];
        if l.is_nan() {
            f32::NEG_INFINITY
        } else {
            l
        }
    };
    key(b).total_cmp(&key(a)).then(a.cmp(&b))
}

/// Index of the largest logit, lowest id on ties; one pass.
/// The index of the largest logit (the first on ties): greedy decoding.
pub fn argmax(logits: &[f32]) -> TokenId {
    // Two passes the compiler vectorizes, instead of one branchy scan (batched decode argmaxes
    // a whole vocabulary per sequence per step): the largest non-NaN logit, then the first
    // index holding it. That is the first strict maximum, as a scan would find.
    const L: usize = 16;
    let pick = |a: f32, l: f32| if l > a { l } else { a };
    let mut lanes = [f32::NEG_INFINITY; L];
    let chunks = logits.chunks_exact(L);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &l) in lanes.iter_mut().zip(c) {
            *a = pick(*a, l);
        }
    }
    let max = lanes
        .into_iter()
        .chain(tail.iter().copied())
        .fold(f32::NEG_INFINITY, pick);
    if max == f32::NEG_INFINITY {
        return 0; // nothing beats -inf: the scan's answer
    }
    let first = logits
        .chunks(L)
        .position(|c| c.iter().fold(false, |hit, &l| hit | (l == max)))
        .unwrap_or(0);
    let at = logits[first * L..]
        .iter()
        .position(|&l| l == max)
        .unwrap_or(0);
    (first * L + at) as TokenId
}

/// `ln(sum(exp(logits)))`, stable against overflow.
fn log_sum_exp(logits: &[f32]) -> f32 {
    let max = logits
        .iter()
        .copied()
        .filter(|l| !l.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    if max.is_infinite() {
        return max;
    }
    let sum: f64 = logits
        .iter()
        .filter(|l| !l.is_nan())
        .map(|&l| f64::from(l - max).exp())
        .sum();
    max + sum.ln() as f32
}

#[cfg(test)]
mod tests;
