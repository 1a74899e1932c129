//! Generates the gRPC messages and services from `proto/kvmesh.proto` (needs `protoc`).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/kvmesh.proto");
    tonic_prost_build::configure().compile_protos(&["proto/kvmesh.proto"], &["proto"])?;
    Ok(())
}
