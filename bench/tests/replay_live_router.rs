//! A short replay of the Mooncake trace against a running router, opt-in:
//! `KVMESH_BENCH_URL=http://127.0.0.1:8000 cargo test -p kvmesh-bench --test
//! replay_live_router -- --ignored --nocapture` (optional: `KVMESH_BENCH_MODEL`,
//! `KVMESH_BENCH_LIMIT`, `KVMESH_BENCH_RATE`).

use kvmesh_bench::{load_trace, replay, Pacing, ReplayOptions, ScaleConfig, TraceSource};

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a running router: set KVMESH_BENCH_URL"]
async fn replays_the_trace_against_a_live_router() {
    let url = std::env::var("KVMESH_BENCH_URL").expect("KVMESH_BENCH_URL");
    let model = std::env::var("KVMESH_BENCH_MODEL").unwrap_or_default();
    let config = ScaleConfig {
        pacing: Pacing::RequestsPerSecond(env_or("KVMESH_BENCH_RATE", 2.0)),
        ..ScaleConfig::default()
    };
    let requests = load_trace(
        &TraceSource::Bundled,
        Some(env_or("KVMESH_BENCH_LIMIT", 20)),
        &config,
    )
    .unwrap();
    let report = replay(&url, &model, &requests, &ReplayOptions::default())
        .await
        .unwrap();
    println!("{report}");
    println!("{}", serde_json::to_string_pretty(&report).unwrap());
    assert_eq!(report.failed(), 0, "{report}");
    assert!(report.ttft_p50_s.is_some());
}
