//! rustls configurations for both ends of a connection, on the ring provider (no aws-lc).

use super::config::{QuicError, TlsConfig};
use kvmesh_common::tls::ClusterTls;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
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
            // Checked by the handshake against `server_name`, which need not be the cluster's.
            mutual(
                &ClusterTls::load_unchecked(ca, cert, key)?,
                provider,
                &versions,
            )?
        }
        TlsConfig::Cluster(tls) => mutual(tls, provider, &versions)?,
    };
    pair.server.alpn_protocols = vec![ALPN.to_vec()];
    pair.client.alpn_protocols = vec![ALPN.to_vec()];
    Ok(pair)
}

/// Both ends present `tls`'s certificate and accept only peers its CA signed.
fn mutual(
    tls: &ClusterTls,
    provider: Arc<CryptoProvider>,
    versions: &[&'static rustls::SupportedProtocolVersion],
) -> Result<TlsPair, QuicError> {
    let roots = Arc::new(tls.roots()?);
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        roots.clone(),
        provider.clone(),
    )
    .build()
    .map_err(|e| QuicError::Verifier(e.to_string()))?;
    let server = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(versions)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(tls.chain(), tls.key())?;
    let client = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(versions)?
        .with_root_certificates(roots)
        .with_client_auth_cert(tls.chain(), tls.key())?;
    Ok(TlsPair { server, client })
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
