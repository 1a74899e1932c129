//! NVRTC: finding its library, compiling a source to PTX, and the on-disk PTX cache.
//!
//! cudarc loads `libnvrtc` by name (dlopen searches the library path) and panics when it
//! cannot. We first load it ourselves from [`NVRTC_LIB_ENV`] or the venv `scripts/setup.sh`
//! fills; once a library is loaded, dlopen of its soname (`libnvrtc.so.13`, one of cudarc's
//! names) returns it, so cudarc finds ours. Then `is_culib_present` says whether it is there.

use super::source::Source;
use super::{CudaError, KERNEL_CACHE_ENV, NVRTC_LIB_ENV};
use cudarc::nvrtc::{self, CompileOptions};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The venv `scripts/setup.sh` installs NVRTC into, under the home directory.
const SETUP_VENV: &str = ".cache/kvmesh/nvrtc";

fn home() -> Option<PathBuf> {
    std::env::var_os("HOME").map(PathBuf::from)
}

/// `libnvrtc.so.*` (not the `-builtins` or `.alt` variants) anywhere under `dir`.
fn find_lib(dir: &Path, depth: usize) -> Option<PathBuf> {
    let entries = std::fs::read_dir(dir).ok()?;
    let mut subdirs = Vec::new();
    for e in entries.flatten() {
        let path = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with("libnvrtc.so.") && path.is_file() {
            return Some(path);
        }
        if depth > 0 && path.is_dir() {
            subdirs.push(path);
        }
    }
    subdirs.sort();
    subdirs.iter().find_map(|d| find_lib(d, depth - 1))
}

/// The candidate library files, in order: the variable's, then the setup venv's.
fn candidates() -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Some(p) = std::env::var_os(NVRTC_LIB_ENV) {
        out.push(PathBuf::from(p));
    }
    if let Some(venv) = home().map(|h| h.join(SETUP_VENV)) {
        // venv/lib/pythonX.Y/site-packages/nvidia/cu13/lib/libnvrtc.so.13
        out.extend(find_lib(&venv, 6));
    }
    out
}

/// NVRTC dlopens `libnvrtc-builtins.so.<major>.<minor>` by name when it compiles; the wheel
/// keeps it beside `libnvrtc`, off the library path, so it is loaded from there first.
fn preload_builtins(nvrtc: &Path) {
    let Some(dir) = nvrtc.parent() else { return };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with("libnvrtc-builtins.so.") {
            // SAFETY: as for libnvrtc itself.
            if let Ok(lib) = unsafe { libloading::Library::new(e.path()) } {
                std::mem::forget(lib);
            }
        }
    }
}

/// Loads NVRTC once per process; `Err` says where it looked.
fn ensure_loaded() -> Result<(), CudaError> {
    static LOADED: OnceLock<Result<(), CudaError>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            let tried = candidates();
            for path in &tried {
                // SAFETY: loading NVRTC runs its initialisers, which have no preconditions.
                if let Ok(lib) = unsafe { libloading::Library::new(path) } {
                    // Kept for the life of the process: cudarc's dlopen by soname finds it.
                    std::mem::forget(lib);
                    preload_builtins(path);
                    break;
                }
            }
            // SAFETY: only tries to dlopen library names.
            if unsafe { nvrtc::sys::is_culib_present() } {
                Ok(())
            } else {
                let mut names: Vec<String> =
                    tried.iter().map(|p| p.display().to_string()).collect();
                names.push("libnvrtc.so.13 on the library path".into());
                Err(CudaError::NoNvrtc {
                    tried: names.join(", "),
                })
            }
        })
        .clone()
}

/// NVRTC's (major, minor) version; an error when its library cannot be loaded.
pub fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    ensure_loaded()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is loaded; both pointers are valid for writes.
    let r = unsafe { nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    match r {
        nvrtc::sys::nvrtcResult::NVRTC_SUCCESS => Ok((major, minor)),
        e => Err(CudaError::NoNvrtc {
            tried: format!("nvrtcVersion failed: {e:?}"),
        }),
    }
}

/// The NVRTC options for a virtual architecture such as `compute_90`.
fn options(arch: &str) -> Vec<String> {
    vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()]
}

/// Compiles one source (with the common helpers) to PTX for `arch` (`compute_90`, ...).
pub fn compile_ptx(source: &Source, arch: &str) -> Result<String, CudaError> {
    ensure_loaded()?;
    let opts = CompileOptions {
        options: options(arch),
        name: Some(source.name.to_string()),
        ..Default::default()
    };
    match nvrtc::compile_ptx_with_opts(source.unit(), opts) {
        Ok(ptx) => Ok(ptx.to_src()),
        Err(nvrtc::CompileError::CompileError { log, .. }) => Err(CudaError::Compile {
            source_name: source.name.into(),
            arch: arch.into(),
            log: log.to_string_lossy().into_owned(),
        }),
        Err(e) => Err(CudaError::Compile {
            source_name: source.name.into(),
            arch: arch.into(),
            log: format!("{e:?}"),
        }),
    }
}

/// FNV-1a, 64-bit: a hash that stays the same across builds and Rust versions, for cache keys.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in *p {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        // A separator, so ("ab", "c") and ("a", "bc") differ.
        h ^= 0xff;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The kernel cache directory: [`KERNEL_CACHE_ENV`], else `~/.cache/kvmesh/kernels`.
pub(crate) fn cache_dir() -> Option<PathBuf> {
    std::env::var_os(KERNEL_CACHE_ENV)
        .map(PathBuf::from)
        .or_else(|| home().map(|h| h.join(".cache/kvmesh/kernels")))
}

/// The cache file of `source` compiled for `arch`: named by a hash of everything that decides
/// the PTX (the helpers, the source, the options).
pub(crate) fn cache_path(dir: &Path, source: &Source, arch: &str) -> PathBuf {
    let opts = options(arch).join(" ");
    let h = fnv1a(&[
        super::source::COMMON.as_bytes(),
        source.text.as_bytes(),
        opts.as_bytes(),
    ]);
    let stem = source.name.trim_end_matches(".cu");
    dir.join(format!("{stem}-{h:016x}-{arch}.ptx"))
}

/// PTX for `source` on `arch`: from the cache when there, else compiled and stored (a cache
/// that cannot be written only costs the next start a compile).
pub(crate) fn cached_ptx(source: &Source, arch: &str) -> Result<String, CudaError> {
    cached_ptx_in(cache_dir().as_deref(), source, arch)
}

fn cached_ptx_in(dir: Option<&Path>, source: &Source, arch: &str) -> Result<String, CudaError> {
    let path = dir.map(|d| cache_path(d, source, arch));
    if let Some(p) = &path {
        if let Ok(ptx) = std::fs::read_to_string(p) {
            return Ok(ptx);
        }
    }
    let ptx = compile_ptx(source, arch)?;
    if let Some(p) = &path {
        let tmp = p.with_extension(format!("tmp{}", std::process::id()));
        let written = p
            .parent()
            .map_or(Ok(()), std::fs::create_dir_all)
            .and_then(|()| std::fs::write(&tmp, &ptx))
            .and_then(|()| std::fs::rename(&tmp, p));
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            tracing_warn(&format!("cannot cache {}: {e}", p.display()));
        }
    }
    Ok(ptx)
}

/// Fills the cache for `arch` (all sources); the paths written. For preparing a machine
/// without NVRTC (`kvmesh gpu-check` carries a filled cache).
pub fn fill_cache(arch: &str) -> Result<Vec<PathBuf>, CudaError> {
    let dir = cache_dir().ok_or_else(|| CudaError::Cache {
        path: "~".into(),
        message: format!("no home directory and no {KERNEL_CACHE_ENV}"),
    })?;
    super::SOURCES
        .iter()
        .map(|s| {
            cached_ptx(s, arch)?;
            let p = cache_path(&dir, s, arch);
            if p.is_file() {
                Ok(p)
            } else {
                Err(CudaError::Cache {
                    path: p.display().to_string(),
                    message: "was not written".into(),
                })
            }
        })
        .collect()
}

// The kernels crate has no logging dependency; a cache miss that cannot be stored is rare and
// harmless, so it goes to stderr.
fn tracing_warn(msg: &str) {
    eprintln!("kvmesh-kernels: {msg}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_is_filled_then_read_without_compiling() {
        let dir = tempfile::tempdir().unwrap();
        let src = &crate::cuda::SOURCES[0];
        let ptx = cached_ptx_in(Some(dir.path()), src, "compute_90").unwrap();
        let path = cache_path(dir.path(), src, "compute_90");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), ptx);
        // A planted entry is served as is: the cache, not NVRTC, answered.
        std::fs::write(&path, "planted").unwrap();
        assert_eq!(
            cached_ptx_in(Some(dir.path()), src, "compute_90").unwrap(),
            "planted"
        );
        // Another architecture is another entry.
        assert_ne!(path, cache_path(dir.path(), src, "compute_80"));
    }

    #[test]
    fn fnv_separates_parts() {
        assert_ne!(fnv1a(&[b"ab", b"c"]), fnv1a(&[b"a", b"bc"]));
        assert_eq!(fnv1a(&[b"x"]), fnv1a(&[b"x"]));
    }
}
