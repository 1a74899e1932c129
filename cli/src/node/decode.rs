//! `kvmesh decode`: a decode node. Takes Generate calls from routers, has the prefill node
//! they name compute the prompt (its KV arrives over QUIC on this node's port), pulls cached
//! prefixes from the node they name, decodes with continuous batching and streams tokens
//! back. Serves its own cache to other nodes' pulls (`KvCache`). It can switch to the prefill
//! role in place (`kvmesh node switch-role`).

use super::config::DecodeNodeConfig;
use super::engine_args::EngineArgs;
use super::process::{self, WorkerNode};
use super::{MeshArgs, PullArgs};
use crate::config::{env_vars, ConfigArgs};
use crate::model_args::ModelArgs;
use anyhow::Result;
use clap::Args;
use kvmesh_common::NodeRole;
use serde::Serialize;

/// The flags of `kvmesh decode`, layered over its TOML (`DecodeNodeConfig`).
#[derive(Args, Debug, Serialize)]
pub struct DecodeArgs {
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
    /// Prompts whose uncached part is shorter than this are prefilled here.
    #[arg(long, env = env_vars::LOCAL_PREFILL_MAX_TOKENS)]
    pub local_prefill_max_tokens: Option<usize>,
    /// Let prefill nodes pull the prefix of a prompt this node holds instead of recomputing
    /// it (`false`: they recompute).
    #[arg(long, env = env_vars::PREFILL_PULLS, action = clap::ArgAction::Set)]
    pub prefill_pulls: Option<bool>,
    #[command(flatten)]
    #[serde(skip)]
    pub config: ConfigArgs,
}

pub fn run(args: &DecodeNodeConfig) -> Result<()> {
    process::run(WorkerNode {
        role: NodeRole::Decode,
        mesh: &args.mesh,
        model: args.model.as_deref(),
        threads: args.threads,
        engine: &args.engine,
        pull_timeout: args.pull_timeout,
        local_prefill_max_tokens: Some(args.local_prefill_max_tokens),
        prefill_pulls: Some(args.prefill_pulls),
    })
}
