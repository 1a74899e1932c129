//! What a node process exports to Prometheus beyond its workers' metrics: the prefix index's
//! publishing (nodes) and watching (routers), and a `/metrics` endpoint for node processes,
//! which have no HTTP server of their own.

use kvmesh_common::metrics as names;
use kvmesh_common::NodeId;
use kvmesh_kvstore::{EtcdPrefixIndex, PrefixIndex, PublisherStats};
use kvmesh_worker::metrics::TotalCounter;
use metrics::{counter, describe_counter, describe_gauge, gauge, Gauge};
use std::net::SocketAddr;

fn total_counter(name: &'static str, help: &'static str, node: NodeId) -> TotalCounter {
    describe_counter!(name, help);
    TotalCounter::new(counter!(name, "node" => node.to_string()))
}

fn node_gauge(name: &'static str, help: &'static str, node: NodeId) -> Gauge {
    describe_gauge!(name, help);
    gauge!(name, "node" => node.to_string())
}

/// One node's KV-event publishing.
pub struct PublisherMetrics {
    events: TotalCounter,
    etcd_writes: TotalCounter,
    write_failures: TotalCounter,
    held_blocks: Gauge,
}

impl PublisherMetrics {
    pub fn new(node: NodeId) -> Self {
        PublisherMetrics {
            events: total_counter(
                names::KV_EVENTS_PUBLISHED_TOTAL,
                "KV events published",
                node,
            ),
            etcd_writes: total_counter(
                names::KV_ETCD_WRITES_TOTAL,
                "etcd writes of the prefix index",
                node,
            ),
            write_failures: total_counter(
                names::KV_ETCD_WRITE_FAILURES_TOTAL,
                "failed etcd writes of the prefix index",
                node,
            ),
            held_blocks: node_gauge(names::KV_HELD_BLOCKS, "KV blocks this node announces", node),
        }
    }

    /// Catches up with `s` (running totals).
    pub fn update(&mut self, s: &PublisherStats) {
        self.events.catch_up(s.events_published);
        self.etcd_writes.catch_up(s.etcd_writes);
        self.write_failures.catch_up(s.write_failures);
        self.held_blocks.set(s.held_blocks as f64);
    }
}

/// A router's view of the cluster's prefix index, refreshed every second.
pub fn export_index_stats(index: EtcdPrefixIndex, node: NodeId) {
    let entries = node_gauge(names::PREFIX_INDEX_ENTRIES, "(block, node) entries", node);
    let mut resyncs = total_counter(
        names::PREFIX_INDEX_RESYNCS_TOTAL,
        "full re-lists of the prefix index",
        node,
    );
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
        loop {
            tick.tick().await;
            entries.set(index.len() as f64);
            resyncs.catch_up(index.stats().resyncs);
        }
    });
}

/// Serves `GET /metrics` (Prometheus text) on `addr`.
pub fn serve(addr: SocketAddr) {
    tokio::spawn(async move {
        let app = axum::Router::new().route(
            "/metrics",
            axum::routing::get(|| async { kvmesh_router::metrics_exporter().render() }),
        );
        match tokio::net::TcpListener::bind(addr).await {
            Ok(listener) => {
                tracing::info!(%addr, "metrics on /metrics");
                if let Err(e) = axum::serve(listener, app).await {
                    tracing::warn!("metrics server: {e}");
                }
            }
            Err(e) => tracing::warn!(%addr, "cannot serve metrics: {e}"),
        }
    });
}
