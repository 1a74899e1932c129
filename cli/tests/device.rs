//! `--device cuda` where there is no CUDA (this build has no `cuda` feature; CI machines have
//! no driver): `kvmesh serve` refuses to start and says why, instead of serving on the CPU or
//! panicking. A bad device name is refused by the flag parser.

use std::process::Command;
use std::time::Duration;

fn serve(device: &str) -> std::process::Output {
    let model = kvmesh_prompt::model_fetch::fetched_model().unwrap_or_else(|e| panic!("{e}"));
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvmesh"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--device",
            device,
            "--model",
        ])
        .arg(model)
        .env("KVMESH_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("kvmesh runs");
    // It must exit on its own; a server that came up would run until killed.
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while child.try_wait().expect("wait").is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("kvmesh serve --device {device} started instead of refusing");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    child.wait_with_output().expect("output")
}

#[test]
fn serve_on_cuda_without_cuda_fails_at_start_and_says_why() {
    let out = serve("cuda");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--device cuda:0"), "{err}");
    assert!(
        err.contains("built without CUDA support") || err.contains("no CUDA driver"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn a_device_that_is_not_one_is_refused() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvmesh"))
        .args(["serve", "--device", "gpu0"])
        .output()
        .expect("kvmesh runs");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("use cpu, cuda or cuda:N"), "{err}");
}
