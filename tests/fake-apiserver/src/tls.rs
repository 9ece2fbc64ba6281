//! TLS as the kube-apiserver serves it: a certificate for the loopback names from a CA of its
//! own, ALPN offering `h2` and `http/1.1`, and at most [`MAX_STREAMS`] concurrent HTTP/2 streams
//! per connection (Go's default since the 2023 rapid-reset fixes, which the kube-apiserver
//! keeps with `--http2-max-streams-per-connection` 0).

use std::sync::Arc;

use anyhow::Context;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// Concurrent streams per HTTP/2 connection.
pub const MAX_STREAMS: u32 = 100;

/// The token the emitted kubeconfig's user carries.
pub const ADMIN_TOKEN: &str = "fake-apiserver-admin-token";

/// A CA and the server certificate it signed.
#[derive(Clone)]
pub struct Tls {
    /// The CA certificate, PEM.
    pub ca_pem: String,
    pub(crate) acceptor: tokio_rustls::TlsAcceptor,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls").finish_non_exhaustive()
    }
}

impl Tls {
    /// A fresh CA, and a certificate from it for `localhost`, `127.0.0.1` and `::1`; ALPN
    /// offers `h2` only if `http2`.
    pub fn generate(http2: bool) -> anyhow::Result<Tls> {
        let ca_key = KeyPair::generate()?;
        let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "fake-apiserver CA");
        let ca = ca_params.self_signed(&ca_key)?;
        let issuer = Issuer::new(ca_params, ca_key);
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(vec![
            "localhost".to_string(),
            "127.0.0.1".to_string(),
            "::1".to_string(),
        ])?;
        params
            .distinguished_name
            .push(DnType::CommonName, "kube-apiserver");
        let cert = params.signed_by(&key, &issuer)?;
        let chain = vec![CertificateDer::from_pem_slice(cert.pem().as_bytes())?];
        let key = PrivateKeyDer::from_pem_slice(key.serialize_pem().as_bytes())?;
        let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .context("the server certificate")?;
        config.alpn_protocols = match http2 {
            true => vec![b"h2".to_vec(), b"http/1.1".to_vec()],
            false => vec![b"http/1.1".to_vec()],
        };
        Ok(Tls {
            ca_pem: ca.pem(),
            acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(config)),
        })
    }
}
