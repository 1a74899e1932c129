//! Every series family each kind of kvmesh process exports on `/metrics`, listed without
//! values (name, type, help, label values, histogram bucket bounds) and compared with
//! `tests/fixtures/metrics_series.txt`: `kvmesh serve` (router and workers in one process),
//! and a mesh of `kvmesh router`, `kvmesh prefill` and `kvmesh decode` (with
//! `--metrics-listen`), each after serving requests so the labelled series exist.
//! `KVMESH_BLESS=1` rewrites the fixture from what the processes export.

mod cluster;

use cluster::*;
use kvmesh_kvstore::EtcdServer;
use serde_json::json;
use std::collections::{BTreeMap, BTreeSet};

const FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/metrics_series.txt"
);

/// One sample line of Prometheus text: its name and its labels (sorted by name).
fn parse_sample(line: &str) -> Option<(String, BTreeMap<String, String>)> {
    let (series, _value) = line.rsplit_once(' ')?;
    let Some((name, rest)) = series.split_once('{') else {
        return Some((series.to_string(), BTreeMap::new()));
    };
    let body = rest.strip_suffix('}')?;
    let mut labels = BTreeMap::new();
    let mut chars = body.chars().peekable();
    while chars.peek().is_some() {
        let key: String = chars.by_ref().take_while(|&c| c != '=').collect();
        if chars.next() != Some('"') {
            return None;
        }
        let mut value = String::new();
        while let Some(c) = chars.next() {
            match c {
                '\\' => value.extend(chars.next()),
                '"' => break,
                c => value.push(c),
            }
        }
        if chars.peek() == Some(&',') {
            chars.next();
        }
        labels.insert(key.trim().to_string(), value);
    }
    Some((name.to_string(), labels))
}

/// `text` as sorted lines prefixed with `process`: per family its type and help, per series
/// its labels (node ids, which differ per run, as `*`) and, for histograms, the bucket bounds.
fn listing(process: &str, text: &str) -> BTreeSet<String> {
    let mut types = BTreeMap::new();
    let mut out = BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            out.insert(format!("{process} help {name} {help}"));
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("a TYPE line names a type");
            out.insert(format!("{process} type {name} {kind}"));
            types.insert(name.to_string(), kind.to_string());
        }
    }
    let mut buckets: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let (name, mut labels) =
            parse_sample(line).unwrap_or_else(|| panic!("a sample line: {line:?}"));
        if let Some(node) = labels.get_mut("node") {
            *node = "*".into();
        }
        let histogram = ["_bucket", "_sum", "_count"].iter().find_map(|suffix| {
            let family = name.strip_suffix(suffix)?;
            (types.get(family).map(String::as_str) == Some("histogram")).then_some(family)
        });
        let family = histogram.unwrap_or(&name);
        let le = labels.remove("le");
        let labels: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
        let series = format!("{family}{{{}}}", labels.join(","));
        match (histogram, le) {
            (Some(_), Some(le)) => {
                let bound = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().expect("a numeric bucket bound")
                };
                buckets.entry(series).or_default().push(bound);
            }
            (Some(_), None) => {}
            _ => {
                out.insert(format!("{process} series {series}"));
            }
        }
    }
    for (series, mut bounds) in buckets {
        bounds.sort_by(f64::total_cmp);
        bounds.dedup();
        let bounds: Vec<String> = bounds.iter().map(f64::to_string).collect();
        out.insert(format!("{process} series {series} le={}", bounds.join(",")));
    }
    out
}

fn log_dir() -> std::path::PathBuf {
    let logs = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("metrics_series");
    std::fs::create_dir_all(&logs).unwrap();
    logs
}

/// `kvmesh serve`'s `/metrics` after a chat request, a completion and a rate-limited one.
fn serve_metrics() -> String {
    let addr = free_addr("127.0.0.1");
    let args = [
        "serve",
        "--threads",
        "1",
        "--listen",
        &addr.to_string(),
        "--rate-limit",
        "0.001",
        "--rate-limit-burst",
        "2",
    ];
    let serve = Node::spawn(args.map(String::from).to_vec(), log_dir().join("serve.log"));
    await_health(addr, &[&serve]);
    let chat = json!({"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}],
                      "max_tokens": 4, "temperature": 0});
    assert_eq!(post(addr, "/v1/chat/completions", &chat).0, 200);
    let completion = json!({"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 4,
                            "temperature": 0});
    assert_eq!(post(addr, "/v1/completions", &completion).0, 200);
    assert_eq!(post(addr, "/v1/completions", &completion).0, 429);
    get(addr, "/metrics")
}

/// The `/metrics` of a mesh's router, prefill node and decode node after a request the
/// decode node sends to the prefill node.
fn mesh_metrics() -> [(&'static str, String); 3] {
    let etcd = EtcdServer::start().expect("etcd starts (scripts/setup.sh installs it)");
    let args = |role: &str, addr| mesh_args(role, addr, &etcd.endpoint(), "metricstest");
    let [router_addr, prefill_addr, decode_addr] =
        ["127.0.0.2", "127.0.0.3", "127.0.0.4"].map(free_addr);
    let [prefill_metrics, decode_metrics] = ["127.0.0.3", "127.0.0.4"].map(free_addr);
    let mut prefill = args("prefill", prefill_addr);
    prefill.extend(["--metrics-listen".into(), prefill_metrics.to_string()]);
    let prefill = Node::spawn(prefill, log_dir().join("prefill.log"));
    let mut decode = args("decode", decode_addr);
    decode.extend(["--local-prefill-max-tokens".into(), "32".into()]);
    decode.extend(["--metrics-listen".into(), decode_metrics.to_string()]);
    let decode = Node::spawn(decode, log_dir().join("decode.log"));
    let mut router = args("router", router_addr);
    router.extend(["--local-prefill-max-tokens".into(), "32".into()]);
    let router = Node::spawn(router, log_dir().join("router.log"));

    let rt = tokio::runtime::Runtime::new().unwrap();
    let discovery = discovery(&rt, &etcd.endpoint(), "metricstest");
    rt.block_on(await_membership(&discovery, 1, 1, START_TIMEOUT));
    await_health(router_addr, &[&prefill, &decode, &router]);
    let long = "Here is a note about rivers, written at length. ".repeat(6);
    let completion = json!({"model": MODEL_NAME, "prompt": long, "max_tokens": 4,
                            "temperature": 0});
    let (status, reply) = post(router_addr, "/v1/completions", &completion);
    assert_eq!(status, 200, "{reply}");
    [
        ("router", get(router_addr, "/metrics")),
        ("prefill", get(prefill_metrics, "/metrics")),
        ("decode", get(decode_metrics, "/metrics")),
    ]
}

#[test]
fn every_process_exports_the_listed_series() {
    let mut all = listing("serve", &serve_metrics());
    for (process, text) in mesh_metrics() {
        all.extend(listing(process, &text));
    }
    let listed: String = all.iter().map(|l| format!("{l}\n")).collect();
    if std::env::var_os("KVMESH_BLESS").is_some() {
        std::fs::write(FIXTURE, &listed).expect("writing the fixture");
    }
    let fixture = std::fs::read_to_string(FIXTURE).expect("the fixture exists");
    let expected: BTreeSet<&str> = fixture.lines().collect();
    let got: BTreeSet<&str> = listed.lines().collect();
    let missing: Vec<_> = expected.difference(&got).collect();
    let extra: Vec<_> = got.difference(&expected).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "/metrics differs from {FIXTURE}\nmissing: {missing:#?}\nnew: {extra:#?}"
    );
}
