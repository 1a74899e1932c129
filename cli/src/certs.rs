//! `kvmesh certs`: a cluster CA and node certificates it signs, for mutual TLS between nodes
//! (`--tls-ca/--tls-cert/--tls-key`).
//!
//! Every node certificate names `kvmesh.cluster` (what peers check, see
//! `kvmesh_common::tls`), the node's own name, its roles (`--roles`: what it may call, see
//! `kvmesh_common::tls::CallerRole`), its node id (unless `--shared`: the node takes its id
//! from the certificate, and peers let it name only that id as where KV goes) and any
//! `--san`, and is good as TLS server and client. An existing CA in the directory is reused, so nodes can be added later; its key
//! never leaves the directory, which should stay on the operator's machine or secret store.

use anyhow::{bail, Context, Result};
use clap::Args;
use humantime_serde::re::humantime;
use kvmesh_common::tls::{
    node_dns_name, pem_node_ids, CallerRole, ClusterTls, CLUSTER_SERVER_NAME, NODE_DOMAIN,
    ROLE_DOMAIN,
};
use kvmesh_common::NodeId;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Args, Debug)]
pub struct CertsArgs {
    /// Directory for ca.pem, ca.key and NAME.pem, NAME.key per node (created if missing).
    #[arg(long)]
    pub out: PathBuf,
    /// Nodes to issue certificates for, comma-separated (letters, digits, '-' and '.').
    #[arg(long, value_delimiter = ',', default_value = "node")]
    pub nodes: Vec<String>,
    /// Extra subject alternative name (IP address or DNS name) on every new node
    /// certificate; repeatable.
    #[arg(long = "san")]
    pub sans: Vec<String>,
    /// How long new node certificates are valid.
    #[arg(long, default_value = "365d", value_parser = humantime::parse_duration)]
    pub valid_for: Duration,
    /// Re-issue node certificates that already exist (the CA is always kept).
    #[arg(long)]
    pub force: bool,
    /// What the new certificates may call, comma-separated: router (Generate), prefill
    /// (pull prefixes), decode (Prefill, pull prefixes), admin (Drain, SwitchRole). Nodes
    /// that may switch roles need prefill,decode; `kvmesh node` and the planner need admin.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "router,prefill,decode,admin"
    )]
    pub roles: Vec<CallerRole>,
    /// Certificates for several nodes each (replicas mounting one secret): they name no node
    /// id, so each node picks its own, and a KV destination a shared certificate names is
    /// bound to it first come, first served. Without this flag every certificate is one
    /// node's and proves that node's id.
    #[arg(long)]
    pub shared: bool,
}

/// How long a new CA is valid: longer than any certificate it signs.
const CA_VALIDITY: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// Certificates start this long in the past, so clocks a little behind accept them.
const CLOCK_SKEW: Duration = Duration::from_secs(3600);

pub fn run(args: &CertsArgs) -> Result<()> {
    for name in &args.nodes {
        check_node_name(name)?;
    }
    for san in &args.sans {
        if san.parse::<std::net::IpAddr>().is_err() && !is_dns_name(san) {
            bail!("invalid subject alternative name {san:?}: give an IP address or a DNS name");
        }
        if is_reserved_name(san) {
            bail!("{san:?} would grant a role or a node id: use --roles; node ids are given by kvmesh certs");
        }
    }
    if args.roles.is_empty() {
        bail!("--roles is empty: a certificate needs at least one role");
    }
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let ca = ClusterCa::open_or_create(&args.out)?;
    for name in &args.nodes {
        let (cert, key) = (
            node_file(&args.out, name, "pem"),
            node_file(&args.out, name, "key"),
        );
        if cert.exists() && !args.force {
            println!("kept    {} (--force re-issues it)", cert.display());
            continue;
        }
        let mut sans = args.sans.clone();
        sans.extend(args.roles.iter().map(|r| r.dns_name()));
        let node_id = (!args.shared)
            .then(|| previous_node_id(&cert).unwrap_or_else(|| NodeId(rand::random())));
        sans.extend(node_id.map(node_dns_name));
        let (cert_pem, key_pem) = ca.issue(name, &sans, args.valid_for)?;
        // What every peer will check, checked now.
        ClusterTls::from_pem(ca.pem.as_bytes(), cert_pem.as_bytes(), key_pem.as_bytes())
            .with_context(|| {
                format!("the certificate issued for {name} does not verify under {} (is ca.key the key of ca.pem?)", ca.path.display())
            })?;
        write(&key, &key_pem, 0o600, args.force)?;
        write(&cert, &cert_pem, 0o644, args.force)?;
        let roles: Vec<_> = args.roles.iter().map(|r| r.as_str()).collect();
        let id = node_id.map_or("none: shared".to_string(), |id| format!("{:016x}", id.0));
        println!(
            "issued  {} and {} (roles {}; node id {id})",
            cert.display(),
            key.display(),
            roles.join(",")
        );
    }
    let dir = args.out.display();
    println!("start each node with --tls-ca {dir}/ca.pem --tls-cert {dir}/NAME.pem --tls-key {dir}/NAME.key");
    Ok(())
}

/// The node id of the certificate at `path`, if one is there: a re-issued certificate keeps
/// it, so a node keeps its id across certificate rotation.
fn previous_node_id(path: &Path) -> Option<NodeId> {
    pem_node_ids(&std::fs::read(path).ok()?).first().copied()
}

/// A DNS name under a domain only `kvmesh certs` itself fills: roles (`--roles`) and node
/// ids.
fn is_reserved_name(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    [ROLE_DOMAIN, NODE_DOMAIN]
        .iter()
        .any(|domain| name == *domain || name.ends_with(&format!(".{domain}")))
}

fn node_file(dir: &Path, name: &str, ext: &str) -> PathBuf {
    dir.join(format!("{name}.{ext}"))
}

/// Letters, digits and '-' in dot-separated labels, none empty or at either end a '-'.
fn is_dns_name(name: &str) -> bool {
    name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        })
}

/// Names become file names and DNS names: keep them to what both accept.
fn check_node_name(name: &str) -> Result<()> {
    if !is_dns_name(name) {
        bail!("invalid node name {name:?}: use letters, digits, '-' and '.' (e.g. decode-1)");
    }
    if name == "ca" {
        bail!("\"ca\" names the CA's own files; pick another node name");
    }
    if is_reserved_name(name) {
        bail!("{name:?} would grant a role or a node id; pick another node name");
    }
    Ok(())
}

struct ClusterCa {
    issuer: Issuer<'static, KeyPair>,
    pem: String,
    path: PathBuf,
}

impl ClusterCa {
    /// The CA in `dir` (ca.pem + ca.key), or a new one written there.
    fn open_or_create(dir: &Path) -> Result<ClusterCa> {
        let (path, key_path) = (dir.join("ca.pem"), dir.join("ca.key"));
        match (path.exists(), key_path.exists()) {
            (true, true) => {
                let pem = read(&path)?;
                let key = KeyPair::from_pem(&read(&key_path)?)
                    .with_context(|| format!("no private key in {}", key_path.display()))?;
                let issuer = Issuer::from_ca_cert_pem(&pem, key)
                    .with_context(|| format!("no CA certificate in {}", path.display()))?;
                println!("using   {} (existing CA)", path.display());
                Ok(ClusterCa { issuer, pem, path })
            }
            (false, false) => {
                let mut params = CertificateParams::new(Vec::<String>::new())?;
                params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
                params.key_usages = vec![
                    KeyUsagePurpose::KeyCertSign,
                    KeyUsagePurpose::CrlSign,
                    KeyUsagePurpose::DigitalSignature,
                ];
                params
                    .distinguished_name
                    .push(DnType::CommonName, "kvmesh cluster CA");
                params.distinguished_name.push(DnType::OrganizationName, "kvmesh");
                validity(&mut params, CA_VALIDITY)?;
                let key = KeyPair::generate()?;
                let key_pem = key.serialize_pem();
                let pem = CertifiedIssuer::self_signed(params, key)?.pem();
                write(&key_path, &key_pem, 0o600, false)?;
                write(&path, &pem, 0o644, false)?;
                println!("created {} and {}", path.display(), key_path.display());
                // The same path as a reused CA takes.
                let issuer = Issuer::from_ca_cert_pem(&pem, KeyPair::from_pem(&key_pem)?)?;
                Ok(ClusterCa { issuer, pem, path })
            }
            (true, false) => bail!(
                "{} exists but {} does not: restore the CA key, or move ca.pem away to make a new CA \
                 (whose certificates the nodes of the old one will refuse)",
                path.display(),
                key_path.display()
            ),
            (false, true) => bail!(
                "{} exists but {} does not: restore the CA certificate or remove the stray key",
                key_path.display(),
                path.display()
            ),
        }
    }

    /// A certificate and key (PEM) for node `name`, usable as TLS server and client.
    fn issue(&self, name: &str, sans: &[String], valid_for: Duration) -> Result<(String, String)> {
        let mut names = vec![CLUSTER_SERVER_NAME.to_string(), name.to_string()];
        names.extend(sans.iter().cloned());
        let mut params = CertificateParams::new(names)
            .with_context(|| format!("invalid subject alternative name in {sans:?}"))?;
        params.distinguished_name.push(DnType::CommonName, name);
        params
            .distinguished_name
            .push(DnType::OrganizationName, "kvmesh");
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        validity(&mut params, valid_for)?;
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok((cert.pem(), key.serialize_pem()))
    }
}

fn validity(params: &mut CertificateParams, valid_for: Duration) -> Result<()> {
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - CLOCK_SKEW;
    params.not_after = time::Duration::try_from(valid_for)
        .ok()
        .and_then(|d| now.checked_add(d))
        .filter(|end| end.year() <= 9999)
        .with_context(|| {
            format!(
                "validity {} is too long",
                humantime::format_duration(valid_for)
            )
        })?;
    Ok(())
}

fn read(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

/// Writes `text` to `path` with `mode` (set at creation, so a key is never readable by
/// others even for a moment); refuses to replace a file unless `replace`.
fn write(path: &Path, text: &str, mode: u32, replace: bool) -> Result<()> {
    let mut options = std::fs::OpenOptions::new();
    options.write(true).mode(mode);
    if replace {
        options.create(true).truncate(true);
    } else {
        options.create_new(true);
    }
    let mut file = options
        .open(path)
        .with_context(|| format!("creating {}", path.display()))?;
    // `mode` applies only to new files; an old key file may have been looser.
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(mode))
        .with_context(|| format!("setting the permissions of {}", path.display()))?;
    file.write_all(text.as_bytes())
        .with_context(|| format!("writing {}", path.display()))
}
