//! TLS and mTLS for the gRPC listener, with rustls, from certificate files that are reloaded
//! when they change. Each new connection uses the configuration current at its handshake; open
//! connections keep theirs, so a rotation drops nobody.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, SystemTime};

use crate::sync::lock;
use rustls::RootCertStore;
use rustls::server::{ServerConfig, WebPkiClientVerifier};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::TlsAcceptor;

/// Where the certificates are.
#[derive(Debug, Clone, PartialEq)]
pub struct TlsFiles {
    /// The server's certificate chain (PEM).
    pub cert: PathBuf,
    /// The server's private key (PEM).
    pub key: PathBuf,
    /// CA certificates (PEM) that client certificates must chain to; set for mTLS.
    pub client_ca: Option<PathBuf>,
}

impl TlsFiles {
    fn paths(&self) -> Vec<&Path> {
        let mut v = vec![self.cert.as_path(), self.key.as_path()];
        v.extend(self.client_ca.as_deref());
        v
    }

    fn stamps(&self) -> Vec<Option<(SystemTime, u64)>> {
        self.paths()
            .iter()
            .map(|p| {
                std::fs::metadata(p)
                    .ok()
                    .map(|m| (m.modified().unwrap_or(SystemTime::UNIX_EPOCH), m.len()))
            })
            .collect()
    }

    /// Builds a rustls configuration from the files as they are now.
    pub fn load(&self) -> anyhow::Result<ServerConfig> {
        use anyhow::Context;
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&self.cert)
            .with_context(|| format!("reading {}", self.cert.display()))?
            .collect::<Result<_, _>>()
            .with_context(|| format!("parsing certificates in {}", self.cert.display()))?;
        anyhow::ensure!(
            !certs.is_empty(),
            "no certificate in {}",
            self.cert.display()
        );
        let key = PrivateKeyDer::from_pem_file(&self.key)
            .with_context(|| format!("reading the private key in {}", self.key.display()))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()?;
        let builder = match &self.client_ca {
            Some(ca) => {
                let mut roots = RootCertStore::empty();
                for cert in CertificateDer::pem_file_iter(ca)
                    .with_context(|| format!("reading {}", ca.display()))?
                {
                    roots
                        .add(cert.with_context(|| format!("parsing {}", ca.display()))?)
                        .with_context(|| format!("adding a CA from {}", ca.display()))?;
                }
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                        .build()
                        .context("building the client certificate verifier")?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let mut config = builder
            .with_single_cert(certs, key)
            .context("the certificate and key do not match")?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(config)
    }
}

/// The current TLS configuration, reloaded from its files.
pub struct Tls {
    files: TlsFiles,
    current: RwLock<Arc<ServerConfig>>,
    stamps: Mutex<Vec<Option<(SystemTime, u64)>>>,
}

impl Tls {
    /// Loads the files; fails if they are missing or do not form a valid configuration.
    pub fn load(files: TlsFiles) -> anyhow::Result<Arc<Tls>> {
        let stamps = files.stamps();
        let config = files.load()?;
        Ok(Arc::new(Tls {
            files,
            current: RwLock::new(Arc::new(config)),
            stamps: Mutex::new(stamps),
        }))
    }

    /// An acceptor for the next handshake.
    pub fn acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(
            self.current
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .clone(),
        )
    }

    /// Reloads if any file changed since the last look; a broken new set is logged and the old
    /// configuration kept. Returns whether a new configuration is in use.
    pub fn reload_if_changed(&self) -> bool {
        let now = self.files.stamps();
        let mut seen = lock(&self.stamps);
        if *seen == now {
            return false;
        }
        match self.files.load() {
            Ok(config) => {
                *seen = now;
                *self.current.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(config);
                tracing::info!(cert = %self.files.cert.display(), "TLS certificates reloaded");
                true
            }
            Err(error) => {
                // Files are often replaced one at a time: try again at the next look.
                tracing::warn!(%error, "TLS files changed but do not load; keeping the previous ones");
                false
            }
        }
    }

    /// Looks for changed files every `every` until the process ends.
    pub fn spawn_reloader(self: &Arc<Self>, every: Duration) {
        let tls = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(tls) = tls.upgrade() else { return };
                tls.reload_if_changed();
            }
        });
    }
}
