//! Nodes that share a host's cores: the processor-sharing model behind running several
//! nodes on one machine (this repository's CPU mesh on a laptop or a two-core CI machine,
//! where four node processes take turns on two cores).
//!
//! A step's time from the [timing model](crate::timing) is its *work*: what it takes with
//! its threads to itself. While `k` nodes of a host have a step in flight, each advances at
//! `min(1, cores / (k * threads_per_node))` of that speed, so a host with as many cores as
//! its busy nodes need runs them as if alone and an oversubscribed one slows them all
//! equally, as the kernel's fair scheduler does. Every start or end of a step on a host
//! changes the speed of the others there: [`Hosts`] returns their new end times.

use std::collections::BTreeMap;
use std::time::Duration;

/// Which nodes share a host, and its cores.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SharedCpu {
    /// Cores of each host.
    pub cores: f64,
    /// Compute threads of each node (what its timing profile was measured with).
    pub threads_per_node: f64,
    /// Nodes `0..n` on the first host, the next `n` on the second, and so on (decode nodes,
    /// then prefill nodes, by id).
    pub nodes_per_host: usize,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum CpuError {
    #[error("a host needs a positive, finite number of cores and of threads per node")]
    BadCores,
    #[error("a host holds at least one node")]
    EmptyHost,
}

impl SharedCpu {
    pub fn validate(&self) -> Result<(), CpuError> {
        let positive = |x: f64| x.is_finite() && x > 0.0;
        if !positive(self.cores) || !positive(self.threads_per_node) {
            return Err(CpuError::BadCores);
        }
        if self.nodes_per_host == 0 {
            return Err(CpuError::EmptyHost);
        }
        Ok(())
    }
}

#[derive(Debug, Default)]
struct Host {
    /// Busy nodes and the work left of their steps, in nanoseconds at full speed.
    running: BTreeMap<usize, f64>,
    /// When `running` was last brought up to date.
    since: Duration,
}

/// The hosts of a mesh, each tracking the steps in flight on it.
#[derive(Debug)]
pub struct Hosts {
    config: SharedCpu,
    hosts: BTreeMap<usize, Host>,
}

impl Hosts {
    pub fn new(config: SharedCpu) -> Result<Hosts, CpuError> {
        config.validate()?;
        Ok(Hosts {
            config,
            hosts: BTreeMap::new(),
        })
    }

    fn host_of(&self, node: usize) -> usize {
        node / self.config.nodes_per_host
    }

    /// The speed of each busy node of a host with `busy` of them.
    fn speed(&self, busy: usize) -> f64 {
        (self.config.cores / (busy as f64 * self.config.threads_per_node)).min(1.0)
    }

    /// Brings a host's work left up to `now` at its current speed.
    fn advance(&mut self, host: usize, now: Duration) -> &mut Host {
        let speed = {
            let busy = self.hosts.get(&host).map_or(0, |h| h.running.len());
            self.speed(busy.max(1))
        };
        let h = self.hosts.entry(host).or_default();
        let done = now.saturating_sub(h.since).as_nanos() as f64 * speed;
        for left in h.running.values_mut() {
            *left = (*left - done).max(0.0);
        }
        h.since = now;
        h
    }

    /// When each step in flight on `host` ends at the speed it has from `now`.
    fn ends(&self, host: usize, now: Duration) -> Vec<(usize, Duration)> {
        let Some(h) = self.hosts.get(&host) else {
            return Vec::new();
        };
        let speed = self.speed(h.running.len().max(1));
        h.running
            .iter()
            .map(|(&node, &left)| {
                (
                    node,
                    now + Duration::from_nanos((left / speed).round() as u64),
                )
            })
            .collect()
    }

    /// `node` starts a step of `work` at `now`: the new end of every step in flight on its
    /// host, its own included.
    pub fn start(&mut self, node: usize, work: Duration, now: Duration) -> Vec<(usize, Duration)> {
        let host = self.host_of(node);
        self.advance(host, now)
            .running
            .insert(node, work.as_nanos() as f64);
        self.ends(host, now)
    }

    /// `node`'s step ended (or was cut short) at `now`: the new end of every other step in
    /// flight on its host.
    pub fn stop(&mut self, node: usize, now: Duration) -> Vec<(usize, Duration)> {
        let host = self.host_of(node);
        if self.advance(host, now).running.remove(&node).is_none() {
            return Vec::new();
        }
        self.ends(host, now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn hosts(cores: f64, nodes_per_host: usize) -> Hosts {
        Hosts::new(SharedCpu {
            cores,
            threads_per_node: 1.0,
            nodes_per_host,
        })
        .unwrap()
    }

    #[test]
    fn enough_cores_run_every_node_at_full_speed() {
        let mut h = hosts(2.0, 4);
        assert_eq!(h.start(0, 10 * MS, Duration::ZERO), [(0, 10 * MS)]);
        let ends = h.start(1, 10 * MS, 5 * MS);
        assert_eq!(ends, [(0, 10 * MS), (1, 15 * MS)]);
    }

    #[test]
    fn an_oversubscribed_host_shares_its_cores() {
        let mut h = hosts(1.0, 4);
        assert_eq!(h.start(0, 10 * MS, Duration::ZERO), [(0, 10 * MS)]);
        // From 4 ms node 0 has 6 ms of work left, shared with node 1's 10: both at half speed.
        let ends = h.start(1, 10 * MS, 4 * MS);
        assert_eq!(ends, [(0, 16 * MS), (1, 24 * MS)]);
        // Node 0 ends at 16 ms; node 1 has done 6 ms of its work and finishes alone.
        assert_eq!(h.stop(0, 16 * MS), [(1, 20 * MS)]);
        assert_eq!(h.stop(1, 20 * MS), []);
        assert_eq!(h.stop(1, 20 * MS), [], "a second stop changes nothing");
    }

    #[test]
    fn hosts_do_not_share_with_each_other() {
        let mut h = hosts(1.0, 2);
        h.start(0, 10 * MS, Duration::ZERO);
        // Node 2 is on the second host: node 0 keeps its speed.
        assert_eq!(h.start(2, 10 * MS, Duration::ZERO), [(2, 10 * MS)]);
        assert_eq!(
            h.start(1, 10 * MS, Duration::ZERO),
            [(0, 20 * MS), (1, 20 * MS)]
        );
    }

    #[test]
    fn threads_count_against_cores() {
        let mut h = Hosts::new(SharedCpu {
            cores: 2.0,
            threads_per_node: 2.0,
            nodes_per_host: 2,
        })
        .unwrap();
        h.start(0, 10 * MS, Duration::ZERO);
        assert_eq!(
            h.start(1, 10 * MS, Duration::ZERO),
            [(0, 20 * MS), (1, 20 * MS)]
        );
    }

    #[test]
    fn bad_hosts_are_refused() {
        let bad = |cores, threads, nodes_per_host| {
            Hosts::new(SharedCpu {
                cores,
                threads_per_node: threads,
                nodes_per_host,
            })
            .unwrap_err()
        };
        assert_eq!(bad(0.0, 1.0, 1), CpuError::BadCores);
        assert_eq!(bad(f64::NAN, 1.0, 1), CpuError::BadCores);
        assert_eq!(bad(1.0, 0.0, 1), CpuError::BadCores);
        assert_eq!(bad(1.0, 1.0, 0), CpuError::EmptyHost);
    }
}
