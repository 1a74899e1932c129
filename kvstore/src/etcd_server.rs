//! A throwaway local etcd for tests and local clusters.
//!
//! [`EtcdServer::start`] runs the `etcd` binary (Debian's `etcd-server`, 3.4) as a
//! single-member cluster on 127.0.0.1 ([`EtcdServer::start_on`]: another local address), on
//! free ports, with its data in a temporary directory
//! that is deleted on drop. Any number can run side by side (parallel tests). It can be
//! stopped and restarted on the same port and data, to test "etcd goes away and comes back".

use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};
use tempfile::TempDir;

/// Overrides where the `etcd` binary is (default: `etcd` on `PATH`).
pub const ETCD_BIN_ENV: &str = "KVMESH_ETCD_BIN";

/// Generous: a loaded CI machine starting several servers at once.
const START_TIMEOUT: Duration = Duration::from_secs(20);
/// Fresh ports are picked by binding port 0 and releasing it; another process can take one
/// before etcd binds it, so start-up retries with new ports a few times.
const START_ATTEMPTS: usize = 4;

#[derive(Debug, thiserror::Error)]
pub enum EtcdServerError {
    #[error("etcd not found: install Debian's etcd-server (scripts/setup.sh does), or set {ETCD_BIN_ENV}")]
    NotFound,
    #[error("could not run {bin}: {source}")]
    Spawn { bin: PathBuf, source: io::Error },
    #[error("etcd exited during start-up ({status}); log tail:\n{log}")]
    Exited { status: ExitStatus, log: String },
    #[error("etcd was not healthy within {waited:?}; log tail:\n{log}")]
    NotReady { waited: Duration, log: String },
    #[error("etcd server I/O: {0}")]
    Io(#[from] io::Error),
}

/// A running (or stopped) single-member etcd. Killed on drop; its data deleted.
#[derive(Debug)]
pub struct EtcdServer {
    bin: PathBuf,
    dir: TempDir,
    ip: Ipv4Addr,
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
}

impl EtcdServer {
    /// Starts etcd on free ports and returns once it answers as healthy (it has a leader).
    pub fn start() -> Result<Self, EtcdServerError> {
        Self::start_on(Ipv4Addr::LOCALHOST)
    }

    /// [`EtcdServer::start`] on local address `ip` (e.g. one that processes in another
    /// network namespace can reach).
    pub fn start_on(ip: Ipv4Addr) -> Result<Self, EtcdServerError> {
        let bin = find_binary()?;
        let mut last = None;
        for _ in 0..START_ATTEMPTS {
            let [client_port, peer_port] = free_ports(ip)?;
            let mut server = EtcdServer {
                bin: bin.clone(),
                dir: tempfile::Builder::new().prefix("kvmesh-etcd-").tempdir()?,
                ip,
                client_port,
                peer_port,
                child: None,
            };
            match server.spawn_and_wait() {
                Ok(()) => return Ok(server),
                // Most likely a port taken in the meantime: try others.
                Err(e @ EtcdServerError::Exited { .. }) => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.expect("at least one attempt"))
    }

    /// The client URL, e.g. `http://127.0.0.1:40123`.
    pub fn endpoint(&self) -> String {
        format!("http://{}:{}", self.ip, self.client_port)
    }

    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// The process id while it runs (e.g. to pause it with SIGSTOP).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Kills etcd (SIGKILL, as a crash would); the data and ports are kept for `restart`.
    pub fn stop(&mut self) -> Result<(), EtcdServerError> {
        if let Some(mut child) = self.child.take() {
            // Fails only if it already exited; `wait` reaps it either way.
            let _ = child.kill();
            child.wait()?;
        }
        Ok(())
    }

    /// Stops etcd if it runs, then starts it again on the same port with the same data, and
    /// waits until it is healthy.
    pub fn restart(&mut self) -> Result<(), EtcdServerError> {
        self.stop()?;
        self.spawn_and_wait()
    }

    /// Where etcd's output goes (appended across restarts).
    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("etcd.log")
    }

    fn spawn_and_wait(&mut self) -> Result<(), EtcdServerError> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())?;
        let client = format!("http://{}:{}", self.ip, self.client_port);
        let peer = format!("http://{}:{}", self.ip, self.peer_port);
        let child = Command::new(&self.bin)
            .arg("--name=kvmesh")
            .arg(format!(
                "--data-dir={}",
                self.dir.path().join("data").display()
            ))
            .arg(format!("--listen-client-urls={client}"))
            .arg(format!("--advertise-client-urls={client}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=kvmesh={peer}"))
            // Short raft timers: a quick first election, and a minimum lease TTL of 1 s
            // (etcd's floor is 1.5 x the election timeout), so tests can use short TTLs.
            .arg("--heartbeat-interval=50")
            .arg("--election-timeout=250")
            .arg("--logger=zap")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .map_err(|source| EtcdServerError::Spawn {
                bin: self.bin.clone(),
                source,
            })?;
        self.child = Some(child);
        let result = self.wait_healthy();
        if result.is_err() {
            let _ = self.stop();
        }
        result
    }

    fn wait_healthy(&mut self) -> Result<(), EtcdServerError> {
        let started = Instant::now();
        let addr = SocketAddr::from((self.ip, self.client_port));
        loop {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                self.child = None;
                let log = log_tail(&self.log_path());
                return Err(EtcdServerError::Exited { status, log });
            }
            if healthy(addr) {
                return Ok(());
            }
            if started.elapsed() > START_TIMEOUT {
                let log = log_tail(&self.log_path());
                return Err(EtcdServerError::NotReady {
                    waited: START_TIMEOUT,
                    log,
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

fn find_binary() -> Result<PathBuf, EtcdServerError> {
    if let Some(bin) = std::env::var_os(ETCD_BIN_ENV) {
        return Ok(bin.into());
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    find_on(&path).ok_or(EtcdServerError::NotFound)
}

fn find_on(path: &std::ffi::OsStr) -> Option<PathBuf> {
    std::env::split_paths(path)
        .map(|dir| dir.join("etcd"))
        .find(|p| p.is_file())
}

/// Two free ports on `ip`, never handed out before in this process.
fn free_ports(ip: Ipv4Addr) -> io::Result<[u16; 2]> {
    let ip = ip.to_string();
    let port = || kvmesh_common::net::free_addr(&ip).map(|a| a.port());
    Ok([port()?, port()?])
}

/// etcd's `/health` says true once the member has a leader and no alarm.
fn healthy(addr: SocketAddr) -> bool {
    let check = || -> io::Result<bool> {
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(200))?;
        s.set_read_timeout(Some(Duration::from_millis(500)))?;
        s.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
        let mut body = String::new();
        s.read_to_string(&mut body)?;
        Ok(body.contains(r#""health":"true""#))
    };
    check().unwrap_or(false)
}

fn log_tail(path: &Path) -> String {
    let log = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_binary_says_how_to_install_it() {
        let empty = tempfile::tempdir().unwrap();
        assert_eq!(find_on(empty.path().as_os_str()), None);
        let msg = EtcdServerError::NotFound.to_string();
        assert!(
            msg.starts_with("etcd not found: install Debian's etcd-server"),
            "{msg}"
        );

        std::fs::write(empty.path().join("etcd"), "").unwrap();
        assert_eq!(
            find_on(empty.path().as_os_str()),
            Some(empty.path().join("etcd"))
        );
    }
}
