//! Overload against the real `kvmesh serve` and the real model: measure the unloaded TTFT and
//! the capacity, then offer ten times the capacity for a bounded time. Excess must get 429
//! with `Retry-After`, admitted requests' p99 TTFT must stay within 2x the unloaded p99 (in one
//! of up to four runs, leaving out requests that stalls of the machine overlapped: see
//! `OVERLOAD_TRIES` and `stall_probe`), every admitted request must complete, and the server's
//! RSS must stay bounded.

use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const START_TIMEOUT: Duration = Duration::from_secs(120);
const MAX_TOKENS: u32 = 4;
/// The unloaded phase: up to this many sequential requests, or fewer on a slow machine (at
/// least `UNLOADED_MIN`, then until `UNLOADED_TIME` is spent).
const UNLOADED_REQUESTS: usize = 40;
const UNLOADED_MIN: usize = 8;
const UNLOADED_TIME: Duration = Duration::from_secs(6);
const CAPACITY_CLIENTS: usize = 6;
const CAPACITY_TIME: Duration = Duration::from_secs(4);
const OVERLOAD: f64 = 10.0;
const OVERLOAD_TIME: Duration = Duration::from_secs(10);
/// The overload phase is a latency measurement on a shared machine: one stall of the whole
/// machine (CPU throttling, a neighbour) during it can push the p99 of a few hundred
/// admitted requests past the bound whatever admission does. So the latency bound must hold
/// in one of this many runs (without admission control it misses by 100x in every one);
/// every other assertion holds in each.
const OVERLOAD_TRIES: usize = 4;
/// Growth of the server's RSS over its warmed-up baseline that overload may cause.
const RSS_GROWTH_BOUND_KIB: u64 = 256 * 1024;

/// A `kvmesh serve` process; its log lines are kept (the last few, for failures).
struct Server {
    child: Child,
    addr: SocketAddr,
    log: Arc<Mutex<Vec<String>>>,
}

impl Server {
    /// Starts `kvmesh serve` with `args` on a free port and returns once it listens.
    fn start(args: &[&str]) -> Server {
        let addr = kvmesh_common::net::free_addr("127.0.0.1").unwrap();
        // One compute thread: on a 2-core machine the other core is left to HTTP and to
        // this test's load generator, which would otherwise preempt the engine's threads
        // and measure its own CPU starvation rather than queueing.
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvmesh"))
            .args(["serve", "--threads", "1", "--listen", &addr.to_string()])
            .args(args)
            .env("KVMESH_LOG", "info")
            .env_remove("KVMESH_DECODE_WORKERS")
            .env_remove("KVMESH_CONFIG")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("kvmesh starts");
        let log = Arc::new(Mutex::new(Vec::new()));
        let (listening_tx, listening) = mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        let lines = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if line.contains("serving the OpenAI API") {
                    let _ = listening_tx.send(());
                }
                let mut lines = lines.lock().unwrap();
                lines.push(line);
                if lines.len() > 200 {
                    lines.drain(..100);
                }
            }
        });
        let server = Server { child, addr, log };
        // The log line comes once the listener is bound (or never: the process died).
        if listening.recv_timeout(START_TIMEOUT).is_err() {
            panic!("kvmesh serve did not start:\n{}", server.log_tail());
        }
        server
    }

    fn log_tail(&self) -> String {
        let lines = self.log.lock().unwrap();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    fn rss_kib(&self) -> u64 {
        rss_kib(self.child.id())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// CPU time (user + system) process `pid` ("self" for this one) has used so far.
fn cpu_time(pid: &str) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The fields after the parenthesised command name; utime and stime are the 12th and 13th.
    let ticks: u64 = stat
        .rsplit_once(')')
        .map_or("", |(_, rest)| rest)
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|f| f.parse::<u64>().ok())
        .sum();
    // In clock ticks of 1/100 s (USER_HZ).
    Duration::from_millis(ticks * 10)
}

/// How long this container's cgroup has been CPU-throttled (cgroup v2 or v1), if it says.
fn throttled() -> Option<Duration> {
    let field = |path: &str, name: &str| -> Option<u64> {
        let stat = std::fs::read_to_string(path).ok()?;
        stat.lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
    };
    field("/sys/fs/cgroup/cpu.stat", "throttled_usec ")
        .map(Duration::from_micros)
        .or_else(|| {
            field("/sys/fs/cgroup/cpu/cpu.stat", "throttled_time ").map(Duration::from_nanos)
        })
}

/// VmRSS of `pid` in KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// What one streamed completion request saw.
#[derive(Debug)]
struct Outcome {
    status: u16,
    retry_after: Option<u64>,
    /// Time from connecting to the first token (streamed 200s).
    ttft: Option<Duration>,
    /// A 200 stream that ended with `[DONE]` and no error event.
    completed: bool,
    /// The JSON body of a non-200.
    error: Option<Value>,
    /// Time from connecting to the HTTP head.
    head: Option<Duration>,
    /// Sent or waiting for its first token during a stall of the machine (see
    /// [`stall_probe`]).
    stalled: bool,
}

/// A short prompt, different per request (shorter than one KV block, so nothing is cached).
fn body(i: usize) -> String {
    let topic = ["rivers", "the moon", "bread", "chess", "volcanoes", "owls"][i % 6];
    json!({
        "prompt": format!("Fact {i} about {topic}:"),
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": true,
        "stream": true,
    })
    .to_string()
}

/// POSTs a streamed completion over HTTP/1.1 and reads the whole answer.
async fn complete(addr: SocketAddr, body: &str) -> std::io::Result<Outcome> {
    let started = Instant::now();
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(request.as_bytes()).await?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let mut head_len = None;
    let mut head_at = None;
    let mut ttft = None;
    loop {
        let n = s.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
        if head_len.is_none() {
            head_len = find(&buf, b"\r\n\r\n").map(|i| i + 4);
            head_at = head_len.map(|_| started.elapsed());
        }
        if let (Some(h), None) = (head_len, ttft) {
            if find(&buf[h..], b"data: {").is_some() {
                ttft = Some(started.elapsed());
            }
        }
    }
    let head_len = head_len.ok_or_else(|| std::io::Error::other("no HTTP head"))?;
    let head = String::from_utf8_lossy(&buf[..head_len]).to_lowercase();
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other("no status"))?;
    let retry_after = head
        .lines()
        .find_map(|l| l.strip_prefix("retry-after:"))
        .and_then(|v| v.trim().parse().ok());
    let rest = &buf[head_len..];
    Ok(Outcome {
        status,
        retry_after,
        ttft: ttft.filter(|_| status == 200),
        completed: status == 200
            && find(rest, b"data: [DONE]").is_some()
            && find(rest, b"\"error\"").is_none(),
        error: (status != 200).then(|| serde_json::from_slice(rest).unwrap_or(Value::Null)),
        head: head_at,
        stalled: false,
    })
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn percentile(mut v: Vec<Duration>, p: f64) -> Duration {
    assert!(!v.is_empty());
    v.sort();
    let i = ((v.len() as f64 * p).ceil() as usize).clamp(1, v.len()) - 1;
    v[i]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Sequential requests (`count` of them, or fewer once `time` is spent and `min` are done):
/// the TTFTs of an idle server.
async fn unloaded_ttfts(
    addr: SocketAddr,
    count: usize,
    min: usize,
    time: Duration,
    from: usize,
) -> Vec<Duration> {
    let start = Instant::now();
    let mut ttfts = Vec::new();
    while ttfts.len() < count && (ttfts.len() < min || start.elapsed() < time) {
        let o = complete(addr, &body(from + ttfts.len()))
            .await
            .expect("a response");
        assert!(o.completed, "unloaded request failed: {o:?}");
        ttfts.push(o.ttft.unwrap());
    }
    ttfts
}

/// Completed requests per second with `clients` closed-loop clients.
async fn capacity(addr: SocketAddr, clients: usize, time: Duration) -> f64 {
    let done = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let done = done.clone();
            tokio::spawn(async move {
                let mut i = 0;
                while start.elapsed() < time {
                    let o = complete(addr, &body(1000 + c * 10_000 + i)).await.unwrap();
                    assert!(o.completed, "capacity request failed: {o:?}");
                    done.fetch_add(1, Ordering::Relaxed);
                    i += 1;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64()
}

/// A stall at least this long is the machine's, not the server's: the requests it overlaps
/// are left out of the latency bound.
const STALL: Duration = Duration::from_millis(40);

/// Time the hypervisor took from each CPU of this virtual machine (`steal` in /proc/stat, in
/// ticks of 1/100 s); empty where the kernel does not count it.
fn steal_per_cpu() -> Vec<Duration> {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    stat.lines()
        .filter(|l| l.starts_with("cpu") && !l.starts_with("cpu "))
        .filter_map(|l| l.split_whitespace().nth(8)?.parse::<u64>().ok())
        .map(|ticks| Duration::from_millis(ticks * 10))
        .collect()
}

/// Watches for stalls of the machine: a thread that wakes every few milliseconds, notes when
/// it woke `STALL` or more late (this process was not run) and when a CPU's steal time grew
/// by `STALL` or more (the hypervisor ran something else on it, stalling whatever thread of
/// the server was there). Returns the stalls as intervals since `start`.
fn stall_probe(
    start: Instant,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<Vec<(Duration, Duration)>> {
    std::thread::spawn(move || {
        let mut stalls = Vec::new();
        let mut steal = steal_per_cpu();
        while !stop.load(Ordering::Relaxed) {
            let before = start.elapsed();
            // A measurement cadence, not synchronisation.
            std::thread::sleep(Duration::from_millis(5));
            let after = start.elapsed();
            let now = steal_per_cpu();
            let stolen = now
                .iter()
                .zip(&steal)
                .map(|(n, b)| n.saturating_sub(*b))
                .max()
                .unwrap_or_default();
            steal = now;
            if after - before >= STALL {
                stalls.push((before, after));
            } else if stolen >= STALL {
                // Counted when the CPU ran again: it was away for the `stolen` before.
                stalls.push((after.saturating_sub(stolen), after));
            }
        }
        stalls
    })
}

/// Samples the RSS of `pid` every 50 ms until `stop`; returns the peak.
fn rss_sampler(pid: u32, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let mut peak = 0;
        while !stop.load(Ordering::Relaxed) {
            peak = peak.max(rss_kib(pid));
            // A measurement cadence, not synchronisation.
            std::thread::sleep(Duration::from_millis(50));
        }
        peak.max(rss_kib(pid))
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_times_capacity_is_shed_with_429_and_admitted_requests_keep_their_latency() {
    let test_start = Instant::now();

    // 1. The server without admission control: unloaded TTFT and capacity.
    let (unloaded, capacity) = {
        let server = Server::start(&["--ttft-target", "0s"]);
        unloaded_ttfts(server.addr, 2, 2, Duration::ZERO, 0).await; // warm-up
        let unloaded = unloaded_ttfts(
            server.addr,
            UNLOADED_REQUESTS,
            UNLOADED_MIN,
            UNLOADED_TIME,
            100,
        )
        .await;
        let capacity = capacity(server.addr, CAPACITY_CLIENTS, CAPACITY_TIME).await;
        (unloaded, capacity)
    };
    let unloaded_count = unloaded.len();
    let p50_unloaded = percentile(unloaded.clone(), 0.5);
    let p99_unloaded = percentile(unloaded, 0.99);
    println!(
        "overload: capacity {capacity:.1} req/s; TTFT unloaded ({unloaded_count} requests) \
         p50 {:.1} ms p99 {:.1} ms",
        ms(p50_unloaded),
        ms(p99_unloaded)
    );

    // 2. The same server with a TTFT target under twice the unloaded p99.
    let target = p99_unloaded.mul_f64(1.5);
    let target_arg = format!("{}us", target.as_micros());
    let server = Server::start(&["--ttft-target", &target_arg]);
    // Warm-up; also gives admission control its first samples.
    unloaded_ttfts(server.addr, 3, 3, Duration::ZERO, 200).await;
    let baseline_rss = server.rss_kib();

    // 3. Offer ten times the capacity, open loop, for a bounded time.
    let rate = capacity * OVERLOAD;
    for attempt in 1..=OVERLOAD_TRIES {
        let run = overload(&server, rate).await;
        let count = run.outcomes.len();
        let admitted: Vec<&Outcome> = run.outcomes.iter().filter(|o| o.status == 200).collect();
        let rejected: Vec<&Outcome> = run.outcomes.iter().filter(|o| o.status == 429).collect();
        // The bound is on what the server controls: requests the machine's stalls overlapped
        // (see `stall_probe`) are left out of it, and a run where they are many does not
        // count.
        let ttfts: Vec<Duration> = admitted
            .iter()
            .filter(|o| !o.stalled)
            .filter_map(|o| o.ttft)
            .collect();
        let stalled = admitted.len() - ttfts.len();
        // Every one stalled: no measurement, a run that does not count.
        let (p50_loaded, p99_loaded) = if ttfts.is_empty() {
            (Duration::MAX, Duration::MAX)
        } else {
            (percentile(ttfts.clone(), 0.5), percentile(ttfts, 0.99))
        };
        println!(
            "overload run {attempt}: offered {rate:.1} req/s for {:.1} s ({count} requests), \
             admitted {} ({:.1} req/s), rejected {} (429); TTFT target {:.1} ms, loaded \
             p50 {:.1} ms p99 {:.1} ms (slowest: {}); CPU used by the server {:.1} s, by \
             the load generator {:.1} s, throttled {}; the machine stalled {} times ({}), \
             {stalled} admitted requests overlapping; RSS baseline {} MiB, peak {} MiB; all \
             answered after {:.1} s, test {:.1} s",
            run.offered_for.as_secs_f64(),
            admitted.len(),
            admitted.len() as f64 / run.offered_for.as_secs_f64(),
            rejected.len(),
            ms(target),
            ms(p50_loaded),
            ms(p99_loaded),
            run.slowest,
            run.server_cpu.as_secs_f64(),
            run.own_cpu.as_secs_f64(),
            run.throttled
                .map_or("unknown".into(), |t| format!("{:.0} ms", ms(t))),
            run.stalls.len(),
            run.stalls.join(", "),
            baseline_rss / 1024,
            run.peak_rss / 1024,
            run.drained.as_secs_f64(),
            test_start.elapsed().as_secs_f64(),
        );

        // Only admitted or refused, nothing else (no 5xx, no 503).
        assert_eq!(
            admitted.len() + rejected.len(),
            count,
            "unexpected answers: {:?}\n{}",
            run.outcomes
                .iter()
                .filter(|o| o.status != 200 && o.status != 429)
                .take(5)
                .collect::<Vec<_>>(),
            server.log_tail()
        );
        assert!(
            rejected.len() > count / 2,
            "ten times the capacity, yet most requests were admitted"
        );
        assert!(
            admitted.len() as f64 >= capacity * OVERLOAD_TIME.as_secs_f64() / 4.0,
            "admission control shed too much: {} admitted",
            admitted.len()
        );
        for r in &rejected {
            assert!(r.retry_after.is_some_and(|s| s >= 1), "{r:?}");
            let err = &r.error.as_ref().unwrap()["error"];
            assert_eq!(err["code"], "overloaded", "{r:?}");
            assert!(err["message"].is_string(), "{r:?}");
        }
        let incomplete: Vec<_> = admitted.iter().filter(|o| !o.completed).collect();
        assert!(
            incomplete.is_empty(),
            "{} admitted requests did not complete, e.g. {:?}",
            incomplete.len(),
            incomplete.first()
        );
        assert!(
            run.peak_rss <= baseline_rss + RSS_GROWTH_BOUND_KIB,
            "RSS grew from {baseline_rss} KiB to {} KiB",
            run.peak_rss
        );
        if p99_loaded <= p99_unloaded * 2 && stalled <= admitted.len() / 10 {
            return;
        }
        assert!(
            attempt < OVERLOAD_TRIES,
            "admitted p99 TTFT {:.1} ms is over twice the unloaded p99 {:.1} ms, or stalls of \
             the machine overlapped over a tenth of the admitted requests, in all \
             {OVERLOAD_TRIES} runs",
            ms(p99_loaded),
            ms(p99_unloaded)
        );
    }
}

/// What one overload run saw.
struct OverloadRun {
    outcomes: Vec<Outcome>,
    /// How long offering the load took, and answering all of it.
    offered_for: Duration,
    drained: Duration,
    /// The slowest admitted requests' TTFT and when they were sent: a tail at the start
    /// reads differently from one spread over the run.
    slowest: String,
    server_cpu: Duration,
    own_cpu: Duration,
    /// How long the machine's cgroup was CPU-throttled meanwhile: stalls of every process.
    throttled: Option<Duration>,
    peak_rss: u64,
    /// The machine's stalls (see [`stall_probe`]).
    stalls: Vec<String>,
}

/// Offers `rate` requests/s to `server` for `OVERLOAD_TIME`, open loop, and waits for every
/// answer.
async fn overload(server: &Server, rate: f64) -> OverloadRun {
    let addr = server.addr;
    let count = (rate * OVERLOAD_TIME.as_secs_f64()).ceil() as usize;
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = rss_sampler(server.child.id(), stop.clone());
    let server_pid = server.child.id().to_string();
    let cpu_before = (cpu_time(&server_pid), cpu_time("self"), throttled());
    let start = tokio::time::Instant::now();
    let probe = stall_probe(start.into_std(), stop.clone());
    let mut tasks = Vec::with_capacity(count);
    for i in 0..count {
        // Pacing the offered load (an open-loop generator), not waiting for an event.
        tokio::time::sleep_until(start + Duration::from_secs_f64(i as f64 / rate)).await;
        let sent = start.elapsed();
        let body = body(10_000 + i);
        tasks.push(tokio::spawn(async move {
            complete(addr, &body).await.map(|o| (sent, o))
        }));
    }
    let offered_for = start.elapsed();
    let mut sent_outcomes = Vec::with_capacity(count);
    for t in tasks {
        sent_outcomes.push(t.await.unwrap().expect("every request gets an HTTP answer"));
    }
    let drained = start.elapsed();
    let server_cpu = cpu_time(&server_pid) - cpu_before.0;
    let own_cpu = cpu_time("self") - cpu_before.1;
    let throttled = throttled()
        .zip(cpu_before.2)
        .map(|(after, before)| after.saturating_sub(before));
    stop.store(true, Ordering::Relaxed);
    let peak_rss = sampler.join().unwrap();
    let stalls = probe.join().unwrap();
    for (sent, o) in &mut sent_outcomes {
        let end = *sent + o.ttft.or(o.head).unwrap_or_default();
        o.stalled = stalls.iter().any(|&(from, to)| from < end && *sent < to);
    }
    let stalls = stalls
        .iter()
        .map(|(from, to)| format!("{:.0} ms at {:.2} s", ms(*to - *from), from.as_secs_f64()))
        .collect::<Vec<_>>();
    let mut slowest: Vec<(Duration, Duration)> = sent_outcomes
        .iter()
        .filter_map(|(sent, o)| Some((o.ttft?, *sent)))
        .collect();
    slowest.sort_by(|a, b| b.cmp(a));
    let slowest = slowest
        .iter()
        .take(4)
        .map(|(ttft, sent)| format!("{:.0} ms at {:.2} s", ms(*ttft), sent.as_secs_f64()))
        .collect::<Vec<_>>()
        .join(", ");
    let mut slow_429: Vec<(Duration, Duration)> = sent_outcomes
        .iter()
        .filter(|(_, o)| o.status == 429)
        .filter_map(|(sent, o)| Some((o.head?, *sent)))
        .collect();
    slow_429.sort_by(|a, b| b.cmp(a));
    let slowest = format!(
        "{slowest}; slowest 429s: {}",
        slow_429
            .iter()
            .take(4)
            .map(|(t, sent)| format!("{:.0} ms at {:.2} s", ms(*t), sent.as_secs_f64()))
            .collect::<Vec<_>>()
            .join(", ")
    );
    OverloadRun {
        stalls,
        outcomes: sent_outcomes.into_iter().map(|(_, o)| o).collect(),
        offered_for,
        drained,
        slowest,
        server_cpu,
        own_cpu,
        throttled,
        peak_rss,
    }
}
