//! How long a decode node's stream may stay silent before the router takes the node as hung.
//!
//! A node that is stopped, wedged or cut off does not announce itself: its sockets stay
//! open and its streams just go quiet. Once a stream has delivered a token, its node owes
//! the next one within about a step (every running sequence gets a token per engine step),
//! so a silence many steps long means the node is not stepping. The step time is what the
//! router sees: the gaps between consecutive tokens of the node's streams, kept as a maximum
//! that decays (a slow step, say one with a long prefill chunk in it, raises the bound at
//! once; a quiet spell lowers it only gradually). The bound is
//! `max(min, steps x step time)`; past it the stream is dropped and the request migrates.
//!
//! Before a stream's first token there is no bound here: the first token waits for the
//! queue and the prompt's prefill, which no step time predicts. A node that is stopped or
//! cut off is caught then by HTTP/2 keepalive on the node channel
//! ([`kvmesh_common::grpc::KEEPALIVE_INTERVAL`]).
//!
//! Sans-IO: time comes in as `now`.

use kvmesh_common::NodeId;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// How the idle bound is set.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StreamIdleConfig {
    /// The least silence that counts as hung, however fast the node steps (it absorbs
    /// scheduling noise and a step that stalls on a prefill chunk).
    pub min: Duration,
    /// The bound in the node's step times.
    pub steps: u32,
    /// The step-time estimate halves over this long without a slower step.
    pub half_life: Duration,
}

impl Default for StreamIdleConfig {
    fn default() -> Self {
        StreamIdleConfig {
            min: Duration::from_secs(2),
            steps: 20,
            half_life: Duration::from_secs(10),
        }
    }
}

/// The step time of each decode node, as its streams show it.
#[derive(Debug, Default)]
pub struct StepTimes {
    config: StreamIdleConfig,
    /// Per node: the decayed maximum gap and when it was last raised or decayed.
    nodes: HashMap<NodeId, (Duration, Instant)>,
}

impl StepTimes {
    pub fn new(config: StreamIdleConfig) -> Self {
        StepTimes {
            config,
            nodes: HashMap::new(),
        }
    }

    /// A stream of `node` delivered a token `gap` after its previous one.
    pub fn observe(&mut self, node: NodeId, gap: Duration, now: Instant) {
        let decayed = self.step(node, now).unwrap_or_default();
        self.nodes.insert(node, (gap.max(decayed), now));
    }

    /// `node`'s step time now (`None` before any of its streams delivered two tokens).
    pub fn step(&self, node: NodeId, now: Instant) -> Option<Duration> {
        let &(gap, at) = self.nodes.get(&node)?;
        let age = now.saturating_duration_since(at).as_secs_f64();
        let half_life = self.config.half_life.as_secs_f64().max(f64::MIN_POSITIVE);
        Some(gap.mul_f64(0.5f64.powf(age / half_life)))
    }

    /// How long a stream of `node` that has delivered a token may now stay silent.
    pub fn idle_bound(&self, node: NodeId, now: Instant) -> Duration {
        let step = self.step(node, now).unwrap_or_default();
        self.config.min.max(step.saturating_mul(self.config.steps))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> StreamIdleConfig {
        StreamIdleConfig {
            min: Duration::from_secs(1),
            steps: 10,
            half_life: Duration::from_secs(10),
        }
    }

    #[test]
    fn the_bound_is_the_floor_until_steps_are_slow() {
        let t0 = Instant::now();
        let mut times = StepTimes::new(config());
        let node = NodeId(1);
        assert_eq!(times.idle_bound(node, t0), Duration::from_secs(1));
        times.observe(node, Duration::from_millis(20), t0);
        assert_eq!(times.idle_bound(node, t0), Duration::from_secs(1));
        // A slow node's bound follows its steps.
        times.observe(node, Duration::from_millis(400), t0);
        assert_eq!(times.idle_bound(node, t0), Duration::from_secs(4));
        // Faster steps after it do not lower it at once...
        times.observe(node, Duration::from_millis(20), t0);
        assert_eq!(times.step(node, t0), Some(Duration::from_millis(400)));
        // ...but it halves over the half-life.
        let later = t0 + Duration::from_secs(10);
        let step = times.step(node, later).unwrap();
        assert!(
            step.abs_diff(Duration::from_millis(200)) < Duration::from_millis(1),
            "{step:?}"
        );
        assert_eq!(times.idle_bound(NodeId(2), later), Duration::from_secs(1));
        assert_eq!(times.step(NodeId(2), later), None);
    }
}
