//! The Mooncake conversation trace beside the repository (never copied into it) parses and
//! scales to prompts that fit the small model. Skipped where the trace is absent.

use std::path::PathBuf;

use kvmesh_bench::trace::DEFAULT_TRACE_PATH;
use kvmesh_bench::{ideal_hit_rate, load_trace, read_trace, Pacing, ScaleConfig};

fn trace_path() -> Option<PathBuf> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(DEFAULT_TRACE_PATH);
    path.exists().then_some(path)
}

#[test]
fn the_conversation_trace_fits_the_small_model() {
    let Some(path) = trace_path() else {
        eprintln!("skipped: no trace at {DEFAULT_TRACE_PATH}");
        return;
    };
    let all = read_trace(&path, None).unwrap();
    assert!(all.len() > 1000);
    let config = ScaleConfig {
        scale: 16,
        pacing: Pacing::RequestsPerSecond(2.0),
        ..ScaleConfig::default()
    };
    let requests = load_trace(&path, None, &config).unwrap();
    let context = 8192;
    assert!(requests
        .iter()
        .all(|r| r.prompt_tokens.len() + r.max_tokens as usize <= context));
    let ideal = ideal_hit_rate(&requests);
    assert!(ideal > 0.0 && ideal < 1.0, "{ideal}");

    let first = load_trace(&path, Some(200), &config).unwrap();
    assert_eq!(first.len(), 200);
    let span = first.last().unwrap().at.as_secs_f64();
    assert!((199.0 / span - 2.0).abs() < 1e-6, "{span}");
    println!(
        "trace: {} requests, ideal hit rate {ideal:.3}; first 200: {:.3}",
        all.len(),
        ideal_hit_rate(&first)
    );
}
