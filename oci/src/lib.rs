//! A small client of the OCI distribution API (docs/decisions/0032): blobs by
//! digest, manifests by tag or digest, and the mesh's artifacts and their
//! signatures beside them.
//!
//! An artifact is one blob of media type [`ARTIFACT_MEDIA_TYPE`], referenced by
//! an OCI image manifest tagged `sha256-<hex>` (so the registry keeps it and
//! tools can list it); its signature is one blob of media type
//! [`SIGNATURE_MEDIA_TYPE`] referenced by a manifest tagged
//! [`ArtifactDigest::signature_tag`] (cosign's convention).
//!
//! Every byte pulled is verified against the digest it was asked by, while it
//! streams: the registry's `Docker-Content-Digest` header is never trusted. A
//! blob that does not match is deleted before the error returns, so nothing
//! unverified is left for a caller to unpack.
//!
//! TLS is the caller's: [`Registry::new`] takes a built `reqwest::Client`, so
//! the agent passes one trusting only the mesh CA. Plain `http://` is refused
//! to anything but a loopback host.

use std::path::{Path, PathBuf};

use mesh_protocol::{
    ARTIFACT_MEDIA_TYPE, ArtifactDigest, ArtifactSignature, DecodeError, MAX_ARTIFACT_SIGNATURES,
    SIGNATURE_MEDIA_TYPE,
};
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};
use tokio::io::AsyncWriteExt as _;

/// Media type of the manifests this crate writes.
pub const MANIFEST_MEDIA_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";

/// Media type of the (empty, `{}`) config blob of those manifests. Registry
/// 2.8 accepts any config media type; the image config type keeps older
/// tools that insist on it content.
pub const CONFIG_MEDIA_TYPE: &str = "application/vnd.oci.image.config.v1+json";

/// The empty config blob.
pub const EMPTY_CONFIG: &[u8] = b"{}";

/// Largest manifest this client reads.
pub const MAX_MANIFEST_BYTES: usize = 4 * 1024 * 1024;

/// Largest signature blob this client reads.
pub const MAX_SIGNATURE_BYTES: usize = 16 * 1024;

/// Largest registry error body read (to name the registry's error).
const MAX_ERROR_BODY: usize = 16 * 1024;

/// The manifest media types asked for when reading a manifest.
const ACCEPT_MANIFESTS: &str = "application/vnd.oci.image.manifest.v1+json, \
    application/vnd.docker.distribution.manifest.v2+json, \
    application/vnd.oci.image.index.v1+json";

/// What went wrong talking to a registry. Each names what it was about.
#[derive(Debug, thiserror::Error)]
pub enum OciError {
    /// The base URL is not one this client talks to.
    #[error("registry URL `{url}`: {reason}")]
    BadUrl { url: String, reason: String },
    /// A repository or reference that cannot be part of a request path.
    #[error("invalid {what} `{value}`: {reason}")]
    BadName {
        what: &'static str,
        value: String,
        reason: &'static str,
    },
    /// The registry answered with an error status (its error code and message,
    /// when it gave them).
    #[error("{method} {url}: the registry answered {status}{}", registry_error(.code, .message))]
    Http {
        method: &'static str,
        url: String,
        status: u16,
        code: Option<String>,
        message: Option<String>,
    },
    /// No answer: connection refused, TLS refused, timeout.
    #[error("{method} {url}: {source}")]
    Transport {
        method: &'static str,
        url: String,
        #[source]
        source: reqwest::Error,
    },
    /// The bytes served are not the ones asked for.
    #[error("digest mismatch: asked for {expected}, the registry served bytes of {actual}")]
    DigestMismatch {
        expected: ArtifactDigest,
        actual: ArtifactDigest,
    },
    /// More bytes than the caller allows.
    #[error("{what} is larger than the limit of {max} bytes")]
    TooLarge { what: String, max: u64 },
    /// The registry does not have it.
    #[error("{0} is not in the registry")]
    NotFound(String),
    /// The registry's answer is not what the API says it is.
    #[error("{what}: {reason}")]
    Malformed { what: String, reason: String },
    /// Writing what was fetched.
    #[error("{}: {source}", .path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

fn registry_error(code: &Option<String>, message: &Option<String>) -> String {
    match (code, message) {
        (Some(c), Some(m)) => format!(" ({c}: {m})"),
        (Some(c), None) => format!(" ({c})"),
        (None, Some(m)) => format!(" ({m})"),
        (None, None) => String::new(),
    }
}

/// A descriptor of a manifest's config or layer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Descriptor {
    pub media_type: String,
    pub digest: String,
    pub size: u64,
}

/// An OCI image manifest (the fields this crate reads and writes).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ImageManifest {
    pub schema_version: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub media_type: Option<String>,
    pub config: Descriptor,
    pub layers: Vec<Descriptor>,
}

impl ImageManifest {
    /// A manifest of one layer over the empty config.
    pub fn single_layer(media_type: &str, digest: &ArtifactDigest, size: u64) -> ImageManifest {
        ImageManifest {
            schema_version: 2,
            media_type: Some(MANIFEST_MEDIA_TYPE.to_owned()),
            config: Descriptor {
                media_type: CONFIG_MEDIA_TYPE.to_owned(),
                digest: ArtifactDigest::of(EMPTY_CONFIG).to_string(),
                size: EMPTY_CONFIG.len() as u64,
            },
            layers: vec![Descriptor {
                media_type: media_type.to_owned(),
                digest: digest.to_string(),
                size,
            }],
        }
    }
}

#[derive(Deserialize)]
struct ErrorBody {
    #[serde(default)]
    errors: Vec<ErrorEntry>,
}

#[derive(Deserialize)]
struct ErrorEntry {
    code: Option<String>,
    message: Option<String>,
}

/// One registry, by base URL (`https://host[:port]`, or `http://` to a
/// loopback host).
#[derive(Debug, Clone)]
pub struct Registry {
    base: url::Url,
    client: reqwest::Client,
}

impl Registry {
    /// A client of the registry at `base_url`, over `client` (its TLS roots and
    /// timeouts are the caller's). Refuses anything but `https://`, and
    /// `http://` to a loopback host; a path, query or credentials in the URL.
    pub fn new(base_url: &str, client: reqwest::Client) -> Result<Registry, OciError> {
        let bad = |reason: &str| OciError::BadUrl {
            url: base_url.chars().take(200).collect(),
            reason: reason.to_owned(),
        };
        let base = url::Url::parse(base_url).map_err(|e| bad(&e.to_string()))?;
        let host = base.host_str().ok_or_else(|| bad("no host"))?;
        match base.scheme() {
            "https" => {}
            "http" if mesh_credentials::advertise::is_loopback_host(host) => {}
            "http" => {
                return Err(bad(
                    "plain http:// is refused to a host that is not loopback: use https://",
                ));
            }
            _ => return Err(bad("not an http:// or https:// URL")),
        }
        if !base.username().is_empty() || base.password().is_some() {
            return Err(bad("credentials in the URL are refused"));
        }
        if base.path() != "/" && !base.path().is_empty() {
            return Err(bad("a base URL has no path (the API is under /v2/)"));
        }
        if base.query().is_some() || base.fragment().is_some() {
            return Err(bad("a base URL has no query or fragment"));
        }
        Ok(Registry { base, client })
    }

    /// The base URL, without a trailing slash.
    pub fn base_url(&self) -> String {
        self.base.as_str().trim_end_matches('/').to_owned()
    }

    fn url(&self, path: &str) -> String {
        format!("{}/v2/{path}", self.base_url())
    }

    async fn send(
        &self,
        method: &'static str,
        url: &str,
        req: reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, OciError> {
        req.send().await.map_err(|source| OciError::Transport {
            method,
            url: url.to_owned(),
            source,
        })
    }

    /// The error of a response with an unexpected status, naming the registry's
    /// error code and message.
    async fn status_error(
        method: &'static str,
        url: &str,
        mut resp: reqwest::Response,
    ) -> OciError {
        let status = resp.status().as_u16();
        let mut body = Vec::new();
        while body.len() < MAX_ERROR_BODY {
            match resp.chunk().await {
                Ok(Some(c)) => body.extend_from_slice(&c),
                _ => break,
            }
        }
        body.truncate(MAX_ERROR_BODY);
        let first = serde_json::from_slice::<ErrorBody>(&body)
            .ok()
            .and_then(|b| b.errors.into_iter().next());
        let (code, message) = match first {
            Some(e) => (e.code, e.message),
            None if body.is_empty() => (None, None),
            None => (
                None,
                Some(
                    String::from_utf8_lossy(&body)
                        .chars()
                        .take(200)
                        .collect::<String>()
                        .trim()
                        .to_owned(),
                ),
            ),
        };
        OciError::Http {
            method,
            url: url.to_owned(),
            status,
            code,
            message,
        }
    }

    /// Whether the repository holds the blob.
    pub async fn blob_exists(&self, repo: &str, digest: &ArtifactDigest) -> Result<bool, OciError> {
        check_repo(repo)?;
        let url = self.url(&format!("{repo}/blobs/{digest}"));
        let resp = self.send("HEAD", &url, self.client.head(&url)).await?;
        match resp.status().as_u16() {
            200 => Ok(true),
            404 => Ok(false),
            _ => Err(Self::status_error("HEAD", &url, resp).await),
        }
    }

    /// Upload `bytes` as a blob of `repo` (monolithic: POST, then PUT with the
    /// digest); nothing is uploaded when the registry already has it.
    pub async fn push_blob(&self, repo: &str, bytes: &[u8]) -> Result<ArtifactDigest, OciError> {
        let digest = ArtifactDigest::of(bytes);
        if self.blob_exists(repo, &digest).await? {
            return Ok(digest);
        }
        let url = self.url(&format!("{repo}/blobs/uploads/"));
        let resp = self
            .send(
                "POST",
                &url,
                self.client.post(&url).header("content-length", "0"),
            )
            .await?;
        if resp.status().as_u16() != 202 {
            return Err(Self::status_error("POST", &url, resp).await);
        }
        let location = resp
            .headers()
            .get("location")
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| OciError::Malformed {
                what: format!("POST {url}"),
                reason: "the upload's answer has no Location".into(),
            })?;
        // Location may be relative to the registry.
        let mut put = self.base.join(location).map_err(|e| OciError::Malformed {
            what: format!("POST {url}"),
            reason: format!("Location `{location}` is not a URL: {e}"),
        })?;
        if put.scheme() != self.base.scheme() || put.host_str() != self.base.host_str() {
            return Err(OciError::Malformed {
                what: format!("POST {url}"),
                reason: format!("Location `{location}` leaves the registry"),
            });
        }
        put.query_pairs_mut().append_pair("digest", digest.as_str());
        let put_url = put.to_string();
        let resp = self
            .send(
                "PUT",
                &put_url,
                self.client
                    .put(put)
                    .header("content-type", "application/octet-stream")
                    .body(bytes.to_vec()),
            )
            .await?;
        if resp.status().as_u16() != 201 {
            return Err(Self::status_error("PUT", &put_url, resp).await);
        }
        Ok(digest)
    }

    /// Store a manifest under `reference` (a tag or its digest).
    pub async fn put_manifest(
        &self,
        repo: &str,
        reference: &str,
        media_type: &str,
        bytes: &[u8],
    ) -> Result<ArtifactDigest, OciError> {
        check_repo(repo)?;
        check_reference(reference)?;
        let url = self.url(&format!("{repo}/manifests/{reference}"));
        let resp = self
            .send(
                "PUT",
                &url,
                self.client
                    .put(&url)
                    .header("content-type", media_type)
                    .body(bytes.to_vec()),
            )
            .await?;
        if resp.status().as_u16() != 201 {
            return Err(Self::status_error("PUT", &url, resp).await);
        }
        Ok(ArtifactDigest::of(bytes))
    }

    /// The manifest `reference` names: its media type and bytes; `None` if the
    /// registry has none. A reference that is a digest is checked against the
    /// bytes.
    pub async fn get_manifest(
        &self,
        repo: &str,
        reference: &str,
    ) -> Result<Option<(String, Vec<u8>)>, OciError> {
        check_repo(repo)?;
        check_reference(reference)?;
        let url = self.url(&format!("{repo}/manifests/{reference}"));
        let resp = self
            .send(
                "GET",
                &url,
                self.client.get(&url).header("accept", ACCEPT_MANIFESTS),
            )
            .await?;
        match resp.status().as_u16() {
            200 => {}
            404 => return Ok(None),
            _ => return Err(Self::status_error("GET", &url, resp).await),
        }
        let media_type = resp
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned();
        let bytes = read_bounded(resp, &url, MAX_MANIFEST_BYTES).await?;
        if reference.starts_with("sha256:") {
            let expected = ArtifactDigest::parse("reference", reference).map_err(bad_name)?;
            let actual = ArtifactDigest::of(&bytes);
            if actual != expected {
                return Err(OciError::DigestMismatch { expected, actual });
            }
        }
        Ok(Some((media_type, bytes)))
    }

    async fn get_blob(
        &self,
        repo: &str,
        digest: &ArtifactDigest,
    ) -> Result<(String, reqwest::Response), OciError> {
        check_repo(repo)?;
        let url = self.url(&format!("{repo}/blobs/{digest}"));
        let resp = self.send("GET", &url, self.client.get(&url)).await?;
        match resp.status().as_u16() {
            200 => Ok((url, resp)),
            404 => Err(OciError::NotFound(format!("blob {digest} of {repo}"))),
            _ => Err(Self::status_error("GET", &url, resp).await),
        }
    }

    /// A blob held in memory (at most `max_bytes`), verified against `digest`.
    pub async fn fetch_blob(
        &self,
        repo: &str,
        digest: &ArtifactDigest,
        max_bytes: usize,
    ) -> Result<Vec<u8>, OciError> {
        let (url, resp) = self.get_blob(repo, digest).await?;
        let bytes = read_bounded(resp, &url, max_bytes).await?;
        let actual = ArtifactDigest::of(&bytes);
        if &actual != digest {
            return Err(OciError::DigestMismatch {
                expected: digest.clone(),
                actual,
            });
        }
        Ok(bytes)
    }

    /// Stream a blob into `path` (created or truncated, then synced) while
    /// hashing it; at most `max_bytes`. On a digest mismatch, an oversized
    /// blob or any error after the file was created, the file is removed.
    /// Returns the blob's size.
    pub async fn fetch_blob_to_file(
        &self,
        repo: &str,
        digest: &ArtifactDigest,
        path: &Path,
        max_bytes: u64,
    ) -> Result<u64, OciError> {
        let (url, resp) = self.get_blob(repo, digest).await?;
        let too_large = || OciError::TooLarge {
            what: format!("blob {digest}"),
            max: max_bytes,
        };
        if resp.content_length().is_some_and(|n| n > max_bytes) {
            return Err(too_large());
        }
        let io = |source| OciError::Io {
            path: path.to_owned(),
            source,
        };
        let file = tokio::fs::File::create(path).await.map_err(io)?;
        let result = stream_to(file, resp, &url, max_bytes, path).await;
        let result = match result {
            Ok((n, hash)) => {
                let actual = ArtifactDigest::from_sha256(hash);
                if &actual == digest {
                    Ok(n)
                } else {
                    Err(OciError::DigestMismatch {
                        expected: digest.clone(),
                        actual,
                    })
                }
            }
            Err(StreamError::TooLarge) => Err(too_large()),
            Err(StreamError::Other(e)) => Err(e),
        };
        if result.is_err() {
            let _ = tokio::fs::remove_file(path).await;
        }
        result
    }

    /// Push an artifact: its blob and a manifest of that one layer
    /// ([`ARTIFACT_MEDIA_TYPE`]) tagged `sha256-<hex>`. Idempotent.
    pub async fn push_artifact(
        &self,
        repo: &str,
        bytes: &[u8],
    ) -> Result<ArtifactDigest, OciError> {
        let digest = self.push_blob(repo, bytes).await?;
        self.push_blob(repo, EMPTY_CONFIG).await?;
        let manifest =
            ImageManifest::single_layer(ARTIFACT_MEDIA_TYPE, &digest, bytes.len() as u64);
        let body = serde_json::to_vec(&manifest).map_err(|e| OciError::Malformed {
            what: "the artifact's manifest".into(),
            reason: e.to_string(),
        })?;
        let tag = format!("sha256-{}", digest.hex());
        self.put_manifest(repo, &tag, MANIFEST_MEDIA_TYPE, &body)
            .await?;
        Ok(digest)
    }

    /// Add an artifact's signature beside it: its JSON as a layer
    /// ([`SIGNATURE_MEDIA_TYPE`]) of the manifest tagged
    /// [`ArtifactDigest::signature_tag`], cosign's convention of one layer per
    /// signature. The layers already there are kept, but one by the same key
    /// is replaced, and at most [`MAX_ARTIFACT_SIGNATURES`] are kept (the
    /// oldest go first). Idempotent.
    pub async fn push_signature(
        &self,
        repo: &str,
        signature: &ArtifactSignature,
    ) -> Result<(), OciError> {
        let json = serde_json::to_vec(signature).map_err(|e| OciError::Malformed {
            what: "the signature".into(),
            reason: e.to_string(),
        })?;
        let layer = self.push_blob(repo, &json).await?;
        self.push_blob(repo, EMPTY_CONFIG).await?;
        let mut manifest =
            ImageManifest::single_layer(SIGNATURE_MEDIA_TYPE, &layer, json.len() as u64);
        let kept: Vec<Descriptor> = self
            .fetch_signatures(repo, &signature.digest)
            .await?
            .into_iter()
            .filter(|(_, s)| s.key != signature.key)
            .map(|(d, _)| d)
            .collect();
        let room = MAX_ARTIFACT_SIGNATURES.saturating_sub(1);
        let skip = kept.len().saturating_sub(room);
        let mut layers: Vec<Descriptor> = kept.into_iter().skip(skip).collect();
        layers.append(&mut manifest.layers);
        manifest.layers = layers;
        let body = serde_json::to_vec(&manifest).map_err(|e| OciError::Malformed {
            what: "the signature's manifest".into(),
            reason: e.to_string(),
        })?;
        self.put_manifest(
            repo,
            &signature.digest.signature_tag(),
            MANIFEST_MEDIA_TYPE,
            &body,
        )
        .await?;
        Ok(())
    }

    /// The signatures stored beside `digest` (tag `sha256-<hex>.sig`), each
    /// with its layer, oldest first; none when there is no such tag. Not
    /// verified against any key here: that is the caller's
    /// ([`ArtifactSignature::verify_any`]); each blob is digest-checked and
    /// at most [`MAX_SIGNATURE_BYTES`], and at most
    /// [`MAX_ARTIFACT_SIGNATURES`] layers are read.
    pub async fn fetch_signatures(
        &self,
        repo: &str,
        digest: &ArtifactDigest,
    ) -> Result<Vec<(Descriptor, ArtifactSignature)>, OciError> {
        let tag = digest.signature_tag();
        let Some((_, bytes)) = self.get_manifest(repo, &tag).await? else {
            return Ok(Vec::new());
        };
        let what = format!("signature manifest {repo}:{tag}");
        let manifest: ImageManifest =
            serde_json::from_slice(&bytes).map_err(|e| OciError::Malformed {
                what: what.clone(),
                reason: e.to_string(),
            })?;
        let layers: Vec<&Descriptor> = manifest
            .layers
            .iter()
            .filter(|l| l.media_type == SIGNATURE_MEDIA_TYPE)
            .collect();
        if layers.is_empty() {
            return Err(OciError::Malformed {
                what,
                reason: format!("no layer of media type {SIGNATURE_MEDIA_TYPE}"),
            });
        }
        let mut out = Vec::new();
        for layer in layers.into_iter().take(MAX_ARTIFACT_SIGNATURES) {
            if layer.size > MAX_SIGNATURE_BYTES as u64 {
                return Err(OciError::TooLarge {
                    what: format!("a signature layer of {what}"),
                    max: MAX_SIGNATURE_BYTES as u64,
                });
            }
            let layer_digest =
                ArtifactDigest::parse("layer.digest", &layer.digest).map_err(|e| {
                    OciError::Malformed {
                        what: what.clone(),
                        reason: e.to_string(),
                    }
                })?;
            let blob = self
                .fetch_blob(repo, &layer_digest, MAX_SIGNATURE_BYTES)
                .await?;
            let signature: ArtifactSignature =
                serde_json::from_slice(&blob).map_err(|e| OciError::Malformed {
                    what: format!("a signature of {digest}"),
                    reason: e.to_string(),
                })?;
            out.push((layer.clone(), signature));
        }
        Ok(out)
    }

    /// The newest signature stored beside `digest`, `None` when there is
    /// none (see [`Registry::fetch_signatures`]).
    pub async fn fetch_signature(
        &self,
        repo: &str,
        digest: &ArtifactDigest,
    ) -> Result<Option<ArtifactSignature>, OciError> {
        Ok(self
            .fetch_signatures(repo, digest)
            .await?
            .pop()
            .map(|(_, s)| s))
    }
}

enum StreamError {
    TooLarge,
    Other(OciError),
}

async fn stream_to(
    mut file: tokio::fs::File,
    mut resp: reqwest::Response,
    url: &str,
    max_bytes: u64,
    path: &Path,
) -> Result<(u64, [u8; 32]), StreamError> {
    let io = |source| {
        StreamError::Other(OciError::Io {
            path: path.to_owned(),
            source,
        })
    };
    let mut hasher = Sha256::new();
    let mut n: u64 = 0;
    loop {
        let chunk = resp.chunk().await.map_err(|source| {
            StreamError::Other(OciError::Transport {
                method: "GET",
                url: url.to_owned(),
                source,
            })
        })?;
        let Some(chunk) = chunk else { break };
        n = n.saturating_add(chunk.len() as u64);
        if n > max_bytes {
            return Err(StreamError::TooLarge);
        }
        hasher.update(&chunk);
        file.write_all(&chunk).await.map_err(io)?;
    }
    file.flush().await.map_err(io)?;
    file.sync_all().await.map_err(io)?;
    Ok((n, hasher.finalize().into()))
}

async fn read_bounded(
    mut resp: reqwest::Response,
    url: &str,
    max: usize,
) -> Result<Vec<u8>, OciError> {
    let too_large = || OciError::TooLarge {
        what: format!("the answer of GET {url}"),
        max: max as u64,
    };
    if resp.content_length().is_some_and(|n| n > max as u64) {
        return Err(too_large());
    }
    let mut out = Vec::new();
    loop {
        let chunk = resp.chunk().await.map_err(|source| OciError::Transport {
            method: "GET",
            url: url.to_owned(),
            source,
        })?;
        let Some(chunk) = chunk else { break };
        if out.len() + chunk.len() > max {
            return Err(too_large());
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out)
}

fn bad_name(e: DecodeError) -> OciError {
    OciError::Malformed {
        what: "reference".into(),
        reason: e.to_string(),
    }
}

/// A repository name as the distribution spec allows it (lower case path
/// components of `a-z 0-9 . _ -`), so it cannot change a request's path.
fn check_repo(repo: &str) -> Result<(), OciError> {
    let ok = !repo.is_empty()
        && repo.len() <= 255
        && repo.split('/').all(|part| {
            !part.is_empty()
                && part != "."
                && part != ".."
                && part.bytes().all(|b| {
                    b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-')
                })
        });
    if ok {
        Ok(())
    } else {
        Err(OciError::BadName {
            what: "repository",
            value: repo.chars().take(80).collect(),
            reason: "path components of a-z 0-9 . _ - separated by /",
        })
    }
}

/// A tag (`[A-Za-z0-9_][A-Za-z0-9._-]{0,127}`) or a digest (`sha256:<hex>`).
fn check_reference(reference: &str) -> Result<(), OciError> {
    let tag_ok = !reference.is_empty()
        && reference.len() <= 128
        && !reference.starts_with(['.', '-'])
        && reference
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if tag_ok || ArtifactDigest::parse("reference", reference).is_ok() {
        Ok(())
    } else {
        Err(OciError::BadName {
            what: "reference",
            value: reference.chars().take(80).collect(),
            reason: "a tag of A-Z a-z 0-9 . _ - (at most 128) or a sha256: digest",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_http_only_to_loopback() {
        let c = reqwest::Client::new();
        assert!(Registry::new("http://127.0.0.1:5000", c.clone()).is_ok());
        assert!(Registry::new("http://localhost:5000/", c.clone()).is_ok());
        assert!(Registry::new("http://[::1]:5000", c.clone()).is_ok());
        assert!(Registry::new("https://registry.example:5000", c.clone()).is_ok());
        let e = Registry::new("http://registry.example:5000", c.clone()).unwrap_err();
        assert!(e.to_string().contains("not loopback"), "{e}");
        let e = Registry::new("http://10.0.0.1:5000", c.clone()).unwrap_err();
        assert!(e.to_string().contains("not loopback"), "{e}");
        assert!(Registry::new("ftp://127.0.0.1", c.clone()).is_err());
        assert!(Registry::new("https://u:p@registry.example", c.clone()).is_err());
        assert!(Registry::new("https://registry.example/v2/x", c).is_err());
    }

    #[test]
    fn names_that_could_change_the_path_are_refused() {
        assert!(check_repo("mesh/artifacts").is_ok());
        for bad in ["", "a//b", "../x", "A", "a/?x", "a b"] {
            assert!(check_repo(bad).is_err(), "{bad}");
        }
        assert!(check_reference("sha256-abc.sig").is_ok());
        assert!(check_reference(ArtifactDigest::of(b"x").as_str()).is_ok());
        for bad in ["", "../x", "a/b", "sha256:ABC", ".x"] {
            assert!(check_reference(bad).is_err(), "{bad}");
        }
    }
}
