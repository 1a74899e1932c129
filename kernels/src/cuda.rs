//! The CUDA backend (feature `cuda`): cudarc with dynamic loading, so the crate builds without
//! a CUDA toolkit and a binary built with it still starts (on CPU) without a driver.
//!
//! Kernel sources live in `kernels/cuda/*.cu` ([`SOURCES`]), embedded in the binary. At start-up
//! [`CudaDevice::open`] compiles each to PTX for the device's compute capability with NVRTC and
//! keeps the PTX in a cache keyed by a hash of the source and the options, so a later start (or
//! a machine without NVRTC, given a filled cache) skips the compile. Without the feature a stub
//! takes the device's place: [`is_available`] is `false` and [`CudaDevice::open`] says why, so
//! call sites carry no `#[cfg]`.
//!
//! Nothing here touches the driver or NVRTC before checking that its library loads: cudarc
//! panics on a missing library, and a missing GPU must be an error, not a crash.

mod layout;
mod source;

#[cfg(feature = "cuda")]
mod copy_stream;
#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
mod graph;
#[cfg(feature = "cuda")]
mod kv_write;
#[cfg(feature = "cuda")]
mod nvrtc;
#[cfg(not(feature = "cuda"))]
mod stub;
mod tiles;

#[cfg(feature = "cuda")]
pub use copy_stream::{KvEvent, KvStager};
#[cfg(feature = "cuda")]
pub use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
#[cfg(feature = "cuda")]
pub use device::{CudaDevice, DeviceQMatrix, KvGeometry};
#[cfg(feature = "cuda")]
pub use graph::DeviceGraph;
#[cfg(feature = "cuda")]
pub use kv_write::KvUnstager;
pub use layout::{
    act_layout, attention_threads, dp4a_launch, quantize_blocks, split_blocks, split_layout,
    ActLayout, GemvKernel, GemvLaunch, SplitLayout, DP4A_THREADS, GEMV_MAX_M, QUANTIZE_THREADS,
};
#[cfg(feature = "cuda")]
pub use nvrtc::{compile_ptx, fill_cache, nvrtc_version};
pub use source::{format_code, Source, COMMON, SOURCES};
#[cfg(not(feature = "cuda"))]
pub use stub::CudaDevice;
pub use tiles::{attention_tiles, tiles_pay, ATTN_TILE_ROWS};

/// Names the NVRTC shared library to load (a path to `libnvrtc.so.13`), ahead of the default
/// places: `~/.cache/kvmesh/nvrtc` (where `scripts/setup.sh` installs it) and the system's
/// library path.
pub const NVRTC_LIB_ENV: &str = "KVMESH_NVRTC_LIB";

/// The directory of compiled kernels (PTX per source hash and architecture); default
/// `~/.cache/kvmesh/kernels`.
pub const KERNEL_CACHE_ENV: &str = "KVMESH_KERNEL_CACHE";

/// Why the CUDA backend cannot run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaError {
    #[error("this kvmesh was built without CUDA support (rebuild with `--features cuda`)")]
    NotBuilt,
    #[error("no CUDA driver: libcuda.so cannot be loaded (is an NVIDIA driver installed?)")]
    NoDriver,
    #[error("CUDA device {ordinal} does not exist: the driver sees {count} device(s)")]
    NoDevice { ordinal: usize, count: usize },
    #[error(
        "NVRTC cannot be loaded (looked for {tried}); run scripts/setup.sh, or set \
         KVMESH_NVRTC_LIB to libnvrtc.so.13"
    )]
    NoNvrtc { tried: String },
    #[error("kernel source {source_name} does not compile for {arch}:\n{log}")]
    Compile {
        source_name: String,
        arch: String,
        log: String,
    },
    #[error("CUDA driver: {0}")]
    Driver(String),
    #[error("cuBLAS: {0}")]
    Blas(String),
    #[error("kernel cache {path}: {message}")]
    Cache { path: String, message: String },
    #[error("{0}")]
    Shape(String),
}

/// Whether a CUDA device can be used: the backend is built, the driver loads and sees at least
/// one device. Never panics.
pub fn is_available() -> bool {
    CudaDevice::count().is_ok_and(|n| n > 0)
}
