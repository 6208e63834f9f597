//! The API's HTTPS listener (rustls, the `ring` provider).
//!
//! The controller issues its own server certificate from the mesh CA at start
//! ([`ApiCertificate::issue`]: a fresh key, the advertised API host, `127.0.0.1`,
//! `localhost` and the hostname as names, `api_certificate_lifetime_secs`
//! long), and again at two thirds of its lifetime in the background
//! ([`ApiCertificate::renew`]): the resolver swaps the new one in, so new
//! connections get it while open ones keep theirs. The chain it sends is the
//! leaf and the CA's certificate, so that a node joining with only the CA's
//! hash finds the CA in it and pins it (host-agent's `join.rs`).
//!
//! [`TlsListener`] is an [`axum::serve::Listener`]: TCP connections are
//! accepted in a task of their own and each handshake runs in its own task
//! (at most [`MAX_HANDSHAKES`] at once, each within [`HANDSHAKE_TIMEOUT`]), so a
//! slow or silent client never holds up the others; the API router is the
//! same one the loopback listener serves.

use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use chrono::{DateTime, Utc};
use mesh_credentials::pki::{CertInfo, MeshCa, PkiError};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_util::sync::CancellationToken;

/// Handshakes in progress at most; past it, accepted connections wait.
pub const MAX_HANDSHAKES: usize = 256;
/// A client that has not finished its handshake by then is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long to wait before trying again when issuing the certificate failed.
const RETRY: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("issuing the API's certificate: {0}")]
    Pki(#[from] PkiError),
    #[error("the API's certificate or key cannot be used: {0}")]
    Rustls(String),
}

/// The crypto provider of the controller's TLS: rustls' `ring` (decision 0028).
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The certificate the HTTPS listener presents, swapped in place on renewal.
#[derive(Debug)]
struct Swap(RwLock<Arc<CertifiedKey>>);

impl ResolvesServerCert for Swap {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.0.read().ok().map(|k| k.clone())
    }
}

/// The API's certificate: issued from the mesh CA, renewed before it expires.
pub struct ApiCertificate {
    ca: Arc<MeshCa>,
    names: Vec<String>,
    lifetime: Duration,
    current: Arc<Swap>,
    renew_at: DateTime<Utc>,
    not_after: DateTime<Utc>,
}

/// A certificate for `names` from `ca`, with when to renew it: two thirds of
/// the way from now to its end. (Not [`CertInfo::renew_at`]: certificates
/// start five minutes early for clocks a little behind, which would put the
/// renewal of a short-lived one in the past.)
fn certified(
    ca: &MeshCa,
    names: &[String],
    lifetime: Duration,
) -> Result<(Arc<CertifiedKey>, CertInfo, DateTime<Utc>), TlsError> {
    let issued_at = Utc::now();
    let issued = ca.issue_server(names, lifetime)?;
    let info = CertInfo::parse(&issued.certificate_pem)?;
    let renew_at = issued_at + (info.not_after - issued_at) * 2 / 3;
    let rustls_err = |e: &dyn std::fmt::Display| TlsError::Rustls(e.to_string());
    let leaf = CertificateDer::from_pem_slice(issued.certificate_pem.as_bytes())
        .map_err(|e| rustls_err(&e))?;
    let ca_der = CertificateDer::from_pem_slice(ca.certificate_pem().as_bytes())
        .map_err(|e| rustls_err(&e))?;
    let key = PrivateKeyDer::from_pem_slice(issued.key_pem.expose().as_bytes())
        .map_err(|_| TlsError::Rustls("the issued key is not PEM".into()))?;
    let signing = provider()
        .key_provider
        .load_private_key(key)
        .map_err(|e| rustls_err(&e))?;
    Ok((
        Arc::new(CertifiedKey::new(vec![leaf, ca_der], signing)),
        info,
        renew_at,
    ))
}

impl ApiCertificate {
    /// Issues the first certificate for `names`.
    pub fn issue(
        ca: Arc<MeshCa>,
        names: Vec<String>,
        lifetime: Duration,
    ) -> Result<ApiCertificate, TlsError> {
        let (key, info, renew_at) = certified(&ca, &names, lifetime)?;
        Ok(ApiCertificate {
            ca,
            names,
            lifetime,
            current: Arc::new(Swap(RwLock::new(key))),
            renew_at,
            not_after: info.not_after,
        })
    }

    /// The rustls configuration of the listener (HTTP/2 and HTTP/1.1).
    pub fn server_config(&self) -> Result<Arc<rustls::ServerConfig>, TlsError> {
        let mut config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Rustls(e.to_string()))?
            .with_no_client_auth()
            .with_cert_resolver(self.current.clone());
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }

    pub fn not_after(&self) -> DateTime<Utc> {
        self.not_after
    }

    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// When [`ApiCertificate::renew`] issues the next one.
    pub fn renew_at(&self) -> DateTime<Utc> {
        self.renew_at
    }

    /// Issues the certificate again at two thirds of its lifetime, until
    /// `shutdown`. A failure is logged and retried a minute later; the old
    /// certificate stays in place meanwhile.
    /// `expiry` is set to each certificate's `not_after` (Unix seconds).
    pub async fn renew(
        mut self,
        shutdown: CancellationToken,
        expiry: crate::metrics::SecondsGauge,
    ) {
        expiry.set(self.not_after.timestamp() as f64);
        loop {
            let wait = (self.renew_at - Utc::now())
                .to_std()
                .unwrap_or(Duration::ZERO);
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(wait) => {}
            }
            match certified(&self.ca, &self.names, self.lifetime) {
                Ok((key, info, renew_at)) => {
                    if let Ok(mut current) = self.current.0.write() {
                        *current = key;
                    }
                    self.renew_at = renew_at;
                    self.not_after = info.not_after;
                    expiry.set(info.not_after.timestamp() as f64);
                    tracing::info!(serial = %info.serial, not_after = %info.not_after, "API certificate renewed");
                }
                Err(e) => {
                    tracing::error!(error = %e, retry_in = ?RETRY, "cannot renew the API certificate; the current one stays");
                    self.renew_at = Utc::now() + RETRY;
                }
            }
        }
    }
}

/// A TCP listener whose connections come out TLS-terminated.
pub struct TlsListener {
    rx: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
}

impl TlsListener {
    /// Accepts on `tcp` and hands out connections whose handshake with
    /// `config` succeeded, until `shutdown`.
    pub fn new(
        tcp: TcpListener,
        config: Arc<rustls::ServerConfig>,
        shutdown: CancellationToken,
    ) -> std::io::Result<TlsListener> {
        let local = tcp.local_addr()?;
        let (tx, rx) = mpsc::channel(64);
        let acceptor = TlsAcceptor::from(config);
        let permits = Arc::new(Semaphore::new(MAX_HANDSHAKES));
        tokio::spawn(async move {
            loop {
                let permit = tokio::select! {
                    () = shutdown.cancelled() => return,
                    p = permits.clone().acquire_owned() => match p {
                        Ok(p) => p,
                        Err(_) => return,
                    },
                };
                let (stream, peer) = tokio::select! {
                    () = shutdown.cancelled() => return,
                    accepted = tcp.accept() => match accepted {
                        Ok(a) => a,
                        Err(e) => {
                            // Out of descriptors and the like: pause, as axum does.
                            tracing::warn!(error = %e, "HTTPS accept failed");
                            tokio::time::sleep(Duration::from_millis(200)).await;
                            continue;
                        }
                    },
                };
                let acceptor = acceptor.clone();
                let tx = tx.clone();
                tokio::spawn(async move {
                    let _permit = permit;
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                        Ok(Ok(tls)) => {
                            let _ = tx.send((tls, peer)).await;
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake refused"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                });
            }
        });
        Ok(TlsListener { rx, local })
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.rx.recv().await {
            Some(conn) => conn,
            // The accept task ended (shutdown): nothing more comes; axum's
            // graceful shutdown ends the serve loop.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}
