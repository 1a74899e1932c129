//! The planner's configuration: TOML in, validation errors out.

use kvmesh_planner::{
    ConfigError, Planner, PlannerConfig, Policy, PredictorConfig, Role, SwingHeadroom,
};
use std::time::Duration;

fn parse(text: &str) -> Result<PlannerConfig, toml::de::Error> {
    toml::from_str(text)
}

#[test]
fn a_full_file_parses_with_humantime_durations() {
    let c = parse(
        r#"
        policy = "slo"
        budget = 12
        advisory = true
        allow_role_switch = false
        prefill = { min = 2, max = 6 }
        decode = { min = 1, max = 8 }

        [cooldown]
        up = "20s"
        down = "3m"
        down_stable_for = "90s"
        lend_stable_for = "30s"

        [load]
        interval = "2s"
        context_length = 4096
        prefill_queue_up = 1.0
        prefill_queue_down = 0.1
        kv_usage_up = 0.85
        kv_usage_down = 0.4

        [slo]
        interval = "1m"
        ttft = "300ms"
        itl = "25ms"
        predictor = { kind = "kalman", process_noise = 0.1, measurement_noise = 4.0 }
        max_decode_batch = 128
        kv_capacity_tokens = 500000
        scale_down_headroom = 0.2
        lend_headroom = true

        [slo.perf]
        step_overhead_us = 4400
        prefill_per_token_us = 45
        decode_per_seq_us = 18
        decode_per_context_token_us = 0.03
        "#,
    )
    .unwrap();
    c.validate().unwrap();
    assert_eq!(c.policy, Policy::Slo);
    assert_eq!(c.cooldown.down, Duration::from_secs(180));
    assert_eq!(c.cooldown.lend_stable_for, Duration::from_secs(30));
    assert_eq!(c.slo.scale_down_headroom, 0.2);
    assert!(c.slo.lend_headroom);
    assert_eq!(c.slo.ttft, Duration::from_millis(300));
    assert_eq!(c.load.interval, Duration::from_secs(2));
    assert_eq!(c.interval(), Duration::from_secs(60));
    assert_eq!(
        c.slo.predictor,
        PredictorConfig::Kalman {
            process_noise: 0.1,
            measurement_noise: 4.0
        }
    );
    assert_eq!(c.slo.perf.prefill_per_cached_token_us, 0.0);
    assert_eq!(c.slo.kv_capacity_tokens, Some(500_000));
    assert!(c.advisory && !c.allow_role_switch);
}

#[test]
fn an_empty_file_is_the_defaults() {
    assert_eq!(parse("").unwrap(), PlannerConfig::default());
}

#[test]
fn unknown_fields_are_refused_at_every_level() {
    for text in [
        "budgets = 3",
        "[cooldown]\nupp = \"1s\"",
        "[load]\ncontext = 10",
        "[slo]\nttft_ms = 10",
        "[slo.perf]\nstep_overhead = 1",
        "[slo]\npredictor = { kind = \"ewma\", alpha = 0.5, beta = 1 }",
        "[slo]\npredictor = { kind = \"arima\" }",
        "policy = \"fancy\"",
        "[cooldown]\nup = 30",
    ] {
        assert!(parse(text).is_err(), "{text}");
    }
}

fn invalid(edit: impl FnOnce(&mut PlannerConfig)) -> ConfigError {
    let mut c = PlannerConfig::default();
    edit(&mut c);
    let err = c.validate().unwrap_err();
    // The planner refuses the same configuration (compared as text: NaN is not NaN).
    let refused = Planner::new(c).err().map(|e| e.to_string());
    assert_eq!(refused, Some(err.to_string()));
    err
}

#[test]
fn validation_names_each_problem() {
    assert_eq!(
        invalid(|c| c.decode.min = 0),
        ConfigError::ZeroMinimum { role: Role::Decode }
    );
    assert_eq!(
        invalid(|c| c.decode = kvmesh_planner::RoleBounds { min: 5, max: 3 }),
        ConfigError::MinAboveMax {
            role: Role::Decode,
            min: 5,
            max: 3
        }
    );
    assert_eq!(
        invalid(|c| {
            c.prefill.min = 3;
            c.decode.min = 3;
            c.budget = 5;
        }),
        ConfigError::BudgetBelowMinimums {
            budget: 5,
            minimums: 6
        }
    );
    assert_eq!(
        invalid(|c| c.slo.itl = Duration::ZERO),
        ConfigError::ZeroDuration { field: "slo.itl" }
    );
    assert_eq!(
        invalid(|c| c.load.interval = Duration::ZERO),
        ConfigError::ZeroDuration {
            field: "load.interval"
        }
    );
    assert_eq!(
        invalid(|c| c.load.kv_usage_up = 1.5),
        ConfigError::OutOfRange {
            field: "load.kv_usage_up",
            range: "(0, 1]",
            value: 1.5
        }
    );
    assert!(matches!(
        invalid(|c| c.load.prefill_queue_down = f64::NAN),
        ConfigError::OutOfRange {
            field: "load.prefill_queue_down",
            ..
        }
    ));
    assert!(matches!(
        invalid(|c| c.load.kv_usage_down = 0.9),
        ConfigError::NoHysteresis {
            down_field: "load.kv_usage_down",
            ..
        }
    ));
    assert!(matches!(
        invalid(|c| c.load.prefill_queue_down = 1.0),
        ConfigError::NoHysteresis { .. }
    ));
    assert_eq!(
        invalid(|c| c.load.context_length = 0),
        ConfigError::ZeroCount {
            field: "load.context_length"
        }
    );
    assert_eq!(
        invalid(|c| c.slo.kv_capacity_tokens = Some(0)),
        ConfigError::ZeroCount {
            field: "slo.kv_capacity_tokens"
        }
    );
    assert_eq!(
        invalid(|c| c.slo.correction_min = 3.0),
        ConfigError::CorrectionBounds { min: 3.0, max: 2.0 }
    );
    assert!(matches!(
        invalid(|c| c.slo.predictor = PredictorConfig::Ewma { alpha: 0.0 }),
        ConfigError::Predictor(_)
    ));
    assert_eq!(
        invalid(|c| c.slo.perf.decode_per_seq_us = -1.0),
        ConfigError::PerfCoefficient {
            field: "decode_per_seq_us",
            value: -1.0
        }
    );
    assert_eq!(
        invalid(|c| c.slo.scale_down_headroom = 1.0),
        ConfigError::OutOfRange {
            field: "slo.scale_down_headroom",
            range: "[0, 1)",
            value: 1.0
        }
    );
    assert_eq!(
        invalid(|c| c.cooldown.lend_stable_for = Duration::from_secs(61)),
        ConfigError::LendAfterScaleDown {
            lend: Duration::from_secs(61),
            down: Duration::from_secs(60)
        }
    );
    assert!(invalid(|c| c.decode.min = 0)
        .to_string()
        .contains("only the prefill role may go to zero"));
    assert_eq!(
        invalid(|c| c.slo.swing_headroom = Some(SwingHeadroom {
            max: 1.0,
            ..SwingHeadroom::default()
        })),
        ConfigError::OutOfRange {
            field: "slo.swing_headroom.max",
            range: "[0, 1)",
            value: 1.0
        }
    );
    assert_eq!(
        invalid(|c| c.slo.swing_headroom = Some(SwingHeadroom {
            over: Duration::ZERO,
            ..SwingHeadroom::default()
        })),
        ConfigError::ZeroDuration {
            field: "slo.swing_headroom.over"
        }
    );
}

/// Off unless given; an empty table is the defaults, and its fields are humantime durations.
#[test]
fn the_swing_headroom_is_a_table_of_defaults() {
    assert_eq!(parse("").unwrap().slo.swing_headroom, None);
    let c = parse("[slo]\nswing_headroom = {}\n").unwrap();
    assert_eq!(c.slo.swing_headroom, Some(SwingHeadroom::default()));
    let c = parse("[slo.swing_headroom]\nover = \"1m\"\ndeviations = 2\n").unwrap();
    let w = c.slo.swing_headroom.unwrap();
    assert_eq!((w.over, w.deviations), (Duration::from_secs(60), 2.0));
    assert_eq!(w.remember, SwingHeadroom::default().remember);
    assert!(parse("[slo.swing_headroom]\nignore = 0.1\n").is_err());
}
