//! A slow, lossy link: one decode node runs in its own network namespace, joined to the
//! rest of the mesh (etcd, a router, a prefill node and two more decode nodes, in the test's
//! namespace) by a veth pair. Midway through a steady stream of streamed requests, while the
//! slow node serves one of them, that link turns bad in both directions: a token bucket
//! (`tc … tbf`: a few Mbit/s and a short queue, so a prompt's KV takes seconds to arrive and
//! bursts past the queue are dropped), random loss and a fixed delay. Every request must still complete with its fault-free greedy
//! text, and the router must route around the slow node: while the link is bad it serves
//! fewer requests than either healthy decode node.
//!
//! Loss and delay are what `tc netem` adds, but netem is not in every kernel (not in the one
//! these machines run); netfilter is: iptables in the slow node's namespace drops a share of
//! the link's packets at random (`-m statistic`) and hands the rest to a queue (`NFQUEUE`)
//! that a thread of this test reads, letting each packet through [`DELAY`] after it came.
//!
//! Needs root, `ip`, `tc` (iproute2) and `iptables`, which scripts/setup.sh installs:
//! namespaces and the faults are part of the test, not optional. Prints the figures:
//! requests, lost, the longest stall, packets the throttle and the loss dropped and the queue
//! delayed, and each decode node's requests before and during the fault.

mod cluster;

use cluster::*;
use kvmesh_common::NodeRole;
use kvmesh_kvstore::EtcdServer;
use serde_json::{json, Value};
use std::net::{Ipv4Addr, SocketAddr};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const CLIENTS: usize = 4;
const MAX_TOKENS: u32 = 24;
/// Requests before the link turns bad, and while it is.
const BEFORE: usize = 12;
const DURING: usize = 36;
/// The throttle on each direction: 8 Mbit/s, a 16 KiB bucket, at most 20 ms of queue
/// (about 20 KB) before packets are dropped.
const THROTTLE: [&str; 7] = ["tbf", "rate", "8mbit", "burst", "16kb", "latency", "20ms"];
/// Each direction's random loss (a probability per packet) and delay.
const LOSS: &str = "0.03";
const DELAY: Duration = Duration::from_millis(25);
/// The netfilter queue the delayed packets wait in (in the slow node's namespace, so any
/// number is free).
const QUEUE: u16 = 7;
/// Requests clients may send in all (a bound, should the test fail midway).
const MAX_REQUESTS: usize = 200;

fn prompt(i: usize) -> String {
    let topic = ["ferns", "comets", "tea", "sailing", "deserts", "wolves"][i % 6];
    let line = format!("Item {i} concerns {topic}; it is written out at some length. ");
    format!(
        "{}Now write a long essay on {topic}.",
        line.repeat(3 + i % 4)
    )
}

fn body(i: usize, stream: bool) -> Value {
    json!({"model": MODEL_NAME, "prompt": prompt(i), "max_tokens": MAX_TOKENS,
           "temperature": 0, "stream": stream})
}

fn run(program: &str, args: &[&str]) {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program} runs (iproute2; scripts/setup.sh installs it): {e}"));
    assert!(
        out.status.success(),
        "{program} {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A network namespace joined to this one by a veth pair: `host` here, `inner` there.
struct Link {
    ns: String,
    host_if: String,
    inner_if: String,
    host: Ipv4Addr,
    inner: Ipv4Addr,
}

impl Link {
    fn create() -> Link {
        // Names and a /30 of their own per process, so runs never collide.
        let id = std::process::id();
        let (a, b) = (((id >> 8) % 250) as u8, ((id % 64) * 4) as u8);
        let link = Link {
            ns: format!("kvmesh-slow-{id}"),
            host_if: format!("kvs{id}h"),
            inner_if: format!("kvs{id}n"),
            host: Ipv4Addr::new(10, 231, a, b + 1),
            inner: Ipv4Addr::new(10, 231, a, b + 2),
        };
        link.remove();
        run("ip", &["netns", "add", &link.ns]);
        run(
            "ip",
            &[
                "link",
                "add",
                &link.host_if,
                "type",
                "veth",
                "peer",
                "name",
                &link.inner_if,
            ],
        );
        run("ip", &["link", "set", &link.inner_if, "netns", &link.ns]);
        run(
            "ip",
            &[
                "addr",
                "add",
                &format!("{}/30", link.host),
                "dev",
                &link.host_if,
            ],
        );
        run("ip", &["link", "set", &link.host_if, "up"]);
        let inner_addr = format!("{}/30", link.inner);
        for args in [
            vec!["addr", "add", &inner_addr, "dev", &link.inner_if],
            vec!["link", "set", &link.inner_if, "up"],
            vec!["link", "set", "lo", "up"],
        ] {
            let mut full = vec!["netns", "exec", &link.ns, "ip"];
            full.extend(args);
            run("ip", &full);
        }
        link
    }

    /// Runs `program args` in the link's namespace.
    fn inside(&self, program: &str, args: &[&str]) {
        let mut full = vec!["netns", "exec", &self.ns, program];
        full.extend(args);
        run("ip", &full);
    }

    /// Throttles both directions of the link, and makes them lose and delay packets: loss
    /// first, then the queue, on the slow node's side of each direction.
    fn degrade(&self) -> Delay {
        let mut host = vec!["qdisc", "add", "dev", &self.host_if, "root"];
        host.extend(THROTTLE);
        run("tc", &host);
        let mut inner = vec!["qdisc", "add", "dev", &self.inner_if, "root"];
        inner.extend(THROTTLE);
        self.inside("tc", &inner);
        let delay = Delay::start(&self.ns);
        let queue = QUEUE.to_string();
        for (chain, dir) in [("INPUT", "-i"), ("OUTPUT", "-o")] {
            let on_link = ["-w", "-A", chain, dir, &self.inner_if];
            let lose = ["-m", "statistic", "--mode", "random", "--probability", LOSS];
            self.inside("iptables", &[&on_link[..], &lose, &["-j", "DROP"]].concat());
            // --queue-bypass: should the reader be gone, packets pass rather than vanish.
            let hold = ["-j", "NFQUEUE", "--queue-num", &queue, "--queue-bypass"];
            self.inside("iptables", &[&on_link[..], &hold].concat());
        }
        delay
    }

    /// Lifts the throttles, the loss and the delay; returns the packets the loss dropped and
    /// those the queue delayed.
    fn restore(&self, delay: Delay) -> (u64, u64) {
        let lost = ["INPUT", "OUTPUT"]
            .map(|chain| self.loss_drops(chain))
            .iter()
            .sum();
        run("tc", &["qdisc", "del", "dev", &self.host_if, "root"]);
        self.inside("tc", &["qdisc", "del", "dev", &self.inner_if, "root"]);
        for chain in ["INPUT", "OUTPUT"] {
            self.inside("iptables", &["-w", "-F", chain]);
        }
        (lost, delay.stop())
    }

    /// Packets the random loss rule of `chain` dropped (its counter, `iptables -L -v -x`).
    fn loss_drops(&self, chain: &str) -> u64 {
        let out = Command::new("ip")
            .args([
                "netns", "exec", &self.ns, "iptables", "-w", "-n", "-v", "-x", "-L",
            ])
            .arg(chain)
            .output()
            .expect("iptables runs");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|line| line.contains("statistic"))
            .filter_map(|line| line.split_whitespace().next()?.parse::<u64>().ok())
            .sum()
    }

    /// Packets the throttles dropped, both directions.
    fn dropped(&self) -> u64 {
        let stats = |out: std::process::Output| -> u64 {
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            text.split("dropped ")
                .skip(1)
                .filter_map(|rest| rest.split(',').next()?.trim().parse::<u64>().ok())
                .sum()
        };
        let host = Command::new("tc")
            .args(["-s", "qdisc", "show", "dev", &self.host_if])
            .output()
            .expect("tc runs");
        let inner = Command::new("ip")
            .args([
                "netns", "exec", &self.ns, "tc", "-s", "qdisc", "show", "dev",
            ])
            .arg(&self.inner_if)
            .output()
            .expect("tc runs");
        stats(host) + stats(inner)
    }

    fn remove(&self) {
        // Deleting the namespace deletes its veth end, and with it the pair.
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).output();
        let _ = Command::new("ip")
            .args(["link", "del", &self.host_if])
            .output();
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.remove();
    }
}

/// The quickest of a few TCP handshakes with `addr` (one round trip each; the quickest, so a
/// lost SYN does not count).
fn handshake(addr: SocketAddr) -> Duration {
    (0..5)
        .filter_map(|_| {
            let start = Instant::now();
            std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5)).ok()?;
            Some(start.elapsed())
        })
        .min()
        .expect("the slow node accepts connections")
}

/// The thread that delays the packets iptables queues to [`QUEUE`] in a namespace: it reads
/// each one and gives the kernel its verdict (accept) [`DELAY`] after the packet arrived, in
/// arrival order, as a fixed netem delay would.
struct Delay {
    stop: std::sync::Arc<AtomicBool>,
    thread: std::thread::JoinHandle<std::io::Result<u64>>,
}

impl Delay {
    /// Starts reading the queue in namespace `ns`; returns once the queue is bound.
    fn start(ns: &str) -> Delay {
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let (ready, bound) = std::sync::mpsc::channel();
        let path = format!("/var/run/netns/{ns}");
        let thread = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let queue = enter_netns(&path).and_then(|()| open_queue());
                let failed = queue.as_ref().err().map(|e| e.to_string());
                ready.send(failed).expect("the test waits");
                delay_packets(queue?, &stop)
            })
        };
        if let Some(e) = bound.recv().expect("the delay thread reports") {
            panic!("cannot read netfilter queue {QUEUE} in {ns}: {e}");
        }
        Delay { stop, thread }
    }

    /// Lets every held packet go and ends the thread; panics if it failed.
    fn stop(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .join()
            .expect("the delay thread ends")
            .expect("the delay thread kept reading its queue")
    }
}

/// Moves the calling thread (only it) into the network namespace at `path`.
fn enter_netns(path: &str) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let ns = std::fs::File::open(path)?;
    // SAFETY: setns on a namespace file this function holds open; it changes the network
    // namespace of the calling thread only.
    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn open_queue() -> std::io::Result<nfq::Queue> {
    let mut queue = nfq::Queue::open()?;
    queue.bind(QUEUE)?;
    // Headers only: the verdict lets the kernel's own copy through.
    queue.set_copy_range(QUEUE, 0)?;
    queue.set_queue_max_len(QUEUE, 16384)?;
    queue.set_nonblocking(true);
    Ok(queue)
}

/// Holds each packet of `queue` for [`DELAY`] until `stop`; returns how many it delayed.
fn delay_packets(mut queue: nfq::Queue, stop: &AtomicBool) -> std::io::Result<u64> {
    let mut held: std::collections::VecDeque<(Instant, nfq::Message)> = Default::default();
    let mut delayed = 0;
    loop {
        let stopping = stop.load(Ordering::Relaxed);
        loop {
            match queue.recv() {
                Ok(packet) => held.push_back((Instant::now() + DELAY, packet)),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e),
            }
        }
        let now = Instant::now();
        while let Some((due, _)) = held.front() {
            if *due > now && !stopping {
                break;
            }
            let (_, mut packet) = held.pop_front().expect("a front");
            packet.set_verdict(nfq::Verdict::Accept);
            queue.verdict(packet)?;
            delayed += 1;
        }
        if stopping {
            return Ok(delayed);
        }
        // Packets arrive at any moment: look again within a millisecond (the delay's grain).
        let next = held.front().map_or(DELAY, |(due, _)| *due - now);
        std::thread::sleep(next.min(Duration::from_millis(1)));
    }
}

#[test]
fn the_mesh_routes_around_a_slow_lossy_link_and_loses_nothing() {
    let link = Link::create();
    let host = link.host.to_string();
    let etcd = EtcdServer::start_on(link.host).expect("etcd starts on the link's address");
    let logs = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("slow_link");
    std::fs::create_dir_all(&logs).unwrap();
    let log = |name: &str| logs.join(format!("{name}.log"));
    let endpoint = etcd.endpoint();
    let args = |role: &str, addr| {
        let mut a = mesh_args(role, addr, &endpoint, "slow");
        if role != "prefill" {
            a.extend(["--local-prefill-max-tokens".into(), "32".into()]);
        }
        a
    };
    // Everything in this namespace listens on the link's host address, which the slow node
    // can reach; the slow node listens on its own end.
    let router_addr = free_addr(&host);
    let prefill_addr = free_addr(&host);
    let decode_addrs = [free_addr(&host), free_addr(&host)];
    let slow_addr = SocketAddr::from((link.inner, free_addr(&host).port()));
    let _prefill = Node::spawn(args("prefill", prefill_addr), log("prefill"));
    let decode: Vec<Node> = (0..2)
        .map(|i| Node::spawn(args("decode", decode_addrs[i]), log(&format!("decode{i}"))))
        .collect();
    let slow = Node::spawn_in(Some(&link.ns), args("decode", slow_addr), log("slow"));
    let router = Node::spawn(args("router", router_addr), log("router"));

    let rt = tokio::runtime::Runtime::new().unwrap();
    let discovery = discovery(&rt, &etcd.endpoint(), "slow");
    rt.block_on(await_membership(&discovery, 1, 3, START_TIMEOUT));
    await_health(router_addr, &[&router, &decode[0], &decode[1], &slow]);

    let served =
        |addr: SocketAddr| rt.block_on(requests_served(&addr.to_string(), NodeRole::Decode));
    let all = [decode_addrs[0], decode_addrs[1], slow_addr];

    let progress = Progress::default();
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let outcomes: Mutex<Vec<(usize, Outcome)>> = Mutex::new(Vec::new());
    let (mut before, mut during) = ([0u64; 3], [0u64; 3]);
    let mut degraded_at = Instant::now();
    let mut delay = None;
    let mut round_trip = Duration::ZERO;
    std::thread::scope(|s| {
        for _ in 0..CLIENTS {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= MAX_REQUESTS || stop.load(Ordering::Relaxed) {
                    return;
                }
                let o = stream_completion(router_addr, &body(i, true));
                outcomes.lock().unwrap().push((i, o));
                progress.complete_one();
            });
        }
        // Should anything below fail, the clients stop too.
        let _stop = StopOnDrop(&stop);
        progress.wait_for(BEFORE, Duration::from_secs(300));
        // The link turns bad under a stream the slow node is serving.
        await_streaming(&rt, &[slow_addr], None);
        for (n, addr) in before.iter_mut().zip(all) {
            *n = served(addr);
        }
        delay = Some(link.degrade());
        degraded_at = Instant::now();
        round_trip = handshake(slow_addr);
        progress.wait_for(BEFORE + DURING, Duration::from_secs(600));
        for (n, addr) in during.iter_mut().zip(all) {
            *n = served(addr);
        }
        stop.store(true, Ordering::Relaxed);
    });
    for (d, b) in during.iter_mut().zip(before) {
        *d -= b;
    }

    let outcomes = outcomes.into_inner().unwrap();
    let dropped = link.dropped();
    // Each prompt is new to the mesh when sent (no decode node holds its prefix, so its KV
    // comes from the prefill node over the network); its fault-free text is the mesh's answer
    // once the link is healthy again.
    let (lost_packets, delayed) = link.restore(delay.expect("the link was degraded"));
    let reference = |i: usize| {
        let (status, v) = post(router_addr, "/v1/completions", &body(i, false));
        assert_eq!(status, 200, "reference {i}: {v}");
        v["choices"][0]["text"].as_str().unwrap().to_string()
    };
    let mut lost = Vec::new();
    for (i, o) in &outcomes {
        let expected = &reference(*i);
        if o.status != 200 || o.error.is_some() || o.finish.is_none() || o.text != *expected {
            lost.push(format!(
                "request {i}: status {} error {:?} finish {:?}\n  got:      {:?}\n  expected: {:?}",
                o.status, o.error, o.finish, o.text, expected
            ));
        }
    }
    let stall = outcomes
        .iter()
        .flat_map(|(_, o)| o.events.windows(2).map(|w| w[1] - w[0]))
        .max()
        .unwrap_or_default();
    println!(
        "slow link: {} requests, lost {}, longest stall {:.3} s; each way {}, loss {LOSS}, \
         delay {DELAY:?}: the throttle dropped {dropped} packets, the loss {lost_packets}, \
         {delayed} were delayed",
        outcomes.len(),
        lost.len(),
        stall.as_secs_f64(),
        THROTTLE.join(" ")
    );
    println!("slow link: a TCP handshake with the slow node took {round_trip:?} on the bad link");
    println!(
        "slow link: requests per decode node before the fault {before:?}, during it {during:?} \
         (the last is the slow node; {:.1} s of fault)",
        degraded_at.elapsed().as_secs_f64()
    );
    assert!(
        lost.is_empty(),
        "lost or changed requests:\n{}",
        lost.join("\n")
    );
    assert!(
        lost_packets > 0 && delayed > 0,
        "the link lost {lost_packets} and delayed {delayed} packets"
    );
    assert!(
        round_trip >= 2 * DELAY,
        "a TCP handshake with the slow node took {round_trip:?} on the bad link"
    );
    assert!(
        before[2] > 0,
        "the slow node served nothing even before its link went bad: {before:?}"
    );
    assert!(
        during[2] < during[0].min(during[1]),
        "the router did not route around the slow node: {during:?}"
    );
}
