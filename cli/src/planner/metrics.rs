//! The planner's Prometheus series (`kvmesh_planner_*`, names in `kvmesh_common::metrics`).

use kvmesh_common::metrics as names;
use kvmesh_planner::{Decision, Observation, Role};
use metrics::{counter, describe_counter, describe_gauge, gauge, Counter, Gauge};
use std::time::Duration;

pub struct PlannerMetrics {
    pub leader: Gauge,
    pub actuation_failures: Counter,
}

fn role_label(role: Role) -> &'static str {
    match role {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
    }
}

impl PlannerMetrics {
    pub fn new() -> Self {
        // Installs the recorder: handles taken before it record nothing.
        kvmesh_router::metrics_exporter();
        describe_gauge!(
            names::PLANNER_LEADER,
            "1 while this planner leads the cluster"
        );
        describe_gauge!(
            names::PLANNER_DESIRED_NODES,
            "The latest decision's target nodes per role"
        );
        describe_gauge!(
            names::PLANNER_ACTUAL_NODES,
            "Nodes alive per role (discovery)"
        );
        describe_gauge!(
            names::PLANNER_ARRIVAL_RATE,
            "Requests per second at the routers"
        );
        describe_gauge!(
            names::PLANNER_TTFT_SECONDS,
            "TTFT over the last observation"
        );
        describe_gauge!(names::PLANNER_ITL_SECONDS, "ITL over the last observation");
        describe_gauge!(
            names::PLANNER_PREFIX_HIT_RATE,
            "Share of prompt tokens cached, over the last observation"
        );
        describe_counter!(
            names::PLANNER_ENGINE_STEPS_TOTAL,
            "Engine steps the nodes reported, fed to the performance model"
        );
        describe_counter!(
            names::PLANNER_DECISIONS_TOTAL,
            "Decisions by role and reason"
        );
        describe_counter!(
            names::PLANNER_NODE_SECONDS_TOTAL,
            "Node-seconds per role while leading"
        );
        describe_counter!(
            names::PLANNER_ACTUATION_FAILURES_TOTAL,
            "Decisions the actuator failed to carry out"
        );
        PlannerMetrics {
            leader: gauge!(names::PLANNER_LEADER),
            actuation_failures: counter!(names::PLANNER_ACTUATION_FAILURES_TOTAL),
        }
    }

    /// An observation covering the `elapsed` before it.
    pub fn observed(&self, obs: &Observation, elapsed: Duration) {
        gauge!(names::PLANNER_ARRIVAL_RATE).set(obs.arrival_rate);
        gauge!(names::PLANNER_PREFIX_HIT_RATE).set(obs.prefix_hit_rate);
        counter!(names::PLANNER_ENGINE_STEPS_TOTAL)
            .increment(obs.steps.iter().map(|s| s.steps).sum());
        for role in Role::ALL {
            let nodes = obs.nodes(role);
            gauge!(names::PLANNER_ACTUAL_NODES, "role" => role_label(role)).set(nodes);
            // Whole node-milliseconds: the counter is an integer.
            counter!(names::PLANNER_NODE_SECONDS_TOTAL, "role" => role_label(role))
                .increment((elapsed.as_secs_f64() * f64::from(nodes)).round() as u64);
        }
        for (name, q) in [
            (names::PLANNER_TTFT_SECONDS, obs.ttft),
            (names::PLANNER_ITL_SECONDS, obs.itl),
        ] {
            if let Some(q) = q {
                gauge!(name, "quantile" => "0.5").set(q.p50.as_secs_f64());
                gauge!(name, "quantile" => "0.99").set(q.p99.as_secs_f64());
            }
        }
    }

    pub fn decided(&self, decision: &Decision) {
        for role in Role::ALL {
            let d = decision.role(role);
            gauge!(names::PLANNER_DESIRED_NODES, "role" => role_label(role)).set(d.target);
            counter!(
                names::PLANNER_DECISIONS_TOTAL,
                "role" => role_label(role),
                "reason" => d.reason.kind()
            )
            .increment(1);
        }
    }
}
