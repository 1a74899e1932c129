//! `kvmesh serve --autoscale` on the real model: the planner inside the process moves its
//! workers while clients stream.
//!
//! It starts with one prefill and one decode worker, bounds 1..=2 each and a budget of 3.
//! Phase A sends long prompts (prefilled on the prefill worker) until the planner, seeing
//! the prefill queue over its threshold, has started a second prefill worker. Phase B sends
//! short prompts (prefilled on the decode worker) with long answers until the decode workers'
//! KV usage makes it want a second decode worker: the budget leaves no room for one, so once
//! the prefill pool may shrink (its down cooldown) the planner switches a prefill worker to
//! decode in place. Every request must complete with exactly its greedy text (each prompt
//! asked again on the idle server afterwards), and the log must show the switch and the
//! decision lines.
//!
//! The second test lets the prefill role go to zero (`min = 0`): idle, the planner removes
//! the only prefill worker; prompts then prefill on the decode worker, whose queued prompt
//! tokens bring a prefill worker back; every request completes with its greedy text.

mod cluster;

use cluster::*;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Long enough for the load policy's thresholds and cooldowns to play out on a slow machine.
const PHASE_TIMEOUT: Duration = Duration::from_secs(240);

/// Each test runs a serve process on one thread; one at a time keeps their phases' timing
/// what it is alone on a small machine.
static ONE_SERVE_AT_A_TIME: Mutex<()> = Mutex::new(());

const PLANNER: &str = r#"
policy = "load"
budget = 3
[prefill]
min = 1
max = 2
[decode]
min = 1
max = 2
[cooldown]
up = "1s"
# The prefill pool may not shrink for this long after it grew: by then phase B's decode
# load has made the planner want a second decode worker, and the shrink becomes a switch.
down = "15s"
down_stable_for = "2s"
[load]
interval = "1s"
# One queued 200-token prompt is over the threshold; phase B's 12-token prompts prefill on
# the decode worker, a step's budget (256 tokens) holding them all.
context_length = 100
prefill_queue_up = 1.0
prefill_queue_down = 0.1
# Phase A holds at most 2 x 13 of the 256 blocks on the decode worker (10%); phase B's 12
# sequences, of staggered lengths, about a third.
kv_usage_up = 0.15
kv_usage_down = 0.05
"#;

/// `n` token ids, different for every `seed`.
fn prompt(seed: u32, n: u32) -> Vec<u32> {
    (0..n)
        .map(|i| 1000 + (seed * 7919 + i * 104_729) % 30_000)
        .collect()
}

fn body(prompt: &[u32], max_tokens: u32) -> Value {
    json!({"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
           "temperature": 0, "ignore_eos": true, "stream": true})
}

/// A planner gauge from serve's `/metrics`, for `role`.
fn nodes(addr: SocketAddr, series: &str, role: &str) -> f64 {
    let metrics = get(addr, "/metrics");
    let prefix = format!("{series}{{role=\"{role}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&prefix)?.trim().parse().ok())
        .unwrap_or(-1.0)
}

/// A series from serve's `/metrics`, summed over its labels.
fn total(addr: SocketAddr, series: &str) -> f64 {
    get(addr, "/metrics")
        .lines()
        .filter(|l| {
            l.strip_prefix(series)
                .is_some_and(|r| r.starts_with([' ', '{']))
        })
        .filter_map(|l| l.rsplit_once(' ')?.1.trim().parse::<f64>().ok())
        .sum()
}

/// Streams prompts from `clients` threads (client `c` asks for `max_tokens(c)`) until `until`
/// says stop; returns each request's (prompt, max_tokens, outcome).
fn load_until(
    addr: SocketAddr,
    clients: u32,
    first_seed: u32,
    prompt_tokens: u32,
    max_tokens: fn(u32) -> u32,
    until: impl Fn() -> bool + Sync,
) -> Vec<(Vec<u32>, u32, Outcome)> {
    let done = AtomicBool::new(false);
    let results = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for c in 0..clients {
            let (done, results) = (&done, &results);
            s.spawn(move || {
                for k in 0.. {
                    if done.load(Ordering::Acquire) {
                        break;
                    }
                    let p = prompt(first_seed + c * 1000 + k, prompt_tokens);
                    let out = stream_completion(addr, &body(&p, max_tokens(c)));
                    results.lock().unwrap().push((p, max_tokens(c), out));
                }
            });
        }
        let deadline = Instant::now() + PHASE_TIMEOUT;
        while !until() {
            assert!(Instant::now() < deadline, "the planner did not act in time");
            // Reading a metrics page, which has no push signal; bounded by the deadline.
            std::thread::sleep(Duration::from_millis(250));
        }
        done.store(true, Ordering::Release);
    });
    results.into_inner().unwrap()
}

/// Each request asked again, 12 at a time, on the now idle server: the same greedy text.
fn assert_all_complete_with_their_text(addr: SocketAddr, all: &[(Vec<u32>, u32, Outcome)]) {
    for (_, _, out) in all {
        assert_eq!(out.status, 200, "{:?}", out.error);
        assert!(out.error.is_none(), "a request was lost: {:?}", out.error);
        assert_eq!(out.finish.as_deref(), Some("length"));
    }
    for batch in all.chunks(12) {
        std::thread::scope(|s| {
            for (p, max_tokens, out) in batch {
                s.spawn(move || {
                    let again = stream_completion(addr, &body(p, *max_tokens));
                    assert_eq!(out.text, again.text, "a request's text changed");
                });
            }
        });
    }
}

/// Waits until `until` holds, reading metrics pages (no push signal), within the deadline.
fn wait_for(what: &str, until: impl Fn() -> bool) {
    let deadline = Instant::now() + PHASE_TIMEOUT;
    while !until() {
        assert!(Instant::now() < deadline, "{what}: not in time");
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Starts `kvmesh serve --autoscale` with `planner_toml` and one worker per role; returns
/// the process, its address and its log.
fn serve(name: &str, planner_toml: &str) -> (Node, SocketAddr, std::path::PathBuf) {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let planner = dir.join("planner.toml");
    std::fs::write(&planner, planner_toml).unwrap();
    let serve_toml = dir.join("serve.toml");
    std::fs::write(
        &serve_toml,
        "local_prefill_max_tokens = 32\n[engine]\nnum_blocks = 256\n",
    )
    .unwrap();
    let addr = free_addr("127.0.0.1");
    let args = [
        "serve",
        "--threads",
        "1",
        "--listen",
        &addr.to_string(),
        "--config",
        serve_toml.to_str().unwrap(),
        "--prefill-workers",
        "1",
        "--decode-workers",
        "1",
        "--autoscale",
        "--planner-config",
        planner.to_str().unwrap(),
        "--observe-every",
        "500ms",
    ];
    let log = dir.join("serve.log");
    let serve = Node::spawn(args.iter().map(|a| a.to_string()).collect(), log.clone());
    await_health(addr, &[&serve]);
    (serve, addr, log)
}

#[test]
fn the_planner_in_serve_adds_a_worker_then_switches_one_and_no_request_changes() {
    let _alone = ONE_SERVE_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let (serve, addr, log) = serve("serve_autoscale", PLANNER);

    let actual = |role| nodes(addr, "kvmesh_planner_actual_nodes", role);
    let phase_a = load_until(addr, 2, 0, 200, |_| 4, || actual("prefill") == 2.0);
    // Answers of different lengths: the sequences end at different times, so the decode
    // worker's KV usage stays up instead of falling at the end of each synchronized wave.
    let phase_b = load_until(
        addr,
        12,
        100_000,
        12,
        |c| 100 + 15 * c,
        || actual("prefill") == 1.0 && actual("decode") == 2.0,
    );

    let text = std::fs::read_to_string(&log).unwrap();
    let line = |what: &str| text.lines().find(|l| l.contains(what)).map(String::from);
    let started = line("autoscale: started a worker")
        .unwrap_or_else(|| panic!("phase A started no worker:\n{}", serve.log_tail()));
    assert!(started.contains("prefill"), "{started}");
    let switched = line("autoscale: switched a worker's role")
        .unwrap_or_else(|| panic!("no switch in the log:\n{}", serve.log_tail()));
    assert!(switched.contains("decode"), "{switched}");
    assert!(
        line("decided: prefill 2 -> 1").is_some_and(|l| l.contains("1 prefill -> decode")),
        "the switch's decision line is missing"
    );
    assert!(
        line("autoscale: drained and stopped").is_none(),
        "a worker was removed instead of switched"
    );

    // The workers' engine steps reached the planner's performance model (each observation
    // takes the steps since the one before, so at most as many as the workers ran).
    let (fed, ran) = (
        total(addr, "kvmesh_planner_engine_steps_total"),
        total(addr, "kvmesh_worker_engine_steps_total"),
    );
    assert!(
        fed > 0.0 && fed <= ran,
        "planner fed {fed} steps, workers ran {ran}"
    );

    // Every request completed, with its greedy text (asked again, 12 at a time).
    eprintln!(
        "phase A: {} requests, phase B: {} requests",
        phase_a.len(),
        phase_b.len()
    );
    let all: Vec<_> = phase_a.into_iter().chain(phase_b).collect();
    assert!(all.len() >= 12, "only {} requests", all.len());
    assert_all_complete_with_their_text(addr, &all);
}

const PLANNER_PREFILL_TO_ZERO: &str = r#"
policy = "load"
budget = 2
[prefill]
min = 0
max = 1
[decode]
min = 1
max = 1
[cooldown]
up = "1s"
down = "1s"
down_stable_for = "2s"
[load]
interval = "1s"
# A 200-token prompt queued on any worker, prefill or decode, is over the threshold; idle,
# every queue is empty.
context_length = 100
prefill_queue_up = 1.0
prefill_queue_down = 0.1
"#;

#[test]
fn the_prefill_role_goes_to_zero_and_returns_when_prompts_queue_on_decode() {
    let _alone = ONE_SERVE_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let (serve, addr, log) = serve("serve_autoscale_prefill_zero", PLANNER_PREFILL_TO_ZERO);
    let actual = |role| nodes(addr, "kvmesh_planner_actual_nodes", role);
    // Idle: the only prefill worker goes.
    wait_for("the prefill worker removed", || actual("prefill") == 0.0);
    // No prefill worker: the router has the decode worker prefill every prompt, and its
    // queued prompt tokens bring a prefill worker back.
    let served = load_until(addr, 2, 0, 200, |_| 4, || actual("prefill") == 1.0);

    let text = std::fs::read_to_string(&log).unwrap();
    let line = |what: &str| text.lines().find(|l| l.contains(what)).map(String::from);
    let tail = || serve.log_tail();
    let removed = line("autoscale: drained and stopped a worker")
        .unwrap_or_else(|| panic!("no worker removed:\n{}", tail()));
    assert!(removed.contains("prefill"), "{removed}");
    assert!(
        line("decided: prefill 1 -> 0 (prefill_queue_low)").is_some(),
        "the removal's decision line is missing:\n{}",
        tail()
    );
    assert!(
        line("decided: prefill 0 -> 1 (prefill_queue_high)").is_some(),
        "no decision to bring prefill back:\n{}",
        tail()
    );
    let started = line("autoscale: started a worker")
        .unwrap_or_else(|| panic!("no worker started:\n{}", tail()));
    assert!(started.contains("prefill"), "{started}");

    eprintln!("{} requests", served.len());
    assert!(!served.is_empty());
    assert_all_complete_with_their_text(addr, &served);
}
