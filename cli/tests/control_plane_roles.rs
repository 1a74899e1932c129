//! The control plane authorizes each call by the roles in the caller's certificate
//! (`kvmesh certs --roles`): a real decode node under mutual TLS, called with a router's, a
//! node's and an operator's certificate from one cluster CA. Being a cluster member is not
//! enough: only an admin may drain a node or switch its role, only a router (or an admin)
//! opens requests, only a decode node asks for a prefill, only prefill and decode nodes pull
//! KV; any member may ask for health. A node certificate proves its node's id: the node
//! takes that id, and a caller may name only its own id as where KV goes.

mod cluster;

use cluster::*;
use kvmesh_common::grpc::{self, pb, Placement};
use kvmesh_common::tls::{grpc_endpoint, ClusterTls};
use kvmesh_common::{GenerateRequest, RequestId, SamplingParams};
use kvmesh_kvstore::{Discovery, EtcdConfig, EtcdDiscovery, EtcdServer};
use std::path::Path;
use std::process::Command;
use tonic::transport::Channel;
use tonic::Code;

/// Issues `name`'s certificate with `roles` (and `extra` flags) under the CA in `dir`.
fn certs(dir: &Path, name: &str, roles: &str, extra: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kvmesh"))
        .args(["certs", "--out"])
        .arg(dir)
        .args(["--nodes", name, "--roles", roles])
        .args(extra)
        .output()
        .expect("kvmesh certs runs")
}

fn identity(dir: &Path, name: &str) -> ClusterTls {
    ClusterTls::load(
        &dir.join("ca.pem"),
        &dir.join(format!("{name}.pem")),
        &dir.join(format!("{name}.key")),
    )
    .expect("the certificate loads")
}

async fn channel(addr: &str, tls: &ClusterTls) -> Channel {
    grpc_endpoint(addr, Some(tls))
        .unwrap()
        .connect()
        .await
        .expect("the node accepts a cluster member")
}

async fn drain(addr: &str, tls: &ClusterTls) -> Result<(), tonic::Status> {
    pb::decode_client::DecodeClient::new(channel(addr, tls).await)
        .drain(pb::DrainRequest {})
        .await
        .map(drop)
}

async fn generate(addr: &str, tls: &ClusterTls) -> Result<(), tonic::Status> {
    let request = GenerateRequest {
        request_id: RequestId(7),
        prompt: vec![1, 2, 3, 4],
        params: SamplingParams::greedy(2),
        resume: Vec::new(),
    };
    let mut stream = pb::decode_client::DecodeClient::new(channel(addr, tls).await)
        .generate(grpc::generate_request_to_pb(
            &request,
            &Placement::default(),
        ))
        .await?
        .into_inner();
    while stream.message().await?.is_some() {}
    Ok(())
}

async fn prefill(addr: &str, tls: &ClusterTls) -> Result<(), tonic::Status> {
    pb::prefill_client::PrefillClient::new(channel(addr, tls).await)
        .prefill(pb::PrefillRequest::default())
        .await
        .map(drop)
}

/// An export (with no blocks: refused as invalid past the checks) into node `dest`.
async fn export(addr: &str, tls: &ClusterTls, dest: u64) -> Result<(), tonic::Status> {
    let request = pb::ExportKvRequest {
        destination: Some(pb::KvDestination {
            node_id: dest,
            transfer_address: "127.0.0.9:7000".into(),
            blocks: Vec::new(),
        }),
        ..Default::default()
    };
    pb::kv_cache_client::KvCacheClient::new(channel(addr, tls).await)
        .export(request)
        .await
        .map(drop)
}

async fn switch_role(addr: &str, tls: &ClusterTls) -> Result<(), tonic::Status> {
    pb::node_client::NodeClient::new(channel(addr, tls).await)
        .switch_role(pb::SwitchRoleRequest {
            to: pb::NodeRole::Decode as i32,
        })
        .await
        .map(drop)
}

fn denied<T: std::fmt::Debug>(call: &str, result: Result<T, tonic::Status>) {
    match result {
        Err(s) if s.code() == Code::PermissionDenied => {
            assert!(
                s.message().contains("certificate"),
                "{call}: {}",
                s.message()
            )
        }
        other => panic!("{call} was not refused: {other:?}"),
    }
}

#[test]
fn each_call_needs_a_role_the_callers_certificate_holds() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("control_plane_roles");
    let _ = std::fs::remove_dir_all(&dir);
    for (name, roles, extra) in [
        ("node", "prefill,decode", &[][..]),
        ("peer", "prefill,decode", &[]),
        ("other", "prefill,decode", &["--shared"]),
        ("router", "router", &[]),
        ("ops", "admin", &[]),
    ] {
        let out = certs(&dir, name, roles, extra);
        assert!(out.status.success(), "{out:?}");
    }
    // A role comes from --roles alone, never from a name.
    let forged = certs(&dir, "sneaky", "router", &[]);
    assert!(forged.status.success());
    let forged = Command::new(env!("CARGO_BIN_EXE_kvmesh"))
        .args(["certs", "--out"])
        .arg(&dir)
        .args(["--nodes", "admin.role.kvmesh.cluster"])
        .output()
        .unwrap();
    assert!(!forged.status.success(), "a node named like a role");
    let (node, peer, other, router, ops) = (
        identity(&dir, "node"),
        identity(&dir, "peer"),
        identity(&dir, "other"),
        identity(&dir, "router"),
        identity(&dir, "ops"),
    );
    let id = |tls: &ClusterTls| tls.node_id().unwrap().map(|id| id.0);
    let (node_id, peer_id) = (id(&node).unwrap(), id(&peer).unwrap());
    assert_eq!(id(&other), None, "a shared certificate names no node");

    let etcd = EtcdServer::start().expect("etcd starts (scripts/setup.sh installs it)");
    let addr = free_addr("127.0.0.5");
    let node_args = |role: &str, addr| {
        let mut args = mesh_args(role, addr, &etcd.endpoint(), "roles");
        for (flag, file) in [
            ("--tls-ca", "ca.pem"),
            ("--tls-cert", "node.pem"),
            ("--tls-key", "node.key"),
        ] {
            args.extend([flag.to_string(), dir.join(file).display().to_string()]);
        }
        args
    };
    let mut decode = Node::spawn(node_args("decode", addr), dir.join("decode.log"));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let discovery = rt
        .block_on(EtcdDiscovery::connect(EtcdConfig {
            endpoints: vec![etcd.endpoint()],
            cluster: "roles".into(),
            ..EtcdConfig::default()
        }))
        .unwrap();
    rt.block_on(await_membership(&discovery, 0, 1, START_TIMEOUT));
    let registered = discovery.nodes(kvmesh_common::NodeRole::Decode);
    assert_eq!(
        registered[0].info.node_id.0, node_id,
        "the node takes its id from its certificate"
    );
    let addr = addr.to_string();
    // A second node with the same node certificate (in any role) has the same id: it
    // refuses to start, saying why.
    let mut twin = Node::spawn(
        node_args("prefill", free_addr("127.0.0.5")),
        dir.join("twin.log"),
    );
    assert!(!twin.child.wait().unwrap().success());
    let log = std::fs::read_to_string(&twin.log).unwrap();
    assert!(
        log.contains("already registered") && log.contains("--shared"),
        "{log}"
    );

    rt.block_on(async {
        // Any member may ask for health.
        node_health(&addr, kvmesh_common::NodeRole::Decode, Some(&router)).await;
        // Requests: a router's certificate, not a node's.
        generate(&addr, &router)
            .await
            .expect("a router opens a request");
        denied(
            "Generate with a node's certificate",
            generate(&addr, &node).await,
        );
        // Prefill and pulls: nodes only.
        denied(
            "Prefill with a router's certificate",
            prefill(&addr, &router).await,
        );
        denied(
            "Export with a router's certificate",
            export(&addr, &router, 42).await,
        );
        // Where KV goes: a node certificate may name its own id (the call then passes the
        // checks and fails as empty) and no other.
        let pulled = export(&addr, &node, node_id).await.unwrap_err();
        assert_eq!(pulled.code(), Code::InvalidArgument, "{pulled:?}");
        denied(
            "Export from a node certificate into another node",
            export(&addr, &node, 42).await,
        );
        // A shared certificate (no node id) binds an id no node proved, first come; it
        // cannot redirect a proven node's KV, by a pull, a prefill or an RDMA ring.
        let own = export(&addr, &other, 42).await.unwrap_err();
        assert_eq!(own.code(), Code::InvalidArgument, "{own:?}");
        denied(
            "Export from a shared certificate into a proven node",
            export(&addr, &other, node_id).await,
        );
        let redirect = pb::PrefillRequest {
            destination: Some(pb::KvDestination {
                node_id,
                ..Default::default()
            }),
            ..Default::default()
        };
        let redirected = pb::prefill_client::PrefillClient::new(channel(&addr, &other).await)
            .prefill(redirect)
            .await;
        denied("Prefill into a proven node", redirected);
        let rdma = pb::prefill_client::PrefillClient::new(channel(&addr, &other).await)
            .rdma_connect(pb::RdmaConnectRequest {
                node_id,
                info: None,
            })
            .await;
        denied("RdmaConnect as a proven node", rdma);
        // A node's id taken first by a shared certificate goes back to the node that proves
        // it, and stays with it.
        let early = export(&addr, &other, peer_id).await.unwrap_err();
        assert_eq!(early.code(), Code::InvalidArgument, "{early:?}");
        let proven = export(&addr, &peer, peer_id).await.unwrap_err();
        assert_eq!(proven.code(), Code::InvalidArgument, "{proven:?}");
        denied(
            "Export from a shared certificate into a node that proved its id",
            export(&addr, &other, peer_id).await,
        );
        // Operations: admin only.
        denied(
            "Drain with a router's certificate",
            drain(&addr, &router).await,
        );
        denied("Drain with a node's certificate", drain(&addr, &node).await);
        denied(
            "SwitchRole with a node's certificate",
            switch_role(&addr, &node).await,
        );
        drain(&addr, &ops)
            .await
            .expect("an operator drains the node");
    });
    let exit = decode.child.wait().unwrap();
    assert!(exit.success(), "the drained node exits cleanly: {exit}");
}
