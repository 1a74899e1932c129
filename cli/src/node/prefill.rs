//! `kvmesh prefill`: a prefill node. Computes prompts it is asked for over gRPC and pushes
//! their KV to the decode node that asked: over RDMA where both have it, else QUIC. A prefix
//! the decode node holds and this node lacks is pulled from it (into this node's QUIC port)
//! when that beats recomputing it. Other nodes may pull prefixes it has cached (`KvCache`).
//! It can switch to the decode role in place (`kvmesh node switch-role`).

use super::config::PrefillNodeConfig;
use super::engine_args::EngineArgs;
use super::process::{self, WorkerNode};
use super::{MeshArgs, PullArgs};
use crate::config::ConfigArgs;
use crate::model_args::ModelArgs;
use anyhow::Result;
use clap::Args;
use kvmesh_common::NodeRole;
use serde::Serialize;

/// The flags of `kvmesh prefill`, layered over its TOML (`PrefillNodeConfig`).
#[derive(Args, Debug, Serialize)]
pub struct PrefillArgs {
    #[command(flatten)]
    #[serde(flatten)]
    pub mesh: MeshArgs,
    #[command(flatten)]
    #[serde(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    #[serde(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    #[serde(flatten)]
    pub pulls: PullArgs,
    #[command(flatten)]
    #[serde(skip)]
    pub config: ConfigArgs,
}

pub fn run(args: &PrefillNodeConfig) -> Result<()> {
    process::run(WorkerNode {
        role: NodeRole::Prefill,
        mesh: &args.mesh,
        model: args.model.as_deref(),
        threads: args.threads,
        engine: &args.engine,
        pull_timeout: args.pull_timeout,
        local_prefill_max_tokens: None,
        prefill_pulls: None,
    })
}
