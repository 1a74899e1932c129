use super::*;
use crate::trace::paced_offsets;

fn shape(s: &str) -> OpenLoop {
    match s.parse::<LoadShape>() {
        Ok(LoadShape::Open(open)) => open,
        other => panic!("{s}: {other:?}"),
    }
}

/// Mean rate (per second) and coefficient of variation of the gaps of `n` arrivals.
fn rate_and_cv(offsets: &[Duration]) -> (f64, f64) {
    let mut gaps = vec![offsets[0].as_secs_f64()];
    gaps.extend(offsets.windows(2).map(|w| (w[1] - w[0]).as_secs_f64()));
    let n = gaps.len() as f64;
    let mean = gaps.iter().sum::<f64>() / n;
    let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (1.0 / mean, var.sqrt() / mean)
}

#[test]
fn poisson_has_the_rate_and_a_cv_of_one() {
    let offsets: Vec<Duration> = shape("poisson:rate=4").schedule(1).take(10_000).collect();
    let (rate, cv) = rate_and_cv(&offsets);
    assert!((rate / 4.0 - 1.0).abs() < 0.03, "rate {rate}");
    assert!((cv - 1.0).abs() < 0.05, "cv {cv}");
}

#[test]
fn gamma_burstiness_sets_the_cv_at_the_same_rate() {
    let offsets: Vec<Duration> = shape("gamma:rate=4,burstiness=0.25")
        .schedule(2)
        .take(10_000)
        .collect();
    let (rate, cv) = rate_and_cv(&offsets);
    assert!((rate / 4.0 - 1.0).abs() < 0.05, "rate {rate}");
    assert!((cv - 2.0).abs() < 0.1, "cv {cv}");
    // Above 1 the gaps are more regular than Poisson.
    let regular: Vec<Duration> = shape("gamma:rate=4,burstiness=4")
        .schedule(2)
        .take(10_000)
        .collect();
    let (rate, cv) = rate_and_cv(&regular);
    assert!((rate / 4.0 - 1.0).abs() < 0.03, "rate {rate}");
    assert!((cv - 0.5).abs() < 0.05, "cv {cv}");
}

#[test]
fn constant_rate_is_exact() {
    let offsets: Vec<Duration> = shape("constant:rate=4").schedule(3).take(1000).collect();
    let expected: Vec<Duration> = (1..=1000).map(|i| Duration::from_millis(250 * i)).collect();
    assert_eq!(offsets, expected);
}

#[test]
fn steps_offer_each_rate_for_its_phase() {
    let steps = shape("steps:2@1000s,0@100s,8@500s");
    let offsets: Vec<Duration> = steps.schedule(4).collect();
    let count = |a: u64, b: u64| {
        let r = Duration::from_secs(a)..Duration::from_secs(b);
        offsets.iter().filter(|t| r.contains(t)).count() as f64
    };
    assert!((count(0, 1000) / 2000.0 - 1.0).abs() < 0.05);
    assert_eq!(count(1000, 1100), 0.0, "a pause sends nothing");
    assert!((count(1100, 1600) / 4000.0 - 1.0).abs() < 0.05);
    assert!(
        *offsets.last().unwrap() <= Duration::from_secs(1600),
        "ends"
    );
    assert_eq!(steps.profile.duration(), Some(Duration::from_secs(1600)));
}

#[test]
fn a_ramp_sends_more_as_it_rises() {
    let ramp = shape("ramp:1..10@2000s");
    let offsets: Vec<Duration> = ramp.schedule(5).collect();
    let half = Duration::from_secs(1000);
    let first = offsets.iter().filter(|t| **t < half).count() as f64;
    let second = offsets.len() as f64 - first;
    // Λ(d/2) = r0·d/2 + (r1 − r0)·d/8 and the rest: 1625 and 3875 of 5500 per 1000 s.
    let expected = 3875.0 / 1625.0;
    assert!(
        (second / first / expected - 1.0).abs() < 0.06,
        "{first} {second}"
    );
    assert!((offsets.len() as f64 / 11_000.0 - 1.0).abs() < 0.03);
    // A falling ramp mirrors it.
    let down: Vec<Duration> = shape("ramp:10..1@2000s").schedule(5).collect();
    let first = down.iter().filter(|t| **t < half).count() as f64;
    let second = down.len() as f64 - first;
    assert!(
        (first / second / expected - 1.0).abs() < 0.06,
        "{first} {second}"
    );
}

#[test]
fn a_day_peaks_at_noon() {
    let day = shape("day:1..10@4000s");
    let offsets: Vec<Duration> = day.schedule(6).collect();
    let p = &day.profile;
    for q in 0..4 {
        let (a, b) = (1000.0 * q as f64, 1000.0 * (q + 1) as f64);
        let expected = p.expected_arrivals(b) - p.expected_arrivals(a);
        let got = offsets
            .iter()
            .filter(|t| (a..b).contains(&t.as_secs_f64()))
            .count() as f64;
        assert!(
            (got / expected - 1.0).abs() < 0.05,
            "quarter {q}: {got} vs {expected}"
        );
    }
    assert!((p.rate_at(2000.0) - 10.0).abs() < 1e-9 && (p.rate_at(0.0) - 1.0).abs() < 1e-9);
}

#[test]
fn time_of_inverts_expected_arrivals() {
    for s in [
        "steps:2@10s,0@5s,8@5s",
        "ramp:0..10@60s",
        "ramp:3..0@60s",
        "day:0..10@60s",
    ] {
        let p = shape(s).profile;
        for t in [0.5, 7.0, 19.0, 30.0, 59.5] {
            if p.rate_at(t) == 0.0 {
                continue;
            }
            let back = p.time_of(p.expected_arrivals(t)).unwrap();
            assert!((back - t).abs() < 1e-6, "{s} at {t}: {back}");
        }
        assert_eq!(p.time_of(p.expected_arrivals(1e9) + 1.0), None, "{s}");
    }
}

#[test]
fn the_seed_decides_the_schedule() {
    let load = shape("gamma:rate=4,burstiness=0.5");
    let a: Vec<Duration> = load.schedule(7).take(100).collect();
    let b: Vec<Duration> = load.schedule(7).take(100).collect();
    let c: Vec<Duration> = load.schedule(8).take(100).collect();
    assert_eq!(a, b);
    assert_ne!(a, c);
    assert!(a.windows(2).all(|w| w[0] <= w[1]), "in order");
}

#[test]
fn trace_time_scaling_keeps_order_and_relative_gaps() {
    let ts = [1000u64, 1000, 1003, 1500, 9000, 9001];
    let fast = paced_offsets(&ts, Pacing::Speedup(4.0));
    let want: Vec<Duration> = ts
        .iter()
        .map(|t| Duration::from_micros((t - 1000) * 250))
        .collect();
    assert_eq!(fast, want, "a power-of-two speed-up is exact");
    let third = paced_offsets(&ts, Pacing::Speedup(3.0));
    for (i, w) in third.windows(2).enumerate() {
        assert!(w[0] <= w[1]);
        let want = (ts[i + 1] - ts[i]) as f64 * 1e6 / 3.0;
        let got = (w[1] - w[0]).as_nanos() as f64;
        assert!((got - want).abs() <= 1.0, "gap {i}: {got} vs {want}");
    }
    // 5 gaps over 8001 ms spread to 5 s at 1 request/s: gaps scale by 5000/8001.
    let paced = paced_offsets(&ts, Pacing::RequestsPerSecond(1.0));
    assert_eq!(paced.last(), Some(&Duration::from_secs(5)));
    assert_eq!(
        paced[2],
        Duration::from_nanos((3e6 * 5000.0 / 8001.0f64).round() as u64)
    );
    assert!(paced_offsets(&[], Pacing::Speedup(2.0)).is_empty());
}

#[test]
fn the_grammar_round_trips() {
    for s in [
        "concurrency:32",
        "poisson:rate=4",
        "constant:rate=0.5",
        "gamma:rate=4,burstiness=0.5",
        "steps:2@30s,8@30s",
        "steps:2@0.5s,8@90s,burstiness=2",
        "ramp:1..10@120s",
        "day:1..10@600s",
        "trace:speedup=4",
        "trace:rate=2",
    ] {
        let shape: LoadShape = s.parse().unwrap();
        assert_eq!(shape.to_string(), s);
    }
    assert_eq!(
        "ramp:1..10@2m".parse::<LoadShape>().unwrap(),
        "ramp:1..10@120s".parse().unwrap()
    );
    assert_eq!(
        "trace".parse::<LoadShape>().unwrap(),
        LoadShape::Trace(Pacing::Speedup(1.0))
    );
    assert_eq!(
        "steps:1@500ms,1@1h".parse::<LoadShape>().unwrap(),
        LoadShape::Open(OpenLoop {
            profile: RateProfile::Steps(vec![
                Step {
                    rate: 1.0,
                    duration: Duration::from_millis(500)
                },
                Step {
                    rate: 1.0,
                    duration: Duration::from_secs(3600)
                },
            ]),
            arrivals: Arrivals::Poisson,
        })
    );
}

#[test]
fn parse_errors_name_the_bad_part() {
    let cases = [
        ("burst:rate=4", "burst", "unknown kind"),
        ("concurrency:0", "0", "at least 1"),
        ("concurrency:x", "x", "whole number"),
        ("concurrency", "", "whole number"),
        ("poisson", "", "missing rate="),
        ("poisson:rate=-1", "-1", "positive number"),
        ("poisson:rate=inf", "inf", "positive number"),
        ("poisson:rate=4,burstiness=2", "burstiness=2", "unknown key"),
        ("poisson:rate=4,rate=5", "rate=5", "given twice"),
        ("poisson:4", "4", "key=value"),
        ("gamma:rate=4", "rate=4", "missing burstiness="),
        ("gamma:rate=4,burstiness=0", "0", "positive number"),
        ("steps:", "steps:", "no steps"),
        ("steps:2@30s,x@30s", "x", "non-negative"),
        ("steps:2@30s,8", "8", "RATE@DURATION"),
        ("steps:2@30", "30", "needs a unit"),
        ("steps:2@30d", "30d", "unknown unit"),
        ("steps:2@0s", "0s", "positive duration"),
        ("steps:0@10s", "steps:0@10s", "every step has rate 0"),
        ("steps:2@1s,speed=3", "speed=3", "unknown key"),
        (
            "steps:2@1s,burstiness=1,burstiness=2",
            "burstiness=2",
            "given twice",
        ),
        ("ramp:1@2m", "1", "FROM..TO"),
        (
            "ramp:1..10@2m,3..4@1m",
            "ramp:1..10@2m,3..4@1m",
            "expected one",
        ),
        ("ramp:0..0@2m", "0..0", "rate is 0"),
        ("ramp:1..10", "1..10", "RATE@DURATION"),
        ("day:10..1@10m", "10..1", "minimum is above"),
        ("trace:speedup=0", "0", "positive number"),
        (
            "trace:speedup=2,rate=3",
            "speedup=2,rate=3",
            "one of speedup and rate",
        ),
        ("trace:pace=2", "pace=2", "unknown key"),
    ];
    for (input, part, problem) in cases {
        let err = input.parse::<LoadShape>().unwrap_err();
        assert_eq!(err.part, part, "{input}: {err}");
        assert!(err.problem.contains(problem), "{input}: {err}");
        assert!(err.to_string().contains(&format!("`{part}`")), "{err}");
    }
}
