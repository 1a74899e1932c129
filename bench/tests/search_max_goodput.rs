//! The max-goodput search end to end through the public API: each probe's request outcomes
//! are judged by the real SLO report, and the search converges on the load where that
//! judgement turns. The outcomes come from a deterministic latency model of a server whose
//! TTFT grows with its load, so the boundary is known in advance.

use std::time::Duration;

use kvmesh_bench::search::{
    judge, Axis, Criteria, MaxGoodputSearch, Probe, SearchConfig, Stop, Verdict, Why,
};
use kvmesh_bench::slo::{RequestOutcome, SloReport, SloSpec};

const SLO: &str = "ttft=500ms";

/// `n` requests at `load`: request `i`'s TTFT is `20 ms × load × 1.2 (i + ½) / n`, spread
/// evenly up to 24 ms per unit of load; above `shed_above` one in ten is shed.
fn outcomes(load: f64, n: usize, shed_above: f64) -> Vec<RequestOutcome> {
    (0..n)
        .map(|i| {
            if load > shed_above && i % 10 == 0 {
                return RequestOutcome {
                    item: i,
                    status: Some(429),
                    error: Some("429".into()),
                    ..RequestOutcome::default()
                };
            }
            let u = 1.2 * (i as f64 + 0.5) / n as f64;
            let ttft = Duration::from_secs_f64(0.020 * load * u);
            RequestOutcome {
                item: i,
                status: Some(200),
                ttft: Some(ttft),
                e2e: Some(ttft + Duration::from_millis(50)),
                gaps: vec![Duration::from_millis(50)],
                output_tokens: 2,
                ..RequestOutcome::default()
            }
        })
        .collect()
}

/// Runs the search, each probe `100 × length` requests over `10 × length` seconds.
fn search(config: SearchConfig, shed_above: f64) -> MaxGoodputSearch {
    let slo: SloSpec = SLO.parse().unwrap();
    let mut search = MaxGoodputSearch::new(config).unwrap();
    while let Some(request) = search.next_probe() {
        let n = 100 * request.length as usize;
        let report = SloReport::new(
            &slo,
            &outcomes(request.load, n, shed_above),
            Duration::from_secs(10 * u64::from(request.length)),
        );
        let criteria = search.config().criteria;
        search
            .record(Probe::judged(request, &report, &criteria, None))
            .unwrap();
    }
    search
}

#[test]
fn a_concurrency_search_finds_where_the_slo_turns() {
    let config = SearchConfig {
        axis: Axis::Concurrency,
        start: 1.0,
        max: 256.0,
        resolution: 1.0,
        max_probes: 30,
        criteria: Criteria::default(),
    };
    let s = search(config, f64::INFINITY);
    let found = s.result().unwrap();
    assert_eq!(found.stop, Stop::Resolved);
    assert_eq!(found.lowest_fail, Some(found.load + 1.0));
    // Up to 20 every request meets 500 ms (24 ms × 20 = 480 ms); at 21, 99 of 100 do, which
    // is inconclusive at 95% and passes at twice the length (198 of 200).
    assert_eq!(found.load, 21.0);
    let at_21: Vec<(u32, Verdict)> = s
        .probes()
        .iter()
        .filter(|p| p.load == 21.0)
        .map(|p| (p.length, p.verdict))
        .collect();
    assert_eq!(at_21, [(1, Verdict::Inconclusive), (2, Verdict::Pass)]);
    // Every good request of 200 in 20 s.
    assert_eq!(found.goodput, 9.9);
    let last_fail = s.probes().iter().find(|p| p.load == 22.0).unwrap();
    assert!(matches!(
        last_fail.verdict,
        Verdict::Fail { .. } | Verdict::Inconclusive
    ));
}

#[test]
fn a_rate_search_stops_where_the_server_starts_shedding() {
    let config = SearchConfig {
        axis: Axis::Rate,
        start: 0.5,
        max: 64.0,
        resolution: 0.05,
        max_probes: 30,
        criteria: Criteria::default(),
    };
    // TTFT stays within the SLO to a load of 20; the server sheds above 6.
    let s = search(config, 6.0);
    let found = s.result().unwrap();
    assert_eq!(found.stop, Stop::Resolved);
    let fail = found.lowest_fail.unwrap();
    assert!(found.load <= 6.0 && 6.0 < fail, "{found:?}");
    assert!(fail - found.load <= 0.05 * fail, "{found:?}");
    let shed: Vec<&Probe> = s
        .probes()
        .iter()
        .filter(|p| {
            matches!(
                p.verdict,
                Verdict::Fail {
                    why: Why::Shed { .. }
                }
            )
        })
        .collect();
    assert!(!shed.is_empty() && shed.iter().all(|p| p.load > 6.0));
}

#[test]
fn judging_a_report_reads_the_interval_not_the_share() {
    let slo: SloSpec = SLO.parse().unwrap();
    // At load 21, 99% meet the SLO: above the 95% target, yet not shown to be with 100.
    let report = SloReport::new(
        &slo,
        &outcomes(21.0, 100, f64::INFINITY),
        Duration::from_secs(10),
    );
    assert_eq!(report.all.share, Some(0.99));
    assert_eq!(judge(&report, &Criteria::default()), Verdict::Inconclusive);
}
