//! The API's HTTPS listener: served with a certificate issued from the mesh
//! CA (leaf and CA in the chain, the names it was issued for), verified by a
//! client that trusts that CA alone, and renewed in place at two thirds of its
//! lifetime (new connections get the new certificate).

use std::sync::Arc;
use std::time::Duration;

use mesh_controller::tls::{ApiCertificate, TlsListener};
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio_util::sync::CancellationToken;

/// The serial of the certificate the listener at `addr` presents, and the
/// length of its chain, through a client that trusts only `ca_pem`.
async fn presented(addr: std::net::SocketAddr, ca_pem: &str) -> anyhow::Result<(String, usize)> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from_pem_slice(ca_pem.as_bytes())?)?;
    let config = rustls::ClientConfig::builder_with_provider(mesh_controller::tls::provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let tls = connector
        .connect(ServerName::try_from("127.0.0.1")?, tcp)
        .await?;
    let chain = tls
        .get_ref()
        .1
        .peer_certificates()
        .ok_or_else(|| anyhow::anyhow!("no chain"))?;
    let pem = pem_of(chain[0].as_ref());
    Ok((
        mesh_credentials::pki::CertInfo::parse(&pem)?.serial,
        chain.len(),
    ))
}

fn pem_of(der: &[u8]) -> String {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let lines: Vec<&str> = b64
        .as_bytes()
        .chunks(64)
        .map(|c| std::str::from_utf8(c).unwrap_or_default())
        .collect();
    format!(
        "-----BEGIN CERTIFICATE-----\n{}\n-----END CERTIFICATE-----\n",
        lines.join("\n")
    )
}

#[tokio::test]
async fn https_with_a_certificate_from_the_mesh_ca_renewed_in_place() -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let ca = mesh_credentials::pki::MeshCa::generate("test CA")?;
    let ca_pem = ca.certificate_pem().to_owned();
    let cert = ApiCertificate::issue(
        Arc::new(ca),
        vec!["127.0.0.1".into(), "localhost".into()],
        Duration::from_secs(3),
    )?;
    let renew_in = (cert.renew_at() - chrono::Utc::now()).num_milliseconds();
    assert!(
        (1000..=2100).contains(&renew_in),
        "renewal in {renew_in} ms"
    );
    let shutdown = CancellationToken::new();
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let listener = TlsListener::new(tcp, cert.server_config()?, shutdown.clone())?;
    let addr = axum::serve::Listener::local_addr(&listener)?;
    let app = axum::Router::new().route("/healthz", axum::routing::get(|| async { "ok" }));
    let served = tokio::spawn(
        axum::serve(listener, app)
            .with_graceful_shutdown(shutdown.clone().cancelled_owned())
            .into_future(),
    );
    let expiry = mesh_controller::metrics::SecondsGauge::default();
    let first_end = cert.not_after().timestamp() as f64;
    tokio::spawn(cert.renew(shutdown.clone(), expiry.clone()));

    // HTTP over it, verified against the CA alone.
    let http = reqwest::Client::builder()
        .use_rustls_tls()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(ca_pem.as_bytes())?)
        .build()?;
    let body = http
        .get(format!("https://127.0.0.1:{}/healthz", addr.port()))
        .send()
        .await?
        .text()
        .await?;
    assert_eq!(body, "ok");

    let (first, chain) = presented(addr, &ca_pem).await?;
    assert_eq!(chain, 2, "leaf and CA");
    // Another CA's client refuses it.
    let other = mesh_credentials::pki::MeshCa::generate("other CA")?;
    assert!(presented(addr, other.certificate_pem()).await.is_err());

    // Past two thirds of its three seconds: a new certificate for new connections.
    let renewed = async {
        loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let (serial, _) = presented(addr, &ca_pem).await?;
            if serial != first {
                return anyhow::Ok(serial);
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), renewed).await??;
    // The expiry gauge follows the certificate: the renewed one ends later.
    let later = async {
        while expiry.get() <= first_end {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(5), later).await?;

    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(5), served).await???;
    Ok(())
}
