//! The OCI registry `bundle/up` raises on loopback (Debian's docker-registry,
//! the CNCF distribution registry; docs/decisions/0031): a blob pushed with the
//! distribution API's monolithic upload reads back byte for byte under its
//! digest, and an upload whose digest does not match its bytes is refused.
//!
//! Runs against the real registry; run `bash bundle/up` first (CI does).
//! Each test pushes into its own repository (`mesh-test/<random hex>`), so
//! tests in parallel never collide.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::time::{Duration, Instant};

use rand::RngCore as _;
use reqwest::StatusCode;
use sha2::{Digest as _, Sha256};

fn random_hex(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    rand::rng().fill_bytes(&mut buf);
    hex::encode(buf)
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("http client")
}

/// `POST /v2/<repo>/blobs/uploads/`: the upload session's URL (its
/// `Location`, made absolute against `base`).
async fn start_upload(http: &reqwest::Client, base: &str, repo: &str) -> reqwest::Url {
    let resp = http
        .post(format!("{base}/v2/{repo}/blobs/uploads/"))
        .send()
        .await
        .expect("POST blobs/uploads");
    assert_eq!(resp.status(), StatusCode::ACCEPTED, "starting an upload");
    let location = resp
        .headers()
        .get(reqwest::header::LOCATION)
        .expect("the upload's Location")
        .to_str()
        .expect("Location is text")
        .to_owned();
    reqwest::Url::parse(base)
        .unwrap()
        .join(&location)
        .expect("Location is a URL")
}

/// `PUT <location>?digest=<digest>` with the whole blob (monolithic upload).
async fn finish_upload(
    http: &reqwest::Client,
    mut location: reqwest::Url,
    digest: &str,
    bytes: Vec<u8>,
) -> reqwest::Response {
    location.query_pairs_mut().append_pair("digest", digest);
    http.put(location)
        .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
        .body(bytes)
        .send()
        .await
        .expect("PUT upload")
}

#[tokio::test]
async fn a_pushed_blob_reads_back_under_its_digest() {
    let base = mesh_testkit::registry_url().expect("the bundle's registry");
    let http = client();
    let repo = format!("mesh-test/{}", random_hex(6));
    let mut blob = format!("mesh artifact {repo}\n").into_bytes();
    blob.extend((0..4096u32).map(|i| (i % 251) as u8));
    let digest = format!("sha256:{}", hex::encode(Sha256::digest(&blob)));

    let location = start_upload(&http, &base, &repo).await;
    let resp = finish_upload(&http, location, &digest, blob.clone()).await;
    assert_eq!(resp.status(), StatusCode::CREATED, "completing the upload");
    let header = |r: &reqwest::Response, name: &str| {
        r.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    assert_eq!(
        header(&resp, "Docker-Content-Digest").as_deref(),
        Some(digest.as_str())
    );

    // Read it back; the registry's storage is consistent on return from the
    // PUT, but allow it a bounded moment rather than assume.
    let deadline = Instant::now() + Duration::from_secs(10);
    let resp = loop {
        let resp = http
            .get(format!("{base}/v2/{repo}/blobs/{digest}"))
            .send()
            .await
            .expect("GET blob");
        if resp.status() != StatusCode::NOT_FOUND || Instant::now() >= deadline {
            break resp;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(resp.status(), StatusCode::OK, "reading the blob back");
    assert_eq!(
        header(&resp, "Docker-Content-Digest").as_deref(),
        Some(digest.as_str())
    );
    let got = resp.bytes().await.expect("blob body");
    assert_eq!(got.as_ref(), blob.as_slice(), "the bytes read back");

    // Unknown digests are not found (the repository is not a wildcard).
    let other = format!("sha256:{}", hex::encode(Sha256::digest(b"never pushed")));
    let resp = http
        .get(format!("{base}/v2/{repo}/blobs/{other}"))
        .send()
        .await
        .expect("GET unknown blob");
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn an_upload_whose_digest_does_not_match_its_bytes_is_refused() {
    let base = mesh_testkit::registry_url().expect("the bundle's registry");
    let http = client();
    let repo = format!("mesh-test/{}", random_hex(6));
    let blob = format!("the bytes of {repo}").into_bytes();
    let claimed = format!("sha256:{}", hex::encode(Sha256::digest(b"other bytes")));

    let location = start_upload(&http, &base, &repo).await;
    let resp = finish_upload(&http, location, &claimed, blob).await;
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    let body = resp.text().await.expect("error body");
    assert!(body.contains("DIGEST_INVALID"), "error body: {body}");

    // Nothing was stored under the claimed digest.
    let resp = http
        .get(format!("{base}/v2/{repo}/blobs/{claimed}"))
        .send()
        .await
        .expect("GET claimed blob");
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
}
