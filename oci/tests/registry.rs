//! mesh-oci against the real registry `bundle/up` raised on loopback
//! (Debian's docker-registry 2.8, CNCF distribution).

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::path::PathBuf;

use mesh_oci::{OciError, Registry};
use mesh_protocol::{ArtifactDigest, ArtifactSignature, DeclarationSigner};

/// Where registry 2.8's filesystem driver keeps a blob's bytes.
const BLOBS: &str = "/var/lib/docker-registry/docker/registry/v2/blobs/sha256";

fn registry() -> Registry {
    let url = mesh_testkit::registry_url().expect("the registry of bundle/up");
    let client = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(30))
        .build()
        .expect("a client");
    Registry::new(&url, client).expect("a loopback registry")
}

/// A repository of this test run alone (the registry is shared and keeps
/// everything).
fn repo(what: &str) -> String {
    format!(
        "mesh-test/oci-{what}-{}",
        hex::encode(rand::random::<[u8; 6]>())
    )
}

fn unique_bytes(n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    for chunk in v.chunks_mut(32) {
        let r: [u8; 32] = rand::random();
        chunk.copy_from_slice(&r[..chunk.len()]);
    }
    v
}

fn blob_data(d: &ArtifactDigest) -> PathBuf {
    PathBuf::from(BLOBS)
        .join(&d.hex()[..2])
        .join(d.hex())
        .join("data")
}

#[tokio::test]
async fn push_then_fetch_round_trips_and_repush_is_idempotent() {
    let reg = registry();
    let repo = repo("roundtrip");
    let bytes = unique_bytes(300_000);
    let d = reg.push_artifact(&repo, &bytes).await.expect("push");
    assert_eq!(d, ArtifactDigest::of(&bytes));
    assert!(reg.blob_exists(&repo, &d).await.expect("head"));
    // Again: the same digest, nothing breaks.
    assert_eq!(reg.push_artifact(&repo, &bytes).await.expect("re-push"), d);

    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("blob");
    let n = reg
        .fetch_blob_to_file(&repo, &d, &path, 1 << 20)
        .await
        .expect("fetch");
    assert_eq!(n, bytes.len() as u64);
    assert_eq!(std::fs::read(&path).expect("read"), bytes);

    // The manifest tagged by digest references the blob.
    let (media, manifest) = reg
        .get_manifest(&repo, &format!("sha256-{}", d.hex()))
        .await
        .expect("manifest")
        .expect("tagged");
    assert!(media.contains("oci.image.manifest"), "{media}");
    let text = String::from_utf8(manifest).expect("utf-8");
    assert!(text.contains(d.as_str()), "{text}");
    assert!(text.contains(mesh_protocol::ARTIFACT_MEDIA_TYPE), "{text}");

    // Too large for the caller's bound: refused, no file left.
    let small = dir.path().join("small");
    let e = reg
        .fetch_blob_to_file(&repo, &d, &small, 1000)
        .await
        .unwrap_err();
    assert!(matches!(e, OciError::TooLarge { .. }), "{e}");
    assert!(!small.exists());

    // What the registry does not have.
    assert!(
        reg.get_manifest(&repo, "no-such-tag")
            .await
            .expect("get")
            .is_none()
    );
    let missing = ArtifactDigest::of(&unique_bytes(64));
    let e = reg
        .fetch_blob_to_file(&repo, &missing, &small, 1000)
        .await
        .unwrap_err();
    assert!(matches!(e, OciError::NotFound(_)), "{e}");
    assert!(!small.exists());
}

#[tokio::test]
async fn tampered_bytes_in_storage_are_a_digest_mismatch_and_leave_no_file() {
    let reg = registry();
    let repo = repo("tamper");
    let bytes = unique_bytes(4096);
    let d = reg.push_artifact(&repo, &bytes).await.expect("push");
    let data = blob_data(&d);
    assert_eq!(
        std::fs::read(&data).expect("the blob's data file"),
        bytes,
        "{}",
        data.display()
    );
    let evil = unique_bytes(4096);
    std::fs::write(&data, &evil).expect("tamper");

    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("blob");
    let e = reg
        .fetch_blob_to_file(&repo, &d, &path, 1 << 20)
        .await
        .unwrap_err();
    match &e {
        OciError::DigestMismatch { expected, actual } => {
            assert_eq!(expected, &d);
            assert_eq!(actual, &ArtifactDigest::of(&evil));
        }
        other => panic!("expected a digest mismatch, got {other}"),
    }
    let text = e.to_string();
    assert!(
        text.contains("digest mismatch") && text.contains(d.as_str()),
        "{text}"
    );
    assert!(!path.exists(), "an unverified blob was left behind");
}

#[tokio::test]
async fn signatures_round_trip_and_an_unsigned_artifact_has_none() {
    let reg = registry();
    let repo = repo("sig");
    let bytes = unique_bytes(1000);
    let d = reg.push_artifact(&repo, &bytes).await.expect("push");
    assert!(
        reg.fetch_signature(&repo, &d)
            .await
            .expect("fetch")
            .is_none()
    );

    let signer = DeclarationSigner::from_seed(rand::random());
    let sig = ArtifactSignature::sign(&signer, &d);
    reg.push_signature(&repo, &sig).await.expect("push sig");
    let got = reg
        .fetch_signature(&repo, &d)
        .await
        .expect("fetch")
        .expect("signed");
    assert_eq!(got, sig);
    let trusted = [mesh_protocol::PublicKey::from_hex(&signer.public_key_hex()).expect("key")];
    got.verify(&d, &trusted).expect("verifies");
    // Re-pushing the signature is idempotent too.
    reg.push_signature(&repo, &sig).await.expect("re-push sig");
    // A second key's signature is kept beside the first (one layer each).
    let other = DeclarationSigner::from_seed(rand::random());
    let second = ArtifactSignature::sign(&other, &d);
    reg.push_signature(&repo, &second)
        .await
        .expect("second sig");
    let all: Vec<ArtifactSignature> = reg
        .fetch_signatures(&repo, &d)
        .await
        .expect("fetch all")
        .into_iter()
        .map(|(_, s)| s)
        .collect();
    assert_eq!(all, [sig.clone(), second.clone()]);
    // The same key signing again replaces its own, not the other's.
    reg.push_signature(&repo, &sig).await.expect("again");
    let all: Vec<ArtifactSignature> = reg
        .fetch_signatures(&repo, &d)
        .await
        .expect("fetch all")
        .into_iter()
        .map(|(_, s)| s)
        .collect();
    assert_eq!(all, [second, sig]);
}

#[tokio::test]
async fn plain_http_to_a_host_that_is_not_loopback_is_refused() {
    let e = Registry::new("http://registry.example:5000", reqwest::Client::new()).unwrap_err();
    assert!(matches!(e, OciError::BadUrl { .. }), "{e}");
    assert!(e.to_string().contains("https://"), "{e}");
}
