//! What the planner sees of a running mesh, from what the mesh already publishes: the nodes
//! and their load reports (etcd discovery), and the routers' Prometheus counters and
//! histograms, read twice and differenced over the interval between.
//!
//! Each node's queued prompt tokens are its load report's (prefill and decode nodes: a
//! decode node's local prefills are prefill work waiting too). Its report also carries its
//! engine steps' running totals; the [`Observer`] differences them between readings into one
//! sample per node, which the SLO policy's performance model refits to. The prefix hit rate
//! is the routers' cached prompt tokens over their prompt tokens (approximation, stated: a
//! request's prompt counts as it starts, its cached tokens as it ends).

use kvmesh_common::metrics as names;
use kvmesh_common::{NodeId, StepTotals};
use kvmesh_kvstore::NodeEntry;
use kvmesh_planner::{LatencyQuantiles, Observation, StepSample};
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

/// The router metrics the planner reads, summed over every router and label set.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RouterTotals {
    pub requests: f64,
    pub prompt_tokens: f64,
    pub cached_prompt_tokens: f64,
    pub generation_tokens: f64,
    /// Cumulative bucket counts by upper bound (`le`), as Prometheus exposes them.
    pub ttft: Histogram,
    pub itl: Histogram,
}

/// A cumulative histogram: count at or below each bound.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Histogram(BTreeMap<Bound, f64>);

/// A bucket's upper bound, ordered (`+Inf` last).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bound(pub f64);

impl Eq for Bound {}

impl PartialOrd for Bound {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Bound {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

impl Histogram {
    fn add(&mut self, le: f64, count: f64) {
        *self.0.entry(Bound(le)).or_default() += count;
    }

    /// The counts of `self` minus those of `before` (a later scrape minus an earlier one).
    fn since(&self, before: &Histogram) -> Histogram {
        Histogram(
            self.0
                .iter()
                .map(|(b, c)| (*b, (c - before.0.get(b).copied().unwrap_or(0.0)).max(0.0)))
                .collect(),
        )
    }

    /// The `q` quantile, interpolated linearly within its bucket (Prometheus'
    /// `histogram_quantile`); `None` without samples. A quantile in the `+Inf` bucket is the
    /// largest finite bound.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.0.values().copied().fold(0.0, f64::max);
        if total <= 0.0 {
            return None;
        }
        let rank = q * total;
        let mut lower = (0.0, 0.0);
        for (&Bound(le), &count) in &self.0 {
            if count >= rank {
                if le.is_infinite() {
                    return Some(lower.0);
                }
                let width = count - lower.1;
                let within = if width > 0.0 {
                    (rank - lower.1) / width
                } else {
                    1.0
                };
                return Some(lower.0 + (le - lower.0) * within);
            }
            lower = (le, count);
        }
        Some(lower.0)
    }
}

impl RouterTotals {
    /// What happened between an earlier reading `before` and this one (a router that
    /// restarted in between reads as having done nothing).
    pub fn since(&self, before: &RouterTotals) -> RouterTotals {
        RouterTotals {
            requests: (self.requests - before.requests).max(0.0),
            prompt_tokens: (self.prompt_tokens - before.prompt_tokens).max(0.0),
            cached_prompt_tokens: (self.cached_prompt_tokens - before.cached_prompt_tokens)
                .max(0.0),
            generation_tokens: (self.generation_tokens - before.generation_tokens).max(0.0),
            ttft: self.ttft.since(&before.ttft),
            itl: self.itl.since(&before.itl),
        }
    }

    /// Adds `other`'s counts (another router's).
    pub fn add(&mut self, other: &RouterTotals) {
        self.requests += other.requests;
        self.prompt_tokens += other.prompt_tokens;
        self.cached_prompt_tokens += other.cached_prompt_tokens;
        self.generation_tokens += other.generation_tokens;
        for (b, c) in &other.ttft.0 {
            self.ttft.add(b.0, *c);
        }
        for (b, c) in &other.itl.0 {
            self.itl.add(b.0, *c);
        }
    }

    /// Adds what one router's `/metrics` page says.
    pub fn add_page(&mut self, text: &str) {
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some((series, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(value) = value.trim().parse::<f64>() else {
                continue;
            };
            let (name, labels) = series.split_once('{').unwrap_or((series, ""));
            match name {
                names::ROUTER_REQUESTS_TOTAL => self.requests += value,
                names::ROUTER_PROMPT_TOKENS_TOTAL => self.prompt_tokens += value,
                names::ROUTER_PROMPT_CACHED_TOKENS_TOTAL => self.cached_prompt_tokens += value,
                names::ROUTER_GENERATION_TOKENS_TOTAL => self.generation_tokens += value,
                _ => {
                    let Some(histogram) = name.strip_suffix("_bucket").and_then(|h| {
                        (h == names::ROUTER_TTFT_SECONDS)
                            .then_some(&mut self.ttft)
                            .or((h == names::ROUTER_ITL_SECONDS).then_some(&mut self.itl))
                    }) else {
                        continue;
                    };
                    if let Some(le) = label(labels, "le").and_then(|v| v.parse().ok()) {
                        histogram.add(le, value);
                    }
                }
            }
        }
    }
}

/// The value of label `name` in `a="x",le="0.5"}`.
fn label<'a>(labels: &'a str, name: &str) -> Option<&'a str> {
    labels.trim_end_matches('}').split(',').find_map(|pair| {
        let (k, v) = pair.split_once('=')?;
        (k.trim() == name).then(|| v.trim().trim_matches('"'))
    })
}

/// The observation for an interval of `elapsed` in which the routers did `window` (the sum
/// of their [`RouterTotals::since`]), with the nodes as discovery lists them now.
///
/// `earlier` is the previous observation: when no request ended in this window (long
/// prompts, a short interval), its mean prompt and output lengths stand, so the SLO
/// policy's demand is not read as prompts of no length while the nodes work.
fn observation(
    prefill: &[NodeEntry],
    decode: &[NodeEntry],
    window: &RouterTotals,
    elapsed: Duration,
    earlier: Option<&Observation>,
) -> Observation {
    let requests = window.requests;
    let per_request = |total: f64, before: Option<f64>| {
        if requests > 0.0 {
            total / requests
        } else {
            before.unwrap_or(0.0)
        }
    };
    let mean_prompt_tokens =
        per_request(window.prompt_tokens, earlier.map(|o| o.mean_prompt_tokens));
    let mean_output_tokens = per_request(
        window.generation_tokens,
        earlier.map(|o| o.mean_output_tokens),
    );
    let prefix_hit_rate = if window.prompt_tokens > 0.0 {
        (window.cached_prompt_tokens / window.prompt_tokens).clamp(0.0, 1.0)
    } else {
        earlier.map_or(0.0, |o| o.prefix_hit_rate)
    };
    let quantiles = |h: &Histogram| {
        Some(LatencyQuantiles {
            p50: secs(h.quantile(0.5)?),
            p99: secs(h.quantile(0.99)?),
        })
    };
    Observation {
        arrival_rate: requests / elapsed.as_secs_f64().max(1e-3),
        mean_prompt_tokens,
        mean_output_tokens,
        prefix_hit_rate,
        prefill_queued_tokens: prefill
            .iter()
            .map(|n| n.load.queued_prompt_tokens)
            .collect(),
        decode_queued_prompt_tokens: decode.iter().map(|n| n.load.queued_prompt_tokens).collect(),
        decode_running: decode.iter().map(|n| n.load.running as u32).collect(),
        decode_kv_usage: decode
            .iter()
            .map(|n| n.load.kv_blocks_used as f64 / n.info.kv_blocks_total.max(1) as f64)
            .collect(),
        ttft: quantiles(&window.ttft),
        itl: quantiles(&window.itl),
        prefill_nodes: prefill.len() as u32,
        decode_nodes: decode.len() as u32,
        steps: Vec::new(),
    }
}

/// Observes a mesh reading after reading: what [`observation`] makes of each, with the steps
/// each node ran since the reading before (one [`StepSample`] per node that stepped).
#[derive(Default)]
pub struct Observer {
    earlier: Option<Observation>,
    /// Each node's step totals at the last reading.
    steps_seen: HashMap<NodeId, StepTotals>,
}

impl Observer {
    /// The observation of an interval of `elapsed` in which the routers did `window`, with
    /// the nodes as discovery lists them now.
    pub fn observe(
        &mut self,
        prefill: &[NodeEntry],
        decode: &[NodeEntry],
        window: &RouterTotals,
        elapsed: Duration,
    ) -> Observation {
        let mut obs = observation(prefill, decode, window, elapsed, self.earlier.as_ref());
        obs.steps = self.new_steps(prefill.iter().chain(decode));
        self.earlier = Some(obs.clone());
        obs
    }

    /// The steps each node ran since its last reading. A node seen for the first time, or
    /// counting from zero again (restarted), gives none this time: its totals start the count.
    fn new_steps<'a>(&mut self, nodes: impl Iterator<Item = &'a NodeEntry>) -> Vec<StepSample> {
        let mut seen = HashMap::with_capacity(self.steps_seen.len());
        let mut samples = Vec::new();
        for n in nodes {
            let now = n.load.steps;
            let before = self.steps_seen.get(&n.info.node_id);
            if let Some(new) = before.and_then(|b| now.since(b)).filter(|d| d.steps > 0) {
                samples.push(StepSample {
                    steps: new.steps,
                    prefill_tokens: new.prefill_tokens,
                    prefill_cached_tokens: new.prefill_cached_tokens,
                    decode_seqs: new.decode_seqs,
                    decode_context_tokens: new.decode_context_tokens,
                    duration: Duration::from_micros(new.micros),
                });
            }
            seen.insert(n.info.node_id, now);
        }
        self.steps_seen = seen;
        samples
    }
}

fn secs(s: f64) -> Duration {
    Duration::try_from_secs_f64(s.max(0.0)).unwrap_or(Duration::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvmesh_common::NodeRole;

    fn page(requests: f64, prompt: f64, output: f64, ttft: &[(&str, f64)]) -> String {
        let mut s = format!(
            "# HELP x\n{r}{{endpoint=\"chat\",status=\"200\"}} {a}\n{r}{{endpoint=\"completions\",status=\"429\"}} {b}\n{p} {prompt}\n{c} {cached}\n{g} {output}\n",
            r = names::ROUTER_REQUESTS_TOTAL,
            a = requests - 1.0,
            b = 1.0,
            p = names::ROUTER_PROMPT_TOKENS_TOTAL,
            c = names::ROUTER_PROMPT_CACHED_TOKENS_TOTAL,
            cached = prompt / 4.0,
            g = names::ROUTER_GENERATION_TOKENS_TOTAL,
        );
        for (le, c) in ttft {
            s += &format!(
                "{}_bucket{{endpoint=\"chat\",le=\"{le}\"}} {c}\n",
                names::ROUTER_TTFT_SECONDS
            );
        }
        s
    }

    fn node(role: NodeRole, running: usize, waiting: usize, used: usize, queued: u64) -> NodeEntry {
        let id = running as u64 * 100 + waiting as u64;
        let mut n = crate::planner::testing::node(id, role, running, waiting, used);
        n.load.queued_prompt_tokens = queued;
        n
    }

    #[test]
    fn two_readings_make_rates_means_and_quantiles_of_the_interval() {
        let mut before = RouterTotals::default();
        before.add_page(&page(
            10.0,
            1000.0,
            100.0,
            &[("0.1", 5.0), ("1", 10.0), ("+Inf", 10.0)],
        ));
        let mut after = RouterTotals::default();
        // 20 more requests, 4,000 prompt tokens, 600 output tokens; their TTFTs: 10 under
        // 0.1 s, 10 between 0.1 and 1 s.
        after.add_page(&page(
            30.0,
            5000.0,
            700.0,
            &[("0.1", 15.0), ("1", 30.0), ("+Inf", 30.0)],
        ));
        let prefill = [node(NodeRole::Prefill, 1, 3, 0, 950)];
        let decode = [
            node(NodeRole::Decode, 7, 0, 25, 0),
            node(NodeRole::Decode, 2, 0, 50, 120),
        ];
        let o = observation(
            &prefill,
            &decode,
            &after.since(&before),
            Duration::from_secs(10),
            None,
        );
        assert_eq!(o.arrival_rate, 2.0);
        assert_eq!(o.mean_prompt_tokens, 200.0);
        assert_eq!(o.mean_output_tokens, 30.0);
        // 1,000 of the window's 4,000 prompt tokens were cached.
        assert_eq!(o.prefix_hit_rate, 0.25);
        // Each node's queued prompt tokens as it reports them, whatever the mean prompt.
        assert_eq!(o.prefill_queued_tokens, vec![950]);
        assert_eq!(o.decode_queued_prompt_tokens, vec![0, 120]);
        assert_eq!(o.decode_running, vec![7, 2]);
        assert_eq!(o.decode_kv_usage, vec![0.25, 0.5]);
        assert_eq!((o.prefill_nodes, o.decode_nodes), (1, 2));
        let ttft = o.ttft.unwrap();
        // The median is the 10th of 20: the top of the first bucket.
        assert_eq!(ttft.p50, Duration::from_millis(100));
        // The p99 is 19.8 of 20: 98% of the way through the second bucket.
        assert!((ttft.p99.as_secs_f64() - (0.1 + 0.9 * 0.98)).abs() < 1e-9);
        assert!(o.itl.is_none(), "no ITL samples: no quantiles");

        // A window in which no request ended keeps the lengths seen before.
        let quiet = observation(
            &prefill,
            &decode,
            &after.since(&after),
            Duration::from_secs(1),
            Some(&o),
        );
        assert_eq!(quiet.arrival_rate, 0.0);
        assert_eq!(quiet.mean_prompt_tokens, 200.0);
        assert_eq!(quiet.mean_output_tokens, 30.0);
        assert_eq!(quiet.prefix_hit_rate, 0.25);
        assert_eq!(quiet.prefill_queued_tokens, vec![950]);
    }

    fn stepped(
        role: NodeRole,
        id: u64,
        steps: u64,
        prefill: u64,
        seqs: u64,
        micros: u64,
    ) -> NodeEntry {
        let mut n = crate::planner::testing::node(id, role, 0, 0, 0);
        n.load.steps = StepTotals {
            steps,
            prefill_tokens: prefill,
            prefill_cached_tokens: prefill / 2,
            decode_seqs: seqs,
            decode_context_tokens: 100 * seqs,
            micros,
        };
        n
    }

    #[test]
    fn each_node_gives_the_steps_it_ran_since_the_last_reading() {
        let mut observer = Observer::default();
        let idle = RouterTotals::default();
        let second = Duration::from_secs(1);
        let (p, d) = (NodeRole::Prefill, NodeRole::Decode);
        // First readings only start each node's count.
        let first = observer.observe(
            &[stepped(p, 1, 10, 5_000, 0, 900_000)],
            &[stepped(d, 2, 40, 0, 200, 400_000)],
            &idle,
            second,
        );
        assert!(first.steps.is_empty());

        let next = observer.observe(
            &[stepped(p, 1, 13, 6_200, 4, 1_300_000)],
            &[
                stepped(d, 2, 40, 0, 200, 400_000),
                stepped(d, 3, 5, 0, 5, 50_000),
            ],
            &idle,
            second,
        );
        // Node 1 stepped 3 times; node 2 did not step; node 3 is new.
        assert_eq!(
            next.steps,
            vec![StepSample {
                steps: 3,
                prefill_tokens: 1_200,
                prefill_cached_tokens: 600,
                decode_seqs: 4,
                decode_context_tokens: 400,
                duration: Duration::from_millis(400),
            }]
        );

        // Node 1 restarted (its totals went back), node 3 stepped, node 2 left.
        let after = observer.observe(
            &[stepped(p, 1, 2, 1_000, 0, 100_000)],
            &[stepped(d, 3, 9, 0, 13, 90_000)],
            &idle,
            second,
        );
        assert_eq!(after.steps.len(), 1);
        assert_eq!((after.steps[0].steps, after.steps[0].decode_seqs), (4, 8));
        // And counts from its new totals on.
        let last = observer.observe(&[stepped(p, 1, 3, 1_400, 0, 150_000)], &[], &idle, second);
        assert_eq!(
            (last.steps[0].steps, last.steps[0].prefill_tokens),
            (1, 400)
        );
        assert_eq!(last.steps[0].duration, Duration::from_millis(50));
    }

    #[test]
    fn a_quantile_past_the_last_finite_bound_is_that_bound() {
        let mut h = Histogram::default();
        h.add(0.5, 1.0);
        h.add(f64::INFINITY, 10.0);
        assert_eq!(h.quantile(0.99), Some(0.5));
        assert_eq!(Histogram::default().quantile(0.5), None);
    }
}
