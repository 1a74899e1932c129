//! The Mooncake conversation trace bundled with the repository (`data/traces/`) parses and
//! scales to prompts that fit the small model.

use kvmesh_bench::{ideal_hit_rate, load_trace, Pacing, ScaleConfig, TraceSource};

#[test]
fn the_conversation_trace_fits_the_small_model() {
    let source = TraceSource::Bundled;
    let all = source.read(None).unwrap();
    assert!(all.len() > 1000);
    let config = ScaleConfig {
        scale: 16,
        pacing: Pacing::RequestsPerSecond(2.0),
        ..ScaleConfig::default()
    };
    let requests = load_trace(&source, None, &config).unwrap();
    let context = 8192;
    assert!(requests
        .iter()
        .all(|r| r.prompt_tokens.len() + r.max_tokens as usize <= context));
    let ideal = ideal_hit_rate(&requests);
    assert!(ideal > 0.0 && ideal < 1.0, "{ideal}");

    let first = load_trace(&source, Some(200), &config).unwrap();
    assert_eq!(first.len(), 200);
    let span = first.last().unwrap().at.as_secs_f64();
    assert!((199.0 / span - 2.0).abs() < 1e-6, "{span}");
    println!(
        "trace: {} requests, ideal hit rate {ideal:.3}; first 200: {:.3}",
        all.len(),
        ideal_hit_rate(&first)
    );
}

#[test]
fn an_explicit_trace_file_reads_like_the_bundled_trace() {
    let file = TraceSource::File(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(kvmesh_bench::trace::BUNDLED_TRACE_PATH),
    );
    assert_eq!(
        file.read(Some(50)).unwrap(),
        TraceSource::Bundled.read(Some(50)).unwrap()
    );
    let missing = TraceSource::File("no/such/trace.jsonl".into());
    let err = missing.read(None).unwrap_err().to_string();
    assert!(err.contains("no/such/trace.jsonl"), "{err}");
}
