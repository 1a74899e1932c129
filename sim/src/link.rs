//! Link models: how long moving N bytes of KV between two nodes takes.
//!
//! A transfer costs `latency + bytes / bandwidth`. A [`Link`] is one direction between two
//! nodes and serves transfers first in, first out: a transfer starts when the link is free
//! and the previous one has left, so concurrent transfers queue behind each other rather
//! than sharing bandwidth (a single-stream model; RDMA queue pairs and a QUIC connection both
//! serialise a stream's bytes).
//!
//! The class figures are line rates, with a stated efficiency, not measurements: replace them
//! with measured values where a real mesh exists.

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// What connects two nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LinkClass {
    /// Two processes on one host: a copy through host memory.
    SameHost,
    Rdma25,
    Rdma50,
    Rdma100,
    Rdma400,
    /// Kernel TCP or QUIC over a 25 Gb/s datacenter NIC.
    Tcp,
}

/// A link's latency and usable bandwidth.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LinkModel {
    /// Paid once per transfer (setup, one-way propagation, completion).
    pub latency: Duration,
    pub bytes_per_s: f64,
}

/// RDMA reaches close to line rate on large messages; kernel TCP/QUIC with encryption less.
/// Both are assumptions, as are the latencies below (typical orders of magnitude: a few
/// microseconds for RDMA inside a rack, tens for kernel networking).
const RDMA_EFFICIENCY: f64 = 0.9;
const TCP_EFFICIENCY: f64 = 0.6;

fn gbit(rate: f64, efficiency: f64) -> f64 {
    rate * 1e9 / 8.0 * efficiency
}

impl LinkClass {
    /// Every class, by its name.
    pub const ALL: [(&'static str, LinkClass); 6] = [
        ("same_host", LinkClass::SameHost),
        ("rdma25", LinkClass::Rdma25),
        ("rdma50", LinkClass::Rdma50),
        ("rdma100", LinkClass::Rdma100),
        ("rdma400", LinkClass::Rdma400),
        ("tcp", LinkClass::Tcp),
    ];

    pub fn name(self) -> &'static str {
        let (name, _) = Self::ALL
            .iter()
            .find(|(_, c)| *c == self)
            .expect("every class is listed");
        name
    }

    pub fn model(self) -> LinkModel {
        let (latency_us, bytes_per_s) = match self {
            // Host memory copy: a few GB/s per stream is conservative for memcpy into pinned
            // buffers; the latency is a process wake-up.
            LinkClass::SameHost => (5, 10e9),
            LinkClass::Rdma25 => (3, gbit(25.0, RDMA_EFFICIENCY)),
            LinkClass::Rdma50 => (3, gbit(50.0, RDMA_EFFICIENCY)),
            LinkClass::Rdma100 => (3, gbit(100.0, RDMA_EFFICIENCY)),
            LinkClass::Rdma400 => (3, gbit(400.0, RDMA_EFFICIENCY)),
            LinkClass::Tcp => (50, gbit(25.0, TCP_EFFICIENCY)),
        };
        LinkModel {
            latency: Duration::from_micros(latency_us),
            bytes_per_s,
        }
    }
}

impl std::fmt::Display for LinkClass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for LinkClass {
    type Err = String;

    fn from_str(s: &str) -> Result<LinkClass, String> {
        Self::ALL
            .iter()
            .find(|(name, _)| *name == s)
            .map(|&(_, class)| class)
            .ok_or_else(|| {
                let names: Vec<_> = Self::ALL.iter().map(|(n, _)| *n).collect();
                format!("unknown link class `{s}` (one of {})", names.join(", "))
            })
    }
}

impl LinkModel {
    /// Time to move `bytes` on an idle link.
    pub fn transfer_time(&self, bytes: u64) -> Duration {
        let wire_ns = (bytes as f64 / self.bytes_per_s * 1e9).round() as u64;
        self.latency + Duration::from_nanos(wire_ns)
    }
}

/// One direction of one link, serving transfers in order.
#[derive(Clone, Debug)]
pub struct Link {
    model: LinkModel,
    /// When the last queued transfer finishes.
    busy_until: Duration,
    bytes_sent: u64,
}

/// When a queued transfer starts and ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transfer {
    pub start: Duration,
    pub done: Duration,
}

impl Link {
    pub fn new(model: LinkModel) -> Self {
        Link {
            model,
            busy_until: Duration::ZERO,
            bytes_sent: 0,
        }
    }

    pub fn model(&self) -> &LinkModel {
        &self.model
    }

    /// Transfers queued from now on move at `model`'s rate (a link that slowed down or
    /// recovered); those already queued keep their times.
    pub fn set_model(&mut self, model: LinkModel) {
        self.model = model;
    }

    /// Queues a transfer of `bytes` offered at `now`: it starts when the transfers queued
    /// before it are done.
    pub fn enqueue(&mut self, now: Duration, bytes: u64) -> Transfer {
        let start = now.max(self.busy_until);
        let done = start + self.model.transfer_time(bytes);
        self.busy_until = done;
        self.bytes_sent += bytes;
        Transfer { start, done }
    }

    pub fn bytes_sent(&self) -> u64 {
        self.bytes_sent
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn time_is_latency_plus_size_over_bandwidth() {
        let m = LinkModel {
            latency: Duration::from_micros(10),
            bytes_per_s: 1e9,
        };
        assert_eq!(m.transfer_time(0), Duration::from_micros(10));
        assert_eq!(m.transfer_time(1_000_000), Duration::from_micros(1010));
    }

    #[test]
    fn names_parse_back() {
        for (name, class) in LinkClass::ALL {
            assert_eq!(name.parse::<LinkClass>(), Ok(class));
            assert_eq!(class.to_string(), name);
        }
        let err = "rdma800".parse::<LinkClass>().unwrap_err();
        assert!(err.contains("rdma800") && err.contains("rdma400"), "{err}");
    }

    #[test]
    fn faster_classes_move_kv_sooner() {
        // 2 MiB: 16 blocks of 16 tokens at 128 KiB of KV a token... divided by 16.
        let bytes = 2 << 20;
        let t = |c: LinkClass| c.model().transfer_time(bytes);
        assert!(t(LinkClass::Rdma400) < t(LinkClass::Rdma100));
        assert!(t(LinkClass::Rdma100) < t(LinkClass::Rdma50));
        assert!(t(LinkClass::Rdma50) < t(LinkClass::Rdma25));
        assert!(t(LinkClass::Rdma25) < t(LinkClass::Tcp));
        // 100 Gb/s at 90%: 11.25 GB/s, so 2 MiB in about 186 us plus 3 us.
        let us = t(LinkClass::Rdma100).as_secs_f64() * 1e6;
        assert!((185.0..192.0).contains(&us), "{us}");
    }

    #[test]
    fn concurrent_transfers_queue_in_order() {
        let mut link = Link::new(LinkModel {
            latency: Duration::ZERO,
            bytes_per_s: 1e6,
        });
        // 1,000 bytes at 1 MB/s: 1 ms each.
        let a = link.enqueue(Duration::ZERO, 1000);
        let b = link.enqueue(Duration::ZERO, 1000);
        assert_eq!(
            a,
            Transfer {
                start: Duration::ZERO,
                done: MS
            }
        );
        assert_eq!(
            b,
            Transfer {
                start: MS,
                done: 2 * MS
            }
        );
        // Offered after the link went idle: starts at once.
        let c = link.enqueue(5 * MS, 1000);
        assert_eq!(
            c,
            Transfer {
                start: 5 * MS,
                done: 6 * MS
            }
        );
        assert_eq!(link.bytes_sent(), 3000);
    }
}
