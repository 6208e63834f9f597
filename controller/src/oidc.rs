//! The HTTP client identity fetches OIDC issuers' documents through
//! (`POST /v1/tokens/exchange`, decision 0049): the discovery document and
//! the key set of a trusted issuer, each within a deadline and a size bound.
//!
//! https issuers are verified against the CA bundle of the setting
//! `oidc_ca_file` alone (the system's, by default: an issuer is usually a
//! public service, unlike everything else this controller talks to, which
//! trusts the mesh CA alone); a loopback `http://` issuer needs none.

use std::path::Path;
use std::time::Duration;

use mesh_identity::{BoxFuture, HttpFetch};

/// The longest one fetch may take, connect to last byte.
const FETCH_TIMEOUT: Duration = Duration::from_secs(5);

/// The largest document read (a key set is a few KiB).
const MAX_DOCUMENT_BYTES: usize = 1 << 20;

/// Fetches with reqwest, redirects refused (an issuer's documents are at the
/// URLs it names).
pub struct IssuerClient {
    client: reqwest::Client,
}

impl IssuerClient {
    /// A client trusting the CAs of the PEM bundle at `ca_file`; a missing or
    /// unreadable bundle leaves https issuers unreachable (said once here, and
    /// in every refused exchange) and loopback http ones reachable.
    pub fn new(ca_file: &Path) -> Result<IssuerClient, reqwest::Error> {
        let mut builder = reqwest::Client::builder()
            .timeout(FETCH_TIMEOUT)
            .connect_timeout(FETCH_TIMEOUT)
            .redirect(reqwest::redirect::Policy::none())
            .tls_built_in_root_certs(false)
            .use_rustls_tls();
        match std::fs::read(ca_file) {
            Ok(pem) => match reqwest::Certificate::from_pem_bundle(&pem) {
                Ok(certs) => {
                    for c in certs {
                        builder = builder.add_root_certificate(c);
                    }
                }
                Err(e) => {
                    tracing::warn!(file = %ca_file.display(), error = %e, "oidc_ca_file is not a PEM bundle: https OIDC issuers cannot be verified")
                }
            },
            Err(e) => {
                tracing::info!(file = %ca_file.display(), error = %e, "no oidc_ca_file: https OIDC issuers cannot be verified (loopback http ones can)")
            }
        }
        Ok(IssuerClient {
            client: builder.build()?,
        })
    }
}

impl HttpFetch for IssuerClient {
    fn get<'a>(&'a self, url: &'a str) -> BoxFuture<'a, Result<Vec<u8>, String>> {
        Box::pin(async move {
            let response = self
                .client
                .get(url)
                .header("accept", "application/json")
                .send()
                .await
                .map_err(|e| format!("GET {url}: {e}"))?;
            let status = response.status();
            if !status.is_success() {
                return Err(format!("GET {url}: {status}"));
            }
            let mut response = response;
            let mut body = Vec::new();
            while let Some(chunk) = response
                .chunk()
                .await
                .map_err(|e| format!("GET {url}: {e}"))?
            {
                if body.len() + chunk.len() > MAX_DOCUMENT_BYTES {
                    return Err(format!("GET {url}: larger than {MAX_DOCUMENT_BYTES} bytes"));
                }
                body.extend_from_slice(&chunk);
            }
            Ok(body)
        })
    }
}
