//! `probe::Bench` against the scripted server over real sockets: a sweep's points, a
//! max-goodput search that reaches its max or fails at its start, and 429s counted shed and
//! judged on the shed share.

use std::num::{NonZeroU64, NonZeroUsize};
use std::time::Duration;

use axum::http::StatusCode;
use kvmesh_bench::arrivals::{Arrivals, LoadShape};
use kvmesh_bench::load::scripted::{self, Injection, Script};
use kvmesh_bench::probe::{Bench, Progress};
use kvmesh_bench::search::{judge, Axis, Criteria, SearchConfig, Stop, Verdict, Why};
use kvmesh_bench::slo::{Judge, SloSpec};
use kvmesh_bench::workload::{WorkloadOptions, WorkloadSpec};
use kvmesh_bench::{Api, RunEvent, Target};

const MS: fn(u64) -> Duration = Duration::from_millis;

/// Serves `script` on a free loopback port; its base URL.
async fn server(script: Script) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(scripted::serve(listener, script));
    url
}

/// `requests` per point of a small synthetic workload, judged on `slo`.
fn bench(url: &str, slo: &str, requests: usize) -> Bench {
    let workload = "synthetic:input=8,output=4"
        .parse::<WorkloadSpec>()
        .unwrap()
        .load(&WorkloadOptions::new(Api::Completions, requests))
        .unwrap();
    Bench {
        target: Target {
            url: url.to_owned(),
            api: Api::Completions,
            model: None,
            api_key: None,
            ignore_eos: true,
            request_timeout: Duration::from_secs(30),
            extra_body: Default::default(),
        },
        workload,
        slo: slo.parse::<SloSpec>().unwrap(),
        seed: 3,
        requests: Some(requests),
        duration: None,
        max_in_flight: 64,
        follow_turns: true,
    }
}

fn closed(n: usize) -> LoadShape {
    LoadShape::Concurrency(NonZeroUsize::new(n).unwrap())
}

fn script(ttft: Duration) -> Script {
    Script {
        ttft,
        itl: MS(1),
        ..Script::default()
    }
}

fn search(max: f64) -> SearchConfig {
    SearchConfig {
        axis: Axis::Concurrency,
        start: 1.0,
        max,
        resolution: 1.0,
        max_probes: 8,
        criteria: Criteria::default(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_gives_one_labelled_point_per_load_with_its_requests() {
    let url = server(script(MS(2))).await;
    let mut bench = bench(&url, "ttft=10s", 12);
    // Room for both points: the second starts where the first stopped.
    bench.workload = "synthetic:input=8,output=4"
        .parse::<WorkloadSpec>()
        .unwrap()
        .load(&WorkloadOptions::new(Api::Completions, 24))
        .unwrap();
    let mut starts = Vec::new();
    let (mut sent, mut ended) = (0, 0);
    let mut observer = |p: Progress<'_>| match p {
        Progress::Point { index, label, .. } => starts.push((index, label.to_owned())),
        Progress::Request(RunEvent::Sent { .. }) => sent += 1,
        Progress::Request(RunEvent::Ended(_)) => ended += 1,
    };
    let points = bench
        .sweep(&[closed(1), closed(3)], &mut observer)
        .await
        .unwrap();
    assert_eq!(
        starts,
        [(0, "concurrency:1".into()), (1, "concurrency:3".into())]
    );
    assert_eq!((sent, ended), (24, 24));
    let labels: Vec<&str> = points.iter().map(|m| m.point.label.as_str()).collect();
    assert_eq!(labels, ["concurrency:1", "concurrency:3"]);
    for m in &points {
        assert_eq!(m.point.load, m.point.label);
        assert_eq!(m.point.slo.requests, 12);
        assert_eq!(m.point.slo.ok, 12);
        assert_eq!(m.run.outcomes.len(), 12);
        assert!(m.point.generator.is_some());
    }
    let items = |m: &kvmesh_bench::probe::Measured| {
        let mut v: Vec<usize> = m.run.outcomes.iter().map(|o| o.item).collect();
        v.sort_unstable();
        v
    };
    assert_eq!(items(&points[0]), (0..12).collect::<Vec<_>>());
    assert_eq!(
        items(&points[1]),
        (12..24).collect::<Vec<_>>(),
        "the second point sends fresh prompts"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_search_the_server_always_passes_reaches_its_max() {
    let url = server(script(MS(1))).await;
    // 60 requests all meeting a loose SLO: the Wilson low bound (about 0.94) reaches 0.9.
    let bench = bench(&url, "ttft=10s", 60);
    let config = SearchConfig {
        criteria: Criteria {
            target_attainment: 0.9,
            ..Criteria::default()
        },
        ..search(4.0)
    };
    let found = bench
        .max_goodput(config, Arrivals::Poisson, &mut |_| {})
        .await
        .unwrap();
    let f = found.found.expect("every probe passes");
    assert_eq!(f.stop, Stop::ReachedMax);
    assert_eq!(f.load, 4.0);
    assert_eq!(f.lowest_fail, None);
    // Doubling from 1 to the max: 1, 2, 4.
    let loads: Vec<&str> = found.points.iter().map(|m| m.point.load.as_str()).collect();
    assert_eq!(loads, ["concurrency:1", "concurrency:2", "concurrency:4"]);
    let best = found.max_goodput.expect("the answer's point");
    assert_eq!(best.load, "concurrency:4");
    assert_eq!(best.goodput, found.points[2].point.slo.goodput);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_search_judged_by_percentiles_counts_every_request_of_a_passing_run() {
    let url = server(script(MS(1))).await;
    let bench = bench(&url, "ttft=10s,itl=10s", 60);
    let config = SearchConfig {
        criteria: Criteria {
            target_attainment: 0.9,
            judge: Judge::Percentiles,
            ..Criteria::default()
        },
        ..search(2.0)
    };
    let found = bench
        .max_goodput(config, Arrivals::Poisson, &mut |_| {})
        .await
        .unwrap();
    assert_eq!(found.found.map(|f| f.load), Some(2.0));
    let best = found.max_goodput.expect("the answer's point");
    assert_eq!(best.judge, Judge::Percentiles);
    let run = &found.points[1].point.slo;
    assert_eq!(best.goodput.rate, run.request_throughput);
    assert_eq!(found.probes[1].goodput, run.request_throughput);
    // Each request streamed 4 tokens: 3 gaps, every one within the target.
    let gaps = run.objectives[1].gaps.as_ref().expect("itl's gaps");
    assert_eq!((gaps.met, gaps.share), (180, Some(1.0)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ttft_objective_below_the_scripts_fails_at_the_start() {
    let url = server(script(MS(30))).await;
    let bench = bench(&url, "ttft=5ms", 10);
    let found = bench
        .max_goodput(search(8.0), Arrivals::Poisson, &mut |_| {})
        .await
        .unwrap();
    assert_eq!(found.found, None);
    assert_eq!(found.max_goodput, None);
    // The first miss settles the start: 9 of 10 at best is inconclusive at 0.95, so it runs
    // again twice as long, where the first miss settles it as well, and the search ends.
    let points: Vec<(&str, usize, usize)> = found
        .points
        .iter()
        .map(|m| (m.point.label.as_str(), m.point.slo.ok, m.point.slo.all.met))
        .collect();
    assert_eq!(
        points,
        [("concurrency:1", 1, 0), ("concurrency:1 retry", 1, 0)]
    );
    assert!(found.probes.iter().all(|p| p.ended_early));
    assert_eq!(found.probes[0].verdict, Verdict::Inconclusive);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inconclusive_probe_is_retried_twice_as_long_under_its_own_label() {
    let url = server(script(MS(1))).await;
    // 10 of 10 met: the Wilson interval [0.72, 1] holds 0.95, and so does 20 of 20's.
    let bench = bench(&url, "ttft=10s", 10);
    let found = bench
        .max_goodput(search(1.0), Arrivals::Poisson, &mut |_| {})
        .await
        .unwrap();
    let points: Vec<(&str, usize)> = found
        .points
        .iter()
        .map(|m| (m.point.label.as_str(), m.point.slo.requests))
        .collect();
    assert_eq!(points, [("concurrency:1", 10), ("concurrency:1 retry", 20)]);
    assert_eq!(found.found, None, "a second inconclusive counts as a fail");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn injected_429s_are_shed_and_fail_the_judge_on_the_shed_share() {
    let url = server(Script {
        inject: Some(Injection {
            every: NonZeroU64::new(4).unwrap(),
            status: StatusCode::TOO_MANY_REQUESTS,
        }),
        ..script(MS(1))
    })
    .await;
    let bench = bench(&url, "ttft=10s", 60);
    let measured = bench.point(&closed(2), &mut |_| {}).await.unwrap();
    let slo = &measured.point.slo;
    assert_eq!(
        (slo.requests, slo.ok, slo.shed, slo.failed),
        (60, 45, 15, 0)
    );
    assert!(
        slo.errors.is_empty(),
        "a shed request is no error: {:?}",
        slo.errors
    );
    assert_eq!(
        judge(slo, &Criteria::default()),
        Verdict::fail(Why::Shed { share: 0.25 })
    );
    // The same run passes with shedding allowed: the shed share is what failed it (45 of 45
    // met: the Wilson low bound is about 0.92).
    let lenient = Criteria {
        target_attainment: 0.9,
        max_shed_share: 0.3,
        ..Criteria::default()
    };
    assert_eq!(judge(slo, &lenient), Verdict::Pass);
}
