//! Mutual TLS inside a cluster: every node holds a certificate that the cluster CA signed,
//! presents it as a client and as a server, and accepts only peers whose certificates the
//! same CA signed. One [`ClusterTls`] is read at start-up and feeds the gRPC control plane
//! (tonic) and the KV transport (QUIC).
//!
//! Servers are verified against one fixed name, [`CLUSTER_SERVER_NAME`], rather than the
//! address dialled: nodes advertise IPs that change with every container or pod, and a name
//! every node certificate carries keeps the CA out of address management. What proves a
//! peer is a cluster member is the CA's signature, not the name.

use rustls::client::danger::ServerCertVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::RootCertStore;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};

/// The DNS name every node certificate carries, and the one clients check servers against.
pub const CLUSTER_SERVER_NAME: &str = "kvmesh.cluster";

/// A peer that opens a connection and never finishes its handshake is dropped after this.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Why the cluster's TLS material cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("no PEM {what} found in {path}")]
    NoPem { what: &'static str, path: PathBuf },
    #[error("the private key in {key} does not belong to the certificate in {cert}: {reason}")]
    KeyMismatch {
        cert: PathBuf,
        key: PathBuf,
        reason: String,
    },
    #[error("{cert} is not a cluster certificate under the CA in {ca}: {reason}")]
    Untrusted {
        cert: PathBuf,
        ca: PathBuf,
        reason: String,
    },
    #[error(
        "the certificate names {} node ids ({}): a node's own certificate names one, a shared \
         one (`kvmesh certs --shared`) none",
        .0.len(),
        .0.iter().map(|id| format!("{id:016x}", id = id.0)).collect::<Vec<_>>().join(", ")
    )]
    ManyNodeIds(Vec<crate::NodeId>),
}

/// A node's cluster identity: the CA it trusts, its certificate chain and key, parsed once.
/// Cheap to clone.
#[derive(Clone)]
pub struct ClusterTls(Arc<Material>);

struct Material {
    ca_pem: Vec<u8>,
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
    ca: Vec<CertificateDer<'static>>,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
}

impl std::fmt::Debug for ClusterTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.debug_struct("ClusterTls")
            .field("ca_certs", &self.0.ca.len())
            .field("chain_len", &self.0.chain.len())
            .finish_non_exhaustive()
    }
}

impl PartialEq for ClusterTls {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
            || (self.0.ca_pem == other.0.ca_pem
                && self.0.cert_pem == other.0.cert_pem
                && self.0.key_pem == other.0.key_pem)
    }
}

impl Eq for ClusterTls {}

impl ClusterTls {
    /// Reads the CA certificate(s), this node's certificate chain and its private key (all
    /// PEM), and checks that they fit: the key is the certificate's, the CA signed the
    /// certificate, it is valid now, names [`CLUSTER_SERVER_NAME`] and may act as both TLS
    /// server and client. A node with the wrong files fails at start-up, not at its first
    /// connection.
    pub fn load(ca: &Path, cert: &Path, key: &Path) -> Result<ClusterTls, TlsError> {
        let tls = Self::load_unchecked(ca, cert, key)?;
        tls.check(ca, cert, key)?;
        Ok(tls)
    }

    /// [`ClusterTls::load`] from PEM in memory (`ca`, `cert` and `key` name them in errors).
    pub fn from_pem(ca: &[u8], cert: &[u8], key: &[u8]) -> Result<ClusterTls, TlsError> {
        let (ca_path, cert_path, key_path) = (Path::new("ca"), Path::new("cert"), Path::new("key"));
        let tls = Self::parse(
            (ca_path, ca.to_vec()),
            (cert_path, cert.to_vec()),
            (key_path, key.to_vec()),
        )?;
        tls.check(ca_path, cert_path, key_path)?;
        Ok(tls)
    }

    /// Reads and parses the files without checking them against each other or the cluster
    /// name (for transports that check a different server name).
    pub fn load_unchecked(ca: &Path, cert: &Path, key: &Path) -> Result<ClusterTls, TlsError> {
        Self::parse((ca, read(ca)?), (cert, read(cert)?), (key, read(key)?))
    }

    fn parse(
        (ca_path, ca_pem): (&Path, Vec<u8>),
        (cert_path, cert_pem): (&Path, Vec<u8>),
        (key_path, key_pem): (&Path, Vec<u8>),
    ) -> Result<ClusterTls, TlsError> {
        let ca = certs(ca_path, &ca_pem)?;
        let chain = certs(cert_path, &cert_pem)?;
        let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|_| TlsError::NoPem {
            what: "private key",
            path: key_path.to_path_buf(),
        })?;
        Ok(ClusterTls(Arc::new(Material {
            ca_pem,
            cert_pem,
            key_pem,
            ca,
            chain,
            key,
        })))
    }

    fn check(&self, ca: &Path, cert: &Path, key: &Path) -> Result<(), TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        rustls::sign::CertifiedKey::from_der(self.chain(), self.key(), &provider).map_err(|e| {
            TlsError::KeyMismatch {
                cert: cert.to_path_buf(),
                key: key.to_path_buf(),
                reason: e.to_string(),
            }
        })?;
        self.verify_peer(&self.0.chain, provider)
            .map_err(|reason| TlsError::Untrusted {
                cert: cert.to_path_buf(),
                ca: ca.to_path_buf(),
                reason,
            })
    }

    /// Whether `chain` passes as this cluster's server and as its client, exactly as a peer
    /// would check it during a handshake.
    fn verify_peer(
        &self,
        chain: &[CertificateDer<'static>],
        provider: Arc<CryptoProvider>,
    ) -> Result<(), String> {
        let roots = Arc::new(
            self.roots()
                .map_err(|e| format!("bad CA certificate: {e}"))?,
        );
        let now = UnixTime::now();
        let (leaf, intermediates) = chain.split_first().ok_or("empty chain")?;
        let name = ServerName::try_from(CLUSTER_SERVER_NAME).map_err(|e| e.to_string())?;
        rustls::client::WebPkiServerVerifier::builder_with_provider(
            roots.clone(),
            provider.clone(),
        )
        .build()
        .map_err(|e| e.to_string())?
        .verify_server_cert(leaf, intermediates, &name, &[], now)
        .map_err(|e| format!("as a server named {CLUSTER_SERVER_NAME}: {e}"))?;
        rustls::server::WebPkiClientVerifier::builder_with_provider(roots, provider)
            .build()
            .map_err(|e| e.to_string())?
            .verify_client_cert(leaf, intermediates, now)
            .map_err(|e| format!("as a client: {e}"))?;
        Ok(())
    }

    /// The CA certificates as trust anchors.
    pub fn roots(&self) -> Result<RootCertStore, rustls::Error> {
        let mut roots = RootCertStore::empty();
        for c in &self.0.ca {
            roots.add(c.clone())?;
        }
        Ok(roots)
    }

    /// This node's certificate chain, leaf first.
    pub fn chain(&self) -> Vec<CertificateDer<'static>> {
        self.0.chain.clone()
    }

    /// The node id this certificate proves (see [`node_dns_name`]): `None` for a certificate
    /// shared by several nodes, which names none.
    pub fn node_id(&self) -> Result<Option<crate::NodeId>, TlsError> {
        let ids = certificate_node_ids(&self.0.chain[0]);
        match ids[..] {
            [] => Ok(None),
            [id] => Ok(Some(id)),
            _ => Err(TlsError::ManyNodeIds(ids)),
        }
    }

    pub fn key(&self) -> PrivateKeyDer<'static> {
        self.0.key.clone_key()
    }

    /// A gRPC server's TLS: presents this node's certificate and requires a client
    /// certificate the CA signed.
    pub fn grpc_server(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(self.identity())
            .client_ca_root(Certificate::from_pem(&self.0.ca_pem))
            .timeout(HANDSHAKE_TIMEOUT)
    }

    /// A gRPC client's TLS: presents this node's certificate and accepts only servers the
    /// CA signed for [`CLUSTER_SERVER_NAME`].
    pub fn grpc_client(&self) -> ClientTlsConfig {
        ClientTlsConfig::new()
            .identity(self.identity())
            .ca_certificate(Certificate::from_pem(&self.0.ca_pem))
            .domain_name(CLUSTER_SERVER_NAME)
            .timeout(HANDSHAKE_TIMEOUT)
    }

    fn identity(&self) -> Identity {
        Identity::from_pem(&self.0.cert_pem, &self.0.key_pem)
    }
}

/// The endpoint of a node's gRPC control plane at `address` (host:port): mutual TLS with
/// `tls`, plaintext without, and HTTP/2 keepalive (see [`crate::grpc::KEEPALIVE_INTERVAL`]),
/// so a hung peer fails its calls within seconds. Every gRPC client in the mesh dials
/// through this.
pub fn grpc_endpoint(
    address: &str,
    tls: Option<&ClusterTls>,
) -> Result<Endpoint, tonic::transport::Error> {
    let endpoint = match tls {
        None => Endpoint::from_shared(format!("http://{address}"))?,
        Some(tls) => {
            Endpoint::from_shared(format!("https://{address}"))?.tls_config(tls.grpc_client())?
        }
    };
    Ok(endpoint
        .http2_keep_alive_interval(crate::grpc::KEEPALIVE_INTERVAL)
        .keep_alive_timeout(crate::grpc::KEEPALIVE_TIMEOUT)
        .keep_alive_while_idle(true))
}

/// What a cluster member may call. A certificate from `kvmesh certs` carries its roles as
/// DNS names `ROLE.role.kvmesh.cluster` ([`CallerRole::dns_name`]), signed by the CA like
/// the rest of it, so a node learns a caller's roles from the handshake alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CallerRole {
    /// Opens requests on decode nodes (`Decode.Generate`).
    Router,
    /// Pulls prefixes (`KvCache.Export`) from the destination of its prompts.
    Prefill,
    /// Asks prefill nodes to prefill (`Prefill.Prefill`, `RdmaConnect`) and pulls prefixes.
    Decode,
    /// Operates nodes: `Drain`, `Node.SwitchRole` (`kvmesh node`, the planner).
    Admin,
}

impl CallerRole {
    pub const ALL: [CallerRole; 4] = [
        CallerRole::Router,
        CallerRole::Prefill,
        CallerRole::Decode,
        CallerRole::Admin,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            CallerRole::Router => "router",
            CallerRole::Prefill => "prefill",
            CallerRole::Decode => "decode",
            CallerRole::Admin => "admin",
        }
    }

    /// The DNS name a certificate carries to hold this role.
    pub fn dns_name(self) -> String {
        format!("{}.{ROLE_DOMAIN}", self.as_str())
    }
}

impl std::str::FromStr for CallerRole {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        CallerRole::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| format!("unknown role {s:?}: router, prefill, decode or admin"))
    }
}

/// The domain under which certificates name their roles.
pub const ROLE_DOMAIN: &str = "role.kvmesh.cluster";

/// The domain under which a certificate names the node it belongs to.
pub const NODE_DOMAIN: &str = "node.kvmesh.cluster";

/// The DNS name that makes a certificate node `id`'s own: `HEX.node.kvmesh.cluster`, with the
/// id in 16 hex digits. The node takes its id from it, and its calls may name that id, and
/// only that one, as where KV goes (see [`Authorizer::bind_destination`]).
pub fn node_dns_name(id: crate::NodeId) -> String {
    format!("{:016x}.{NODE_DOMAIN}", id.0)
}

/// [`certificate_node_ids`] of the first certificate in `pem` (none without one).
pub fn pem_node_ids(pem: &[u8]) -> Vec<crate::NodeId> {
    CertificateDer::from_pem_slice(pem).map_or(Vec::new(), |cert| certificate_node_ids(&cert))
}

/// The node ids `cert` names (see [`node_dns_name`]), in order, without repeats. Proves
/// nothing by itself: the CA's signature on the certificate must be checked (a handshake
/// did, or the caller does).
pub fn certificate_node_ids(cert: &CertificateDer<'_>) -> Vec<crate::NodeId> {
    let Ok(cert) = webpki::EndEntityCert::try_from(cert) else {
        return Vec::new();
    };
    let suffix = format!(".{NODE_DOMAIN}");
    let mut ids = Vec::new();
    for name in cert.valid_dns_names() {
        let name = name.to_ascii_lowercase();
        let Some(hex) = name.strip_suffix(&suffix) else {
            continue;
        };
        // Hex digits only: a wildcard (`*.node...`) names no node.
        if (1..=16).contains(&hex.len()) && hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            let id = crate::NodeId(u64::from_str_radix(hex, 16).expect("checked hex"));
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
    }
    ids
}

/// What a caller's certificate proves.
#[derive(Clone, Debug, PartialEq)]
struct Caller {
    /// What it may call. A certificate that names no role at all (issued before roles
    /// existed) holds every role.
    roles: Vec<CallerRole>,
    /// The node ids it names: none for a certificate shared by several nodes.
    nodes: Vec<crate::NodeId>,
    /// A hash of the leaf certificate.
    fingerprint: u64,
}

/// Who may tell where a node id receives KV.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Owner {
    /// The certificate that names the id: the caller proved it is that node.
    Proven,
    /// The first certificate naming no node (one shared by replicas; a hash of its leaf)
    /// that named the id.
    FirstCome(u64),
}

/// Past this many node ids, first-come bindings are forgotten (ids come and go with
/// leases; a flood of them must not grow the table). Proven ones stay: only the CA makes more.
const MAX_FIRST_COME: usize = 4096;

/// Whether `caller` may name `node` as where KV goes, given the bindings in `owners`, which
/// it updates. A certificate naming node ids may name those and no other, and takes them
/// over from any shared certificate; a shared certificate may name an id no proven node
/// holds, first come, first served.
fn bind(
    owners: &mut std::collections::HashMap<crate::NodeId, Owner>,
    node: crate::NodeId,
    caller: &Caller,
) -> Result<(), String> {
    if !caller.nodes.is_empty() {
        if !caller.nodes.contains(&node) {
            let own: Vec<_> = caller.nodes.iter().map(|id| id.to_string()).collect();
            return Err(format!(
                "the caller's certificate is node {}'s: it may name only itself as a KV \
                 destination, not node {node}",
                own.join(", ")
            ));
        }
        owners.insert(node, Owner::Proven);
        return Ok(());
    }
    match owners.get(&node) {
        Some(Owner::Proven) => Err(format!(
            "node {node} proves its id with its own certificate; a certificate that names no \
             node cannot name it as a KV destination"
        )),
        Some(&Owner::FirstCome(owner)) if owner != caller.fingerprint => Err(format!(
            "node {node}'s KV address is bound to another certificate: a caller may only name \
             itself as a KV destination"
        )),
        Some(_) => Ok(()),
        None => {
            if owners.len() >= MAX_FIRST_COME {
                owners.retain(|_, owner| *owner == Owner::Proven);
            }
            owners.insert(node, Owner::FirstCome(caller.fingerprint));
            Ok(())
        }
    }
}

/// Decides, per call, whether the caller's certificate holds a role the call needs and
/// whether it may name a node id as where KV goes. Without TLS every call passes (the node
/// warns that its cluster is unauthenticated).
pub struct Authorizer {
    verifier: Option<Arc<rustls::client::WebPkiServerVerifier>>,
    /// Callers by leaf certificate: a role check verifies a signature, a lookup does not.
    known: std::sync::Mutex<std::collections::HashMap<Vec<u8>, Caller>>,
    /// Who may tell where each node id receives KV.
    owners: std::sync::Mutex<std::collections::HashMap<crate::NodeId, Owner>>,
}

impl Authorizer {
    pub fn new(tls: Option<&ClusterTls>) -> Result<Authorizer, rustls::Error> {
        let verifier = match tls {
            None => None,
            Some(tls) => {
                let provider = Arc::new(rustls::crypto::ring::default_provider());
                let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
                    Arc::new(tls.roots()?),
                    provider,
                )
                .build()
                .map_err(|e| rustls::Error::General(e.to_string()))?;
                Some(verifier)
            }
        };
        Ok(Authorizer {
            verifier,
            known: Default::default(),
            owners: Default::default(),
        })
    }

    /// `Ok` when the caller of `request` may say where `node` receives KV (a `Prefill`,
    /// `Export` or `RdmaConnect` names the caller's own destination), `PERMISSION_DENIED`
    /// otherwise, so no member can redirect another node's KV to itself: a node certificate
    /// (naming its node id) may name only its own id; a certificate shared by replicas
    /// (naming none) may name an id no node certificate has claimed, and the first such
    /// certificate to name it keeps it. Always `Ok` without TLS.
    pub fn bind_destination<T>(
        &self,
        request: &tonic::Request<T>,
        node: crate::NodeId,
    ) -> Result<(), tonic::Status> {
        let Some(verifier) = &self.verifier else {
            return Ok(());
        };
        let caller = self
            .caller(verifier, request)
            .ok_or_else(|| tonic::Status::permission_denied("no client certificate"))?;
        let mut owners = self.owners.lock().unwrap_or_else(|e| e.into_inner());
        bind(&mut owners, node, &caller).map_err(tonic::Status::permission_denied)
    }

    /// `Ok` when the caller of `request` holds one of `allowed` (always without TLS);
    /// `PERMISSION_DENIED` naming the call (`what`) otherwise.
    pub fn check<T>(
        &self,
        request: &tonic::Request<T>,
        allowed: &[CallerRole],
        what: &str,
    ) -> Result<(), tonic::Status> {
        let Some(verifier) = &self.verifier else {
            return Ok(());
        };
        let denied = |held: &str| {
            let names: Vec<_> = allowed.iter().map(|r| r.as_str()).collect();
            tonic::Status::permission_denied(format!(
                "{what} needs a certificate with the role {}; the caller's holds {held}",
                names.join(" or ")
            ))
        };
        let Some(caller) = self.caller(verifier, request) else {
            return Err(denied("no certificate"));
        };
        if caller.roles.iter().any(|r| allowed.contains(r)) {
            return Ok(());
        }
        let held: Vec<_> = caller.roles.iter().map(|r| r.as_str()).collect();
        Err(denied(&format!("[{}]", held.join(", "))))
    }

    /// What the certificate the caller of `request` presented proves (`None` without one).
    fn caller<T>(
        &self,
        verifier: &rustls::client::WebPkiServerVerifier,
        request: &tonic::Request<T>,
    ) -> Option<Caller> {
        let chain = request.peer_certs()?;
        let (leaf, intermediates) = chain.split_first()?;
        Some(self.identify(verifier, leaf, intermediates))
    }

    fn identify(
        &self,
        verifier: &rustls::client::WebPkiServerVerifier,
        leaf: &CertificateDer<'static>,
        intermediates: &[CertificateDer<'static>],
    ) -> Caller {
        let mut known = self.known.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(caller) = known.get(leaf.as_ref()) {
            return caller.clone();
        }
        let now = UnixTime::now();
        let holds = |role: CallerRole| {
            ServerName::try_from(role.dns_name()).is_ok_and(|name| {
                verifier
                    .verify_server_cert(leaf, intermediates, &name, &[], now)
                    .is_ok()
            })
        };
        let mut roles: Vec<_> = CallerRole::ALL.into_iter().filter(|&r| holds(r)).collect();
        if roles.is_empty() {
            roles = CallerRole::ALL.to_vec();
        }
        let caller = Caller {
            roles,
            // The handshake checked the CA's signature on everything the leaf names.
            nodes: certificate_node_ids(leaf),
            fingerprint: xxhash_rust::xxh3::xxh3_64(leaf.as_ref()),
        };
        // Bounded: the CA issues few certificates; a flood of distinct ones resets it.
        if known.len() >= 1024 {
            known.clear();
        }
        known.insert(leaf.as_ref().to_vec(), caller.clone());
        caller
    }
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    })
}

fn certs(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs: Vec<_> = CertificateDer::pem_slice_iter(pem)
        .filter_map(Result::ok)
        .collect();
    if certs.is_empty() {
        return Err(TlsError::NoPem {
            what: "certificate",
            path: path.to_path_buf(),
        });
    }
    Ok(certs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::NodeId;
    use rcgen::{
        BasicConstraints, CertificateParams, CertifiedIssuer, ExtendedKeyUsagePurpose, IsCa,
        KeyPair,
    };
    use std::collections::HashMap;

    struct Ca(CertifiedIssuer<'static, KeyPair>);

    impl Ca {
        fn new() -> Ca {
            let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            Ca(CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap())
        }

        /// (cert PEM, key PEM) for `names`, for server and client use.
        fn issue(&self, names: &[&str]) -> (String, String) {
            let key = KeyPair::generate().unwrap();
            let mut params =
                CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                    .unwrap();
            params.extended_key_usages = vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ];
            (
                params.signed_by(&key, &self.0).unwrap().pem(),
                key.serialize_pem(),
            )
        }
    }

    #[test]
    fn a_certificate_of_the_cluster_ca_loads() {
        let ca = Ca::new();
        let (cert, key) = ca.issue(&[CLUSTER_SERVER_NAME, "10.0.0.7"]);
        let tls =
            ClusterTls::from_pem(ca.0.pem().as_bytes(), cert.as_bytes(), key.as_bytes()).unwrap();
        assert_eq!(tls.chain().len(), 1);
        assert_eq!(tls.roots().unwrap().len(), 1);
        assert!(!format!("{tls:?}").contains("PRIVATE"), "{tls:?}");
    }

    #[test]
    fn mismatched_material_is_refused_with_the_reason() {
        let (ca, other) = (Ca::new(), Ca::new());
        let ca_pem = ca.0.pem();
        let (cert, key) = ca.issue(&[CLUSTER_SERVER_NAME]);
        let (foreign, foreign_key) = other.issue(&[CLUSTER_SERVER_NAME]);
        let load =
            |c: &str, k: &str| ClusterTls::from_pem(ca_pem.as_bytes(), c.as_bytes(), k.as_bytes());

        let err = load(&foreign, &foreign_key).unwrap_err();
        assert!(matches!(err, TlsError::Untrusted { .. }), "{err}");
        let err = load(&cert, &foreign_key).unwrap_err();
        assert!(matches!(err, TlsError::KeyMismatch { .. }), "{err}");
        let (unnamed, unnamed_key) = ca.issue(&["decode-1"]);
        let err = load(&unnamed, &unnamed_key).unwrap_err();
        assert!(err.to_string().contains(CLUSTER_SERVER_NAME), "{err}");
        let err = load("not a certificate", &key).unwrap_err();
        assert!(
            matches!(
                err,
                TlsError::NoPem {
                    what: "certificate",
                    ..
                }
            ),
            "{err}"
        );
        let err = load(&cert, "").unwrap_err();
        assert!(
            matches!(
                err,
                TlsError::NoPem {
                    what: "private key",
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn roles_come_from_the_certificates_role_names() {
        let ca = Ca::new();
        let (cert, key) = ca.issue(&[CLUSTER_SERVER_NAME, "node-1"]);
        let tls =
            ClusterTls::from_pem(ca.0.pem().as_bytes(), cert.as_bytes(), key.as_bytes()).unwrap();
        let auth = Authorizer::new(Some(&tls)).unwrap();
        let verifier = auth.verifier.clone().unwrap();
        let roles_of = |names: &[&str]| {
            let (pem, _) = ca.issue(names);
            let der = CertificateDer::from_pem_slice(pem.as_bytes()).unwrap();
            auth.identify(&verifier, &der, &[]).roles
        };
        let admin = CallerRole::Admin.dns_name();
        let router = CallerRole::Router.dns_name();
        assert_eq!(
            roles_of(&[CLUSTER_SERVER_NAME, &admin]),
            [CallerRole::Admin]
        );
        assert_eq!(
            roles_of(&[CLUSTER_SERVER_NAME, "x", &router, &admin]),
            [CallerRole::Router, CallerRole::Admin]
        );
        // Issued before roles: every role.
        assert_eq!(roles_of(&[CLUSTER_SERVER_NAME, "old"]), CallerRole::ALL);
        // A name that only looks like a role grants nothing it does not name exactly.
        assert_eq!(
            roles_of(&[CLUSTER_SERVER_NAME, "xadmin.role.kvmesh.cluster", &router]),
            [CallerRole::Router]
        );
        assert_eq!("decode".parse(), Ok(CallerRole::Decode));
        assert!("root".parse::<CallerRole>().is_err());
    }

    #[test]
    fn a_certificate_names_its_nodes_ids() {
        let ca = Ca::new();
        let ids_of = |names: &[&str]| {
            let (pem, _) = ca.issue(names);
            certificate_node_ids(&CertificateDer::from_pem_slice(pem.as_bytes()).unwrap())
        };
        let own = node_dns_name(NodeId(0xab));
        assert_eq!(own, "00000000000000ab.node.kvmesh.cluster");
        assert_eq!(ids_of(&[CLUSTER_SERVER_NAME, &own]), [NodeId(0xab)]);
        assert_eq!(ids_of(&[CLUSTER_SERVER_NAME, "decode-1"]), []);
        // Case does not matter; repeats count once; what is not 1-16 hex digits names nothing.
        let upper = own.to_ascii_uppercase();
        assert_eq!(ids_of(&[&own, &upper]), [NodeId(0xab)]);
        for not_an_id in [
            "*.node.kvmesh.cluster",
            "decode-1.node.kvmesh.cluster",
            "10000000000000000.node.kvmesh.cluster",
            "ab.xnode.kvmesh.cluster",
        ] {
            assert_eq!(ids_of(&[CLUSTER_SERVER_NAME, not_an_id]), [], "{not_an_id}");
        }
        let two = node_dns_name(NodeId(u64::MAX));
        assert_eq!(ids_of(&[&own, &two]), [NodeId(0xab), NodeId(u64::MAX)]);

        let load = |names: &[&str]| {
            let (cert, key) = ca.issue(names);
            ClusterTls::from_pem(ca.0.pem().as_bytes(), cert.as_bytes(), key.as_bytes())
                .unwrap()
                .node_id()
        };
        assert_eq!(
            load(&[CLUSTER_SERVER_NAME, &own]).unwrap(),
            Some(NodeId(0xab))
        );
        assert_eq!(load(&[CLUSTER_SERVER_NAME]).unwrap(), None);
        let err = load(&[CLUSTER_SERVER_NAME, &own, &two]).unwrap_err();
        assert!(
            err.to_string()
                .contains("00000000000000ab, ffffffffffffffff"),
            "{err}"
        );
    }

    #[test]
    fn a_node_certificate_names_only_its_own_id_and_keeps_it_from_shared_ones() {
        let caller = |nodes: &[u64], fingerprint| Caller {
            roles: CallerRole::ALL.to_vec(),
            nodes: nodes.iter().map(|&n| NodeId(n)).collect(),
            fingerprint,
        };
        let (node_7, shared_a, shared_b) = (caller(&[7], 1), caller(&[], 2), caller(&[], 3));
        let mut owners = HashMap::new();
        // A node certificate: its own id, never another's.
        assert_eq!(bind(&mut owners, NodeId(7), &node_7), Ok(()));
        let err = bind(&mut owners, NodeId(8), &node_7).unwrap_err();
        assert!(
            err.contains("node 7's") && err.contains("not node 8"),
            "{err}"
        );
        // A shared certificate: first come among shared ones, never a proven id.
        let err = bind(&mut owners, NodeId(7), &shared_a).unwrap_err();
        assert!(err.contains("proves its id"), "{err}");
        assert_eq!(bind(&mut owners, NodeId(9), &shared_a), Ok(()));
        assert_eq!(bind(&mut owners, NodeId(9), &shared_a), Ok(()));
        assert!(bind(&mut owners, NodeId(9), &shared_b).is_err());
        // A node proving an id a shared certificate took first takes it back.
        let node_9 = caller(&[9], 4);
        assert_eq!(bind(&mut owners, NodeId(9), &node_9), Ok(()));
        assert!(bind(&mut owners, NodeId(9), &shared_a).is_err());
        // A flood of ids from shared certificates forgets first-come bindings only.
        for n in 100..100 + MAX_FIRST_COME as u64 {
            bind(&mut owners, NodeId(n), &shared_b).unwrap();
        }
        assert!(owners.len() <= MAX_FIRST_COME + 2, "{}", owners.len());
        assert!(bind(&mut owners, NodeId(7), &shared_b).is_err());
        assert!(bind(&mut owners, NodeId(9), &shared_b).is_err());
        assert_eq!(bind(&mut owners, NodeId(7), &node_7), Ok(()));
    }

    #[test]
    fn missing_files_are_named() {
        let err = ClusterTls::load(
            Path::new("/nonexistent/ca.pem"),
            Path::new("/nonexistent/node.pem"),
            Path::new("/nonexistent/node.key"),
        )
        .unwrap_err();
        assert!(err.to_string().contains("/nonexistent/ca.pem"), "{err}");
    }

    #[test]
    fn endpoints_use_https_only_with_tls() {
        let ca = Ca::new();
        let (cert, key) = ca.issue(&[CLUSTER_SERVER_NAME]);
        let tls =
            ClusterTls::from_pem(ca.0.pem().as_bytes(), cert.as_bytes(), key.as_bytes()).unwrap();
        let plain = grpc_endpoint("127.0.0.1:7000", None).unwrap();
        assert_eq!(plain.uri().scheme_str(), Some("http"));
        let secure = grpc_endpoint("127.0.0.1:7000", Some(&tls)).unwrap();
        assert_eq!(secure.uri().scheme_str(), Some("https"));
        assert!(grpc_endpoint("not an address at all", None).is_err());
    }
}
