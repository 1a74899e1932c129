//! What a node process exports to Prometheus beyond its workers' metrics: its role and role
//! switches, its model loads, the prefix index's publishing (nodes) and watching (routers),
//! and a `/metrics` endpoint for node processes,
//! which have no HTTP server of their own.

use super::switchboard::Switchboard;
use axum::http::StatusCode;
use kvmesh_common::metrics as names;
use kvmesh_common::{NodeId, NodeRole};
use kvmesh_kvstore::{EtcdPrefixIndex, PrefixIndex, PublisherStats};
use kvmesh_worker::metrics::TotalCounter;
use kvmesh_worker::RoleState;
use metrics::{
    counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram, Counter,
    Gauge, Histogram,
};
use std::net::SocketAddr;
use std::sync::Arc;

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

/// A node's roles: which it serves, its switches and how long they took.
pub struct RoleMetrics {
    /// Per role (prefill, decode): 1 while the node serves it.
    serving: [Gauge; 2],
    /// Per role switched to (prefill, decode).
    switches: [Counter; 2],
    switch_seconds: Histogram,
}

const ROLES: [NodeRole; 2] = [NodeRole::Prefill, NodeRole::Decode];

impl RoleMetrics {
    pub fn new(node: NodeId) -> Self {
        describe_gauge!(
            names::NODE_ROLE,
            "1 for the role the node serves now (both 0 while it switches)."
        );
        describe_counter!(
            names::NODE_ROLE_SWITCHES_TOTAL,
            "Role switches done in place, by the role switched to."
        );
        describe_histogram!(
            names::NODE_ROLE_SWITCH_SECONDS,
            "Time from a role switch request to serving the new role, draining included."
        );
        let node = node.to_string();
        RoleMetrics {
            serving: ROLES.map(|r| {
                gauge!(names::NODE_ROLE, "node" => node.clone(), "role" => r.as_str())
            }),
            switches: ROLES.map(|r| {
                counter!(names::NODE_ROLE_SWITCHES_TOTAL, "node" => node.clone(), "to" => r.as_str())
            }),
            switch_seconds: histogram!(names::NODE_ROLE_SWITCH_SECONDS, "node" => node),
        }
    }

    /// The node serves `role` now (`None`: it is switching).
    pub fn serving(&self, role: Option<NodeRole>) {
        for (gauge, r) in self.serving.iter().zip(ROLES) {
            gauge.set(f64::from(u8::from(role == Some(r))));
        }
    }

    /// A switch to `to` ended after `seconds`.
    pub fn switched(&self, to: NodeRole, seconds: f64) {
        if let Some(i) = ROLES.iter().position(|&r| r == to) {
            self.switches[i].increment(1);
        }
        self.switch_seconds.record(seconds);
    }
}

/// Counts a load of the model's weights (a role switch reuses them: this stays at 1).
pub fn count_model_load(node: NodeId) {
    describe_counter!(
        names::NODE_MODEL_LOADS_TOTAL,
        "Times this process loaded the model's weights."
    );
    counter!(names::NODE_MODEL_LOADS_TOTAL, "node" => node.to_string()).increment(1);
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

/// Serves `GET /metrics` (Prometheus text) on `addr`. With `board` (a prefill or decode
/// node) also `GET /health`, a readiness check: 200 with the role while the node serves one,
/// 503 while it switches roles or drains; and `GET /live`, 200 while the process answers.
/// The address is bound before this returns, so a taken port fails the caller's start.
pub fn serve(addr: SocketAddr, board: Option<Arc<Switchboard>>) -> anyhow::Result<()> {
    use axum::routing::get;
    let mut app = axum::Router::new().route(
        "/metrics",
        get(|| async { kvmesh_router::metrics_exporter().render() }),
    );
    if let Some(board) = board {
        app = app
            .route(
                "/health",
                get(move || std::future::ready(health(board.state()))),
            )
            .route("/live", get(|| async { "ok" }));
    }
    let listener = std::net::TcpListener::bind(addr)
        .and_then(|l| l.set_nonblocking(true).map(|()| l))
        .and_then(tokio::net::TcpListener::from_std)
        .map_err(|e| anyhow::anyhow!("binding the metrics address {addr}: {e}"))?;
    tracing::info!(%addr, "metrics on /metrics");
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::warn!("metrics server: {e}");
        }
    });
    Ok(())
}

fn health(state: RoleState) -> (StatusCode, String) {
    match state {
        RoleState::Serving(role) => (StatusCode::OK, format!("serving {}", role.as_str())),
        RoleState::Switching { from, to } => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("switching from {} to {}", from.as_str(), to.as_str()),
        ),
        RoleState::ShuttingDown => (StatusCode::SERVICE_UNAVAILABLE, "draining".to_string()),
    }
}
