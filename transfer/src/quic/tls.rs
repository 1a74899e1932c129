//! rustls configurations for both ends of a connection, on the ring provider (no aws-lc).

use super::config::{QuicError, TlsConfig};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
use std::path::Path;
use std::sync::Arc;

/// ALPN of the KV transfer protocol; a peer speaking anything else fails the handshake.
pub const ALPN: &[u8] = b"kvmesh-kv/1";

pub(super) struct TlsPair {
    pub server: rustls::ServerConfig,
    pub client: rustls::ClientConfig,
}

pub(super) fn build(tls: &TlsConfig, server_name: &str) -> Result<TlsPair, QuicError> {
    // AES-128-GCM first: QUIC encrypts every packet with the negotiated suite, and it is
    // the cheapest per byte (fewer AES rounds than AES-256) on CPUs with AES instructions.
    let mut provider = rustls::crypto::ring::default_provider();
    provider
        .cipher_suites
        .sort_by_key(|s| s.suite() != rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
    let provider = Arc::new(provider);
    let versions = [&rustls::version::TLS13];
    let mut pair = match tls {
        TlsConfig::SelfSigned => {
            let key = rcgen::generate_simple_self_signed(vec![server_name.to_string()])?;
            let cert = key.cert.der().clone();
            let key = PrivateKeyDer::try_from(key.signing_key.serialize_der())
                .map_err(|e| QuicError::Config(e.to_string()))?;
            let server = rustls::ServerConfig::builder_with_provider(provider.clone())
                .with_protocol_versions(&versions)?
                .with_no_client_auth()
                .with_single_cert(vec![cert], key)?;
            let client = rustls::ClientConfig::builder_with_provider(provider.clone())
                .with_protocol_versions(&versions)?
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(AnyServerCert(provider)))
                .with_no_client_auth();
            TlsPair { server, client }
        }
        TlsConfig::Files { ca, cert, key } => {
            let mut roots = RootCertStore::empty();
            for c in certs(ca)? {
                roots.add(c)?;
            }
            let roots = Arc::new(roots);
            let chain = certs(cert)?;
            let key_bytes = read(key)?;
            let key = PrivateKeyDer::from_pem_slice(&key_bytes).map_err(|_| QuicError::NoPem {
                what: "private key",
                path: key.clone(),
            })?;
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                roots.clone(),
                provider.clone(),
            )
            .build()
            .map_err(|e| QuicError::Verifier(e.to_string()))?;
            let server = rustls::ServerConfig::builder_with_provider(provider.clone())
                .with_protocol_versions(&versions)?
                .with_client_cert_verifier(verifier)
                .with_single_cert(chain.clone(), key.clone_key())?;
            let client = rustls::ClientConfig::builder_with_provider(provider)
                .with_protocol_versions(&versions)?
                .with_root_certificates(roots)
                .with_client_auth_cert(chain, key)?;
            TlsPair { server, client }
        }
    };
    pair.server.alpn_protocols = vec![ALPN.to_vec()];
    pair.client.alpn_protocols = vec![ALPN.to_vec()];
    Ok(pair)
}

fn read(path: &Path) -> Result<Vec<u8>, QuicError> {
    std::fs::read(path).map_err(|source| QuicError::ReadFile {
        path: path.to_path_buf(),
        source,
    })
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, QuicError> {
    let bytes = read(path)?;
    let certs: Vec<_> = CertificateDer::pem_slice_iter(&bytes)
        .filter_map(Result::ok)
        .collect();
    if certs.is_empty() {
        return Err(QuicError::NoPem {
            what: "certificate",
            path: path.to_path_buf(),
        });
    }
    Ok(certs)
}

/// Accepts any server certificate, but still checks that the server holds its key: the
/// session is encrypted to whoever answered, who is not authenticated.
#[derive(Debug)]
struct AnyServerCert(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyServerCert {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
