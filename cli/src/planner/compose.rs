//! The `compose` actuator: the Compose cluster of `deploy/compose.yaml`, from the Docker
//! host. A decision becomes `docker-compose -f FILE [-p PROJECT] up -d --no-recreate --scale
//! prefill=P --scale decode=D prefill decode`: new replicas start and register themselves;
//! the replicas Compose removes (the highest-numbered) get SIGTERM and drain before they
//! exit (the file's `stop_grace_period` covers the nodes' drain timeout). A container's
//! service fixes its role, so a decision's role switches are carried out as the starts and
//! drains its targets imply. The command runs in the background (a scale-down waits out the
//! drains); while it runs, a new decision is refused as an actuation failure and the next
//! one retries.

use super::actuator::{Actuator, Move};
use anyhow::{bail, Context, Result};
use kvmesh_common::NodeRole;
use kvmesh_kvstore::NodeEntry;
use kvmesh_planner::Decision;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::process::{Child, Command};

/// Replicas asked for and not registered within this no longer count as starting.
const START_TIMEOUT: Duration = Duration::from_secs(180);

/// The Compose services of the two roles.
const SERVICES: [&str; 2] = ["prefill", "decode"];

pub struct ComposeActuator {
    /// `docker-compose -f FILE [-p PROJECT]`.
    base: Vec<String>,
    /// The `up` in progress.
    running: Option<Child>,
    /// The last counts asked for (`[prefill, decode]`) and when.
    asked: Option<([u32; 2], Instant)>,
}

impl ComposeActuator {
    pub fn new(command: &str, file: PathBuf, project: Option<String>) -> Result<Self> {
        if !file.is_file() {
            bail!("--compose-file {}: no such file", file.display());
        }
        let mut base: Vec<String> = command.split_whitespace().map(String::from).collect();
        if base.is_empty() {
            bail!("--compose-command is empty");
        }
        base.extend(["-f".into(), file.display().to_string()]);
        if let Some(p) = project {
            base.extend(["-p".into(), p]);
        }
        Ok(ComposeActuator {
            base,
            running: None,
            asked: None,
        })
    }

    /// Whether the previous `up` is done (an error if it failed).
    fn previous_done(&mut self) -> Result<bool> {
        let Some(child) = &mut self.running else {
            return Ok(true);
        };
        match child.try_wait()? {
            None => Ok(false),
            Some(status) => {
                self.running = None;
                if !status.success() {
                    bail!("`{}` failed ({status})", self.base.join(" "));
                }
                Ok(true)
            }
        }
    }
}

/// The arguments after `docker-compose -f FILE [-p PROJECT]` that scale the two services.
pub fn scale_args(targets: [u32; 2]) -> Vec<String> {
    let mut args: Vec<String> = ["up", "-d", "--no-recreate"].map(String::from).to_vec();
    for (service, n) in SERVICES.iter().zip(targets) {
        args.extend(["--scale".into(), format!("{service}={n}")]);
    }
    args.extend(SERVICES.map(String::from));
    args
}

/// Of the replicas asked for, those not registered yet.
pub(super) fn starting(asked: [u32; 2], registered: &[NodeEntry]) -> [u32; 2] {
    let count = |role| registered.iter().filter(|n| n.info.role == role).count() as u32;
    [
        asked[0].saturating_sub(count(NodeRole::Prefill)),
        asked[1].saturating_sub(count(NodeRole::Decode)),
    ]
}

#[kvmesh_router::async_trait]
impl Actuator for ComposeActuator {
    fn name(&self) -> &'static str {
        "compose"
    }

    async fn apply(&mut self, decision: &Decision, _moves: &[Move]) -> Result<()> {
        if !self.previous_done()? {
            bail!("the previous `docker-compose up` is still running (removed replicas drain)");
        }
        let targets = [decision.prefill.target, decision.decode.target];
        let args = scale_args(targets);
        tracing::info!(command = %format!("{} {}", self.base.join(" "), args.join(" ")),
            "scaling the Compose services");
        let child = Command::new(&self.base[0])
            .args(&self.base[1..])
            .args(&args)
            .stdin(Stdio::null())
            .spawn()
            .with_context(|| format!("running {}", self.base[0]))?;
        self.running = Some(child);
        self.asked = Some((targets, Instant::now()));
        Ok(())
    }

    fn starting(&mut self, registered: &[NodeEntry]) -> [u32; 2] {
        match self.asked {
            Some((asked, at)) if at.elapsed() < START_TIMEOUT => starting(asked, registered),
            _ => [0, 0],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_decision_scales_both_services_and_touches_no_other() {
        assert_eq!(
            scale_args([1, 3]).join(" "),
            "up -d --no-recreate --scale prefill=1 --scale decode=3 prefill decode"
        );
    }

    #[test]
    fn replicas_asked_for_count_as_starting_until_they_register() {
        let node = |id, role| crate::planner::testing::node(id, role, 0, 0, 0);
        let registered = [
            node(1, NodeRole::Prefill),
            node(2, NodeRole::Decode),
            node(3, NodeRole::Decode),
        ];
        assert_eq!(starting([2, 3], &registered), [1, 1]);
        // Asked for fewer than run (a scale-down): none starting.
        assert_eq!(starting([1, 1], &registered), [0, 0]);
    }

    #[test]
    fn a_missing_compose_file_is_refused_at_start() {
        let e = ComposeActuator::new("docker-compose", "/nonexistent.yaml".into(), None)
            .err()
            .unwrap();
        assert!(e.to_string().contains("no such file"), "{e}");
    }
}
