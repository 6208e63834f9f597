//! `mesh-agent join`: enrol this node with a join token, over HTTPS pinned to
//! the mesh CA.
//!
//! Generates the node's Ed25519 key pair and its X25519 seal key (secrets are
//! sealed to it) in the state directory (the private keys, mode 0600, never
//! leave the node), sends the public key with the token to
//! `POST <api>/v1/join`, and writes what comes back — the broker URL with the
//! node's own credentials (the advertised AMQPS endpoint), the controller's
//! declaration-signing key, the API's URL and the mesh CA's certificate — to
//! `credentials.toml` (mode 0600). The agent then runs with `mesh-agent run`.
//!
//! **The pin.** The join command carries `--ca-hash sha256:<hex>`, the SHA-256
//! of the mesh CA certificate's SubjectPublicKeyInfo (as kubeadm's
//! `--discovery-token-ca-cert-hash`). The TLS client trusts no root store: its
//! verifier ([`PinnedCa`]) looks in the chain the controller presents for the
//! certificate whose public key has that hash, and verifies the leaf up to it
//! (webpki, that certificate as the only trust anchor, the host name or IP
//! address of `--api` checked against the leaf). Anything else fails the
//! handshake, so the token is never sent to a server that cannot prove it is
//! the mesh's. The CA certificate found there is what the node keeps, and
//! verifies the broker and the API with from then on.
//!
//! Plain `http://` is accepted only for a loopback API (the local mesh,
//! tests), without a pin.
//!
//! This is the agent's only HTTP request, and it happens before the agent runs:
//! once running, the agent never asks (it states and is told).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use base64::Engine as _;
use mesh_credentials::AgentCredentials;
use mesh_credentials::advertise::is_loopback_host;
pub use mesh_credentials::key::NODE_KEY_FILE;
use mesh_protocol::{DeclarationSigner, NodeId, PublicKey, Secret};
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
use serde::Deserialize;

#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    #[error("state directory {path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error(transparent)]
    Credentials(#[from] mesh_credentials::CredentialsError),
    /// `--api` or `--ca-hash` is not usable; nothing was sent.
    #[error("{0}; nothing was sent")]
    Usage(String),
    #[error("cannot reach the API at {api}: {message}")]
    Http { api: String, message: String },
    /// The controller's chain holds no certificate with the pinned public key,
    /// or its leaf does not verify up to it: the TLS handshake failed and the
    /// token was not sent.
    #[error(
        "the controller at {api} is not the mesh the join command names: {reason} (expected CA {expected}; the chain presented {presented:?}). The join token was not sent"
    )]
    PinMismatch {
        api: String,
        expected: String,
        presented: Vec<String>,
        reason: String,
    },
    /// The API refused the join (problem+json detail; never the token).
    #[error("the join was refused ({status}): {detail}")]
    Refused { status: u16, detail: String },
    #[error("the API's answer is not usable: {0}")]
    BadAnswer(String),
}

#[derive(Deserialize)]
struct Answer {
    node: String,
    broker_url: Secret<String>,
    controller_key: String,
    /// The API's advertised URL (newer controllers).
    #[serde(default)]
    api_url: Option<String>,
    /// The mesh CA's certificate (newer controllers with a CA).
    #[serde(default)]
    ca_certificate: Option<String>,
}

/// What a successful join wrote.
#[derive(Debug)]
pub struct Joined {
    pub node: NodeId,
    pub credentials: PathBuf,
    pub public_key: String,
    /// The broker URL without its password.
    pub broker: String,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> JoinError + '_ {
    move |error| JoinError::Io {
        path: path.to_owned(),
        error,
    }
}

/// A CA pin: `sha256:` and 64 lower-case hex digits.
pub fn parse_pin(value: &str) -> Result<String, JoinError> {
    let v = value.trim().to_ascii_lowercase();
    match v.strip_prefix("sha256:") {
        Some(hex) if hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()) => Ok(v),
        _ => Err(JoinError::Usage(format!(
            "--ca-hash `{value}` is not sha256:<64 hex digits> (the hash `meshctl node add` prints)"
        ))),
    }
}

/// The PEM of a DER certificate.
pub fn pem_of_der(der: &[u8]) -> String {
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let mut pem = String::from("-----BEGIN CERTIFICATE-----\n");
    for chunk in b64.as_bytes().chunks(64) {
        pem.push_str(&String::from_utf8_lossy(chunk));
        pem.push('\n');
    }
    pem.push_str("-----END CERTIFICATE-----\n");
    pem
}

/// The pin of a DER certificate; `None` when it cannot be read.
fn pin_of_der(der: &[u8]) -> Option<String> {
    mesh_credentials::pki::pin_of(&pem_of_der(der)).ok()
}

/// The crypto provider of every TLS client of the agent: rustls' `ring`
/// (decision 0028), named here rather than taken from the process default.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// What the verifier saw in the handshake.
#[derive(Debug, Default)]
struct Seen {
    /// The pins of every certificate the server presented, leaf first.
    presented: Vec<String>,
    /// The presented certificate whose pin matched, once the leaf verified.
    anchor: Option<CertificateDer<'static>>,
    /// Why the chain was refused.
    refused: Option<String>,
}

/// A server certificate verifier that trusts the one certificate in the
/// presented chain whose SubjectPublicKeyInfo has the pinned SHA-256, and
/// verifies the leaf up to it with webpki (names, validity, signatures,
/// usages) — kubeadm's discovery-token-ca-cert-hash, in rustls.
#[derive(Debug)]
pub struct PinnedCa {
    pin: String,
    provider: Arc<CryptoProvider>,
    seen: Mutex<Seen>,
}

impl PinnedCa {
    pub fn new(pin: String) -> PinnedCa {
        PinnedCa {
            pin,
            provider: provider(),
            seen: Mutex::new(Seen::default()),
        }
    }

    fn refuse(&self, reason: String) -> rustls::Error {
        if let Ok(mut s) = self.seen.lock() {
            s.refused = Some(reason.clone());
        }
        rustls::Error::General(reason)
    }
}

impl ServerCertVerifier for PinnedCa {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let mut presented = Vec::new();
        let mut anchor: Option<CertificateDer<'static>> = None;
        for cert in std::iter::once(end_entity).chain(intermediates) {
            let pin = pin_of_der(cert).unwrap_or_else(|| "unreadable".into());
            if pin == self.pin && anchor.is_none() {
                anchor = Some(cert.clone().into_owned());
            }
            presented.push(pin);
        }
        if let Ok(mut s) = self.seen.lock() {
            s.presented = presented;
        }
        let Some(anchor) = anchor else {
            return Err(self.refuse("no certificate in its chain has the pinned public key".into()));
        };
        let mut roots = RootCertStore::empty();
        roots
            .add(anchor.clone())
            .map_err(|e| self.refuse(format!("the pinned certificate is no CA: {e}")))?;
        let inner =
            WebPkiServerVerifier::builder_with_provider(Arc::new(roots), self.provider.clone())
                .build()
                .map_err(|e| self.refuse(format!("cannot verify against the pinned CA: {e}")))?;
        let rest: Vec<CertificateDer<'_>> = intermediates
            .iter()
            .filter(|c| c.as_ref() != anchor.as_ref())
            .cloned()
            .collect();
        inner
            .verify_server_cert(end_entity, &rest, server_name, ocsp_response, now)
            .map_err(|e| {
                self.refuse(format!(
                    "its certificate does not verify against the pinned CA: {e}"
                ))
            })?;
        if let Ok(mut s) = self.seen.lock() {
            s.anchor = Some(anchor);
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// A rustls client configuration that trusts only `ca_pem` (the mesh CA the
/// node keeps): for the agent's HTTPS requests after its join.
pub fn mesh_ca_client_config(ca_pem: &str) -> Result<rustls::ClientConfig, String> {
    use rustls::pki_types::pem::PemObject as _;
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        let cert = cert.map_err(|e| format!("the mesh CA is not PEM: {e}"))?;
        roots
            .add(cert)
            .map_err(|e| format!("the mesh CA is not usable: {e}"))?;
    }
    if roots.is_empty() {
        return Err("the mesh CA holds no certificate".into());
    }
    Ok(rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// Join as `node` with `token` through the API at `api`: `https://host:port`
/// with `ca_hash` (the pin), or `http://<loopback>:port` without.
// Long on purpose: the join is one sequence, read top to bottom (what may
// be sent, the fresh keys, the pinned request, the checks of the answer, the
// credentials written), each step guarding the next; it runs once per node.
pub async fn join(
    api: &str,
    token: &Secret<String>,
    ca_hash: Option<&str>,
    node: &NodeId,
    state_dir: &Path,
) -> Result<Joined, JoinError> {
    // What may be sent, before anything is made or sent.
    let api_url = url::Url::parse(api)
        .map_err(|e| JoinError::Usage(format!("--api `{api}` is not a URL ({e})")))?;
    let host = api_url.host_str().unwrap_or_default().to_owned();
    let pinned = match (api_url.scheme(), ca_hash) {
        ("https", Some(hash)) => Some(Arc::new(PinnedCa::new(parse_pin(hash)?))),
        ("https", None) => {
            return Err(JoinError::Usage(
                "--ca-hash is required with an https:// API: it is how the node knows the controller is the mesh's (the join command `meshctl node add` prints has it)".into(),
            ));
        }
        ("http", _) if is_loopback_host(&host) => None,
        ("http", _) => {
            return Err(JoinError::Usage(format!(
                "--api `{api}`: plain http:// would send the join token in cleartext; it is for a loopback API only (use the https:// URL `meshctl node add` prints)"
            )));
        }
        (other, _) => {
            return Err(JoinError::Usage(format!(
                "--api `{api}`: scheme `{other}` is not https"
            )));
        }
    };

    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(state_dir)
        .map_err(io(state_dir))?;
    // A fresh key pair for every join: re-enrolment is under a new key.
    let key = DeclarationSigner::from_seed(rand::random());
    mesh_credentials::key::write_signing_key(&state_dir.join(NODE_KEY_FILE), &key)?;
    let public_key = key.public_key_hex();
    // The key secrets are sealed to, beside it: also fresh, also never sent
    // (its public half goes in every hello).
    let seal_key = mesh_protocol::sealing::SealSecretKey::from_seed(rand::random());
    mesh_credentials::key::write_seal_key(
        &state_dir.join(mesh_credentials::key::SEAL_KEY_FILE),
        &seal_key,
    )?;

    let url = format!("{}/v1/join", api.trim_end_matches('/'));
    let http_err = |e: reqwest::Error| JoinError::Http {
        api: api.to_owned(),
        message: error_chain(&e.without_url()),
    };
    let mut builder = reqwest::Client::builder().timeout(std::time::Duration::from_secs(30));
    if let Some(verifier) = &pinned {
        let tls = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| JoinError::Usage(format!("TLS set-up: {e}")))?
            .dangerous()
            .with_custom_certificate_verifier(verifier.clone())
            .with_no_client_auth();
        builder = builder.use_preconfigured_tls(tls).https_only(true);
    }
    let http = builder.build().map_err(http_err)?;
    let sent = http
        .post(&url)
        .json(&serde_json::json!({
            "token": token.expose(),
            "node": node.as_str(),
            "public_key": public_key,
        }))
        .send()
        .await;
    let response = match sent {
        Ok(r) => r,
        Err(e) => {
            if let Some(verifier) = &pinned
                && let Ok(seen) = verifier.seen.lock()
                && let Some(reason) = &seen.refused
            {
                return Err(JoinError::PinMismatch {
                    api: api.to_owned(),
                    expected: verifier.pin.clone(),
                    presented: seen.presented.clone(),
                    reason: reason.clone(),
                });
            }
            return Err(http_err(e));
        }
    };
    let status = response.status();
    let body = response.bytes().await.map_err(http_err)?;
    if !status.is_success() {
        let detail = serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v.get("detail").and_then(|d| d.as_str()).map(str::to_owned))
            .unwrap_or_else(|| String::from_utf8_lossy(&body).chars().take(300).collect());
        return Err(JoinError::Refused {
            status: status.as_u16(),
            detail,
        });
    }
    let answer: Answer = serde_json::from_slice(&body)
        .map_err(|e| JoinError::BadAnswer(format!("not the expected JSON: {e}")))?;
    if answer.node != node.as_str() {
        return Err(JoinError::BadAnswer(format!(
            "it enrolled `{}`, not `{node}`",
            answer.node
        )));
    }
    let controller_key = PublicKey::from_hex(&answer.controller_key)
        .map_err(|e| JoinError::BadAnswer(format!("controller_key: {e}")))?;
    // A node joining over the network must be handed an endpoint it can reach.
    let broker_host = url::Url::parse(answer.broker_url.expose())
        .ok()
        .and_then(|u| u.host_str().map(str::to_owned))
        .unwrap_or_default();
    if !is_loopback_host(&host) && is_loopback_host(&broker_host) {
        return Err(JoinError::BadAnswer(format!(
            "the controller handed a loopback broker ({broker_host}) to a node joining from another machine: set advertise_broker on the controller (bundle/up does), then join again with a new token"
        )));
    }
    // The CA the node keeps: over HTTPS, the one the handshake proved (the
    // answer's copy, if any, must be that one); over loopback HTTP, the answer's.
    let ca_certificate = match &pinned {
        Some(verifier) => {
            let anchor = verifier
                .seen
                .lock()
                .ok()
                .and_then(|s| s.anchor.clone())
                .ok_or_else(|| JoinError::BadAnswer("the handshake kept no CA".into()))?;
            let pem = pem_of_der(anchor.as_ref());
            if let Some(sent) = &answer.ca_certificate
                && mesh_credentials::pki::pin_of(sent).ok().as_deref() != Some(&verifier.pin)
            {
                return Err(JoinError::BadAnswer(
                    "ca_certificate is not the pinned CA".into(),
                ));
            }
            Some(pem)
        }
        None => answer.ca_certificate.clone(),
    };
    let api_url = answer
        .api_url
        .clone()
        .or_else(|| (api_url.scheme() == "https").then(|| api.trim_end_matches('/').to_owned()));
    let creds = AgentCredentials {
        node: node.clone(),
        broker_url: answer.broker_url,
        controller_key,
        ca_certificate,
        api_url,
    };
    // The writer checks it reads back before it replaces anything; what the
    // agent could not read (a broker user that is not the node, a plain
    // broker elsewhere than loopback) is the answer's fault.
    creds.write(state_dir).map_err(|e| match e {
        mesh_credentials::CredentialsError::Invalid { field, reason, .. } => {
            JoinError::BadAnswer(format!("{field}: {reason}"))
        }
        other => JoinError::Credentials(other),
    })?;
    Ok(Joined {
        node: node.clone(),
        credentials: AgentCredentials::path_in(state_dir),
        public_key,
        broker: creds.redacted_url(),
    })
}

/// An error with its sources, `: `-separated (reqwest's own Display is terse).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pins_are_checked() {
        let good = format!("sha256:{}", "ab".repeat(32));
        assert_eq!(
            parse_pin(&good.to_uppercase().replace("SHA256", "sha256")).unwrap(),
            good
        );
        for bad in [
            "",
            "sha256:",
            "ab".repeat(32).as_str(),
            "sha1:abcd",
            "sha256:zz",
        ] {
            let err = parse_pin(bad).unwrap_err().to_string();
            assert!(
                err.contains("--ca-hash") && err.contains("nothing was sent"),
                "{err}"
            );
        }
    }

    #[test]
    fn pem_of_der_reads_back_with_the_same_pin() {
        let ca = mesh_credentials::pki::MeshCa::generate("t").unwrap();
        use rustls::pki_types::pem::PemObject as _;
        let der = CertificateDer::from_pem_slice(ca.certificate_pem().as_bytes()).unwrap();
        assert_eq!(pin_of_der(der.as_ref()).unwrap(), ca.pin());
    }

    #[tokio::test]
    async fn what_would_leak_is_refused_before_anything_is_sent() {
        let dir = tempfile::tempdir().unwrap();
        let node = NodeId::parse("node-a").unwrap();
        let token = Secret::new("tok".to_string());
        for (api, hash, says) in [
            ("https://192.0.2.2:7443", None, "--ca-hash is required"),
            ("http://192.0.2.2:7700", None, "cleartext"),
            ("ftp://192.0.2.2", None, "not https"),
            ("https://192.0.2.2:7443", Some("sha256:12"), "--ca-hash"),
        ] {
            let err = join(api, &token, hash, &node, dir.path())
                .await
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(says) && err.contains("nothing was sent"),
                "{api}: {err}"
            );
        }
        assert!(
            !dir.path().join(NODE_KEY_FILE).exists(),
            "nothing made either"
        );
    }
}
