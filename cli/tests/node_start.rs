//! A node that cannot bind an address it was given stops at start with the address in its
//! error, before it registers: a node in the mesh that answers nothing on its gRPC address
//! would take requests the router then loses.

mod cluster;

use cluster::{free_addr, mesh_args};
use kvmesh_kvstore::EtcdServer;
use std::net::TcpListener;
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// Runs `kvmesh args`; `None` if it has not exited within `within`.
fn run_to_exit(args: &[String], within: Duration) -> Option<Output> {
    let child = Command::new(env!("CARGO_BIN_EXE_kvmesh"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kvmesh starts");
    let pid = child.id();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(within) {
        Ok(output) => Some(output.expect("the node's output")),
        Err(_) => {
            let _ = Command::new("kill").arg(pid.to_string()).status();
            None
        }
    }
}

fn fails_naming(args: &[String], what: &str) {
    let output = run_to_exit(args, Duration::from_secs(60))
        .unwrap_or_else(|| panic!("a node given a taken {what} kept running"));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "exited 0 with a taken {what}");
    assert!(
        stderr.contains(what),
        "the error does not name the {what}: {stderr}"
    );
}

#[test]
fn a_node_whose_address_is_taken_stops_at_start() {
    let etcd = EtcdServer::start().expect("etcd starts (scripts/setup.sh installs it)");
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let taken_addr = taken.local_addr().unwrap();

    let args = mesh_args("prefill", taken_addr, &etcd.endpoint(), "taken");
    fails_naming(&args, &format!("gRPC address {taken_addr}"));

    let mut args = mesh_args("decode", free_addr("127.0.0.1"), &etcd.endpoint(), "taken");
    args.extend(["--metrics-listen".into(), taken_addr.to_string()]);
    fails_naming(&args, &format!("metrics address {taken_addr}"));
}
