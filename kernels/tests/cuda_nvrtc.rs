//! Every kernel source compiles to PTX with NVRTC, for each architecture we ship for, and
//! defines the kernels the loader asks for. Needs only NVRTC's library (no driver, no GPU):
//! `scripts/setup.sh` installs it. Without it these tests fail, as they must in CI.
#![cfg(feature = "cuda")]

use kvmesh_kernels::cuda::{self, CudaDevice, CudaError, SOURCES};

/// Ampere (A100), Ada, Hopper (H100/H200).
const ARCHES: &[&str] = &["compute_80", "compute_89", "compute_90"];

#[test]
fn nvrtc_loads() {
    let (major, _) = cuda::nvrtc_version().unwrap_or_else(|e| panic!("{e}"));
    assert!(
        major >= 12,
        "NVRTC {major} is older than the CUDA 12 we build for"
    );
}

#[test]
fn every_source_compiles_for_every_arch() {
    for arch in ARCHES {
        for s in SOURCES {
            let ptx = cuda::compile_ptx(s, arch).unwrap_or_else(|e| panic!("{e}"));
            let target = format!(".target sm_{}", &arch["compute_".len()..]);
            assert!(
                ptx.contains(&target),
                "{}: no `{target}` in the PTX",
                s.name
            );
            for k in s.kernels {
                assert!(
                    ptx.contains(&format!(".entry {k}(")),
                    "{}: kernel {k} missing from the PTX for {arch}",
                    s.name
                );
            }
        }
    }
}

#[test]
fn a_source_that_does_not_compile_is_an_error_with_the_log() {
    let bad = cuda::Source {
        name: "bad.cu",
        text: "extern \"C\" __global__ void k(float* x) { x[0] = undefined_name; }",
        kernels: &["k"],
    };
    match cuda::compile_ptx(&bad, "compute_90") {
        Err(CudaError::Compile {
            source_name, log, ..
        }) => {
            assert_eq!(source_name, "bad.cu");
            assert!(log.contains("undefined_name"), "{log}");
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
}

/// No driver (CI) or a device that does not exist: an error that says so, never a panic.
#[test]
fn opening_a_missing_device_is_a_clear_error() {
    match CudaDevice::count() {
        Err(CudaError::NoDriver) => {
            assert!(!cuda::is_available());
            assert_eq!(CudaDevice::open(0).unwrap_err(), CudaError::NoDriver);
        }
        Ok(n) => assert_eq!(
            CudaDevice::open(n).unwrap_err(),
            CudaError::NoDevice {
                ordinal: n,
                count: n
            }
        ),
        Err(e) => panic!("unexpected: {e}"),
    }
}
