use std::time::Duration;

use super::*;
use crate::slo::{wilson, Judge, Objective, RequestOutcome, SloSpec, Z_95};

fn concurrency(start: f64, max: f64, max_probes: usize) -> SearchConfig {
    SearchConfig {
        axis: Axis::Concurrency,
        start,
        max,
        resolution: 1.0,
        max_probes,
        criteria: Criteria::default(),
    }
}

fn rate(start: f64, max: f64, resolution: f64) -> SearchConfig {
    SearchConfig {
        axis: Axis::Rate,
        start,
        max,
        resolution,
        max_probes: 50,
        criteria: Criteria::default(),
    }
}

/// Runs the search against `oracle` (the verdict at a load and length) to its end; the
/// goodput of a probe is its load. Returns the loads probed.
fn run(search: &mut MaxGoodputSearch, oracle: impl Fn(f64, u32) -> Verdict) -> Vec<f64> {
    let mut loads = Vec::new();
    while let Some(request) = search.next_probe() {
        loads.push(request.load);
        let probe = Probe {
            load: request.load,
            length: request.length,
            verdict: oracle(request.load, request.length),
            goodput: request.load,
            ended_early: false,
        };
        search.record(probe).unwrap();
        assert!(loads.len() <= 1000, "the search does not end");
    }
    loads
}

fn below(threshold: f64) -> impl Fn(f64, u32) -> Verdict {
    move |load, _| {
        if load <= threshold {
            Verdict::Pass
        } else {
            Verdict::fail(Why::Attainment { high: 0.5 })
        }
    }
}

#[test]
fn doubles_then_bisects_a_concurrency_to_the_threshold() {
    let mut search = MaxGoodputSearch::new(concurrency(1.0, 1024.0, 50)).unwrap();
    let loads = run(&mut search, below(37.0));
    // 1..64 doubling, 64 fails; then bisect (32, 64): 48, 40, 36, 38, 37.
    assert_eq!(
        loads,
        [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 48.0, 40.0, 36.0, 38.0, 37.0]
    );
    let found = search.result().unwrap();
    assert_eq!(
        found,
        Found {
            load: 37.0,
            goodput: 37.0,
            lowest_fail: Some(38.0),
            stop: Stop::Resolved,
            probes: 12,
        }
    );
    assert_eq!(search.next_probe(), None);
    assert_eq!(
        search.record(search.probes()[0]),
        Err(RecordError::Ended),
        "nothing is asked once resolved"
    );
}

#[test]
fn converges_to_every_threshold_in_a_range() {
    for threshold in 1..=100 {
        let mut search = MaxGoodputSearch::new(concurrency(1.0, 128.0, 50)).unwrap();
        run(&mut search, below(f64::from(threshold)));
        let found = search.result().unwrap();
        assert_eq!(found.load, f64::from(threshold), "threshold {threshold}");
        assert_eq!(found.stop, Stop::Resolved);
        assert_eq!(found.lowest_fail, Some(f64::from(threshold + 1)));
    }
}

#[test]
fn a_coarser_resolution_stops_sooner_and_stays_below_the_threshold() {
    let mut config = concurrency(1.0, 128.0, 50);
    config.resolution = 8.0;
    let mut search = MaxGoodputSearch::new(config).unwrap();
    run(&mut search, below(37.0));
    let found = search.result().unwrap();
    // 32 passes, 64 fails; 48 fails, 40 fails: 40 - 32 <= 8.
    assert_eq!((found.load, found.lowest_fail), (32.0, Some(40.0)));
    assert_eq!(found.probes, 9);
}

#[test]
fn bisects_a_rate_to_a_relative_tolerance() {
    let threshold = 13.7;
    let mut search = MaxGoodputSearch::new(rate(1.0, 1000.0, 0.02)).unwrap();
    run(&mut search, below(threshold));
    let found = search.result().unwrap();
    let fail = found.lowest_fail.unwrap();
    assert_eq!(found.stop, Stop::Resolved);
    assert!(found.load <= threshold && threshold < fail, "{found:?}");
    assert!(fail - found.load <= 0.02 * fail, "{found:?}");
    // Not stopped too early either: one bisection step back was still too wide.
    assert!(fail - found.load > 0.02 * fail / 2.0 - 1e-12, "{found:?}");
}

#[test]
fn a_pass_at_max_ends_the_search_capped() {
    let mut search = MaxGoodputSearch::new(concurrency(4.0, 24.0, 50)).unwrap();
    let loads = run(&mut search, below(1e9));
    assert_eq!(loads, [4.0, 8.0, 16.0, 24.0], "doubling is clamped to max");
    let found = search.result().unwrap();
    assert_eq!((found.load, found.stop), (24.0, Stop::ReachedMax));
    assert_eq!(found.lowest_fail, None);
    // The limit between the clamped step and max is still bisected.
    let mut search = MaxGoodputSearch::new(concurrency(4.0, 24.0, 50)).unwrap();
    let loads = run(&mut search, below(20.0));
    assert_eq!(loads, [4.0, 8.0, 16.0, 24.0, 20.0, 22.0, 21.0]);
    assert_eq!(search.result().unwrap().load, 20.0);
}

#[test]
fn the_probe_limit_ends_the_search_at_the_best_pass_so_far() {
    let mut search = MaxGoodputSearch::new(concurrency(1.0, 1024.0, 8)).unwrap();
    let loads = run(&mut search, below(37.0));
    assert_eq!(loads.len(), 8);
    let found = search.result().unwrap();
    // 1..32 pass, 64 fails, 48 fails: the best so far is 32.
    assert_eq!((found.load, found.stop), (32.0, Stop::ProbeLimit));
    assert_eq!(found.lowest_fail, Some(48.0));
    // One probe: it passes, and that is all.
    let mut search = MaxGoodputSearch::new(concurrency(2.0, 64.0, 1)).unwrap();
    assert_eq!(run(&mut search, below(37.0)), [2.0]);
    assert_eq!(search.result().unwrap().stop, Stop::ProbeLimit);
}

#[test]
fn a_failing_start_has_no_answer() {
    let mut search = MaxGoodputSearch::new(rate(4.0, 64.0, 0.05)).unwrap();
    assert_eq!(run(&mut search, below(1.0)), [4.0]);
    assert_eq!(search.stop(), Some(Stop::FailsAtStart));
    assert_eq!(search.result(), None);
}

#[test]
fn an_inconclusive_probe_is_run_again_twice_as_long_once() {
    // Inconclusive at 16 at the normal length; at twice the length it passes.
    let oracle = |load: f64, length: u32| match (load, length) {
        (16.0, 1) => Verdict::Inconclusive,
        (l, _) if l <= 20.0 => Verdict::Pass,
        _ => Verdict::fail(Why::Attainment { high: 0.5 }),
    };
    let mut search = MaxGoodputSearch::new(concurrency(4.0, 64.0, 50)).unwrap();
    run(&mut search, oracle);
    let probes: Vec<(f64, u32)> = search.probes().iter().map(|p| (p.load, p.length)).collect();
    assert_eq!(
        probes,
        [
            (4.0, 1),
            (8.0, 1),
            (16.0, 1),
            (16.0, 2),
            (32.0, 1),
            (24.0, 1),
            (20.0, 1),
            (22.0, 1),
            (21.0, 1),
        ]
    );
    assert_eq!(search.result().unwrap().load, 20.0);

    // Inconclusive at any length counts as a fail after the retry.
    let oracle = |load: f64, _| match load {
        l if l <= 8.0 => Verdict::Pass,
        l if l <= 12.0 => Verdict::Inconclusive,
        _ => Verdict::fail(Why::Attainment { high: 0.5 }),
    };
    let mut search = MaxGoodputSearch::new(concurrency(4.0, 64.0, 50)).unwrap();
    run(&mut search, oracle);
    let found = search.result().unwrap();
    assert_eq!((found.load, found.lowest_fail), (8.0, Some(9.0)));
    // 4, 8, 16, 12 ×2, 10 ×2, 9 ×2.
    assert_eq!(found.probes, 9);
    assert!(search.probes().iter().filter(|p| p.length == 2).count() == 3);
}

#[test]
fn record_refuses_a_probe_it_did_not_ask_for() {
    let mut search = MaxGoodputSearch::new(concurrency(4.0, 64.0, 50)).unwrap();
    let probe = Probe {
        load: 5.0,
        length: 1,
        verdict: Verdict::Pass,
        goodput: 1.0,
        ended_early: false,
    };
    assert_eq!(
        search.record(probe),
        Err(RecordError::Unexpected {
            expected: 4.0,
            length: 1,
            got: 5.0
        })
    );
    assert!(search.probes().is_empty());
    let wrong_length = Probe {
        load: 4.0,
        length: 2,
        ..probe
    };
    assert!(search.record(wrong_length).is_err());
}

#[test]
fn configs_out_of_range_are_refused_by_name() {
    let field = |c: SearchConfig| MaxGoodputSearch::new(c).unwrap_err().field;
    assert_eq!(field(concurrency(0.0, 8.0, 5)), "start");
    assert_eq!(field(concurrency(1.5, 8.0, 5)), "start");
    assert_eq!(field(concurrency(8.0, 4.0, 5)), "max");
    assert_eq!(field(concurrency(1.0, 8.0, 0)), "max_probes");
    assert_eq!(field(rate(1.0, 8.0, 1.0)), "resolution");
    assert_eq!(field(rate(1.0, f64::INFINITY, 0.1)), "max");
    let mut c = concurrency(1.0, 8.0, 5);
    c.resolution = 0.5;
    assert_eq!(field(c.clone()), "resolution");
    c.resolution = 1.0;
    c.criteria.target_attainment = 1.5;
    assert_eq!(field(c.clone()), "target_attainment");
    c.criteria.target_attainment = 0.9;
    c.criteria.max_shed_share = -0.1;
    let err = MaxGoodputSearch::new(c).unwrap_err();
    assert_eq!(err.to_string(), "search: max_shed_share must be in [0, 1]");
}

#[test]
fn an_axis_gives_the_load_shape_to_run() {
    assert_eq!(
        Axis::Concurrency.shape(8.0, Arrivals::Poisson),
        Some("concurrency:8".parse().unwrap())
    );
    assert_eq!(Axis::Concurrency.shape(2.5, Arrivals::Poisson), None);
    assert_eq!(
        Axis::Rate.shape(2.5, Arrivals::Poisson),
        Some("poisson:rate=2.5".parse().unwrap())
    );
    assert_eq!(
        Axis::Rate.shape(3.0, Arrivals::Constant),
        Some("constant:rate=3".parse().unwrap())
    );
    assert_eq!(Axis::Rate.shape(0.0, Arrivals::Poisson), None);
}

// --- judging ---------------------------------------------------------------------------

const MS: fn(u64) -> Duration = Duration::from_millis;

fn completed(ttft_ms: u64) -> RequestOutcome {
    RequestOutcome {
        status: Some(200),
        ttft: Some(MS(ttft_ms)),
        e2e: Some(MS(ttft_ms + 10)),
        output_tokens: 2,
        gaps: vec![MS(10)],
        ..RequestOutcome::default()
    }
}

fn refused(status: Option<u16>, error: &str) -> RequestOutcome {
    RequestOutcome {
        status,
        error: Some(error.into()),
        ..RequestOutcome::default()
    }
}

/// `met` requests meeting `ttft=100ms`, `missed` missing it, and `extra` others.
fn report(met: usize, missed: usize, extra: Vec<RequestOutcome>) -> SloReport {
    let slo: SloSpec = "ttft=100ms".parse().unwrap();
    let mut outcomes: Vec<RequestOutcome> = (0..met).map(|_| completed(50)).collect();
    outcomes.extend((0..missed).map(|_| completed(500)));
    outcomes.extend(extra);
    SloReport::new(&slo, &outcomes, Duration::from_secs(10))
}

fn target(t: f64) -> Criteria {
    Criteria {
        target_attainment: t,
        ..Criteria::default()
    }
}

#[test]
fn judges_by_the_bounds_of_the_wilson_interval() {
    // 95 of 100: the 95% Wilson interval is (0.8882, 0.9785).
    let r = report(95, 5, Vec::new());
    let i = r.all.interval.unwrap();
    assert_eq!(i, wilson(95, 100, Z_95).unwrap());
    let at4 = |x: f64| (x * 1e4).round() / 1e4;
    assert_eq!((at4(i.low), at4(i.high)), (0.8882, 0.9785));
    assert_eq!(judge(&r, &target(0.88)), Verdict::Pass);
    assert_eq!(judge(&r, &target(0.9)), Verdict::Inconclusive);
    assert_eq!(judge(&r, &target(0.95)), Verdict::Inconclusive);
    assert_eq!(
        judge(&r, &target(0.98)),
        Verdict::fail(Why::Attainment { high: i.high })
    );
    // The bounds themselves: a low bound at the target passes, a high bound at it does not
    // fail.
    assert_eq!(judge(&r, &target(i.low)), Verdict::Pass);
    assert_eq!(judge(&r, &target(i.high)), Verdict::Inconclusive);
    // The same share over ten times the requests is decisive at 0.9.
    let r = report(950, 50, Vec::new());
    assert_eq!(judge(&r, &target(0.9)), Verdict::Pass);
    assert!(r.all.interval.unwrap().low > 0.93);
}

#[test]
fn refusals_fail_a_probe_before_attainment_is_judged() {
    // 100 met, 2 shed of 102 sent: above the default 1%.
    let shed = vec![refused(Some(429), "429"); 2];
    let r = report(100, 0, shed.clone());
    assert_eq!(
        judge(&r, &Criteria::default()),
        Verdict::fail(Why::Shed { share: 2.0 / 102.0 })
    );
    let tolerant = Criteria {
        max_shed_share: 0.02,
        ..Criteria::default()
    };
    assert_eq!(judge(&r, &tolerant), Verdict::Pass);
    // Timeouts count apart from sheds.
    let r = report(100, 0, vec![refused(None, "timeout"); 2]);
    assert_eq!(
        judge(&r, &tolerant),
        Verdict::fail(Why::Failed { share: 2.0 / 102.0 })
    );
    // One shed in 200 is tolerated.
    let r = report(199, 0, vec![refused(Some(429), "429")]);
    assert_eq!(judge(&r, &Criteria::default()), Verdict::Pass);
}

#[test]
fn nothing_completed_fails() {
    let all_shed = Criteria {
        max_shed_share: 1.0,
        ..Criteria::default()
    };
    let r = report(0, 0, vec![refused(Some(429), "429")]);
    assert_eq!(judge(&r, &all_shed), Verdict::fail(Why::NothingCompleted));
    let r = report(0, 0, Vec::new());
    assert_eq!(judge(&r, &all_shed), Verdict::fail(Why::NothingCompleted));
}

#[test]
fn a_probe_is_judged_from_its_report_and_serializes_flat() {
    let r = report(100, 0, Vec::new());
    let request = ProbeRequest {
        load: 8.0,
        length: 1,
    };
    let probe = Probe::judged(request, &r, &Criteria::default(), None);
    assert_eq!(probe.verdict, Verdict::Pass);
    assert!(!probe.ended_early);
    assert_eq!(probe.goodput, 10.0, "100 good requests in 10 s");
    let json = serde_json::to_value(probe).unwrap();
    assert_eq!(json["verdict"], "pass");
    assert_eq!(json["load"], 8.0);
    let fail = Probe {
        verdict: Verdict::fail(Why::Shed { share: 0.5 }),
        ..probe
    };
    let json = serde_json::to_value(fail).unwrap();
    assert_eq!(
        (&json["verdict"], &json["reason"], &json["share"]),
        (&"fail".into(), &"shed".into(), &0.5.into())
    );
}

#[test]
fn a_probe_can_pass_until_its_best_case_cannot() {
    let at99 = target(0.99);
    // 400 planned at 0.99: 381 in a row pass (low 0.9901), one miss in 400 cannot (0.9860).
    let clean = Tally {
        met: 10,
        ..Tally::default()
    };
    assert!(clean.can_pass(400, &at99));
    assert!(!clean.can_pass(300, &at99), "300 all met: low 0.9874");
    let one_miss = Tally { missed: 1, ..clean };
    assert!(!one_miss.can_pass(400, &at99));
    // Its best case is inconclusive (high above 0.99), so the search runs it again longer,
    // where one miss in 800 passes.
    let best = one_miss.best_case(400);
    assert_eq!((best.met, best.missed), (399, 1));
    assert_eq!(judge_tally(best, &at99), Verdict::Inconclusive);
    assert!(one_miss.can_pass(800, &at99));
    // Refusals count against the planned total: 4 shed of 400 planned is 1%, 5 is over.
    let shed = |n| Tally { shed: n, ..clean };
    assert!(shed(4).can_pass(400, &Criteria::default()));
    assert!(!shed(5).can_pass(400, &Criteria::default()));
    // The tally of a report is the report's judgement.
    let r = report(95, 5, vec![refused(Some(429), "429")]);
    let t = Tally::of(&r);
    assert_eq!((t.met, t.missed, t.shed, t.failed), (95, 5, 1, 0));
    assert_eq!(judge_tally(t, &target(0.9)), judge(&r, &target(0.9)));
}

#[test]
fn a_probe_stopped_early_is_judged_by_its_best_case() {
    let r = report(50, 5, Vec::new());
    let request = ProbeRequest {
        load: 2.0,
        length: 1,
    };
    let at99 = target(0.99);
    // 395 of 400 at best: inconclusive at 0.99 (0.9710, 0.9947), so it is run again longer.
    let stopped = Probe::judged(request, &r, &at99, Some(400));
    assert_eq!(stopped.verdict, Verdict::Inconclusive);
    assert!(stopped.ended_early);
    // Planned at 60, 55 of 60 at best is a fail.
    let short = Probe::judged(request, &r, &at99, Some(60));
    assert!(matches!(short.verdict, Verdict::Fail { .. }));
}

// --- the sweep grammar -------------------------------------------------------------------

fn loads(s: &str) -> Vec<f64> {
    s.parse::<Sweep>().unwrap().loads
}

#[test]
fn sweeps_parse_to_lists_and_ranges() {
    assert_eq!(loads("rate=1,2,4"), [1.0, 2.0, 4.0]);
    assert_eq!(
        loads("concurrency=1..32x2"),
        [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]
    );
    assert_eq!(loads("concurrency=1..20x2"), [1.0, 2.0, 4.0, 8.0, 16.0]);
    assert_eq!(loads("concurrency=1,4,16"), [1.0, 4.0, 16.0]);
    assert_eq!(loads("concurrency=2..8+2"), [2.0, 4.0, 6.0, 8.0]);
    assert_eq!(
        loads(" rate = 0.5 , 1..4x2 , 6 "),
        [0.5, 1.0, 2.0, 4.0, 6.0]
    );
    // Steps are computed, not accumulated: ten steps of 0.1 end exactly at 1.
    let tenths = loads("rate=0.1..1+0.1");
    assert_eq!(tenths.len(), 10);
    assert_eq!(tenths.last(), Some(&1.0));
}

#[test]
fn sweeps_give_load_shapes() {
    let shapes = parse_sweep("rate=1,2").unwrap();
    let expected: Vec<LoadShape> = vec![
        "poisson:rate=1".parse().unwrap(),
        "poisson:rate=2".parse().unwrap(),
    ];
    assert_eq!(shapes, expected);
    let shapes = parse_sweep("rate=2;arrivals=constant").unwrap();
    assert_eq!(shapes, ["constant:rate=2".parse::<LoadShape>().unwrap()]);
    let shapes = parse_sweep("rate=2;burstiness=0.5").unwrap();
    assert_eq!(
        shapes,
        ["gamma:rate=2,burstiness=0.5".parse::<LoadShape>().unwrap()]
    );
    let shapes = parse_sweep("concurrency=1,8").unwrap();
    assert_eq!(
        shapes,
        [
            "concurrency:1".parse::<LoadShape>().unwrap(),
            "concurrency:8".parse().unwrap()
        ]
    );
    // Written back, a sweep parses to itself.
    for s in [
        "rate=0.5..4x2;arrivals=constant",
        "rate=1;burstiness=2",
        "concurrency=1..8x2",
    ] {
        let sweep: Sweep = s.parse().unwrap();
        assert_eq!(sweep.to_string().parse::<Sweep>().unwrap(), sweep, "{s}");
    }
}

#[test]
fn bad_sweeps_say_what_is_wrong() {
    let err = |s: &str| s.parse::<Sweep>().unwrap_err();
    let cases = [
        ("rate", "rate", "expected rate=LOADS"),
        ("load=1,2", "load", "unknown axis"),
        ("rate=", "", "an empty load"),
        ("rate=1,,2", "1,,2", "an empty load"),
        ("rate=1,x", "x", "positive number"),
        ("rate=-1", "-1", "positive number"),
        ("rate=4,2", "4,2", "must increase (4 then 2)"),
        ("rate=1,1", "1,1", "must increase"),
        ("concurrency=1.5", "1.5", "whole number"),
        ("concurrency=0.5..4x2", "0.5..4x2", "whole number"),
        ("concurrency=1..8", "1..8", "xFACTOR or +STEP"),
        ("concurrency=1..8x1", "1..8x1", "factor must be above 1"),
        ("concurrency=8..1x2", "8..1x2", "ends below its start"),
        ("rate=1..1000000+1", "1..1000000+1", "more than 1000 loads"),
        (
            "concurrency=1;arrivals=constant",
            "arrivals=constant",
            "takes no options",
        ),
        (
            "rate=1;arrivals=gamma",
            "arrivals=gamma",
            "expected arrivals=poisson",
        ),
        ("rate=1;burstiness=0", "0", "positive number"),
        ("rate=1;seed=3", "seed=3", "unknown option"),
        (
            "rate=1;arrivals=constant;burstiness=2",
            "burstiness=2",
            "given twice",
        ),
    ];
    for (input, part, problem) in cases {
        let e = err(input);
        assert_eq!(e.part, part, "{input}: {e}");
        assert!(e.problem.contains(problem), "{input}: {e}");
    }
    assert_eq!(
        err("rate=4,2").to_string(),
        "sweep: `4,2`: loads must increase (4 then 2)"
    );
}

/// A completed request at TTFT `ttft_ms` streaming 100 gaps of 10 ms, `slow` of them 150 ms.
fn streamed(ttft_ms: u64, slow: usize) -> RequestOutcome {
    let gaps: Vec<Duration> = (0..100)
        .map(|i| MS(if i < slow { 150 } else { 10 }))
        .collect();
    RequestOutcome {
        status: Some(200),
        ttft: Some(MS(ttft_ms)),
        e2e: Some(MS(ttft_ms) + gaps.iter().sum::<Duration>()),
        output_tokens: 101,
        gaps,
        ..RequestOutcome::default()
    }
}

fn percentiles(t: f64) -> Criteria {
    Criteria {
        target_attainment: t,
        judge: Judge::Percentiles,
        ..Criteria::default()
    }
}

#[test]
fn percentiles_judge_each_objective_over_its_own_samples() {
    let slo: SloSpec = "ttft=2s,itl=100ms".parse().unwrap();
    // 400 requests, each with one slow gap in 100: none keeps every gap under 100 ms, yet
    // 99% of all gaps are under it; every TTFT within 2 s.
    let one_slow: Vec<RequestOutcome> = (0..400).map(|_| streamed(300, 1)).collect();
    let r = SloReport::new(&slo, &one_slow, Duration::from_secs(100));
    let gaps = r.objectives[1].gaps.as_ref().unwrap();
    assert_eq!((gaps.met, gaps.share), (39_600, Some(0.99)));
    assert_eq!(r.objectives[0].gaps, None, "gaps are reported for ITL only");
    let t = Tally::of(&r);
    assert_eq!(
        t.samples[Objective::Itl as usize],
        Some(Samples {
            met: 39_600,
            total: 40_000
        })
    );
    assert_eq!(
        t.samples[Objective::Ttft as usize],
        Some(Samples {
            met: 400,
            total: 400
        })
    );
    assert_eq!(t.samples[Objective::E2e as usize], None, "not in the SLO");
    assert_eq!(
        judge(&r, &target(0.99)),
        Verdict::fail(Why::Attainment {
            high: wilson(0, 400, Z_95).unwrap().high
        })
    );
    // 99.0% of 40,000 gaps: the target lies inside the interval.
    assert_eq!(judge(&r, &percentiles(0.99)), Verdict::Inconclusive);
    assert_eq!(judge(&r, &percentiles(0.985)), Verdict::Pass);
    // Two slow gaps in 100 fail ITL's p99; TTFT alone decides when gaps are clean.
    let two_slow: Vec<RequestOutcome> = (0..400).map(|_| streamed(300, 2)).collect();
    let r = SloReport::new(&slo, &two_slow, Duration::from_secs(100));
    let high = wilson(39_200, 40_000, Z_95).unwrap().high;
    assert_eq!(
        judge(&r, &percentiles(0.99)),
        Verdict::fail(Why::Percentile {
            objective: Objective::Itl,
            high
        })
    );
    let mut late: Vec<RequestOutcome> = (0..400).map(|_| streamed(300, 0)).collect();
    late[..20].iter_mut().for_each(|o| o.ttft = Some(MS(2_500)));
    let r = SloReport::new(&slo, &late, Duration::from_secs(100));
    assert!(matches!(
        judge(&r, &percentiles(0.99)),
        Verdict::Fail {
            why: Why::Percentile {
                objective: Objective::Ttft,
                ..
            }
        }
    ));
    // Judged by percentiles, a passing run's goodput is every completed request.
    let clean: Vec<RequestOutcome> = (0..400).map(|_| streamed(300, 1)).collect();
    let r = SloReport::new(&slo, &clean, Duration::from_secs(100));
    let request = ProbeRequest {
        load: 4.0,
        length: 1,
    };
    let probe = Probe::judged(request, &r, &percentiles(0.98), None);
    assert_eq!((probe.verdict, probe.goodput), (Verdict::Pass, 4.0));
    let probe = Probe::judged(request, &r, &target(0.98), None);
    assert_eq!(probe.goodput, 0.0, "per request, none met ITL");
}

#[test]
fn a_tally_counts_as_its_report_and_projects_gaps_for_its_best_case() {
    let slo: SloSpec = "ttft=2s,itl=100ms".parse().unwrap();
    let outcomes = [
        streamed(300, 1),
        streamed(3_000, 0),
        refused(Some(429), "429"),
    ];
    let mut tally = Tally::new(&slo);
    let met: Vec<bool> = outcomes.iter().map(|o| tally.add(o, &slo)).collect();
    assert_eq!(met, [false, false, false]);
    let r = SloReport::new(&slo, &outcomes, Duration::from_secs(10));
    assert_eq!(tally, Tally::of(&r));
    assert_eq!(
        tally.samples[Objective::Itl as usize],
        Some(Samples {
            met: 199,
            total: 200
        })
    );
    // 10 planned: 7 to come, each with 100 gaps (the average so far), all within target.
    let best = tally.best_case(10);
    assert_eq!(
        best.samples[Objective::Itl as usize],
        Some(Samples {
            met: 899,
            total: 900
        })
    );
    assert_eq!(
        best.samples[Objective::Ttft as usize],
        Some(Samples { met: 8, total: 9 })
    );
    // One late first token in 400 planned keeps TTFT's p99 reachable by percentiles; per
    // request, the two misses already cannot pass at 0.99.
    let at99 = percentiles(0.99);
    assert!(!tally.can_pass(400, &target(0.99)));
    assert!(tally.can_pass(800, &at99));
    assert!(
        !tally.can_pass(10, &at99),
        "one 429 in 10 is over the 1% shed limit"
    );
}
