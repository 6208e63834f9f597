//! S3 requests signed with AWS Signature Version 4, for tests that speak to a
//! real S3 server (Garage, the `s3.bucket` provider: decision 0039) with a
//! grant's key. Pure: the caller sends the request with the client it has.

use sha2::{Digest, Sha256};

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
