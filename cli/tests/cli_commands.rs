//! The `kvmesh` binary's own commands: `generate --json` against llama.cpp's golden tokens,
//! and `serve --print-config` layering (defaults < TOML < env < flags).

use std::process::Command;

fn kvmesh() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvmesh"));
    c.env_remove("KVMESH_DECODE_WORKERS")
        .env_remove("KVMESH_CONFIG")
        .env("KVMESH_LOG", "warn");
    c
}

/// The golden outputs recorded from llama.cpp (`data/golden/`, bundled in the repository).
fn golden() -> serde_json::Value {
    let text = include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../data/golden/smollm2_golden.json"
    ));
    serde_json::from_str(text).expect("golden file is JSON")
}

#[test]
fn generate_json_matches_llama_cpp_greedy() {
    let case = &golden()["generation"][1];
    assert_eq!(case["prompt"], "The capital of France is");
    let out = kvmesh()
        .args([
            "generate",
            "--prompt",
            "The capital of France is",
            "--max-tokens",
            "8",
            "--json",
        ])
        .output()
        .expect("kvmesh runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(json["prompt_ids"], case["prompt_ids"]);
    let greedy: Vec<u64> = serde_json::from_value(case["greedy_ids"].clone()).unwrap();
    let output: Vec<u64> = serde_json::from_value(json["output_ids"].clone()).unwrap();
    assert_eq!(output, greedy[..8]);
    assert_eq!(
        json["first_step_top5"]["ids"][0],
        case["first_step_top5_ids"][0]
    );
    assert_eq!(
        json["first_step_top5"]["logits"].as_array().unwrap().len(),
        5
    );
    assert!(json["text"].as_str().unwrap().starts_with(" Paris."));
}

fn print_config(args: &[&str], env: &[(&str, &str)]) -> Result<String, String> {
    let mut c = kvmesh();
    c.args(["serve", "--print-config"]).args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().expect("kvmesh runs");
    if out.status.success() {
        Ok(String::from_utf8(out.stdout).unwrap())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

#[test]
fn serve_config_layers_file_env_and_flags() {
    let dir = std::env::temp_dir().join(format!("kvmesh-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("serve.toml");
    std::fs::write(&file, "decode_workers = 3\n[router]\nmax_n = 2\n").unwrap();
    let file = file.to_str().unwrap();

    let from_file = print_config(&["--config", file], &[]).unwrap();
    assert!(from_file.contains("decode_workers = 3"), "{from_file}");
    assert!(from_file.contains("max_n = 2"), "{from_file}");
    let from_env = print_config(&["--config", file], &[("KVMESH_DECODE_WORKERS", "4")]).unwrap();
    assert!(from_env.contains("decode_workers = 4"), "{from_env}");
    let from_flag = print_config(
        &["--config", file, "--decode-workers", "5"],
        &[("KVMESH_DECODE_WORKERS", "4")],
    )
    .unwrap();
    assert!(from_flag.contains("decode_workers = 5"), "{from_flag}");

    std::fs::write(dir.join("bad.toml"), "decode_wokers = 2\n").unwrap();
    let err = print_config(&["--config", dir.join("bad.toml").to_str().unwrap()], &[]).unwrap_err();
    assert!(err.contains("decode_wokers"), "{err}");
    let err = print_config(&["--decode-workers", "0"], &[]).unwrap_err();
    assert!(err.contains("decode_workers must be at least 1"), "{err}");

    // Admission-control and rate-limit flags land in the router section.
    let admission = print_config(
        &[
            "--ttft-target",
            "750ms",
            "--max-in-flight",
            "9",
            "--rate-limit",
            "2.5",
        ],
        &[("KVMESH_RATE_LIMIT_BURST", "4")],
    )
    .unwrap();
    for line in [
        "ttft_target = \"750ms\"",
        "max_in_flight = 9",
        "rate_limit_per_second = 2.5",
        "rate_limit_burst = 4",
    ] {
        assert!(admission.contains(line), "{line} in {admission}");
    }
    let err = print_config(&["--max-in-flight", "0"], &[]).unwrap_err();
    assert!(err.contains("max_in_flight"), "{err}");
    let err = print_config(&["--ttft-target", "soon"], &[]).unwrap_err();
    assert!(err.contains("ttft-target"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `ROLE --print-config` with `args`, as the binary prints it.
fn role_print_config(role: &str, args: &[&str]) -> String {
    let out = kvmesh()
        .args([role, "--print-config"])
        .args(args)
        .output()
        .expect("kvmesh runs");
    assert!(
        out.status.success(),
        "{role}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn every_role_prints_a_config_that_reads_back_the_same() {
    let dir = tempfile::tempdir().unwrap();
    for (role, args) in [
        ("serve", &["--decode-workers", "2"][..]),
        (
            "router",
            &["--etcd", "http://127.0.0.1:2379", "--max-migrations", "1"][..],
        ),
        ("prefill", &["--kv-blocks", "64", "--node-id", "ab"][..]),
        (
            "decode",
            &["--prefill-pulls", "false", "--listen", "127.0.0.1:7000"][..],
        ),
    ] {
        let printed = role_print_config(role, args);
        let file = dir.path().join(format!("{role}.toml"));
        std::fs::write(&file, &printed).unwrap();
        let again = role_print_config(role, &["--config", file.to_str().unwrap()]);
        assert_eq!(again, printed, "{role}");
        assert_ne!(
            printed,
            role_print_config(role, &[]),
            "{role}: {args:?} had no effect"
        );
    }
}

fn certs(args: &[&str]) -> std::process::Output {
    kvmesh()
        .arg("certs")
        .args(args)
        .output()
        .expect("kvmesh runs")
}

fn mode(path: &std::path::Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

/// Whether a TLS client that trusts `ca` accepts `cert` from a server it dialled as `name`.
fn server_name_ok(ca: &std::path::Path, cert: &std::path::Path, name: &str) -> Result<(), String> {
    use rustls::client::danger::ServerCertVerifier;
    use rustls::pki_types::{pem::PemObject, CertificateDer, ServerName, UnixTime};
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_file(ca).unwrap())
        .unwrap();
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let verifier =
        rustls::client::WebPkiServerVerifier::builder_with_provider(roots.into(), provider)
            .build()
            .unwrap();
    let leaf = CertificateDer::from_pem_file(cert).unwrap();
    let name = ServerName::try_from(name.to_string()).unwrap();
    verifier
        .verify_server_cert(&leaf, &[], &name, &[], UnixTime::now())
        .map(|_| ())
        .map_err(|e| e.to_string())
}

#[test]
fn certs_make_a_cluster_ca_and_node_certificates_and_reuse_the_ca() {
    use kvmesh_common::tls::{ClusterTls, CLUSTER_SERVER_NAME};
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("certs");
    let out_dir = dir.to_str().unwrap();
    let file = |name: &str| dir.join(name);
    let load = |node: &str| {
        ClusterTls::load(
            &file("ca.pem"),
            &file(&format!("{node}.pem")),
            &file(&format!("{node}.key")),
        )
    };

    let out = certs(&[
        "--out",
        out_dir,
        "--nodes",
        "prefill-1,decode-1",
        "--san",
        "10.0.0.5",
        "--san",
        "node.example",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(mode(&file("ca.key")), 0o600);
    assert_eq!(mode(&file("decode-1.key")), 0o600);
    for node in ["prefill-1", "decode-1"] {
        load(node).unwrap_or_else(|e| panic!("{node}: {e}"));
    }
    let pem = std::fs::read_to_string(file("decode-1.pem")).unwrap();
    for name in [CLUSTER_SERVER_NAME, "decode-1", "node.example", "10.0.0.5"] {
        server_name_ok(&file("ca.pem"), &file("decode-1.pem"), name)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    assert!(server_name_ok(&file("ca.pem"), &file("decode-1.pem"), "other.example").is_err());

    // Later: one more node under the same CA; existing certificates are kept.
    let ca = std::fs::read(file("ca.pem")).unwrap();
    let out = certs(&["--out", out_dir, "--nodes", "decode-1,decode-2"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("kept"));
    assert_eq!(
        std::fs::read(file("ca.pem")).unwrap(),
        ca,
        "the CA was replaced"
    );
    assert_eq!(std::fs::read_to_string(file("decode-1.pem")).unwrap(), pem);
    load("decode-2").unwrap();
    // Each certificate is one node's and names its id, which a re-issued one keeps.
    let id = |node: &str| load(node).unwrap().node_id().unwrap();
    let decode_1 = id("decode-1").expect("a node certificate names its node id");
    let ids = [decode_1, id("decode-2").unwrap(), id("prefill-1").unwrap()];
    assert!(
        ids[0] != ids[1] && ids[1] != ids[2] && ids[0] != ids[2],
        "{ids:?}"
    );
    let out = certs(&["--out", out_dir, "--nodes", "decode-1", "--force"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_ne!(std::fs::read_to_string(file("decode-1.pem")).unwrap(), pem);
    assert_eq!(id("decode-1"), Some(decode_1));
    // One for replicas names none.
    let out = certs(&["--out", out_dir, "--nodes", "replica", "--shared"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("node id none"));
    assert_eq!(id("replica"), None);

    // A certificate of one CA does not pass under another.
    let other = tmp.path().join("other");
    assert!(certs(&["--out", other.to_str().unwrap(), "--nodes", "x"])
        .status
        .success());
    let foreign = ClusterTls::load(
        &other.join("ca.pem"),
        &file("decode-1.pem"),
        &file("decode-1.key"),
    );
    assert!(foreign.is_err());

    // Clear refusals.
    let err = |args: &[&str]| {
        let out = certs(args);
        assert!(!out.status.success(), "{args:?} succeeded");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    assert!(err(&["--out", out_dir, "--nodes", "../evil"]).contains("invalid node name"));
    assert!(err(&["--out", out_dir, "--nodes", "ca"]).contains("CA's own files"));
    assert!(
        err(&["--out", out_dir, "--nodes", "n", "--san", "bad name!"])
            .contains("subject alternative name")
    );
    // Only kvmesh certs itself names roles and node ids.
    for reserved in ["ab.node.kvmesh.cluster", "admin.role.kvmesh.cluster"] {
        assert!(
            err(&["--out", out_dir, "--nodes", "n", "--san", reserved]).contains("--roles"),
            "{reserved}"
        );
    }
    let half = tmp.path().join("half");
    std::fs::create_dir(&half).unwrap();
    std::fs::copy(file("ca.pem"), half.join("ca.pem")).unwrap();
    assert!(err(&["--out", half.to_str().unwrap()]).contains("ca.key"));
}
