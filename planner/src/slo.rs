//! The SLO policy: predicted demand through the performance model against TTFT/ITL targets.
//!
//! Once per interval the window's mean arrival rate, prompt and output lengths and prefix
//! hit rate feed one [`Predictor`] each; the model is refitted to the measured steps; then:
//!
//! ```text
//! uncached prompt  Pu = P * (1 - h)
//! prefill step     C* = the step size (new tokens) of highest throughput C / t(C) whose
//!                       TTFT estimate  k * t(C) * (1 + ceil(Pu / C))  meets the TTFT target
//!                       (a request waits out the step in progress, then its own steps)
//! prefill replicas = ceil((rate * Pu + Q / queue_drain) / (u * C* / (k * t(C*))))
//!                       u: prefill_utilization, Q: prompt tokens queued on every node now
//! decode batch     B* = the largest batch with  k * t_dec(B, B * (P + O/2)) <= ITL target,
//!                       and B * (P + O) within the node's KV capacity
//! decode replicas  = ceil(max(rate * O * k * t_dec(B*), running) / B*)  (Little's law;
//!                       running: the sequences decoding now, with `running_floor`)
//! ```
//!
//! `k` is the correction: observed p50 latency over the model's prediction for the load
//! observed (queue wait plus service for TTFT, the step at the observed batch for ITL),
//! clamped to `correction_min..=correction_max`.
//!
//! A scale-down goes at most to the largest count wanted over `cooldown.down_stable_for`
//! (the Kubernetes HPA's stabilization window), and only to a count that passes the
//! consolidation check against the load observed now. With a headroom x (the fixed
//! `scale_down_headroom`, or with `swing_headroom` a multiple of the spread of the role's
//! demand swings over a node's start-up lately, whichever is larger), the count a
//! scale-down wants and the check's limits keep x of each node's planned share free
//! (growth sizes without it): room for a burst while a node starts.
//!
//! With a prefill minimum of 0 the prefill role may go to zero (the decode nodes prefill
//! every prompt): when the predicted prompt tokens would keep one prefill node less than
//! [`IDLE_PREFILL_UTILIZATION`] busy and no observation of the interval had prompt tokens
//! queued (on any node) at the load policy's down threshold (`load.prefill_queue_down`
//! context lengths). Either rising brings a prefill node back.

use crate::config::SloConfig;
use crate::decision::{Metric, Reason, Role};
use crate::load::Overload;
use crate::observation::Observation;
use crate::perf_model::PerfModel;
use crate::predictor::Predictor;
use crate::swing::Swing;
use std::collections::VecDeque;
use std::time::Duration;

/// The highest prefix hit rate the sizing believes (the rest of a prompt is always computed).
const MAX_HIT_RATE: f64 = 0.95;

/// Below this share of one prefill node's throughput (and with nothing queued), the prefill
/// role may go to zero when its minimum allows.
pub const IDLE_PREFILL_UTILIZATION: f64 = 0.1;

/// How one prefill node should run and what it then serves.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PrefillSizing {
    /// New tokens per step.
    pub step_tokens: f64,
    /// Corrected step time, seconds.
    pub step_s: f64,
    /// Corrected throughput at that step size, prompt tokens per second (before utilization).
    pub tokens_per_s: f64,
    /// Corrected TTFT estimate of a request on an idle node, seconds.
    pub ttft_s: f64,
    pub meets_target: bool,
}

/// How one decode node should run and what it then serves.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecodeSizing {
    /// The largest batch meeting ITL (and KV capacity).
    pub batch: f64,
    /// Corrected step time at that batch, seconds.
    pub step_s: f64,
    pub meets_target: bool,
}

/// The prefill step size meeting TTFT with the highest throughput.
pub fn size_prefill(
    perf: &PerfModel,
    uncached_prompt: f64,
    hit_rate: f64,
    ttft_target_s: f64,
    correction: f64,
    max_step_tokens: u64,
) -> PrefillSizing {
    let pu = uncached_prompt.max(1.0);
    let h = hit_rate.clamp(0.0, MAX_HIT_RATE);
    let max = max_step_tokens.max(1) as f64;
    let mut candidates: Vec<f64> = (4..32)
        .map(|p| f64::from(1u32 << p))
        .take_while(|&c| c < max)
        .collect();
    candidates.push(max);
    if pu < max {
        candidates.push(pu.ceil());
    }
    let size = |c: f64| {
        let step_s = correction * perf.prefill_step_s(c, c * h / (1.0 - h));
        let ttft_s = step_s * (1.0 + (pu / c).ceil());
        PrefillSizing {
            step_tokens: c,
            step_s,
            tokens_per_s: c / step_s,
            ttft_s,
            meets_target: ttft_s <= ttft_target_s,
        }
    };
    let all: Vec<PrefillSizing> = candidates.into_iter().map(size).collect();
    let best_feasible = all
        .iter()
        .filter(|s| s.meets_target)
        .max_by(|a, b| a.tokens_per_s.total_cmp(&b.tokens_per_s));
    *best_feasible.unwrap_or_else(|| {
        all.iter()
            .min_by(|a, b| a.ttft_s.total_cmp(&b.ttft_s))
            .expect("at least one candidate")
    })
}

/// The largest decode batch meeting ITL.
pub fn size_decode(
    perf: &PerfModel,
    prompt: f64,
    output: f64,
    itl_target_s: f64,
    correction: f64,
    max_batch: u32,
    kv_capacity_tokens: Option<u64>,
) -> DecodeSizing {
    let c = perf.coefficients();
    let context = prompt + output / 2.0;
    let per_seq_us = c.decode_per_seq_us + c.decode_per_context_token_us * context;
    let budget_us = itl_target_s / correction * 1e6 - c.step_overhead_us;
    let by_itl = if per_seq_us > 0.0 {
        (budget_us / per_seq_us).floor()
    } else {
        f64::from(max_batch)
    };
    let by_kv = kv_capacity_tokens.map_or(f64::INFINITY, |kv| {
        (kv as f64 / (prompt + output).max(1.0)).floor()
    });
    let batch = by_itl.min(by_kv).min(f64::from(max_batch)).max(1.0);
    DecodeSizing {
        batch,
        step_s: correction * perf.decode_step_s(batch, batch * context),
        meets_target: by_itl >= 1.0 && by_kv >= 1.0,
    }
}

/// What the predictors expect of the next interval.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Demand {
    rate: f64,
    prompt: f64,
    output: f64,
    hit_rate: f64,
}

/// The last interval's sizing, kept for the consolidation check.
#[derive(Clone, Copy, Debug)]
struct Plan {
    prefill: PrefillSizing,
    decode: DecodeSizing,
    wanted: [(u32, f64, f64, f64, bool); 2],
    /// Per role: the share of a replica's planned share a scale-down keeps free.
    headroom: [f64; 2],
}

pub(crate) struct SloPolicy {
    config: SloConfig,
    kv_usage_up: f64,
    /// `Some(queued prompt tokens below which no prefill work waits)` when the prefill
    /// role may go to zero.
    idle_prefill_below: Option<f64>,
    perf: PerfModel,
    /// Rate, prompt, output, hit rate.
    predictors: [Box<dyn Predictor>; 4],
    /// Per role: (when, replicas wanted, the fewest replicas a scale-down may go to) over
    /// the stabilization window.
    history: [VecDeque<(Duration, u32, u32)>; 2],
    /// Per role, with `swing_headroom`: the demand's swings.
    swings: Option<[Swing; 2]>,
    plan: Option<Plan>,
}

impl SloPolicy {
    /// `idle_prefill_below`: see the field.
    pub fn new(config: SloConfig, kv_usage_up: f64, idle_prefill_below: Option<f64>) -> SloPolicy {
        SloPolicy {
            perf: PerfModel::new(config.perf, config.perf_window),
            predictors: std::array::from_fn(|_| config.predictor.build()),
            swings: config
                .swing_headroom
                .map(|c| std::array::from_fn(|_| Swing::new(c))),
            config,
            kv_usage_up,
            idle_prefill_below,
            history: Default::default(),
            plan: None,
        }
    }

    pub fn perf(&self) -> &PerfModel {
        &self.perf
    }

    pub fn observe(&mut self, obs: &Observation) {
        for s in &obs.steps {
            self.perf.observe(*s);
        }
    }

    /// Feed the window to the predictors, refit the model and size both roles. Called once
    /// per interval, with a non-empty window.
    pub fn plan(&mut self, now: Duration, stable_for: Duration, window: &[Observation]) {
        let n = window.len().max(1) as f64;
        let mean = |f: fn(&Observation) -> f64| window.iter().map(f).sum::<f64>() / n;
        let observed = [
            mean(|o| o.arrival_rate),
            mean(|o| o.mean_prompt_tokens),
            mean(|o| o.mean_output_tokens),
            mean(|o| o.prefix_hit_rate),
        ];
        for (p, v) in self.predictors.iter_mut().zip(observed) {
            p.observe(v);
        }
        let predicted: [f64; 4] =
            std::array::from_fn(|i| self.predictors[i].predict().unwrap_or(observed[i]).max(0.0));
        let demand = Demand {
            rate: predicted[0],
            prompt: predicted[1].max(1.0),
            output: predicted[2].max(1.0),
            hit_rate: predicted[3].clamp(0.0, MAX_HIT_RATE),
        };
        self.perf.refit();
        let latest = window.last().expect("a non-empty window");
        let (prefill, p_corr) = self.size_prefill_corrected(&demand, latest);
        let (decode, d_corr) = self.size_decode_corrected(&demand, latest);

        let pu = demand.prompt * (1.0 - demand.hit_rate);
        let drain = self.config.queue_drain.as_secs_f64();
        let backlog = if drain > 0.0 {
            latest.queued_prompt_tokens() as f64 / drain
        } else {
            0.0
        };
        let p_demand = demand.rate * pu + backlog;
        let p_per_replica = prefill.tokens_per_s * self.config.prefill_utilization;
        let p_needed = p_demand / p_per_replica;
        let queued = window
            .iter()
            .map(Observation::queued_prompt_tokens)
            .max()
            .unwrap_or(0) as f64;
        let p_replicas = match self.idle_prefill_below {
            Some(below) if p_needed < IDLE_PREFILL_UTILIZATION && queued < below => 0,
            _ => replicas(p_needed),
        };
        let predicted_in_flight = demand.rate * demand.output * decode.step_s;
        let d_demand = if self.config.running_floor {
            let running = latest.decode_running.iter().map(|&r| f64::from(r)).sum();
            predicted_in_flight.max(running)
        } else {
            predicted_in_flight
        };
        let d_replicas = replicas(d_demand / decode.batch);
        let wanted = [
            (
                p_replicas,
                p_demand,
                p_per_replica,
                p_corr,
                prefill.meets_target,
            ),
            (
                d_replicas,
                d_demand,
                decode.batch,
                d_corr,
                decode.meets_target,
            ),
        ];
        let headroom = self.headroom(now, [p_demand, d_demand]);
        // Per role: the fewest replicas a scale-down may go to (the demand within
        // `1 - headroom` of each replica's share; at least the plan's).
        let down_to = [
            if p_replicas == 0 {
                0
            } else {
                replicas(p_demand / (p_per_replica * (1.0 - headroom[0])))
            },
            replicas(d_demand / (decode.batch * (1.0 - headroom[1]))),
        ];
        for role in Role::ALL {
            let h = &mut self.history[role.index()];
            h.push_back((now, wanted[role.index()].0, down_to[role.index()]));
            // Keep the newest entry at or before `now - stable_for`: it shows the window is
            // covered (no scale-down before the planner has watched that long).
            while h
                .get(1)
                .is_some_and(|&(t, _, _)| now.saturating_sub(t) >= stable_for)
            {
                h.pop_front();
            }
        }
        self.plan = Some(Plan {
            prefill,
            decode,
            wanted,
            headroom,
        });
    }

    /// Per role: the fixed `scale_down_headroom`, or the headroom the swings of the role's
    /// demand (this plan's now recorded) ask for when that is larger.
    fn headroom(&mut self, now: Duration, demand: [f64; 2]) -> [f64; 2] {
        let fixed = self.config.scale_down_headroom;
        let Some(swings) = &mut self.swings else {
            return [fixed; 2];
        };
        std::array::from_fn(|i| {
            swings[i].record(now, demand[i]);
            swings[i].headroom(now).max(fixed)
        })
    }

    fn size_prefill_corrected(&self, d: &Demand, latest: &Observation) -> (PrefillSizing, f64) {
        let c = &self.config;
        let pu = d.prompt * (1.0 - d.hit_rate);
        let ttft = c.ttft.as_secs_f64();
        let raw = size_prefill(
            &self.perf,
            pu,
            d.hit_rate,
            ttft,
            1.0,
            c.max_prefill_step_tokens,
        );
        let correction = match latest.ttft {
            Some(q) => {
                let queue = &latest.prefill_queued_tokens;
                let per_node = queue.iter().sum::<u64>() as f64 / queue.len().max(1) as f64;
                let predicted = per_node / raw.tokens_per_s + raw.ttft_s;
                self.clamp_correction(q.p50.as_secs_f64() / predicted)
            }
            None => 1.0,
        };
        let sized = size_prefill(
            &self.perf,
            pu,
            d.hit_rate,
            ttft,
            correction,
            c.max_prefill_step_tokens,
        );
        (sized, correction)
    }

    fn size_decode_corrected(&self, d: &Demand, latest: &Observation) -> (DecodeSizing, f64) {
        let c = &self.config;
        let running = &latest.decode_running;
        let batch =
            running.iter().map(|&r| f64::from(r)).sum::<f64>() / running.len().max(1) as f64;
        let correction = match latest.itl {
            Some(q) if batch >= 1.0 => {
                let context = d.prompt + d.output / 2.0;
                let predicted = self.perf.decode_step_s(batch, batch * context);
                self.clamp_correction(q.p50.as_secs_f64() / predicted)
            }
            _ => 1.0,
        };
        let sized = size_decode(
            &self.perf,
            d.prompt,
            d.output,
            c.itl.as_secs_f64(),
            correction,
            c.max_decode_batch,
            c.kv_capacity_tokens,
        );
        (sized, correction)
    }

    /// The share of a replica's planned capacity a scale-down may fill.
    fn keep(&self, role: Role) -> f64 {
        self.plan
            .as_ref()
            .map_or(1.0, |p| 1.0 - p.headroom[role.index()])
    }

    fn clamp_correction(&self, k: f64) -> f64 {
        if k.is_finite() {
            k.clamp(self.config.correction_min, self.config.correction_max)
        } else {
            1.0
        }
    }

    /// The replicas the last plan wants; a scale-down only as far as the largest count
    /// wanted over the stabilization window.
    pub fn propose(
        &self,
        role: Role,
        now: Duration,
        stable_for: Duration,
        observed: u32,
    ) -> (u32, Reason) {
        let Some(plan) = &self.plan else {
            return (observed, Reason::Hold);
        };
        let (replicas, demand, per_replica, correction, meets_target) = plan.wanted[role.index()];
        let history = &self.history[role.index()];
        let covered = history
            .front()
            .is_some_and(|&(t, _, _)| now.saturating_sub(t) >= stable_for);
        let stabilized = history
            .iter()
            .map(|&(_, _, down_to)| down_to)
            .max()
            .unwrap_or(replicas);
        let target = if replicas >= observed {
            replicas
        } else if covered {
            stabilized.min(observed)
        } else {
            observed
        };
        let reason = Reason::PredictedDemand {
            demand,
            per_replica,
            correction,
            replicas,
            meets_target,
            headroom: plan.headroom[role.index()],
        };
        (target, reason)
    }

    /// Whether the role can lend the node that takes it from `to + 1` to `to`: every plan
    /// over the last `span` (at most the stabilization window; zero: the last plan alone)
    /// let a scale-down go to `to`, before the stabilization window holds it back, and `to`
    /// passes the consolidation check. With `lend_headroom` a lend may spend the role's
    /// scale-down headroom: the plans need only want `to`, and the check is made at the
    /// plan's own limits.
    pub fn lendable(
        &self,
        role: Role,
        to: u32,
        now: Duration,
        span: Duration,
        latest: &Observation,
    ) -> bool {
        if self.plan.is_none() {
            return false;
        }
        let spend = self.config.lend_headroom;
        let fits = |wanted: u32, down_to: u32| if spend { wanted } else { down_to } <= to;
        let history = &self.history[role.index()];
        let planned = if span.is_zero() {
            history.back().is_some_and(|&(_, w, d)| fits(w, d))
        } else {
            history
                .front()
                .is_some_and(|&(t, _, _)| now.saturating_sub(t) >= span)
                && history
                    .iter()
                    .filter(|&&(t, _, _)| now.saturating_sub(t) <= span)
                    .all(|&(_, w, d)| fits(w, d))
        };
        let keep = if spend { 1.0 } else { self.keep(role) };
        planned && self.consolidation_within(role, to, latest, keep).is_ok()
    }

    /// Would `to` nodes serve the load observed now within the targets (less the
    /// scale-down headroom)?
    pub fn consolidation(&self, role: Role, to: u32, latest: &Observation) -> Result<(), Overload> {
        self.consolidation_within(role, to, latest, self.keep(role))
    }

    /// The consolidation check with each node's planned share scaled by `keep`.
    fn consolidation_within(
        &self,
        role: Role,
        to: u32,
        latest: &Observation,
        keep: f64,
    ) -> Result<(), Overload> {
        let Some(plan) = &self.plan else {
            return Ok(());
        };
        if role == Role::Prefill && to == 0 {
            return self.consolidation_to_no_prefill(plan, latest);
        }
        let to = f64::from(to.max(1));
        match role {
            Role::Prefill => {
                let p = plan.prefill;
                let demand = latest.arrival_rate
                    * latest.mean_prompt_tokens
                    * (1.0 - latest.prefix_hit_rate.clamp(0.0, MAX_HIT_RATE));
                let utilization = demand / (to * p.tokens_per_s);
                let limit = self.config.prefill_utilization * keep;
                if utilization > limit {
                    return Err(Overload {
                        metric: Metric::PrefillUtilization,
                        projected: utilization,
                        limit,
                    });
                }
                let queued = latest.prefill_queued_tokens.iter().sum::<u64>() as f64;
                let ttft = queued / (to * p.tokens_per_s) + p.ttft_s;
                let limit = self.config.ttft.as_secs_f64();
                if ttft > limit {
                    return Err(Overload {
                        metric: Metric::TtftSeconds,
                        projected: ttft,
                        limit,
                    });
                }
            }
            Role::Decode => {
                let running = latest
                    .decode_running
                    .iter()
                    .map(|&r| f64::from(r))
                    .sum::<f64>();
                let limit = plan.decode.batch * keep;
                if running / to > limit {
                    return Err(Overload {
                        metric: Metric::DecodeBatch,
                        projected: running / to,
                        limit,
                    });
                }
                let kv = latest.decode_kv_usage.iter().sum::<f64>() / to;
                if kv >= self.kv_usage_up {
                    return Err(Overload {
                        metric: Metric::KvUsage,
                        projected: kv,
                        limit: self.kv_usage_up,
                    });
                }
            }
        }
        Ok(())
    }
}

impl SloPolicy {
    /// Would the decode nodes alone serve the prompts: one prefill node would be almost
    /// idle, and nothing is queued?
    fn consolidation_to_no_prefill(
        &self,
        plan: &Plan,
        latest: &Observation,
    ) -> Result<(), Overload> {
        let Some(below) = self.idle_prefill_below else {
            return Ok(());
        };
        let queued = latest.queued_prompt_tokens() as f64;
        if queued >= below {
            return Err(Overload {
                metric: Metric::QueuedPrefillTokens,
                projected: queued,
                limit: below,
            });
        }
        let demand = latest.arrival_rate
            * latest.mean_prompt_tokens
            * (1.0 - latest.prefix_hit_rate.clamp(0.0, MAX_HIT_RATE));
        let utilization = demand / plan.prefill.tokens_per_s;
        if utilization >= IDLE_PREFILL_UTILIZATION {
            return Err(Overload {
                metric: Metric::PrefillUtilization,
                projected: utilization,
                limit: IDLE_PREFILL_UTILIZATION,
            });
        }
        Ok(())
    }
}

/// At least one replica; a tiny epsilon keeps exact multiples from rounding up.
fn replicas(x: f64) -> u32 {
    if !x.is_finite() {
        return u32::MAX;
    }
    ((x - 1e-9).ceil().max(1.0)).min(f64::from(u32::MAX)) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::perf_model::PerfCoefficients;

    fn perf() -> PerfModel {
        PerfModel::new(
            PerfCoefficients {
                step_overhead_us: 5000.0,
                prefill_per_token_us: 50.0,
                prefill_per_cached_token_us: 0.0,
                decode_per_seq_us: 100.0,
                decode_per_context_token_us: 0.1,
            },
            16,
        )
    }

    #[test]
    fn prefill_takes_the_largest_step_meeting_ttft() {
        // 2,000-token prompts: a 2,048-token step (the prompt and the start of the next)
        // takes 0.1074 s, TTFT 2 steps = 0.2148 s; 4,096 would take 0.42 s.
        let s = size_prefill(&perf(), 2000.0, 0.0, 0.25, 1.0, 8192);
        assert_eq!(s.step_tokens, 2048.0);
        assert!(s.meets_target);
        assert!((s.tokens_per_s - 2048.0 / 0.1074).abs() < 1e-6);
        // A tighter target forces smaller steps (lower throughput) or cannot be met.
        let tight = size_prefill(&perf(), 2000.0, 0.0, 0.15, 1.0, 8192);
        assert!(!tight.meets_target);
        // A correction of 2 doubles every step.
        let slow = size_prefill(&perf(), 2000.0, 0.0, 1.0, 2.0, 8192);
        assert!((slow.step_s - 2.0 * perf().prefill_step_s(slow.step_tokens, 0.0)).abs() < 1e-12);
    }

    #[test]
    fn decode_batch_is_the_largest_meeting_itl() {
        // Context 1,000 + 100: per sequence 100 + 110 us; 50 ms target: (50,000 - 5,000) / 210.
        let d = size_decode(&perf(), 1000.0, 200.0, 0.05, 1.0, 1024, None);
        assert_eq!(d.batch, (45_000.0f64 / 210.0).floor());
        assert!(d.step_s <= 0.05);
        let next = perf().decode_step_s(d.batch + 1.0, (d.batch + 1.0) * 1100.0);
        assert!(next > 0.05);
        // KV capacity for 10 sequences of 1,200 tokens.
        let kv = size_decode(&perf(), 1000.0, 200.0, 0.05, 1.0, 1024, Some(12_000));
        assert_eq!(kv.batch, 10.0);
        // Unreachable ITL: batch 1, flagged.
        let bad = size_decode(&perf(), 1000.0, 200.0, 0.004, 1.0, 1024, None);
        assert_eq!(bad.batch, 1.0);
        assert!(!bad.meets_target);
    }

    #[test]
    fn replicas_round_up_but_never_to_zero() {
        assert_eq!(replicas(0.0), 1);
        assert_eq!(replicas(2.0), 2);
        assert_eq!(replicas(2.01), 3);
    }
}
