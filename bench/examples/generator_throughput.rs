//! How many streamed requests a second the load generator sustains, on one core: a closed
//! loop against the scripted server, on a single-threaded runtime.
//!
//! For the one-core figure, run the server on other cores:
//!
//! ```text
//! taskset -c 1-3 target/release/kvmesh bench scripted-server --listen 127.0.0.1:8123 --threads 3 &
//! taskset -c 0 target/release/examples/generator_throughput --url http://127.0.0.1:8123
//! ```
//!
//! Without `--url` it starts the scripted server in-process on its own threads (which then
//! share whatever cores the process may use). Flags: `--concurrency N` (64), `--requests N`
//! (20000), `--tokens N` per request (8), `--chat`.

use std::num::NonZeroUsize;
use std::time::{Duration, Instant};

use kvmesh_bench::arrivals::LoadShape;
use kvmesh_bench::load::scripted::{self, Script};
use kvmesh_bench::slo::Class;
use kvmesh_bench::workload::{Prompt, WorkItem, Workload};
use kvmesh_bench::{load, Api, RunPlan, Target};

struct Args {
    url: Option<String>,
    concurrency: usize,
    requests: usize,
    tokens: u32,
    chat: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        url: None,
        concurrency: 64,
        requests: 20_000,
        tokens: 8,
        chat: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        let number = |v: String| v.parse::<usize>().map_err(|e| format!("{v}: {e}"));
        match flag.as_str() {
            "--url" => args.url = Some(value()?),
            "--concurrency" => args.concurrency = number(value()?)?,
            "--requests" => args.requests = number(value()?)?,
            "--tokens" => args.tokens = number(value()?)? as u32,
            "--chat" => args.chat = true,
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    Ok(args)
}

/// This process's CPU time so far (user + system), from /proc (Linux).
fn cpu_time() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command's closing parenthesis; utime and stime are the 14th and 15th.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split(' ').collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(Duration::from_millis(ticks * 10)) // USER_HZ is 100 on Linux
}

fn in_process_server() -> String {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("the server's runtime");
        runtime.block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("a loopback port");
            let _ = tx.send(format!("http://{}", listener.local_addr().unwrap()));
            let _ = scripted::serve(listener, Script::default()).await;
        });
    });
    rx.recv().expect("the server's address")
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let external = args.url.is_some();
    let url = args.url.clone().unwrap_or_else(in_process_server);
    let api = if args.chat {
        Api::Chat
    } else {
        Api::Completions
    };
    let target = Target {
        url,
        api,
        model: None,
        api_key: None,
        ignore_eos: true,
        request_timeout: Duration::from_secs(30),
        extra_body: Default::default(),
    };
    let workload = Workload {
        name: "throughput".into(),
        items: (0..64)
            .map(|i| WorkItem {
                prompt: Prompt::Text(format!("request {i} of the generator benchmark")),
                max_tokens: args.tokens,
                at: None,
                previous_turn: None,
                hash_ids: vec![],
            })
            .collect(),
    };
    let plan = RunPlan {
        shape: LoadShape::Concurrency(
            NonZeroUsize::new(args.concurrency.max(1)).unwrap_or(NonZeroUsize::MIN),
        ),
        seed: 0,
        max_requests: Some(args.requests),
        duration: None,
        max_in_flight: args.concurrency.max(1),
        follow_turns: false,
        first_item: 0,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let (cpu0, wall0) = (cpu_time(), Instant::now());
    let run = runtime.block_on(load::run(&target, &workload, &plan, &mut |_| {}));
    let (cpu, wall) = (cpu_time(), wall0.elapsed());
    let run = match run {
        Ok(r) => r,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    };
    let ok = run
        .outcomes
        .iter()
        .filter(|o| o.class() == Class::Ok)
        .count();
    let secs = run.duration.as_secs_f64();
    println!(
        "{} requests ({ok} completed, {} tokens each, {api}) at concurrency {} in {secs:.3} s: {:.0} req/s, {:.0} tokens/s",
        run.outcomes.len(),
        args.tokens,
        args.concurrency,
        ok as f64 / secs,
        (ok as f64 * f64::from(args.tokens)) / secs,
    );
    if let (Some(a), Some(b), true) = (cpu0, cpu, external) {
        let used = (b - a).as_secs_f64();
        println!(
            "generator CPU: {used:.2} s over {:.2} s wall ({:.0}% of a core), {:.1} us per request",
            wall.as_secs_f64(),
            100.0 * used / wall.as_secs_f64(),
            1e6 * used / run.outcomes.len().max(1) as f64
        );
    }
    let mut errors: Vec<_> = run.error_examples.iter().collect();
    errors.truncate(3);
    for (kind, example) in errors {
        println!("error {kind}: {example}");
    }
}
