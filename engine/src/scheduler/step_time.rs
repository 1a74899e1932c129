//! The step-time budget: prefill chunks sized so that a step takes no longer than a target.
//!
//! Every stream decoding beside a prompt waits for each of that prompt's chunks, so a token
//! budget alone bounds the gap only on the machine it was sized for; and a chunk's cost grows
//! with the context it attends, so a chunk that is cheap at the start of a long prompt is not
//! at its end. [`StepTimeModel`] learns what steps cost on this engine as it runs — time =
//! a + b·tokens + c·positions attended, least squares over recent steps — and
//! [`TimeBudget`] gives each chunk the tokens that keep the step within the target.

use crate::runner::StepInput;

/// What a step asks of the model: tokens through the weights, and positions attended (each
/// token attends its own position and every one before it), for this many sequences.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepShape {
    pub sequences: usize,
    pub tokens: usize,
    pub attended: u64,
}

impl StepShape {
    /// A chunk of `n` tokens after `start` computed ones.
    pub fn chunk(start: usize, n: usize) -> StepShape {
        let (start, n64) = (start as u64, n as u64);
        StepShape {
            sequences: 1,
            tokens: n,
            attended: n64 * start + n64 * (n64 + 1) / 2,
        }
    }

    pub fn of(step: &StepInput) -> StepShape {
        step.chunks
            .iter()
            .map(|c| StepShape::chunk(c.start_pos, c.tokens.len()))
            .fold(StepShape::default(), StepShape::plus)
    }

    pub fn plus(self, other: StepShape) -> StepShape {
        StepShape {
            sequences: self.sequences + other.sequences,
            tokens: self.tokens + other.tokens,
            attended: self.attended + other.attended,
        }
    }

    /// The regression's inputs, scaled to be near 1 for a step of a hundred tokens over a
    /// thousand positions, so that the normal equations are well conditioned.
    fn features(self) -> [f64; 3] {
        [1.0, self.tokens as f64 / 100.0, self.attended as f64 / 1e5]
    }
}

/// Each step's weight in the fit decays by this much per later step: a memory of a few
/// hundred steps, so the model follows a machine whose speed changes (other work on it).
const FORGET: f64 = 0.995;
/// Pulls coefficients the steps so far cannot tell apart towards zero instead of letting
/// them run off, relative to each feature's own weight (features differ in scale by orders
/// of magnitude between decode and prefill steps): small enough to leave what the steps do
/// tell apart alone.
const RIDGE: f64 = 1e-6;
/// Steps observed before the model predicts.
const MIN_STEPS: u32 = 4;

/// Step time as a linear function of [`StepShape`], fitted online.
#[derive(Clone, Debug, Default)]
pub struct StepTimeModel {
    /// Decayed sums of `x xᵀ` and `x y` over observed steps (`x`: features, `y`: seconds).
    xx: [[f64; 3]; 3],
    xy: [f64; 3],
    steps: u32,
    /// Whether a step with more than one token per sequence has been seen: until then the
    /// cost of a prefill chunk is unknown.
    seen_chunk: bool,
}

impl StepTimeModel {
    /// Takes a step's shape and how long it took.
    pub fn observe(&mut self, shape: StepShape, seconds: f64) {
        if shape.tokens == 0 || !seconds.is_finite() || seconds < 0.0 {
            return;
        }
        let x = shape.features();
        for i in 0..3 {
            for j in 0..3 {
                self.xx[i][j] = self.xx[i][j] * FORGET + x[i] * x[j];
            }
            self.xy[i] = self.xy[i] * FORGET + x[i] * seconds;
        }
        self.steps = self.steps.saturating_add(1);
        self.seen_chunk |= shape.tokens > shape.sequences;
    }

    /// What steps cost, as fitted so far; `None` until the model has seen enough.
    pub fn cost(&self) -> Option<StepCost> {
        if self.steps < MIN_STEPS || !self.seen_chunk {
            return None;
        }
        let mut a = self.xx;
        for (i, row) in a.iter_mut().enumerate() {
            row[i] *= 1.0 + RIDGE;
        }
        let c = solve3(a, self.xy)?;
        // A negative cost is noise in a coefficient the data barely constrain.
        Some(StepCost(c.map(|v| v.max(0.0))))
    }
}

/// A fitted step time: `a + b·tokens + c·attended` (coefficients of the scaled features,
/// each at least zero).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepCost([f64; 3]);

impl StepCost {
    /// The predicted seconds of a step of this shape.
    pub fn predict(self, shape: StepShape) -> f64 {
        let (c, x) = (self.0, shape.features());
        c[0] * x[0] + c[1] * x[1] + c[2] * x[2]
    }

    /// The most tokens a chunk starting after `start` computed ones can add to a step of
    /// shape `used` with the step predicted to take at most `target` seconds; `None` when
    /// chunks cost nothing the fit can see.
    pub fn chunk_tokens(self, used: StepShape, start: usize, target: f64) -> Option<usize> {
        let [_, b, c] = self.0;
        let (b, c) = (b / 100.0, c / 1e5);
        // predict(used + chunk(start, n)) = k0 + k1·n + k2·n² with
        let k0 = self.predict(used) - target;
        let k1 = b + c * (start as f64 + 0.5);
        let k2 = c / 2.0;
        if k0 >= 0.0 {
            return Some(0);
        }
        let n = if k2 > 0.0 {
            (-k1 + (k1 * k1 - 4.0 * k2 * k0).sqrt()) / (2.0 * k2)
        } else if k1 > 0.0 {
            -k0 / k1
        } else {
            // Chunks cost nothing the fit can see: no limit from time.
            return None;
        };
        Some(n.floor().min(usize::MAX as f64) as usize)
    }
}

/// Solves `a x = b` by Gaussian elimination with partial pivoting; `None` if singular.
fn solve3(mut a: [[f64; 3]; 3], mut b: [f64; 3]) -> Option<[f64; 3]> {
    for col in 0..3 {
        let pivot = (col..3).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[pivot][col] == 0.0 {
            return None;
        }
        a.swap(col, pivot);
        b.swap(col, pivot);
        let (top, top_b) = (a[col], b[col]);
        for (row, row_b) in a.iter_mut().zip(b.iter_mut()).skip(col + 1) {
            let f = row[col] / top[col];
            for (v, t) in row.iter_mut().zip(top).skip(col) {
                *v -= f * t;
            }
            *row_b -= f * top_b;
        }
    }
    let mut x = [0.0; 3];
    for row in (0..3).rev() {
        let s: f64 = (row + 1..3).map(|k| a[row][k] * x[k]).sum();
        x[row] = (b[row] - s) / a[row][row];
    }
    Some(x)
}

/// One step's time budget while it is planned: what is in it so far and the target.
#[derive(Clone, Copy, Debug)]
pub(super) struct TimeBudget {
    /// `None` until the model can predict: chunks are then left to the token budget.
    cost: Option<StepCost>,
    target: f64,
    used: StepShape,
    /// Whether a prefill chunk is in the step already.
    chunked: bool,
    /// Fewest tokens of the step's first chunk, so prompts progress even when decodes alone
    /// fill the target.
    floor: usize,
}

impl TimeBudget {
    /// A step that will hold `decodes` (the running sequences' one-token chunks).
    pub(super) fn new(
        cost: Option<StepCost>,
        target: f64,
        decodes: StepShape,
        floor: usize,
    ) -> Self {
        TimeBudget {
            cost,
            target,
            used: decodes,
            chunked: false,
            floor,
        }
    }

    /// How many of `n` tokens of a prefill chunk starting after `start` computed ones the
    /// time left allows.
    pub(super) fn limit(&self, start: usize, n: usize) -> usize {
        let fit = self
            .cost
            .and_then(|c| c.chunk_tokens(self.used, start, self.target))
            .unwrap_or(n);
        let floor = if self.chunked { 0 } else { self.floor };
        n.min(fit.max(floor))
    }

    /// Counts in a chunk of `n` tokens after `start` computed ones.
    pub(super) fn add(&mut self, start: usize, n: usize) {
        if n == 0 {
            return;
        }
        self.used = self.used.plus(StepShape::chunk(start, n));
        self.chunked = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `rounds` of steps of a machine whose cost is exactly `a + b·tokens + c·attended`:
    /// decodes of 1..8 sequences at various contexts, and chunks of various sizes beside them.
    fn train(m: &mut StepTimeModel, (a, b, c): (f64, f64, f64), rounds: usize) {
        let time = |s: StepShape| a + b * s.tokens as f64 + c * s.attended as f64;
        for i in 0..rounds {
            let decodes = (0..1 + i % 8)
                .map(|k| StepShape::chunk(100 + 37 * k + i % 50, 1))
                .fold(StepShape::default(), StepShape::plus);
            m.observe(decodes, time(decodes));
            let chunk = decodes.plus(StepShape::chunk(64 * (i % 5), 16 + 8 * (i % 7)));
            m.observe(chunk, time(chunk));
        }
    }

    const MACHINE: (f64, f64, f64) = (0.004, 0.0012, 1.5e-6);

    fn trained() -> StepTimeModel {
        let mut m = StepTimeModel::default();
        train(&mut m, MACHINE, 40);
        m
    }

    #[test]
    fn shapes_count_tokens_and_attended_positions() {
        assert_eq!(StepShape::chunk(0, 1).attended, 1);
        assert_eq!(StepShape::chunk(10, 1).attended, 11);
        // Positions 5..8 attend 6, 7 and 8 positions.
        assert_eq!(StepShape::chunk(5, 3).attended, 6 + 7 + 8);
        assert_eq!(StepShape::chunk(5, 3).tokens, 3);
        let two = StepShape::chunk(5, 3).plus(StepShape::chunk(9, 1));
        assert_eq!((two.sequences, two.tokens, two.attended), (2, 4, 31));
    }

    #[test]
    fn learns_an_exact_linear_cost() {
        let m = trained().cost().unwrap();
        let shape = StepShape::chunk(900, 128).plus(StepShape::chunk(300, 1));
        let truth = 0.004 + 0.0012 * 129.0 + 1.5e-6 * shape.attended as f64;
        let got = m.predict(shape);
        assert!((got / truth - 1.0).abs() < 0.02, "{got} vs {truth}");
    }

    #[test]
    fn predicts_nothing_before_a_chunk_is_seen() {
        let mut m = StepTimeModel::default();
        for i in 0..20 {
            m.observe(StepShape::chunk(100 + i, 1), 0.01);
        }
        assert_eq!(m.cost(), None);
    }

    #[test]
    fn chunk_tokens_is_the_largest_chunk_within_the_target() {
        let m = trained().cost().unwrap();
        let used = StepShape::chunk(500, 1).plus(StepShape::chunk(700, 1));
        for start in [0, 400, 1000] {
            let n = m.chunk_tokens(used, start, 0.1).unwrap();
            let at = |n| m.predict(used.plus(StepShape::chunk(start, n)));
            assert!(at(n) <= 0.1 && at(n + 1) > 0.1, "start {start}: {n}");
        }
        // Later in a prompt, each token attends more: fewer fit.
        let early = m.chunk_tokens(used, 0, 0.1).unwrap();
        let late = m.chunk_tokens(used, 1000, 0.1).unwrap();
        assert!(late < early, "{late} vs {early}");
        // Decodes that already take the whole target leave nothing.
        assert_eq!(m.chunk_tokens(used, 0, 0.004), Some(0));
    }

    #[test]
    fn follows_a_machine_that_slows_down() {
        let mut m = trained();
        let shape = StepShape::chunk(200, 64);
        let before = m.cost().unwrap().predict(shape);
        // The same steps now take three times as long: after a few hundred of them the old
        // ones have all but faded.
        let (a, b, c) = MACHINE;
        train(&mut m, (3.0 * a, 3.0 * b, 3.0 * c), 500);
        let after = m.cost().unwrap().predict(shape);
        assert!((after / before - 3.0).abs() < 0.05, "{after} vs {before}");
    }

    #[test]
    fn the_first_chunk_gets_the_floor_and_later_ones_only_what_fits() {
        let cost = trained().cost();
        // Decodes alone exceed a 5 ms target.
        let decodes = StepShape::chunk(100, 1).plus(StepShape::chunk(100, 1));
        let mut budget = TimeBudget::new(cost, 0.005, decodes, 16);
        assert_eq!(budget.limit(0, 100), 16);
        // A prompt shorter than the floor takes only what it has.
        assert_eq!(budget.limit(0, 5), 5);
        budget.add(0, 16);
        assert_eq!(budget.limit(0, 100), 0);
        // With room, a chunk takes what fits, and the next one what is left.
        let mut budget = TimeBudget::new(cost, 0.1, decodes, 16);
        let n = budget.limit(0, 1000);
        assert!(n > 16 && n < 1000, "{n}");
        budget.add(0, n);
        assert!(budget.limit(0, 1000) <= 1, "{}", budget.limit(0, 1000));
    }

    #[test]
    fn an_untrained_model_leaves_chunks_to_the_token_budget() {
        let mut budget = TimeBudget::new(None, 0.001, StepShape::default(), 16);
        assert_eq!(budget.limit(0, 128), 128);
        budget.add(0, 128);
        assert_eq!(budget.limit(128, 128), 128);
    }
}
