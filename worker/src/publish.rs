//! What a worker's thread publishes after each turn of its loop, whatever its role.

use crate::load::LoadCell;
use crate::metrics::WorkerMetrics;
use kvmesh_common::kv_tier::{KvEventSink, Tier, TieredKvEvent};
use kvmesh_common::{LoadReport, NodeId};
use kvmesh_engine::block_pool::Held;
use kvmesh_engine::llm_engine::LlmEngine;
use kvmesh_engine::runner::ModelRunner;
use std::sync::Arc;

/// Publishes a worker's prefix-cache changes to its sink, and its load to its handles (from
/// which discovery and routers read it) and to its metrics.
pub struct LoadPublisher {
    node_id: NodeId,
    kv_events: Option<Arc<dyn KvEventSink>>,
    metrics: WorkerMetrics,
    /// The engine's preemption, step and token counts at the last publication (the metrics
    /// count the rest).
    last_preemptions: u64,
    last_steps: u64,
    last_tokens: u64,
}

impl LoadPublisher {
    /// `kv_events`: where the node announces its prefix-cache changes (none: not announced).
    pub fn new(
        node_id: NodeId,
        kv_events: Option<Arc<dyn KvEventSink>>,
        metrics: WorkerMetrics,
    ) -> Self {
        LoadPublisher {
            node_id,
            kv_events,
            metrics,
            last_preemptions: 0,
            last_steps: 0,
            last_tokens: 0,
        }
    }

    /// Called once as the worker's thread starts, before it takes requests: announces what
    /// the pool holds (a fresh engine's disk tier, or the warm cache of an engine taken over
    /// in a role switch), and counts the engine's running totals from where they are now.
    pub fn start<R: ModelRunner>(&mut self, engine: &mut LlmEngine<R>) {
        let pool = engine.scheduler().pool();
        self.last_preemptions = engine.scheduler().num_preemptions();
        self.last_steps = engine.steps_run();
        self.last_tokens = engine.tokens_generated();
        self.metrics.count_tiers_from(pool);
        let Some(sink) = &self.kv_events else {
            return;
        };
        let snapshot: Vec<TieredKvEvent> = pool
            .cached_hashes()
            .filter_map(|hash| {
                let tier = match pool.locate(hash)? {
                    Held::Device(_) => Tier::Device,
                    Held::Lower(tier) => tier,
                };
                Some(TieredKvEvent::stored(tier, hash))
            })
            .collect();
        // What the engine recorded so far (its disk tier) is in the snapshot.
        let _ = engine.drain_kv_events();
        if !snapshot.is_empty() {
            sink.publish(self.node_id, snapshot);
        }
    }

    /// Publishes `engine`'s state into `cell`; `pulling` requests wait for a pull (outside
    /// the engine) and count as waiting.
    pub fn publish<R: ModelRunner>(
        &mut self,
        engine: &mut LlmEngine<R>,
        pulling: usize,
        cell: &LoadCell,
    ) {
        if let Some(sink) = &self.kv_events {
            let events = engine.drain_kv_events();
            if !events.is_empty() {
                sink.publish(self.node_id, events);
            }
        }
        let s = engine.scheduler();
        let load = LoadReport {
            running: s.num_running() + s.num_awaiting_kv(),
            waiting: s.num_waiting() + pulling,
            kv_blocks_used: s.pool().num_used(),
            queued_prompt_tokens: s.queued_prompt_tokens(),
            steps: engine.step_totals(),
        };
        cell.publish(load);
        self.metrics.running.set(load.running as f64);
        self.metrics.waiting.set(load.waiting as f64);
        self.metrics.kv_blocks_used.set(load.kv_blocks_used as f64);
        self.metrics.observe_tiers(s.pool());
        let preemptions = s.num_preemptions();
        self.metrics
            .preemptions
            .increment(preemptions - self.last_preemptions);
        self.last_preemptions = preemptions;
        let (steps, tokens) = (engine.steps_run(), engine.tokens_generated());
        self.metrics.engine_steps.increment(steps - self.last_steps);
        self.metrics
            .generated_tokens
            .increment(tokens - self.last_tokens);
        (self.last_steps, self.last_tokens) = (steps, tokens);
    }
}
