//! Local deployments of this binary on loopback addresses, for the benchmarks that start
//! their own servers (`kvmesh bench trace`, `kvmesh tune`): a multi-process mesh (a
//! throwaway etcd, prefill and decode nodes, a router) or one in-process `kvmesh serve`.
//! Every child is killed when its handle drops, on an error path too; an interrupted
//! parent's children share its terminal's process group and get its Ctrl-C themselves.

use crate::config::env_vars;
use anyhow::{bail, Context, Result};
use kvmesh_common::NodeRole;
use kvmesh_kvstore::{Discovery, EtcdConfig, EtcdDiscovery, EtcdServer};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a deployment may take to come up (model loads on a busy machine included).
pub const START_TIMEOUT: Duration = Duration::from_secs(120);

/// Environment variables of the roles that would override what a deployment sets (the
/// environment layers over the `--config` file).
const OVERRIDING_ENV: &[&str] = &[
    env_vars::CONFIG,
    env_vars::LISTEN,
    env_vars::ETCD,
    env_vars::CLUSTER,
    env_vars::PREFILL_WORKERS,
    env_vars::DECODE_WORKERS,
    env_vars::TTFT_TARGET,
    env_vars::MAX_BATCHED_TOKENS,
    env_vars::MAX_STEP_TIME,
    env_vars::ROUTING_POLICY,
    env_vars::LOCAL_PREFILL_MAX_TOKENS,
];

/// What every child process shares.
#[derive(Clone, Debug, Default)]
pub struct ChildOptions {
    /// `--model`; `None`: the role's default (the cached model).
    pub model: Option<PathBuf>,
    /// `--threads` of each process.
    pub threads: usize,
    /// Each child's stderr goes to `<dir>/<name>.log` when set, else nowhere.
    pub logs: Option<PathBuf>,
    /// Waiting for a deployment gives up once this is set.
    pub interrupt: Option<Interrupt>,
}

/// Set once Ctrl-C is pressed, so that a driver stops waiting and drops its deployments
/// (killing them) instead of dying with them running.
#[derive(Clone, Debug)]
pub struct Interrupt(tokio::sync::watch::Receiver<bool>);

impl Interrupt {
    /// Listens for Ctrl-C on `runtime` from now on (replacing the default of exiting).
    pub fn on_ctrl_c(runtime: &tokio::runtime::Runtime) -> Interrupt {
        let (tx, rx) = tokio::sync::watch::channel(false);
        runtime.spawn(async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                let _ = tx.send(true);
            }
            // Kept open: a closed channel would read as no interrupt ever coming.
            std::future::pending::<()>().await
        });
        Interrupt(rx)
    }

    pub fn is_set(&self) -> bool {
        *self.0.borrow()
    }

    /// Until it is set.
    pub async fn wait(&self) {
        let mut rx = self.0.clone();
        if rx.wait_for(|&set| set).await.is_err() {
            std::future::pending::<()>().await
        }
    }
}

/// Child processes, killed and reaped on drop.
#[derive(Default)]
struct Children {
    running: Vec<(String, Child)>,
    logs: Option<PathBuf>,
    interrupt: Option<Interrupt>,
}

impl Children {
    fn for_options(options: &ChildOptions) -> Children {
        Children {
            running: Vec::new(),
            logs: options.logs.clone(),
            interrupt: options.interrupt.clone(),
        }
    }

    fn spawn(&mut self, name: &str, mut cmd: Command) -> Result<()> {
        let stderr = match &self.logs {
            Some(dir) => {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("creating {}", dir.display()))?;
                let path = dir.join(format!("{name}.log"));
                Stdio::from(
                    std::fs::File::create(&path)
                        .with_context(|| format!("creating {}", path.display()))?,
                )
            }
            None => Stdio::null(),
        };
        for var in OVERRIDING_ENV {
            cmd.env_remove(var);
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        self.running.push((name.to_string(), child));
        Ok(())
    }

    /// An error naming the first child that has exited, with its log's tail.
    fn check_alive(&mut self) -> Result<()> {
        for (name, child) in &mut self.running {
            if let Some(status) = child.try_wait()? {
                let tail = self
                    .logs
                    .as_ref()
                    .and_then(|dir| std::fs::read_to_string(dir.join(format!("{name}.log"))).ok())
                    .map(|log| {
                        let lines: Vec<&str> = log.lines().collect();
                        format!(":\n{}", lines[lines.len().saturating_sub(10)..].join("\n"))
                    })
                    .unwrap_or_default();
                bail!("{name} exited ({status}) before the deployment was up{tail}");
            }
        }
        Ok(())
    }

    /// Until `addr` answers /health 200, a child exits, or `within` passes.
    fn await_health(&mut self, addr: SocketAddr, within: Duration) -> Result<()> {
        let deadline = Instant::now() + within;
        while !health_ok(addr) {
            self.check_alive()?;
            if self.interrupt.as_ref().is_some_and(Interrupt::is_set) {
                bail!("interrupted");
            }
            if Instant::now() > deadline {
                bail!("{addr} was not healthy within {within:?}");
            }
            // A process start-up with no push signal to await; bounded by the deadline.
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        for (_, c) in &mut self.running {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A port on `ip` free now and not handed out before (the caller's child binds it next).
pub fn free_addr(ip: &str) -> Result<SocketAddr> {
    kvmesh_common::net::free_addr(ip).with_context(|| format!("binding {ip}"))
}

fn command(role: &str, listen: SocketAddr, options: &ChildOptions) -> Result<Command> {
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args([role, "--listen", &listen.to_string()])
        .args(["--threads", &options.threads.max(1).to_string()]);
    if let Some(m) = &options.model {
        cmd.arg("--model").arg(m);
    }
    Ok(cmd)
}

/// A mesh to start: node counts, each role's `--config` file and extra flags.
#[derive(Clone, Debug, Default)]
pub struct MeshSpec {
    pub prefill_nodes: usize,
    pub decode_nodes: usize,
    pub router_config: Option<PathBuf>,
    pub prefill_config: Option<PathBuf>,
    pub decode_config: Option<PathBuf>,
    pub router_args: Vec<String>,
    pub decode_args: Vec<String>,
}

/// etcd, prefill and decode nodes and a router; stopped on drop.
pub struct Cluster {
    // Before etcd: the nodes go first.
    _children: Children,
    pub router: SocketAddr,
    prefill_nodes: usize,
    decode_nodes: usize,
    etcd: EtcdServer,
}

/// The discovery cluster name the nodes join.
const CLUSTER: &str = "bench";

impl Cluster {
    /// Starts every process and returns once the router is healthy (a decode node has
    /// registered); [`await_nodes`](Self::await_nodes) waits for all of them.
    pub fn start(spec: &MeshSpec, options: &ChildOptions) -> Result<Cluster> {
        if spec.decode_nodes == 0 {
            bail!("a mesh needs at least one decode node");
        }
        if spec.prefill_nodes + spec.decode_nodes > 250 {
            bail!("at most 250 nodes on loopback addresses");
        }
        let etcd = EtcdServer::start().context("starting etcd")?;
        let mut children = Children::for_options(options);
        // Each node on its own loopback address: its UDP transfer port beside the TCP one.
        let mut spawn = |role: &str,
                         name: String,
                         ip: String,
                         config: &Option<PathBuf>,
                         extra: &[String]|
         -> Result<SocketAddr> {
            let addr = free_addr(&ip)?;
            let mut cmd = command(role, addr, options)?;
            cmd.args(["--etcd", &etcd.endpoint(), "--cluster", CLUSTER]);
            if let Some(path) = config {
                cmd.arg("--config").arg(path);
            }
            cmd.args(extra);
            children.spawn(&name, cmd)?;
            Ok(addr)
        };
        for i in 0..spec.prefill_nodes {
            spawn(
                "prefill",
                format!("prefill-{i}"),
                format!("127.0.0.{}", 3 + i),
                &spec.prefill_config,
                &[],
            )?;
        }
        for i in 0..spec.decode_nodes {
            let ip = format!("127.0.0.{}", 3 + spec.prefill_nodes + i);
            spawn(
                "decode",
                format!("decode-{i}"),
                ip,
                &spec.decode_config,
                &spec.decode_args,
            )?;
        }
        let router = spawn(
            "router",
            "router".into(),
            "127.0.0.2".into(),
            &spec.router_config,
            &spec.router_args,
        )?;
        children.await_health(router, START_TIMEOUT)?;
        Ok(Cluster {
            _children: children,
            router,
            prefill_nodes: spec.prefill_nodes,
            decode_nodes: spec.decode_nodes,
            etcd,
        })
    }

    /// The router's root URL.
    pub fn url(&self) -> String {
        format!("http://{}", self.router)
    }

    /// Until discovery shows every node (they register once their model is loaded).
    pub async fn await_nodes(&self, within: Duration) -> Result<()> {
        let config = EtcdConfig {
            endpoints: vec![self.etcd.endpoint()],
            cluster: CLUSTER.into(),
            ..EtcdConfig::default()
        };
        let discovery = EtcdDiscovery::connect(config).await?;
        let mut changes = discovery.subscribe();
        let all_up = || {
            discovery.nodes(NodeRole::Prefill).len() == self.prefill_nodes
                && discovery.nodes(NodeRole::Decode).len() == self.decode_nodes
        };
        tokio::time::timeout(within, async {
            while !all_up() {
                if changes.changed().await.is_err() {
                    break;
                }
            }
        })
        .await
        .context("waiting for the nodes to register")?;
        Ok(())
    }
}

/// One `kvmesh serve` process; stopped on drop.
pub struct ServeProcess {
    _children: Children,
    pub addr: SocketAddr,
}

impl ServeProcess {
    /// Starts `kvmesh serve --config config` and returns once it is healthy.
    pub fn start(config: &Path, options: &ChildOptions) -> Result<ServeProcess> {
        let mut children = Children::for_options(options);
        let addr = free_addr("127.0.0.1")?;
        let mut cmd = command("serve", addr, options)?;
        cmd.arg("--config").arg(config);
        children.spawn("serve", cmd)?;
        children.await_health(addr, START_TIMEOUT)?;
        Ok(ServeProcess {
            _children: children,
            addr,
        })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// Whether `addr` answers `GET /health` with 200.
pub fn health_ok(addr: SocketAddr) -> bool {
    let answer = crate::health::http_get(&addr.to_string(), "/health", Duration::from_secs(5));
    matches!(answer, Ok((200, _)))
}
