//! The `kubernetes` actuator: the prefill and decode Deployments' `replicas`, set through
//! their scale subresource (`PATCH /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale`,
//! a JSON merge patch `{"spec":{"replicas":N}}`), as the planner's ServiceAccount
//! (deploy/k8s/base/planner-rbac.yaml grants `get` and `patch` on `deployments/scale`).
//!
//! New pods register themselves; the pods Kubernetes removes get SIGTERM and drain within
//! their `terminationGracePeriodSeconds`. A pod's Deployment fixes its role, so a decision's
//! role switches are carried out as the starts and removals its targets imply (as with
//! `compose`). Replicas asked for count as starting until they register.
//!
//! One HTTPS request per change, written by hand over rustls: the planner needs a single
//! call of the API, which does not justify `kube` and `k8s-openapi` (dozens of crates and
//! the largest compile of the workspace). The in-cluster credentials are read as every
//! client reads them: the API server from `KUBERNETES_SERVICE_HOST`/`_PORT`, the CA, the
//! token (again for every request: kubelet rotates it) and the namespace from the
//! ServiceAccount's mounted directory.

use super::actuator::{Actuator, Move};
use anyhow::{bail, Context, Result};
use kvmesh_kvstore::NodeEntry;
use kvmesh_planner::Decision;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Where a pod finds its ServiceAccount's credentials.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// Replicas asked for and not registered within this no longer count as starting.
const START_TIMEOUT: Duration = Duration::from_secs(300);

/// How long one API request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// A Kubernetes API server, reached over HTTPS with a bearer token.
pub struct KubeApi {
    /// `host:port`.
    address: String,
    server_name: ServerName<'static>,
    tls: Arc<rustls::ClientConfig>,
    /// Read before every request.
    token_file: PathBuf,
}

impl KubeApi {
    /// The API server of the cluster this pod runs in, and the pod's namespace (if mounted).
    pub fn in_cluster() -> Result<(KubeApi, Option<String>)> {
        let host = std::env::var("KUBERNETES_SERVICE_HOST")
            .context("KUBERNETES_SERVICE_HOST is not set: not running in a Kubernetes pod")?;
        let port = std::env::var("KUBERNETES_SERVICE_PORT").unwrap_or_else(|_| "443".into());
        let dir = Path::new(SERVICE_ACCOUNT_DIR);
        let ca = std::fs::read(dir.join("ca.crt"))
            .with_context(|| format!("reading {}/ca.crt", dir.display()))?;
        let namespace = std::fs::read_to_string(dir.join("namespace")).ok();
        let api = KubeApi::new(&host, &port, &ca, dir.join("token"))?;
        Ok((api, namespace.map(|n| n.trim().to_string())))
    }

    /// The API server at `host:port` (an IPv6 host bare, as the variable holds it), whose
    /// certificate chains to `ca_pem`, called with the token in `token_file`.
    pub fn new(host: &str, port: &str, ca_pem: &[u8], token_file: PathBuf) -> Result<KubeApi> {
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(ca_pem) {
            roots
                .add(cert.context("the API server's CA")?)
                .context("the API server's CA")?;
        }
        if roots.is_empty() {
            bail!("the API server's CA holds no certificate");
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let address = if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        Ok(KubeApi {
            address,
            server_name: ServerName::try_from(host.to_string())
                .with_context(|| format!("{host:?} is not a host name or address"))?,
            tls: Arc::new(tls),
            token_file,
        })
    }

    /// Sets Deployment `name`'s replicas to `replicas` through its scale subresource; returns
    /// the replicas the answer's spec says.
    pub async fn scale(&self, namespace: &str, name: &str, replicas: u32) -> Result<u32> {
        let path = scale_path(namespace, name);
        let body = scale_patch(replicas);
        let (status, answer) = tokio::time::timeout(REQUEST_TIMEOUT, self.patch(&path, &body))
            .await
            .with_context(|| format!("PATCH {path}: no answer within {REQUEST_TIMEOUT:?}"))??;
        let json: serde_json::Value = serde_json::from_slice(&answer)
            .with_context(|| format!("PATCH {path}: {status}, not JSON"))?;
        if status != 200 {
            // A `Status` object: its message says why (forbidden, not found, ...).
            let message = json["message"].as_str().unwrap_or("no message");
            bail!("PATCH {path}: {status}: {message}");
        }
        if json["kind"] != "Scale" {
            bail!(
                "PATCH {path}: answered a {} instead of a Scale",
                json["kind"]
            );
        }
        json["spec"]["replicas"]
            .as_u64()
            .map(|r| r as u32)
            .with_context(|| format!("PATCH {path}: the Scale has no spec.replicas"))
    }

    /// One `PATCH` (a JSON merge patch) over a fresh connection; the status and body.
    async fn patch(&self, path: &str, body: &str) -> Result<(u16, Vec<u8>)> {
        let token = std::fs::read_to_string(&self.token_file)
            .with_context(|| format!("reading the token {}", self.token_file.display()))?;
        let tcp = tokio::net::TcpStream::connect(&self.address)
            .await
            .with_context(|| format!("connecting to the API server {}", self.address))?;
        let mut tls = tokio_rustls::TlsConnector::from(self.tls.clone())
            .connect(self.server_name.clone(), tcp)
            .await
            .with_context(|| format!("TLS with the API server {}", self.address))?;
        let request = format!(
            "PATCH {path} HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {}\r\n\
             Content-Type: application/merge-patch+json\r\nAccept: application/json\r\n\
             User-Agent: kvmesh-planner\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            self.address,
            token.trim(),
            body.len()
        );
        tls.write_all(request.as_bytes()).await?;
        let mut answer = Vec::new();
        // A server that closes without close_notify still gave its whole answer when the
        // body is complete; `parse_response` checks that.
        if let Err(e) = tls.read_to_end(&mut answer).await {
            if e.kind() != std::io::ErrorKind::UnexpectedEof {
                return Err(e.into());
            }
        }
        parse_response(&answer)
    }
}

/// The scale subresource of Deployment `name` in `namespace`.
pub fn scale_path(namespace: &str, name: &str) -> String {
    format!("/apis/apps/v1/namespaces/{namespace}/deployments/{name}/scale")
}

/// The merge patch that sets the replicas.
pub fn scale_patch(replicas: u32) -> String {
    serde_json::json!({ "spec": { "replicas": replicas } }).to_string()
}

/// An HTTP/1.1 response read to its end: the status and the body (chunked or not).
fn parse_response(raw: &[u8]) -> Result<(u16, Vec<u8>)> {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .context("the API server's answer has no end of headers")?;
    let head = std::str::from_utf8(&raw[..end]).context("headers are not UTF-8")?;
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .context("no HTTP status line")?;
    let header = |name: &str| {
        head.split("\r\n").skip(1).find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
        })
    };
    let rest = &raw[end + 4..];
    if header("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        return Ok((status, dechunk(rest)?));
    }
    match header("content-length") {
        Some(n) => {
            let n: usize = n.parse().context("a bad Content-Length")?;
            let body = rest.get(..n).context("the answer ended before its body")?;
            Ok((status, body.to_vec()))
        }
        None => Ok((status, rest.to_vec())),
    }
}

fn dechunk(mut rest: &[u8]) -> Result<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let line_end = rest
            .windows(2)
            .position(|w| w == b"\r\n")
            .context("a chunk without its size line")?;
        let size = std::str::from_utf8(&rest[..line_end])?;
        let size = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16)
            .context("a bad chunk size")?;
        rest = &rest[line_end + 2..];
        if size == 0 {
            return Ok(body);
        }
        body.extend_from_slice(rest.get(..size).context("the answer ended in a chunk")?);
        rest = rest
            .get(size + 2..)
            .context("the answer ended in a chunk")?;
    }
}

/// The Deployments of the two roles, in one namespace.
pub struct KubernetesActuator {
    api: KubeApi,
    namespace: String,
    /// `[prefill, decode]`.
    deployments: [String; 2],
    /// The last counts asked for and when.
    asked: Option<([u32; 2], Instant)>,
}

impl KubernetesActuator {
    pub fn new(api: KubeApi, namespace: String, deployments: [String; 2]) -> Self {
        KubernetesActuator {
            api,
            namespace,
            deployments,
            asked: None,
        }
    }
}

#[kvmesh_router::async_trait]
impl Actuator for KubernetesActuator {
    fn name(&self) -> &'static str {
        "kubernetes"
    }

    /// Patches each Deployment whose count changes (both are tried; the first failure is
    /// returned).
    async fn apply(&mut self, decision: &Decision, _moves: &[Move]) -> Result<()> {
        let targets = [decision.prefill.target, decision.decode.target];
        let observed = [decision.prefill.observed, decision.decode.observed];
        let mut first_error = None;
        for i in 0..2 {
            if targets[i] == observed[i] {
                continue;
            }
            let name = &self.deployments[i];
            match self.api.scale(&self.namespace, name, targets[i]).await {
                Ok(replicas) => tracing::info!(deployment = %name, replicas,
                    "scaled the Deployment"),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        self.asked = Some((targets, Instant::now()));
        first_error.map_or(Ok(()), Err)
    }

    fn starting(&mut self, registered: &[NodeEntry]) -> [u32; 2] {
        match self.asked {
            Some((asked, at)) if at.elapsed() < START_TIMEOUT => {
                super::compose::starting(asked, registered)
            }
            _ => [0, 0],
        }
    }
}

#[cfg(test)]
mod tests;
