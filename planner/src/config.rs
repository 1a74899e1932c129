//! The planner's configuration: one typed struct, every field defaulted, unknown fields
//! refused, durations written the humantime way (`"30s"`), and [`PlannerConfig::validate`]
//! saying exactly what is wrong.

use crate::decision::Role;
use crate::perf_model::PerfCoefficients;
use crate::predictor::PredictorConfig;
use serde::Deserialize;
use std::time::Duration;

/// Which control loop decides.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// Reactive thresholds on queue and KV usage, one node at a time.
    #[default]
    Load,
    /// Predicted demand through a performance model against TTFT/ITL targets.
    Slo,
}

/// How many nodes one role may have.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RoleBounds {
    /// Decode: at least 1. Prefill may be 0: with no prefill node the decode nodes prefill
    /// every prompt themselves, and the planner removes the last one only when no prompt
    /// tokens are queued anywhere (and adds one back when they are).
    pub min: u32,
    pub max: u32,
}

impl Default for RoleBounds {
    fn default() -> Self {
        RoleBounds { min: 1, max: 8 }
    }
}

/// Minimum times between changes of one role, and how long low load must last before a
/// scale-down.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Cooldowns {
    /// Since the role's last change, before it may grow again.
    #[serde(with = "humantime_serde")]
    pub up: Duration,
    /// Since the role's last change, before it may shrink.
    #[serde(with = "humantime_serde")]
    pub down: Duration,
    /// Load policy: every node must have stayed below the down threshold this long. SLO
    /// policy: a scale-down goes only to the largest count wanted over this long.
    #[serde(with = "humantime_serde")]
    pub down_stable_for: Duration,
    /// Role switching: a role lends a node only if its policy has wanted it gone this long
    /// (load policy: every node below the down threshold; SLO policy: every plan wanting no
    /// more than the count without it). Zero: one reading suffices. At most
    /// `down_stable_for`: a lend is an early scale-down, not a later one.
    #[serde(with = "humantime_serde")]
    pub lend_stable_for: Duration,
}

impl Default for Cooldowns {
    fn default() -> Self {
        Cooldowns {
            up: Duration::from_secs(30),
            down: Duration::from_secs(120),
            down_stable_for: Duration::from_secs(60),
            lend_stable_for: Duration::ZERO,
        }
    }
}

/// The load policy's thresholds. Up thresholds sit above down thresholds (hysteresis).
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoadConfig {
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    /// The model's context length, in tokens: the unit of the prefill queue thresholds.
    pub context_length: u64,
    /// Scale prefill up when any node's queue reaches this many context lengths.
    pub prefill_queue_up: f64,
    /// Scale prefill down when every node's queue stays below this many context lengths.
    pub prefill_queue_down: f64,
    /// Scale decode up when any node's KV usage reaches this share.
    pub kv_usage_up: f64,
    /// Scale decode down when every node's KV usage stays below this share.
    pub kv_usage_down: f64,
}

impl Default for LoadConfig {
    fn default() -> Self {
        LoadConfig {
            interval: Duration::from_secs(5),
            context_length: 8192,
            prefill_queue_up: 1.0,
            prefill_queue_down: 0.1,
            kv_usage_up: 0.9,
            kv_usage_down: 0.5,
        }
    }
}

impl LoadConfig {
    pub(crate) fn prefill_up_tokens(&self) -> f64 {
        self.prefill_queue_up * self.context_length as f64
    }
    pub(crate) fn prefill_down_tokens(&self) -> f64 {
        self.prefill_queue_down * self.context_length as f64
    }
}

/// The SLO policy: targets, the model and the predictor.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SloConfig {
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    /// Time-to-first-token target (compared with the observed p50).
    #[serde(with = "humantime_serde")]
    pub ttft: Duration,
    /// Inter-token-latency target (compared with the observed p50).
    #[serde(with = "humantime_serde")]
    pub itl: Duration,
    pub predictor: PredictorConfig,
    /// The seed of the performance model (e.g. from `kvmesh profile`).
    pub perf: PerfCoefficients,
    /// Measured steps the model is refitted to.
    pub perf_window: usize,
    /// The largest prefill step a node runs, in new tokens.
    pub max_prefill_step_tokens: u64,
    /// The largest decode batch a node runs.
    pub max_decode_batch: u32,
    /// KV tokens one decode node holds; bounds the batch (`None`: unbounded).
    pub kv_capacity_tokens: Option<u64>,
    /// The share of a prefill node's modelled throughput to plan for (queues explode at 1).
    pub prefill_utilization: f64,
    /// Prompt tokens queued on the nodes now (prefill nodes' queues and decode nodes' local
    /// prefills) are prefill demand too, to be served within this on top of the predicted
    /// arrivals: a backlog the prediction did not foresee is worked off instead of only
    /// kept from growing. Zero (the default): the queue is not read.
    #[serde(with = "humantime_serde")]
    pub queue_drain: Duration,
    /// Decode replicas cover at least the sequences running now at the planned batch
    /// (Little's law measured, not predicted): the predicted output length is learned from
    /// completed requests and lags a turn of the mix towards longer answers.
    pub running_floor: bool,
    /// A scale-down (or a lend) goes only to a count that serves the planned demand, and
    /// passes the consolidation check, within `1 - scale_down_headroom` of what the plan
    /// gives a node (prefill throughput at `prefill_utilization`, the decode batch): room
    /// for the next burst while a node started for it loads. Growth still sizes at the plan
    /// itself, so between the two a count holds (hysteresis). `0..1`; zero (the default):
    /// no headroom.
    pub scale_down_headroom: f64,
    /// A scale-down headroom that follows the demand: per role, the largest share by which
    /// the demand the plans sized it from came or went within a node's start-up lately
    /// (see [`SwingHeadroom`]). The headroom used is the larger of this and
    /// `scale_down_headroom`. `None` (the default): the fixed headroom alone.
    pub swing_headroom: Option<SwingHeadroom>,
    /// Role switching: a lend may spend the lender's `scale_down_headroom` (down to the
    /// count the plan itself wants, checked at the plan's own limits). The two roles then
    /// share one burst room: when the mix turns from one to the other, the one it turns
    /// from hands its room over in a switch instead of the other starting a node.
    pub lend_headroom: bool,
    /// Bounds of the observed/predicted latency correction. The correction scales the step
    /// time the sizing uses, so below 1 it credits nodes with throughput the measured steps
    /// do not show (at light load the observed latency lacks the queueing the model
    /// predicts), and the next peak finds too few nodes: the default keeps it at least 1.
    pub correction_min: f64,
    pub correction_max: f64,
}

impl Default for SloConfig {
    fn default() -> Self {
        SloConfig {
            interval: Duration::from_secs(60),
            ttft: Duration::from_millis(500),
            itl: Duration::from_millis(30),
            predictor: PredictorConfig::default(),
            perf: PerfCoefficients::default(),
            perf_window: 512,
            max_prefill_step_tokens: 8192,
            max_decode_batch: 256,
            kv_capacity_tokens: None,
            prefill_utilization: 0.8,
            queue_drain: Duration::ZERO,
            running_floor: true,
            scale_down_headroom: 0.0,
            swing_headroom: None,
            lend_headroom: false,
            correction_min: 1.0,
            correction_max: 2.0,
        }
    }
}

/// `[slo.swing_headroom]`: a scale-down keeps free `deviations` times the spread of the
/// role's demand swings over `over` at the plans of the last `remember`, less the spread
/// a steady demand shows (`noise`, in quadrature), at most `max`. The swing at a plan is
/// `1 - low / high` of the mean demand of the plans within `over` up to it and the mean of
/// as many plans before them (a rise or a drop); the spread is their root mean square.
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SwingHeadroom {
    /// The span a swing is measured over: about the time from a rise to a node started for
    /// it serving (its start-up plus a planning interval), which the nodes already there
    /// must bridge. Plans further apart than this compare with the previous one.
    #[serde(with = "humantime_serde")]
    pub over: Duration,
    /// The plans whose swings make the spread.
    #[serde(with = "humantime_serde")]
    pub remember: Duration,
    /// The spread of the swings at a steady load: the measurement's own (a window's mean
    /// prompt length over a few thousand requests varies from one span to the next; 0.05
    /// to 0.08 at 50-200 requests/s and 15 s plans).
    pub noise: f64,
    /// How many spreads beyond the noise a scale-down keeps free.
    pub deviations: f64,
    /// The most a scale-down keeps free.
    pub max: f64,
}

impl Default for SwingHeadroom {
    fn default() -> Self {
        SwingHeadroom {
            over: Duration::from_secs(45),
            remember: Duration::from_secs(1200),
            noise: 0.08,
            deviations: 3.0,
            max: 0.5,
        }
    }
}

/// The whole planner configuration (the `[planner]` table).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PlannerConfig {
    pub policy: Policy,
    pub prefill: RoleBounds,
    pub decode: RoleBounds,
    /// Prefill plus decode nodes may not exceed this.
    pub budget: u32,
    pub cooldown: Cooldowns,
    pub load: LoadConfig,
    pub slo: SloConfig,
    /// Decide and report, do not act.
    pub advisory: bool,
    /// Flip a node's role when one pool shrinks while the other grows.
    pub allow_role_switch: bool,
}

impl Default for PlannerConfig {
    fn default() -> Self {
        PlannerConfig {
            policy: Policy::default(),
            prefill: RoleBounds::default(),
            decode: RoleBounds::default(),
            budget: 16,
            cooldown: Cooldowns::default(),
            load: LoadConfig::default(),
            slo: SloConfig::default(),
            advisory: false,
            allow_role_switch: true,
        }
    }
}

/// What is wrong with a [`PlannerConfig`]; one variant per cause.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error("{role:?} min must be at least 1: only the prefill role may go to zero")]
    ZeroMinimum { role: Role },
    #[error("{role:?} min ({min}) is above its max ({max})")]
    MinAboveMax { role: Role, min: u32, max: u32 },
    #[error("budget {budget} is below the sum of the minimums ({minimums})")]
    BudgetBelowMinimums { budget: u32, minimums: u32 },
    #[error("{field} must be longer than zero")]
    ZeroDuration { field: &'static str },
    #[error("{field} must be a finite number in {range}, got {value}")]
    OutOfRange {
        field: &'static str,
        range: &'static str,
        value: f64,
    },
    #[error("{field} must be at least 1")]
    ZeroCount { field: &'static str },
    #[error("hysteresis: {down_field} ({down}) must be below {up_field} ({up})")]
    NoHysteresis {
        down_field: &'static str,
        down: f64,
        up_field: &'static str,
        up: f64,
    },
    #[error(
        "cooldown.lend_stable_for ({lend:?}) must be at most cooldown.down_stable_for ({down:?})"
    )]
    LendAfterScaleDown { lend: Duration, down: Duration },
    #[error("correction_min ({min}) must be positive and at most correction_max ({max})")]
    CorrectionBounds { min: f64, max: f64 },
    #[error("slo.predictor: {0}")]
    Predictor(String),
    #[error("slo.perf.{field} must be finite and non-negative, got {value}")]
    PerfCoefficient { field: &'static str, value: f64 },
}

impl PlannerConfig {
    pub fn bounds(&self, role: Role) -> RoleBounds {
        match role {
            Role::Prefill => self.prefill,
            Role::Decode => self.decode,
        }
    }

    /// The interval of the configured policy.
    pub fn interval(&self) -> Duration {
        match self.policy {
            Policy::Load => self.load.interval,
            Policy::Slo => self.slo.interval,
        }
    }

    /// Checks every field; the first problem found is returned.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for role in Role::ALL {
            let b = self.bounds(role);
            if b.min == 0 && role == Role::Decode {
                return Err(ConfigError::ZeroMinimum { role });
            }
            if b.min > b.max {
                return Err(ConfigError::MinAboveMax {
                    role,
                    min: b.min,
                    max: b.max,
                });
            }
        }
        let minimums = self.prefill.min + self.decode.min;
        if self.budget < minimums {
            return Err(ConfigError::BudgetBelowMinimums {
                budget: self.budget,
                minimums,
            });
        }
        for (field, d) in [
            ("load.interval", self.load.interval),
            ("slo.interval", self.slo.interval),
            ("slo.ttft", self.slo.ttft),
            ("slo.itl", self.slo.itl),
        ] {
            if d.is_zero() {
                return Err(ConfigError::ZeroDuration { field });
            }
        }
        let c = &self.cooldown;
        if c.lend_stable_for > c.down_stable_for {
            return Err(ConfigError::LendAfterScaleDown {
                lend: c.lend_stable_for,
                down: c.down_stable_for,
            });
        }
        let l = &self.load;
        if l.context_length == 0 {
            return Err(ConfigError::ZeroCount {
                field: "load.context_length",
            });
        }
        in_range(
            "load.prefill_queue_up",
            l.prefill_queue_up,
            0.0,
            f64::MAX,
            "(0, inf)",
        )?;
        in_range(
            "load.prefill_queue_down",
            l.prefill_queue_down,
            0.0,
            f64::MAX,
            "(0, inf)",
        )?;
        in_range("load.kv_usage_up", l.kv_usage_up, 0.0, 1.0, "(0, 1]")?;
        in_range("load.kv_usage_down", l.kv_usage_down, 0.0, 1.0, "(0, 1]")?;
        hysteresis(
            "load.prefill_queue_down",
            l.prefill_queue_down,
            "load.prefill_queue_up",
            l.prefill_queue_up,
        )?;
        hysteresis(
            "load.kv_usage_down",
            l.kv_usage_down,
            "load.kv_usage_up",
            l.kv_usage_up,
        )?;
        let s = &self.slo;
        in_range(
            "slo.prefill_utilization",
            s.prefill_utilization,
            0.0,
            1.0,
            "(0, 1]",
        )?;
        if !(0.0..1.0).contains(&s.scale_down_headroom) {
            return Err(ConfigError::OutOfRange {
                field: "slo.scale_down_headroom",
                range: "[0, 1)",
                value: s.scale_down_headroom,
            });
        }
        if let Some(w) = &s.swing_headroom {
            for (field, d) in [
                ("slo.swing_headroom.over", w.over),
                ("slo.swing_headroom.remember", w.remember),
            ] {
                if d.is_zero() {
                    return Err(ConfigError::ZeroDuration { field });
                }
            }
            for (field, value, range) in [
                ("slo.swing_headroom.noise", w.noise, 0.0..1.0),
                ("slo.swing_headroom.deviations", w.deviations, 0.0..f64::MAX),
                ("slo.swing_headroom.max", w.max, 0.0..1.0),
            ] {
                if !range.contains(&value) {
                    return Err(ConfigError::OutOfRange {
                        field,
                        range: if range.end == 1.0 {
                            "[0, 1)"
                        } else {
                            "[0, inf)"
                        },
                        value,
                    });
                }
            }
        }
        if !(s.correction_min > 0.0
            && s.correction_min <= s.correction_max
            && s.correction_max.is_finite())
        {
            return Err(ConfigError::CorrectionBounds {
                min: s.correction_min,
                max: s.correction_max,
            });
        }
        for (field, n) in [
            ("slo.perf_window", s.perf_window as u64),
            ("slo.max_prefill_step_tokens", s.max_prefill_step_tokens),
            ("slo.max_decode_batch", u64::from(s.max_decode_batch)),
            ("slo.kv_capacity_tokens", s.kv_capacity_tokens.unwrap_or(1)),
        ] {
            if n == 0 {
                return Err(ConfigError::ZeroCount { field });
            }
        }
        if let Some(problem) = s.predictor.problem() {
            return Err(ConfigError::Predictor(problem));
        }
        if let Some((field, value)) = s.perf.problem() {
            return Err(ConfigError::PerfCoefficient { field, value });
        }
        Ok(())
    }
}

/// `value` in `(low, high]`.
fn in_range(
    field: &'static str,
    value: f64,
    low: f64,
    high: f64,
    range: &'static str,
) -> Result<(), ConfigError> {
    if value.is_finite() && value > low && value <= high {
        Ok(())
    } else {
        Err(ConfigError::OutOfRange {
            field,
            range,
            value,
        })
    }
}

fn hysteresis(
    down_field: &'static str,
    down: f64,
    up_field: &'static str,
    up: f64,
) -> Result<(), ConfigError> {
    if down < up {
        Ok(())
    } else {
        Err(ConfigError::NoHysteresis {
            down_field,
            down,
            up_field,
            up,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_are_valid() {
        PlannerConfig::default().validate().unwrap();
    }

    #[test]
    fn only_prefill_may_scale_to_zero() {
        let mut c = PlannerConfig::default();
        c.decode.min = 0;
        assert_eq!(
            c.validate(),
            Err(ConfigError::ZeroMinimum { role: Role::Decode })
        );
        let mut c = PlannerConfig::default();
        c.prefill.min = 0;
        assert_eq!(c.validate(), Ok(()));
    }
}
