//! What a node process exports to Prometheus beyond its workers' metrics: the prefix index's
//! publishing (nodes) and watching (routers), and a `/metrics` endpoint for node processes,
//! which have no HTTP server of their own.

use kvmesh_common::metrics as names;
use kvmesh_common::NodeId;
use kvmesh_kvstore::{EtcdPrefixIndex, PrefixIndex, PublisherStats};
use prometheus::{IntCounter, IntGauge, Opts};
use std::net::SocketAddr;

fn register<C: prometheus::core::Collector + Clone + 'static>(c: C) -> C {
    if let Err(e) = prometheus::register(Box::new(c.clone())) {
        tracing::warn!("metric registration: {e}");
    }
    c
}

fn counter(name: &str, help: &str, node: NodeId) -> IntCounter {
    let opts = Opts::new(name, help).const_label("node", node.to_string());
    register(IntCounter::with_opts(opts).expect("valid metric"))
}

fn gauge(name: &str, help: &str, node: NodeId) -> IntGauge {
    let opts = Opts::new(name, help).const_label("node", node.to_string());
    register(IntGauge::with_opts(opts).expect("valid metric"))
}

/// Moves a counter up to `total` (the stats are running totals).
fn catch_up(c: &IntCounter, total: u64) {
    c.inc_by(total.saturating_sub(c.get()));
}

/// One node's KV-event publishing.
pub struct PublisherMetrics {
    events: IntCounter,
    etcd_writes: IntCounter,
    write_failures: IntCounter,
    held_blocks: IntGauge,
}

impl PublisherMetrics {
    pub fn new(node: NodeId) -> Self {
        PublisherMetrics {
            events: counter(
                names::KV_EVENTS_PUBLISHED_TOTAL,
                "KV events published",
                node,
            ),
            etcd_writes: counter(
                names::KV_ETCD_WRITES_TOTAL,
                "etcd writes of the prefix index",
                node,
            ),
            write_failures: counter(
                names::KV_ETCD_WRITE_FAILURES_TOTAL,
                "failed etcd writes of the prefix index",
                node,
            ),
            held_blocks: gauge(names::KV_HELD_BLOCKS, "KV blocks this node announces", node),
        }
    }

    pub fn update(&self, s: &PublisherStats) {
        catch_up(&self.events, s.events_published);
        catch_up(&self.etcd_writes, s.etcd_writes);
        catch_up(&self.write_failures, s.write_failures);
        self.held_blocks.set(s.held_blocks as i64);
    }
}

/// A router's view of the cluster's prefix index, refreshed every second.
pub fn export_index_stats(index: EtcdPrefixIndex, node: NodeId) {
    let entries = gauge(names::PREFIX_INDEX_ENTRIES, "(block, node) entries", node);
    let resyncs = counter(
        names::PREFIX_INDEX_RESYNCS_TOTAL,
        "full re-lists of the prefix index",
        node,
    );
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
        loop {
            tick.tick().await;
            entries.set(index.len() as i64);
            catch_up(&resyncs, index.stats().resyncs);
        }
    });
}

/// Serves `GET /metrics` (Prometheus text) on `addr`.
pub fn serve(addr: SocketAddr) {
    tokio::spawn(async move {
        let app = axum::Router::new().route(
            "/metrics",
            axum::routing::get(|| async {
                let mut text = String::new();
                let encoder = prometheus::TextEncoder::new();
                if let Err(e) = encoder.encode_utf8(&prometheus::gather(), &mut text) {
                    tracing::warn!("encoding metrics: {e}");
                }
                text
            }),
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
