//! The load generator's own CPU use over a run, so a report says when the generator, not the
//! server, may have been the bottleneck.
//!
//! The driver's hot path (sleeping to each send, reading every SSE stream, stamping each token)
//! runs on one event-loop thread, so the process's CPU time per wall second is, in effect, how
//! busy that thread was. Past [`GeneratorUse::SATURATION`] of one core, events queue behind one
//! another: with utilisation ρ a queue's mean wait grows as ρ/(1-ρ) service times (4 at 0.8,
//! 9 at 0.9), so token timestamps come late (TTFT and ITL read high) and sends slip behind
//! their schedule. The figure is process-wide: with work on other threads it over-states the
//! loop's share, which errs on the side of warning.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// This process's CPU time so far, user plus system (all threads), from `getrusage`; `None`
/// where the call fails.
pub fn process_cpu_time() -> Option<Duration> {
    // SAFETY: `getrusage` writes a `rusage` into the zeroed one we own; RUSAGE_SELF is valid.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        if libc::getrusage(libc::RUSAGE_SELF, &mut usage) != 0 {
            return None;
        }
        usage
    };
    let tv = |t: libc::timeval| {
        Duration::from_secs(t.tv_sec.max(0) as u64) + Duration::from_micros(t.tv_usec.max(0) as u64)
    };
    Some(tv(usage.ru_utime) + tv(usage.ru_stime))
}

/// A sample taken at the start of a run; [`CpuClock::stop`] at its end gives the use between.
#[derive(Clone, Copy, Debug)]
pub struct CpuClock {
    cpu: Option<Duration>,
    wall: Instant,
}

impl CpuClock {
    pub fn start() -> CpuClock {
        CpuClock {
            cpu: process_cpu_time(),
            wall: Instant::now(),
        }
    }

    /// The use since [`CpuClock::start`]; `None` where the CPU time could not be read.
    pub fn stop(&self) -> Option<GeneratorUse> {
        let cpu = process_cpu_time()?.checked_sub(self.cpu?)?;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Some(GeneratorUse::new(cpu, self.wall.elapsed(), cores))
    }
}

/// The generator's CPU use over a run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GeneratorUse {
    /// User plus system CPU time of the process over the run, in seconds.
    pub cpu_s: f64,
    /// The run's wall time, in seconds.
    pub wall_s: f64,
    /// `cpu_s / wall_s`: how many cores were busy on average (0 for no wall time).
    pub cores_busy: f64,
    /// The cores this process may run on.
    pub cores_available: usize,
}

impl GeneratorUse {
    /// The share of one core past which the event loop is taken to be near saturation (see the
    /// module's documentation).
    pub const SATURATION: f64 = 0.8;
    /// Runs shorter than this are not judged: their CPU time is mostly start-up (building
    /// bodies, the first connections), not the event loop keeping pace.
    pub const MIN_JUDGED_WALL_S: f64 = 1.0;

    pub fn new(cpu: Duration, wall: Duration, cores_available: usize) -> GeneratorUse {
        let (cpu_s, wall_s) = (cpu.as_secs_f64(), wall.as_secs_f64());
        GeneratorUse {
            cpu_s,
            wall_s,
            cores_busy: if wall_s > 0.0 { cpu_s / wall_s } else { 0.0 },
            cores_available,
        }
    }

    /// Whether the generator was busy enough to distort what it measured.
    pub fn near_saturation(&self) -> bool {
        self.wall_s >= Self::MIN_JUDGED_WALL_S && self.cores_busy > Self::SATURATION
    }

    /// A warning to print beside the results, where [`Self::near_saturation`].
    pub fn warning(&self) -> Option<String> {
        self.near_saturation().then(|| {
            format!(
                "warning: the load generator used {:.2} cores on average ({:.1} s CPU in {:.1} s; \
                 {} available), past {:.0}% of the one core its event loop runs on: its send \
                 times and token timestamps may lag, so latencies may read high and the offered \
                 rate low. Run it on a less loaded machine, or lower the load per generator.",
                self.cores_busy,
                self.cpu_s,
                self.wall_s,
                self.cores_available,
                Self::SATURATION * 100.0
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saturation_is_past_the_share_of_one_core() {
        let s = Duration::from_secs;
        let calm = GeneratorUse::new(s(4), s(10), 8);
        assert_eq!((calm.cpu_s, calm.wall_s, calm.cores_busy), (4.0, 10.0, 0.4));
        assert!(!calm.near_saturation());
        assert_eq!(calm.warning(), None);
        let at = GeneratorUse::new(s(8), s(10), 8);
        assert!(!at.near_saturation(), "the threshold itself is not past it");
        let busy = GeneratorUse::new(s(9), s(10), 8);
        assert!(busy.near_saturation());
        let blip = GeneratorUse::new(Duration::from_millis(97), Duration::from_millis(100), 8);
        assert!(!blip.near_saturation(), "too short a run to judge");
        let w = busy.warning().unwrap();
        assert!(w.contains("0.90 cores") && w.contains("past 80%"), "{w}");
        assert_eq!(GeneratorUse::new(s(1), Duration::ZERO, 1).cores_busy, 0.0);
    }

    #[test]
    fn the_clock_counts_this_process_spinning() {
        let clock = CpuClock::start();
        let before = process_cpu_time().unwrap();
        // Spin until this process has burnt 20 ms of CPU (however the machine schedules us).
        let mut x = 0u64;
        while process_cpu_time().unwrap() < before + Duration::from_millis(20) {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        let used = clock.stop().expect("getrusage works on this platform");
        assert!(used.cpu_s >= 0.02, "{used:?}");
        assert!(used.wall_s > 0.0 && used.cores_available >= 1, "{used:?}");
        assert_eq!(used.cores_busy, used.cpu_s / used.wall_s);
    }
}
