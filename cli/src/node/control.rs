//! `kvmesh node`: operating a running prefill or decode node over its gRPC port: switch its
//! role in place, show where it stands, drain it. [`switch_role`] is the call an actuator
//! (the planner's) makes.

use anyhow::{Context, Result};
use clap::{Args, Subcommand, ValueEnum};
use humantime_serde::re::humantime;
use kvmesh_common::grpc::{self, pb};
use kvmesh_common::tls::{grpc_endpoint, ClusterTls};
use kvmesh_common::NodeRole;
use std::path::PathBuf;
use std::time::Duration;
use tonic::transport::Channel;
use tonic::Code;

#[derive(Subcommand)]
pub enum NodeCommand {
    /// Switch a node to the other role in place: it leaves the mesh, finishes the requests it
    /// accepted, keeps its weights and KV pool, and registers in the new role. Returns once
    /// routers can see it there.
    SwitchRole(SwitchRoleArgs),
    /// Show a node's role, load and requests served per role.
    Status(NodeTarget),
    /// Drain a node for shutdown: it leaves the mesh, finishes its requests and exits.
    Drain(NodeTarget),
}

/// Which node, and how to reach it.
#[derive(Args, Debug)]
pub struct NodeTarget {
    /// The node's gRPC address, host:port (what it registered: its --advertise or --listen).
    #[arg(long)]
    pub addr: String,
    /// The cluster CA certificate (PEM), when nodes use mutual TLS; with --tls-cert and
    /// --tls-key (a certificate `kvmesh certs` made).
    #[arg(long, requires_all = ["tls_cert", "tls_key"])]
    pub tls_ca: Option<PathBuf>,
    #[arg(long, requires = "tls_ca")]
    pub tls_cert: Option<PathBuf>,
    #[arg(long, requires = "tls_ca")]
    pub tls_key: Option<PathBuf>,
    /// How long to wait for the node's answer (a switch waits for the old role's requests:
    /// up to the node's --drain-timeout).
    #[arg(long, default_value = "120s", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
}

#[derive(Args, Debug)]
pub struct SwitchRoleArgs {
    #[command(flatten)]
    pub node: NodeTarget,
    /// The role to serve from now on.
    #[arg(long, value_enum)]
    pub to: Role,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Role {
    Prefill,
    Decode,
}

impl From<Role> for NodeRole {
    fn from(r: Role) -> Self {
        match r {
            Role::Prefill => NodeRole::Prefill,
            Role::Decode => NodeRole::Decode,
        }
    }
}

/// A finished `SwitchRole` call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Switched {
    pub role: NodeRole,
    /// False when the node already served the role.
    pub switched: bool,
    /// False when the old role's requests outlived the node's drain timeout.
    pub drained: bool,
    pub seconds: f64,
    pub drain_seconds: f64,
}

pub fn run(command: &NodeCommand) -> Result<()> {
    super::runtime()?.block_on(async {
        match command {
            NodeCommand::SwitchRole(args) => {
                let to = NodeRole::from(args.to);
                let channel = connect(&args.node).await?;
                let s = switch_role(channel, to, args.node.timeout)
                    .await
                    .with_context(|| format!("switching {} to {}", args.node.addr, to.as_str()))?;
                if !s.switched {
                    println!(
                        "{} already serves {}: nothing to do",
                        args.node.addr,
                        to.as_str()
                    );
                } else {
                    println!(
                        "{} serves {} now: switched in {:.2} s ({:.2} s finishing the old \
                         role's requests{})",
                        args.node.addr,
                        s.role.as_str(),
                        s.seconds,
                        s.drain_seconds,
                        if s.drained {
                            ""
                        } else {
                            "; the drain timeout passed and the router moved the rest"
                        }
                    );
                }
                Ok(())
            }
            NodeCommand::Status(target) => status(target).await,
            NodeCommand::Drain(target) => {
                let channel = connect(target).await?;
                let mut call = tonic::Request::new(pb::DrainRequest {});
                call.set_timeout(target.timeout);
                pb::decode_client::DecodeClient::new(channel)
                    .drain(call)
                    .await
                    .map_err(|s| explain(&target.addr, &s))?;
                println!(
                    "{} is draining: it left the mesh and exits once its requests end",
                    target.addr
                );
                Ok(())
            }
        }
    })
}

async fn connect(target: &NodeTarget) -> Result<Channel> {
    let tls = match (&target.tls_ca, &target.tls_cert, &target.tls_key) {
        (Some(ca), Some(cert), Some(key)) => {
            Some(ClusterTls::load(ca, cert, key).context("loading the cluster TLS files")?)
        }
        _ => None,
    };
    node_channel(&target.addr, tls.as_ref()).await
}

/// A connection to the node at `addr` (its gRPC host:port), over mutual TLS with `tls`.
pub async fn node_channel(addr: &str, tls: Option<&ClusterTls>) -> Result<Channel> {
    grpc_endpoint(addr, tls)
        .with_context(|| format!("{addr:?} is not a node address (host:port)"))?
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .with_context(|| format!("connecting to the node at {addr}"))
}

/// Asks the node on `channel` to serve `to`, waiting up to `timeout` for the switch.
pub async fn switch_role(channel: Channel, to: NodeRole, timeout: Duration) -> Result<Switched> {
    let mut call = tonic::Request::new(pb::SwitchRoleRequest {
        to: grpc::node_role_to_pb(to) as i32,
    });
    call.set_timeout(timeout);
    let reply = pb::node_client::NodeClient::new(channel)
        .switch_role(call)
        .await
        .map_err(|s| explain("the node", &s))?
        .into_inner();
    Ok(Switched {
        role: grpc::node_role_from_pb("SwitchRoleReply", reply.role)?,
        switched: reply.switched,
        drained: reply.drained,
        seconds: reply.seconds,
        drain_seconds: reply.drain_seconds,
    })
}

async fn status(target: &NodeTarget) -> Result<()> {
    let channel = connect(target).await?;
    let ask = || {
        let mut call = tonic::Request::new(pb::HealthRequest {});
        call.set_timeout(target.timeout);
        call
    };
    let decode = pb::decode_client::DecodeClient::new(channel.clone())
        .health(ask())
        .await
        .map_err(|s| explain(&target.addr, &s))?
        .into_inner();
    let prefill = pb::prefill_client::PrefillClient::new(channel)
        .health(ask())
        .await
        .map_err(|s| explain(&target.addr, &s))?
        .into_inner();
    let role = match grpc::node_role_from_pb("HealthReply", decode.role) {
        Ok(role) => role.as_str(),
        Err(_) => "switching",
    };
    let load = decode.load.unwrap_or_default();
    let serving = decode.serving || prefill.serving;
    println!(
        "node {:x} at {}: {role}{}; running {}, waiting {}, KV blocks in use {}; requests \
         accepted as prefill {}, as decode {}",
        decode.node_id,
        target.addr,
        if serving {
            ""
        } else {
            " (not taking requests)"
        },
        load.running,
        load.waiting,
        load.kv_blocks_used,
        prefill.requests_total,
        decode.requests_total
    );
    Ok(())
}

/// A refusal as the operator should read it.
fn explain(who: &str, status: &tonic::Status) -> anyhow::Error {
    match status.code() {
        Code::Unimplemented => anyhow::anyhow!(
            "{who} does not offer this call (a kvmesh version without role switching?)"
        ),
        Code::DeadlineExceeded => anyhow::anyhow!(
            "{who} did not answer within --timeout; a switch goes on without the caller"
        ),
        code => anyhow::anyhow!("{who} refused: {} ({code:?})", status.message()),
    }
}
