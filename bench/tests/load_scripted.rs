//! The load generator against the scripted server over real sockets: closed and open loops,
//! trace timing and turns, the in-flight cap, what each outcome measured, shedding, timeouts
//! and errors.

use std::num::{NonZeroU64, NonZeroUsize};
use std::time::Duration;

use axum::http::StatusCode;
use kvmesh_bench::arrivals::{Arrivals, LoadShape, OpenLoop, RateProfile, Step};
use kvmesh_bench::load;
use kvmesh_bench::load::scripted::{self, Injection, Script};
use kvmesh_bench::slo::{Class, RequestOutcome, SloReport, SloSpec};
use kvmesh_bench::workload::{Message, Prompt, WorkItem, Workload};
use kvmesh_bench::{Api, LoadError, Pacing, Run, RunEvent, RunPlan, Target};

const MS: fn(u64) -> Duration = Duration::from_millis;

/// Latencies measured over loopback on a shared machine may exceed the script by this much;
/// they may never fall below it.
const TOLERANCE: Duration = Duration::from_millis(250);

/// Serves `script` on a free loopback port; its base URL.
async fn server(script: Script) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(scripted::serve(listener, script));
    url
}

fn target(url: &str, api: Api) -> Target {
    Target {
        url: url.to_owned(),
        api,
        model: Some("scripted".into()),
        api_key: Some("secret".into()),
        ignore_eos: true,
        request_timeout: Duration::from_secs(30),
        extra_body: Default::default(),
    }
}

fn item(prompt: Prompt, max_tokens: u32) -> WorkItem {
    WorkItem {
        prompt,
        max_tokens,
        at: None,
        previous_turn: None,
        hash_ids: vec![],
    }
}

fn text_workload(n: usize, max_tokens: u32) -> Workload {
    Workload {
        name: "test".into(),
        items: (0..n)
            .map(|i| item(Prompt::Text(format!("prompt number {i}")), max_tokens))
            .collect(),
    }
}

fn plan(shape: LoadShape) -> RunPlan {
    RunPlan {
        shape,
        seed: 7,
        max_requests: None,
        duration: None,
        max_in_flight: 1024,
        follow_turns: true,
        first_item: 0,
    }
}

fn closed(n: usize) -> LoadShape {
    LoadShape::Concurrency(NonZeroUsize::new(n).unwrap())
}

/// Runs, tracking how many requests were in flight at most (from the events).
async fn run_counting(
    target: &Target,
    workload: &Workload,
    plan: &RunPlan,
) -> (Result<Run, LoadError>, usize, usize) {
    let (mut in_flight, mut most, mut events) = (0usize, 0usize, 0usize);
    let result = load::run(target, workload, plan, &mut |e| {
        events += 1;
        match e {
            RunEvent::Sent { .. } => {
                in_flight += 1;
                most = most.max(in_flight);
            }
            RunEvent::Ended(_) => in_flight -= 1,
        }
    })
    .await;
    (result, most, events)
}

fn assert_sorted_by_send(outcomes: &[RequestOutcome]) {
    assert!(outcomes.windows(2).all(|w| w[0].sent <= w[1].sent));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_loop_keeps_n_in_flight_and_cycles_the_workload() {
    let url = server(Script::default()).await;
    let workload = text_workload(3, 4);
    let plan = RunPlan {
        max_requests: Some(20),
        ..plan(closed(4))
    };
    let (run, most, events) = run_counting(&target(&url, Api::Completions), &workload, &plan).await;
    let run = run.unwrap();
    assert_eq!(run.outcomes.len(), 20);
    assert_eq!(events, 40, "a Sent and an Ended each");
    assert_eq!(most, 4);
    assert!(
        run.outcomes.iter().all(|o| o.class() == Class::Ok),
        "{run:#?}"
    );
    let of_item = |i| run.outcomes.iter().filter(|o| o.item == i).count();
    assert_eq!((of_item(0), of_item(1), of_item(2)), (7, 7, 6));
    assert_sorted_by_send(&run.outcomes);
    let first = run.outcomes[0].sent;
    let last = run.outcomes.iter().map(|o| o.ended).max().unwrap();
    assert_eq!(run.duration, last - first);
    assert_eq!((run.waited, run.held), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_starts_at_its_first_item_and_wraps() {
    let url = server(Script::default()).await;
    let plan = RunPlan {
        max_requests: Some(5),
        first_item: 4,
        ..plan(closed(1))
    };
    let run = load::run(
        &target(&url, Api::Completions),
        &text_workload(3, 2),
        &plan,
        &mut |_| {},
    )
    .await
    .unwrap();
    let items: Vec<usize> = run.outcomes.iter().map(|o| o.item).collect();
    assert_eq!(items, [1, 2, 0, 1, 2], "4 wraps to item 1 of 3");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_loop_sends_on_its_schedule_and_a_finite_one_ends_by_itself() {
    let url = server(Script::default()).await;
    let workload = text_workload(2, 2);
    let open = OpenLoop {
        profile: RateProfile::Fixed(200.0),
        arrivals: Arrivals::Poisson,
    };
    let plan_ = RunPlan {
        max_requests: Some(10),
        ..plan(LoadShape::Open(open.clone()))
    };
    let run = load::run(
        &target(&url, Api::Completions),
        &workload,
        &plan_,
        &mut |_| {},
    )
    .await
    .unwrap();
    assert_eq!(run.outcomes.len(), 10);
    let schedule: Vec<Duration> = open.schedule(plan_.seed).take(10).collect();
    for (o, due) in run.outcomes.iter().zip(&schedule) {
        assert!(o.sent >= *due, "sent {:?} before its time {due:?}", o.sent);
        assert_eq!(o.class(), Class::Ok, "{o:?}");
    }
    assert!(run.max_lateness < TOLERANCE, "{:?}", run.max_lateness);

    // 100 requests/s for 50 ms, then a pause: the schedule's own end ends the run.
    let steps = OpenLoop {
        profile: RateProfile::Steps(vec![
            Step {
                rate: 100.0,
                duration: MS(50),
            },
            Step {
                rate: 0.0,
                duration: MS(10),
            },
        ]),
        arrivals: Arrivals::Constant,
    };
    let expected = steps.schedule(1).count();
    assert_eq!(expected, 5);
    let run = load::run(
        &target(&url, Api::Completions),
        &workload,
        &plan(LoadShape::Open(steps)),
        &mut |_| {},
    )
    .await
    .unwrap();
    assert_eq!(run.outcomes.len(), expected);
}

/// Checks one completed outcome against the script: never faster, not much slower.
fn assert_on_script(o: &RequestOutcome, script: &Script, tokens: u64) {
    assert_eq!(o.class(), Class::Ok, "{o:?}");
    assert_eq!(o.status, Some(200));
    let ttft = o.ttft.unwrap();
    assert!(
        ttft >= script.ttft && ttft < script.ttft + TOLERANCE,
        "{o:?}"
    );
    assert_eq!(o.gaps.len() as u64, tokens - 1, "{o:?}");
    for gap in &o.gaps {
        assert!(*gap >= script.itl && *gap < script.itl + TOLERANCE, "{o:?}");
    }
    let e2e = o.e2e.unwrap();
    assert!(e2e >= ttft + o.gaps.iter().sum::<Duration>(), "{o:?}");
    assert_eq!(o.ended, o.sent + e2e);
    assert_eq!(o.output_tokens, tokens);
    assert_eq!(o.cached_tokens, Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_and_chat_outcomes_follow_the_script() {
    let script = Script {
        ttft: MS(40),
        itl: MS(15),
        ..Script::default()
    };
    let url = server(script.clone()).await;
    let completions = Workload {
        name: "completions".into(),
        items: vec![
            item(Prompt::Text("one two three".into()), 5),
            item(Prompt::Tokens(vec![1, 2, 3, 4, 5, 6]), 3),
        ],
    };
    let plan_ = RunPlan {
        max_requests: Some(2),
        ..plan(closed(2))
    };
    let run_ = load::run(
        &target(&url, Api::Completions),
        &completions,
        &plan_,
        &mut |_| {},
    )
    .await
    .unwrap();
    assert_eq!(run_.outcomes.len(), 2);
    for o in &run_.outcomes {
        let (tokens, prompt) = if o.item == 0 { (5, 3) } else { (3, 6) };
        assert_on_script(o, &script, tokens);
        assert_eq!(o.prompt_tokens, Some(prompt));
    }

    // Chat: the server's role-only first delta, sent at once, is no token.
    let chat = Workload {
        name: "chat".into(),
        items: vec![
            item(Prompt::Text("hello there".into()), 4),
            item(
                Prompt::Messages(vec![
                    Message {
                        role: "system".into(),
                        content: "be brief".into(),
                    },
                    Message {
                        role: "user".into(),
                        content: "why is the sky blue".into(),
                    },
                ]),
                2,
            ),
        ],
    };
    let run_ = load::run(&target(&url, Api::Chat), &chat, &plan_, &mut |_| {})
        .await
        .unwrap();
    for o in &run_.outcomes {
        let (tokens, prompt) = if o.item == 0 { (4, 2) } else { (2, 7) };
        assert_on_script(o, &script, tokens);
        assert_eq!(o.prompt_tokens, Some(prompt));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_is_shed_not_failed() {
    let url = server(Script {
        inject: Some(Injection {
            every: NonZeroU64::new(3).unwrap(),
            status: StatusCode::TOO_MANY_REQUESTS,
        }),
        ..Script::default()
    })
    .await;
    let plan_ = RunPlan {
        max_requests: Some(12),
        ..plan(closed(1))
    };
    let run = load::run(
        &target(&url, Api::Completions),
        &text_workload(4, 3),
        &plan_,
        &mut |_| {},
    )
    .await
    .unwrap();
    let refused: Vec<&RequestOutcome> = run
        .outcomes
        .iter()
        .filter(|o| o.status == Some(429))
        .collect();
    assert_eq!(refused.len(), 4, "{run:#?}");
    assert!(refused
        .iter()
        .all(|o| o.error.as_deref() == Some("http_429") && o.e2e.is_none()));
    assert!(run.error_examples["http_429"].contains("scripted refusal"));
    let slo: SloSpec = "ttft=10s".parse().unwrap();
    let report = SloReport::new(&slo, &run.outcomes, run.duration);
    assert_eq!((report.ok, report.shed, report.failed), (8, 4, 0));

    let url = server(Script {
        inject: Some(Injection {
            every: NonZeroU64::new(1).unwrap(),
            status: StatusCode::SERVICE_UNAVAILABLE,
        }),
        ..Script::default()
    })
    .await;
    let run = load::run(
        &target(&url, Api::Completions),
        &text_workload(1, 3),
        &RunPlan {
            max_requests: Some(2),
            ..plan(closed(1))
        },
        &mut |_| {},
    )
    .await
    .unwrap();
    let report = SloReport::new(&slo, &run.outcomes, run.duration);
    assert_eq!((report.ok, report.shed, report.failed), (0, 0, 2));
    assert_eq!(report.errors.get("http_503"), Some(&2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_outlasts_the_timeout_fails_as_timeout() {
    let url = server(Script {
        ttft: Duration::from_secs(60),
        ..Script::default()
    })
    .await;
    let target = Target {
        request_timeout: MS(100),
        ..target(&url, Api::Completions)
    };
    let run = load::run(
        &target,
        &text_workload(1, 3),
        &RunPlan {
            max_requests: Some(2),
            ..plan(closed(2))
        },
        &mut |_| {},
    )
    .await
    .unwrap();
    assert_eq!(run.outcomes.len(), 2);
    for o in &run.outcomes {
        assert_eq!(o.error.as_deref(), Some("timeout"), "{o:?}");
        // The headers came before the stream stalled.
        assert_eq!(o.status, Some(200));
        assert_eq!((o.ttft, o.e2e), (None, None));
        assert!(o.ended >= o.sent + MS(100), "{o:?}");
        assert_eq!(o.class(), Class::Failed);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_urls_unreachable_servers_and_plans_that_cannot_run() {
    let workload = text_workload(2, 2);
    let bounded = RunPlan {
        max_requests: Some(2),
        ..plan(closed(1))
    };
    let no_op = &mut |_: RunEvent<'_>| {};
    for url in ["https://127.0.0.1:1", "127.0.0.1:8000", "http://"] {
        let err = load::run(&target(url, Api::Completions), &workload, &bounded, no_op)
            .await
            .unwrap_err();
        assert!(matches!(err, LoadError::BadUrl { .. }), "{url}: {err}");
    }

    // Nothing listens there: every request fails to connect.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    let run_ = load::run(&target(&url, Api::Completions), &workload, &bounded, no_op)
        .await
        .unwrap();
    assert_eq!(run_.outcomes.len(), 2);
    assert!(run_
        .outcomes
        .iter()
        .all(|o| o.error.as_deref() == Some("connect") && o.status.is_none()));

    // Plans refused before anything is sent.
    let tokens = Workload {
        name: "ids".into(),
        items: vec![item(Prompt::Tokens(vec![1, 2]), 2)],
    };
    let err = load::run(&target(&url, Api::Chat), &tokens, &bounded, no_op)
        .await
        .unwrap_err();
    assert!(
        matches!(err, LoadError::PromptForApi { item: 0, .. }),
        "{err}"
    );
    let err = load::run(
        &target(&url, Api::Completions),
        &workload,
        &plan(closed(4)),
        no_op,
    )
    .await
    .unwrap_err();
    assert!(matches!(err, LoadError::NoEnd(_)), "{err}");
    assert!(err.to_string().contains("concurrency:4"), "{err}");
    let poisson = "poisson:rate=5".parse().unwrap();
    let err = load::run(
        &target(&url, Api::Completions),
        &workload,
        &plan(poisson),
        no_op,
    )
    .await
    .unwrap_err();
    assert!(matches!(err, LoadError::NoEnd(_)), "{err}");
    let err = load::run(
        &target(&url, Api::Completions),
        &workload,
        &plan(LoadShape::Trace(Pacing::Speedup(1.0))),
        no_op,
    )
    .await
    .unwrap_err();
    assert!(
        matches!(err, LoadError::NoArrivalTimes { item: 0, .. }),
        "{err}"
    );
    let empty = Workload {
        name: "empty".into(),
        items: vec![],
    };
    let err = load::run(&target(&url, Api::Completions), &empty, &bounded, no_op)
        .await
        .unwrap_err();
    assert!(matches!(err, LoadError::EmptyWorkload(_)), "{err}");
    let no_cap = RunPlan {
        max_in_flight: 0,
        ..bounded.clone()
    };
    let err = load::run(&target(&url, Api::Completions), &workload, &no_cap, no_op)
        .await
        .unwrap_err();
    assert_eq!(err, LoadError::NoInFlight);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trace_timing_holds_follow_ups_and_the_cap_makes_requests_wait() {
    let script = Script {
        ttft: MS(30),
        itl: MS(5),
        ..Script::default()
    };
    let url = server(script).await;
    // Arrivals 0, 100, 100, 200 ms at double speed; the third follows up on the first.
    let at = [0, 100, 100, 200];
    let mut items: Vec<WorkItem> = at
        .iter()
        .map(|&ms| WorkItem {
            at: Some(MS(ms)),
            ..item(Prompt::Tokens(vec![1, 2, 3]), 3)
        })
        .collect();
    items[2].at = Some(MS(0));
    items[2].previous_turn = Some(0);
    let workload = Workload {
        name: "trace".into(),
        items,
    };
    let plan_ = plan(LoadShape::Trace(Pacing::Speedup(2.0)));
    let run_ = load::run(
        &target(&url, Api::Completions),
        &workload,
        &plan_,
        &mut |_| {},
    )
    .await
    .unwrap();
    assert_eq!(run_.outcomes.len(), 4);
    assert_eq!(run_.held, 1);
    let of = |i: usize| run_.outcomes.iter().find(|o| o.item == i).unwrap();
    assert!(of(2).sent >= of(0).ended, "{run_:#?}");
    assert!(of(1).sent >= MS(50) && of(3).sent >= MS(100), "{run_:#?}");

    // Without turns, the follow-up goes with the first turn.
    let open = RunPlan {
        follow_turns: false,
        ..plan_.clone()
    };
    let run_ = load::run(
        &target(&url, Api::Completions),
        &workload,
        &open,
        &mut |_| {},
    )
    .await
    .unwrap();
    assert_eq!(run_.held, 0);
    let of = |i: usize| run_.outcomes.iter().find(|o| o.item == i).unwrap();
    assert!(of(2).sent < of(0).ended, "{run_:#?}");

    // One at a time: every request due while one runs waits for it.
    let capped = RunPlan {
        max_in_flight: 1,
        follow_turns: false,
        ..plan(LoadShape::Trace(Pacing::Speedup(1000.0)))
    };
    let (run_, most, _) = run_counting(&target(&url, Api::Completions), &workload, &capped).await;
    let run_ = run_.unwrap();
    assert_eq!((run_.outcomes.len(), most), (4, 1));
    assert_eq!(run_.waited, 3);
    for w in run_.outcomes.windows(2) {
        assert!(w[1].sent >= w[0].ended, "{run_:#?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duration_stops_sending_and_awaits_what_is_in_flight() {
    let url = server(Script {
        ttft: MS(20),
        itl: MS(20),
        ..Script::default()
    })
    .await;
    let plan_ = RunPlan {
        duration: Some(MS(150)),
        ..plan(closed(2))
    };
    let run = load::run(
        &target(&url, Api::Completions),
        &text_workload(3, 3),
        &plan_,
        &mut |_| {},
    )
    .await
    .unwrap();
    // Each request takes at least 60 ms: two slots in 150 ms send at most 6.
    assert!((2..=6).contains(&run.outcomes.len()), "{run:#?}");
    assert!(run.outcomes.iter().all(|o| o.sent < MS(150)));
    assert!(run.outcomes.iter().all(|o| o.class() == Class::Ok));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_are_kept_alive_and_reused() {
    use axum::serve::ListenerExt;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    let accepted = Arc::new(AtomicUsize::new(0));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let counter = accepted.clone();
    let listener = listener.tap_io(move |_| {
        counter.fetch_add(1, Ordering::Relaxed);
    });
    tokio::spawn(async move { axum::serve(listener, scripted::router(Script::default())).await });
    let plan_ = RunPlan {
        max_requests: Some(200),
        ..plan(closed(2))
    };
    let run = load::run(
        &target(&url, Api::Completions),
        &text_workload(3, 4),
        &plan_,
        &mut |_| {},
    )
    .await
    .unwrap();
    assert!(run.outcomes.iter().all(|o| o.class() == Class::Ok));
    let connections = accepted.load(Ordering::Relaxed);
    println!("{connections} connections for 200 requests");
    assert!(
        connections <= 8,
        "{connections} connections for 200 requests"
    );
}
