//! S3 requests signed with AWS Signature Version 4 (path style), and the one
//! S3 use of the bundle itself: keeping a backup in a bucket granted to the
//! controller's node (`mesh-bundle backup --to-bucket`, decision 0039's "the
//! controller is a consumer like any other"). The grant's credential file is
//! the env file provisioning writes for an `s3.bucket` (`AWS_ENDPOINT_URL`,
//! `AWS_REGION`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `S3_BUCKET`).
//! The tests speak to a real S3 server (Garage) with the same signing.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use mesh_credentials::Secret;
use sha2::{Digest, Sha256};
use thiserror::Error;

/// HMAC-SHA256 (RFC 2104).
fn hmac(key: &[u8], msg: &[u8]) -> Vec<u8> {
    let mut k = [0u8; 64];
    if key.len() > 64 {
        k[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        k[..key.len()].copy_from_slice(key);
    }
    let ipad: Vec<u8> = k.iter().map(|b| b ^ 0x36).collect();
    let opad: Vec<u8> = k.iter().map(|b| b ^ 0x5c).collect();
    let inner = Sha256::new()
        .chain_update(&ipad)
        .chain_update(msg)
        .finalize();
    Sha256::new()
        .chain_update(&opad)
        .chain_update(inner)
        .finalize()
        .to_vec()
}

/// One path-style S3 request to sign.
pub struct Request<'a> {
    /// `addr:port`, as sent in `Host`.
    pub host: &'a str,
    /// Garage's is `garage`.
    pub region: &'a str,
    /// The access key id and its secret.
    pub key: &'a str,
    pub secret: &'a str,
    pub method: &'a str,
    /// `/<bucket>` or `/<bucket>/<object>`, no query.
    pub path: &'a str,
    pub body: &'a [u8],
}

/// The headers that sign `r` at `now`: `x-amz-date`, `x-amz-content-sha256`
/// and `authorization`.
pub fn signed_headers(
    r: &Request<'_>,
    now: chrono::DateTime<chrono::Utc>,
) -> Vec<(&'static str, String)> {
    let Request {
        host,
        region,
        key,
        secret,
        method,
        path,
        body,
    } = *r;
    let amz_date = now.format("%Y%m%dT%H%M%SZ").to_string();
    let day = now.format("%Y%m%d").to_string();
    let payload = hex::encode(Sha256::digest(body));
    let canonical = format!(
        "{method}\n{path}\n\nhost:{host}\nx-amz-content-sha256:{payload}\nx-amz-date:{amz_date}\n\nhost;x-amz-content-sha256;x-amz-date\n{payload}"
    );
    let scope = format!("{day}/{region}/s3/aws4_request");
    let to_sign = format!(
        "AWS4-HMAC-SHA256\n{amz_date}\n{scope}\n{}",
        hex::encode(Sha256::digest(canonical.as_bytes()))
    );
    let k = hmac(format!("AWS4{secret}").as_bytes(), day.as_bytes());
    let k = hmac(&k, region.as_bytes());
    let k = hmac(&k, b"s3");
    let k = hmac(&k, b"aws4_request");
    let signature = hex::encode(hmac(&k, to_sign.as_bytes()));
    vec![
        ("x-amz-date", amz_date),
        ("x-amz-content-sha256", payload),
        (
            "authorization",
            format!(
                "AWS4-HMAC-SHA256 Credential={key}/{scope}, SignedHeaders=host;x-amz-content-sha256;x-amz-date, Signature={signature}"
            ),
        ),
    ]
}

/// What keeping an object in a granted bucket can fail on. Never holds the
/// secret key.
#[derive(Debug, Error)]
pub enum S3Error {
    #[error("{path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {field} is missing (an s3.bucket grant's credential file has it)")]
    Missing { path: PathBuf, field: &'static str },
    #[error("{path}: {field}: {reason}")]
    Invalid {
        path: PathBuf,
        field: &'static str,
        reason: String,
    },
    #[error("object name `{0}`: 1 to 255 of [A-Za-z0-9._-]")]
    Name(String),
    #[error("PUT s3://{bucket}/{object} at {endpoint}: {source}")]
    Send {
        bucket: String,
        object: String,
        endpoint: String,
        source: reqwest::Error,
    },
    #[error("PUT s3://{bucket}/{object} at {endpoint}: the server answered {status}: {body}")]
    Refused {
        bucket: String,
        object: String,
        endpoint: String,
        status: u16,
        body: String,
    },
}

/// An `s3.bucket` grant as its credential file states it.
#[derive(Debug, Clone)]
pub struct BucketGrant {
    /// `host:port` of the S3 API (plain HTTP: the provider's address on the
    /// mesh's overlay or LAN, decision 0039).
    pub host: String,
    pub region: String,
    pub key: String,
    pub secret: Secret<String>,
    pub bucket: String,
}

impl BucketGrant {
    /// Read a grant's credential file (`KEY=VALUE` lines; blank lines and
    /// `#` comments skipped; values may be single- or double-quoted).
    pub fn read(path: &Path) -> Result<BucketGrant, S3Error> {
        let text = std::fs::read_to_string(path).map_err(|source| S3Error::Read {
            path: path.to_owned(),
            source,
        })?;
        let vars: BTreeMap<&str, &str> = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| {
                let v = v.trim();
                let v = v
                    .strip_prefix('"')
                    .and_then(|v| v.strip_suffix('"'))
                    .or_else(|| v.strip_prefix('\'').and_then(|v| v.strip_suffix('\'')))
                    .unwrap_or(v);
                (k.trim(), v)
            })
            .collect();
        let get = |field: &'static str| {
            vars.get(field)
                .filter(|v| !v.is_empty())
                .map(|v| (*v).to_owned())
                .ok_or(S3Error::Missing {
                    path: path.to_owned(),
                    field,
                })
        };
        let endpoint = get("AWS_ENDPOINT_URL")?;
        let host = endpoint
            .strip_prefix("http://")
            .map(|h| h.trim_end_matches('/'))
            .filter(|h| !h.is_empty() && !h.contains('/'))
            .ok_or_else(|| S3Error::Invalid {
                path: path.to_owned(),
                field: "AWS_ENDPOINT_URL",
                reason: format!("`{endpoint}` is not http://<host>:<port>"),
            })?
            .to_owned();
        Ok(BucketGrant {
            host,
            region: get("AWS_REGION")?,
            key: get("AWS_ACCESS_KEY_ID")?,
            secret: Secret::new(get("AWS_SECRET_ACCESS_KEY")?),
            bucket: get("S3_BUCKET")?,
        })
    }

    /// Put `body` into the bucket as `object` (replacing one of that name).
    pub async fn put(&self, object: &str, body: Vec<u8>) -> Result<(), S3Error> {
        let valid = !object.is_empty()
            && object.len() <= 255
            && object
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        if !valid {
            return Err(S3Error::Name(object.chars().take(80).collect()));
        }
        let path = format!("/{}/{object}", self.bucket);
        let headers = signed_headers(
            &Request {
                host: &self.host,
                region: &self.region,
                key: &self.key,
                secret: self.secret.expose(),
                method: "PUT",
                path: &path,
                body: &body,
            },
            chrono::Utc::now(),
        );
        let (bucket, endpoint) = (self.bucket.clone(), self.host.clone());
        let mut request = reqwest::Client::new()
            .put(format!("http://{}{path}", self.host))
            .timeout(std::time::Duration::from_secs(300));
        for (name, value) in headers {
            request = request.header(name, value);
        }
        let answer = request
            .body(body)
            .send()
            .await
            .map_err(|source| S3Error::Send {
                bucket: bucket.clone(),
                object: object.to_owned(),
                endpoint: endpoint.clone(),
                source,
            })?;
        let status = answer.status();
        if status.is_success() {
            return Ok(());
        }
        let body = answer.text().await.unwrap_or_default();
        Err(S3Error::Refused {
            bucket,
            object: object.to_owned(),
            endpoint,
            status: status.as_u16(),
            body: body.chars().take(300).collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 4231 test case 2.
    #[test]
    fn hmac_matches_rfc_4231() {
        assert_eq!(
            hex::encode(hmac(b"Jefe", b"what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn the_signature_covers_method_path_and_body() {
        let now = chrono::DateTime::from_timestamp(1_700_000_000, 0).unwrap_or_default();
        let sig = |method: &str, path: &str, body: &[u8]| {
            let r = Request {
                host: "h:1",
                region: "garage",
                key: "GK1",
                secret: "s",
                method,
                path,
                body,
            };
            signed_headers(&r, now)[2].1.clone()
        };
        let base = sig("GET", "/b/k", b"");
        assert_ne!(base, sig("PUT", "/b/k", b""));
        assert_ne!(base, sig("GET", "/b/j", b""));
        assert_ne!(base, sig("GET", "/b/k", b"x"));
        assert!(
            base.starts_with("AWS4-HMAC-SHA256 Credential=GK1/20231114/garage/s3/aws4_request")
        );
    }
}
