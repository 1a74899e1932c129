//! Successive halving over the candidates, as a pure scheduler: it says which candidate to
//! measure next and for how long; the driver runs a max-goodput search for that long and
//! records the goodput it found.
//!
//! Every candidate is measured at a short budget, the better half (rounded up) is kept and
//! measured again at twice the budget, and so on until two remain for a last measurement;
//! the better of those is the winner. Rung `r` then costs about `n · b₀` for every `r`, so
//! with `n` candidates the plan is `Σ |rung r| · 2^r` units of the first budget `b₀`, and
//! `b₀` is chosen to spend exactly the total. Measurements rarely take exactly their budget,
//! so each one is given at most its share of what is left; once that share falls below the
//! shortest useful measurement the schedule ends early.
//!
//! Within a rung candidates are measured best-first (by the rung below), so a schedule cut
//! short has measured the likeliest winners; the winner is the best of the highest rung that
//! has a measurement, compared only against candidates measured at the same budget.

use std::cmp::Ordering;
use std::time::Duration;

/// Measure `candidate` for `budget`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Measurement {
    /// An index into the candidates the schedule was made for.
    pub candidate: usize,
    pub rung: usize,
    pub budget: Duration,
}

/// A measurement and the goodput it found.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Measured {
    pub measurement: Measurement,
    /// Higher is better; NaN ranks below everything.
    pub score: f64,
    /// How long it really took.
    pub took: Duration,
}

/// Why the schedule ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// The last rung was measured: one candidate is left.
    OneLeft,
    /// What is left of the total affords no measurement of the shortest useful length.
    BudgetSpent,
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum HalvingError {
    #[error("no candidates to tune")]
    NoCandidates,
    #[error("the shortest measurement must be longer than zero")]
    ZeroMinimum,
    #[error(
        "{candidates} candidates need {needed:?} at {min_budget:?} a measurement; the budget \
         affords {affordable} (sample that many, or give a longer budget)"
    )]
    TooManyCandidates {
        candidates: usize,
        needed: Duration,
        min_budget: Duration,
        affordable: usize,
    },
    #[error("nothing is being measured: the schedule has ended")]
    Ended,
}

/// How many candidates each rung measures: `n`, then half of the one before (rounded up),
/// down to 2; a single candidate is one rung of one.
fn rung_sizes(candidates: usize) -> Vec<usize> {
    let mut sizes = vec![candidates];
    while let Some(&last) = sizes.last().filter(|&&s| s > 2) {
        sizes.push(last.div_ceil(2));
    }
    sizes
}

/// The plan's length in units of the first rung's budget.
fn units(sizes: &[usize]) -> f64 {
    sizes
        .iter()
        .enumerate()
        .map(|(r, &s)| s as f64 * f64::powi(2.0, r as i32))
        .sum()
}

/// The most candidates a `total` affords when no measurement may be shorter than
/// `min_budget` (0 when not even one).
pub fn affordable(total: Duration, min_budget: Duration) -> usize {
    if min_budget.is_zero() {
        return usize::MAX;
    }
    let fits = |n: usize| units(&rung_sizes(n)) * min_budget.as_secs_f64() <= total.as_secs_f64();
    // `units(n) >= n`, so the answer is at most total / min_budget; the cost only grows
    // with `n`, so bisect.
    let (mut lo, mut hi) = (
        0,
        (total.as_secs_f64() / min_budget.as_secs_f64()) as usize + 1,
    );
    while lo + 1 < hi {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

/// The schedule's state.
#[derive(Clone, Debug)]
pub struct Halving {
    total: Duration,
    min_budget: Duration,
    sizes: Vec<usize>,
    /// The first rung's budget; rung `r` gets `2^r` times it (or its share of what is left).
    first_budget: Duration,
    /// The current rung's candidates, in the order they are measured.
    order: Vec<usize>,
    rung: usize,
    measured: Vec<Measured>,
    spent: Duration,
    finished: Option<Finish>,
}

impl Halving {
    /// A schedule for `candidates` in `total`, no measurement shorter than `min_budget`.
    pub fn new(
        candidates: usize,
        total: Duration,
        min_budget: Duration,
    ) -> Result<Halving, HalvingError> {
        if candidates == 0 {
            return Err(HalvingError::NoCandidates);
        }
        if min_budget.is_zero() {
            return Err(HalvingError::ZeroMinimum);
        }
        let sizes = rung_sizes(candidates);
        let first_budget = total.div_f64(units(&sizes));
        if first_budget < min_budget {
            return Err(HalvingError::TooManyCandidates {
                candidates,
                needed: min_budget.mul_f64(units(&sizes)),
                min_budget,
                affordable: affordable(total, min_budget),
            });
        }
        Ok(Halving {
            total,
            min_budget,
            sizes,
            first_budget,
            order: (0..candidates).collect(),
            rung: 0,
            measured: Vec::new(),
            spent: Duration::ZERO,
            finished: None,
        })
    }

    /// How many candidates each rung measures.
    pub fn rung_sizes(&self) -> &[usize] {
        &self.sizes
    }

    /// The planned budget of one measurement in each rung (before any shrinking).
    pub fn planned(&self) -> Vec<Duration> {
        (0..self.sizes.len())
            .map(|r| self.first_budget * (1 << r))
            .collect()
    }

    fn in_rung(&self) -> usize {
        self.measured
            .iter()
            .filter(|m| m.measurement.rung == self.rung)
            .count()
    }

    /// What to measure next; `None` once the schedule has ended.
    pub fn next(&self) -> Option<Measurement> {
        if self.finished.is_some() {
            return None;
        }
        let done = self.in_rung();
        let scale = |r: usize| f64::powi(2.0, r as i32);
        let left_units = (self.sizes[self.rung] - done) as f64 * scale(self.rung)
            + (self.rung + 1..self.sizes.len())
                .map(|r| self.sizes[r] as f64 * scale(r))
                .sum::<f64>();
        let left = self.total.saturating_sub(self.spent);
        let share = left.mul_f64(scale(self.rung) / left_units);
        let planned = self.first_budget.mul_f64(scale(self.rung));
        let budget = share.min(planned);
        (budget >= self.min_budget).then(|| Measurement {
            candidate: self.order[done],
            rung: self.rung,
            budget,
        })
    }

    /// Records the score of the measurement [`next`](Self::next) named, and how long it
    /// took.
    pub fn record(&mut self, score: f64, took: Duration) -> Result<(), HalvingError> {
        let measurement = self.next().ok_or(HalvingError::Ended)?;
        self.measured.push(Measured {
            measurement,
            score,
            took,
        });
        self.spent += took;
        if self.in_rung() < self.sizes[self.rung] {
            return Ok(());
        }
        if self.rung + 1 == self.sizes.len() {
            self.finished = Some(Finish::OneLeft);
            return Ok(());
        }
        let mut ranked = self.rung_results(self.rung);
        ranked.truncate(self.sizes[self.rung + 1]);
        self.order = ranked.iter().map(|m| m.measurement.candidate).collect();
        self.rung += 1;
        Ok(())
    }

    /// The measurements of rung `r`, best first (ties: the lower candidate index).
    fn rung_results(&self, rung: usize) -> Vec<Measured> {
        let mut results: Vec<Measured> = self
            .measured
            .iter()
            .filter(|m| m.measurement.rung == rung)
            .copied()
            .collect();
        results.sort_by(|a, b| {
            better(b.score, a.score).then(a.measurement.candidate.cmp(&b.measurement.candidate))
        });
        results
    }

    /// Why the schedule ended; `None` while it runs.
    pub fn finished(&self) -> Option<Finish> {
        self.finished.or_else(|| {
            // Only an unaffordable next measurement stops it early.
            self.next().is_none().then_some(Finish::BudgetSpent)
        })
    }

    /// Every measurement so far, in order.
    pub fn measured(&self) -> &[Measured] {
        &self.measured
    }

    /// The time the measurements took, all together.
    pub fn spent(&self) -> Duration {
        self.spent
    }

    /// The best of the highest rung with a measurement; `None` before the first.
    pub fn winner(&self) -> Option<Measured> {
        let top = self.measured.last()?.measurement.rung;
        self.rung_results(top).first().copied()
    }
}

/// Orders scores ascending with NaN lowest.
fn better(a: f64, b: f64) -> Ordering {
    match (a.is_nan(), b.is_nan()) {
        (true, true) => Ordering::Equal,
        (true, false) => Ordering::Less,
        (false, true) => Ordering::Greater,
        (false, false) => a.total_cmp(&b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: Duration = Duration::from_secs(60);

    /// Runs the schedule, scoring candidate `i` as `scores[i]` and taking `took(budget)`.
    fn run(h: &mut Halving, scores: &[f64], took: impl Fn(Duration) -> Duration) {
        while let Some(m) = h.next() {
            h.record(scores[m.candidate], took(m.budget)).unwrap();
        }
    }

    fn measured(h: &Halving) -> Vec<(usize, usize, u64)> {
        h.measured()
            .iter()
            .map(|m| {
                let m = m.measurement;
                (m.rung, m.candidate, m.budget.as_secs())
            })
            .collect()
    }

    #[test]
    fn keeps_the_better_half_and_doubles_the_budget() {
        // 4 candidates: 4 × 1 + 2 × 2 = 8 units of the first budget.
        let mut h = Halving::new(4, 8 * MIN, MIN).unwrap();
        assert_eq!(h.planned(), [MIN, 2 * MIN]);
        run(&mut h, &[1.0, 4.0, 3.0, 2.0], |b| b);
        // Rung 1 measures the best of rung 0 first.
        assert_eq!(
            measured(&h),
            [
                (0, 0, 60),
                (0, 1, 60),
                (0, 2, 60),
                (0, 3, 60),
                (1, 1, 120),
                (1, 2, 120)
            ]
        );
        assert_eq!(h.finished(), Some(Finish::OneLeft));
        assert_eq!(h.winner().unwrap().measurement.candidate, 1);
        assert_eq!(h.spent(), 8 * MIN);
        assert_eq!(h.record(1.0, MIN), Err(HalvingError::Ended));
    }

    #[test]
    fn the_winner_is_judged_at_the_longest_budget() {
        // Candidate 3 looks best briefly, but candidate 0 is better measured longer: the
        // scores of the last rung decide.
        let mut h = Halving::new(4, 8 * MIN, MIN).unwrap();
        while let Some(m) = h.next() {
            let score = match (m.rung, m.candidate) {
                (0, 3) => 9.0,
                (0, 0) => 5.0,
                (1, 0) => 6.0,
                (1, 3) => 4.0,
                _ => 1.0,
            };
            h.record(score, m.budget).unwrap();
        }
        assert_eq!(h.winner().unwrap().measurement.rung, 1);
        assert_eq!(h.winner().unwrap().measurement.candidate, 0);
        assert_eq!(h.winner().unwrap().score, 6.0);
    }

    #[test]
    fn an_odd_count_keeps_the_half_rounded_up() {
        // 5, 3, 2: 5 + 6 + 8 = 19 units.
        let mut h = Halving::new(5, 19 * MIN, MIN).unwrap();
        assert_eq!(h.planned(), [MIN, 2 * MIN, 4 * MIN]);
        run(&mut h, &[5.0, 1.0, 4.0, 2.0, 3.0], |b| b);
        let rungs: Vec<Vec<usize>> = (0..3)
            .map(|r| {
                h.measured()
                    .iter()
                    .filter(|m| m.measurement.rung == r)
                    .map(|m| m.measurement.candidate)
                    .collect()
            })
            .collect();
        assert_eq!(rungs, [vec![0, 1, 2, 3, 4], vec![0, 2, 4], vec![0, 2]]);
        assert_eq!(h.winner().unwrap().measurement.candidate, 0);
        assert_eq!(h.spent(), 19 * MIN);
    }

    #[test]
    fn the_first_budget_spends_exactly_the_total() {
        let mut h = Halving::new(3, Duration::from_secs(700), Duration::from_secs(1)).unwrap();
        // 3 + 2 × 2 = 7 units of 100 s.
        assert_eq!(
            h.planned(),
            [Duration::from_secs(100), Duration::from_secs(200)]
        );
        run(&mut h, &[1.0, 2.0, 3.0], |b| b);
        assert_eq!(h.spent(), Duration::from_secs(700));
        assert_eq!(h.winner().unwrap().measurement.candidate, 2);
    }

    #[test]
    fn overruns_shrink_later_budgets_and_can_end_the_schedule() {
        let half_minute = Duration::from_secs(30);
        // Each measurement takes 1.5 × its budget: the later ones get their share of what
        // is left, so the schedule still completes, near the total.
        let mut h = Halving::new(4, 8 * MIN, half_minute).unwrap();
        run(&mut h, &[1.0, 4.0, 3.0, 2.0], |b| b.mul_f64(1.5));
        assert_eq!(h.finished(), Some(Finish::OneLeft));
        let budgets: Vec<f64> = h
            .measured()
            .iter()
            .map(|m| m.measurement.budget.as_secs_f64())
            .collect();
        // After the first, 6.5 min are left for 7 units: 55.7 s each.
        assert_eq!(budgets[0], 60.0);
        assert!((budgets[1] - 6.5 * 60.0 / 7.0).abs() < 1e-6, "{budgets:?}");
        assert!(
            budgets.windows(2).take(3).all(|w| w[1] < w[0]),
            "{budgets:?}"
        );
        assert!(budgets[4] < 120.0, "rung 1 is shrunk too: {budgets:?}");
        let spent = h.spent().as_secs_f64();
        assert!(spent > 480.0 && spent < 1.1 * 480.0, "{spent}");
        assert_eq!(h.winner().unwrap().measurement.candidate, 1);

        // At 3 × its budget, the third share is below the minimum: the schedule ends in
        // rung 0, and the winner is the best of what it measured.
        let mut h = Halving::new(4, 8 * MIN, half_minute).unwrap();
        run(&mut h, &[1.0, 4.0, 3.0, 2.0], |b| b * 3);
        assert_eq!(h.finished(), Some(Finish::BudgetSpent));
        assert_eq!(h.measured().len(), 2);
        assert_eq!(h.winner().unwrap().measurement.candidate, 1);
        assert_eq!(h.record(1.0, MIN), Err(HalvingError::Ended));
    }

    #[test]
    fn a_nan_score_ranks_last() {
        let mut h = Halving::new(3, 7 * MIN, MIN).unwrap();
        run(&mut h, &[f64::NAN, 1.0, 0.5], |b| b);
        let last: Vec<usize> = h.measured()[3..]
            .iter()
            .map(|m| m.measurement.candidate)
            .collect();
        assert_eq!(last, [1, 2]);
        assert_eq!(h.winner().unwrap().measurement.candidate, 1);
    }

    #[test]
    fn ties_keep_the_lower_index() {
        let mut h = Halving::new(4, 8 * MIN, MIN).unwrap();
        run(&mut h, &[1.0, 2.0, 2.0, 2.0], |b| b);
        assert_eq!(h.winner().unwrap().measurement.candidate, 1);
        let rung1: Vec<usize> = h.measured()[4..]
            .iter()
            .map(|m| m.measurement.candidate)
            .collect();
        assert_eq!(rung1, [1, 2]);
    }

    #[test]
    fn one_candidate_is_measured_once_for_the_whole_budget() {
        let mut h = Halving::new(1, 10 * MIN, MIN).unwrap();
        assert_eq!(
            h.next(),
            Some(Measurement {
                candidate: 0,
                rung: 0,
                budget: 10 * MIN
            })
        );
        h.record(3.0, 10 * MIN).unwrap();
        assert_eq!(h.finished(), Some(Finish::OneLeft));
        assert_eq!(h.winner().unwrap().score, 3.0);
    }

    #[test]
    fn too_many_candidates_say_how_many_fit() {
        // 20 min at 30 s: 8 candidates take 8 + 4·2 + 2·4 = 24 units (12 min); 9 take
        // 9 + 5·2 + 3·4 + 2·8 = 47 (23.5 min).
        let (total, min) = (20 * MIN, Duration::from_secs(30));
        assert_eq!(affordable(total, min), 8);
        assert!(Halving::new(8, total, min).is_ok());
        let err = Halving::new(9, total, min).unwrap_err();
        assert_eq!(
            err,
            HalvingError::TooManyCandidates {
                candidates: 9,
                needed: Duration::from_secs(47 * 30),
                min_budget: min,
                affordable: 8,
            }
        );
        assert!(err.to_string().contains("the budget affords 8"), "{err}");
        assert_eq!(affordable(Duration::from_secs(29), min), 0);
        assert_eq!(affordable(Duration::from_secs(30), min), 1);
        assert_eq!(
            Halving::new(0, total, min).unwrap_err(),
            HalvingError::NoCandidates
        );
        assert_eq!(
            Halving::new(2, total, Duration::ZERO).unwrap_err(),
            HalvingError::ZeroMinimum
        );
    }
}
