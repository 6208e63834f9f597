//! Issue 29, point 4: the signing keys nodes trust are the admins' to add and
//! remove. Through the API's router over a real isolated environment (its
//! auth layer included): an operator or a viewer is refused (403), a bad key
//! or name is a 422 naming the field, a signature for an artifact that was
//! never pushed is a 404 and a malformed digest a 422 naming `digest`. (What
//! the keys do on real nodes: e2e/tests/signing.rs; the context's own rules:
//! contexts/delivery/tests/delivery.rs.)

mod common;

use axum::Router;
use axum::http::StatusCode;
use common::call;
use mesh_protocol::{ArtifactDigest, ArtifactSignature, DeclarationSigner};
use mesh_testkit::TestEnv;
use serde_json::json;

async fn token(router: &Router, admin: &str, name: &str, role: &str) -> anyhow::Result<String> {
    let (status, v) = call(
        router,
        "POST",
        "/v1/tokens",
        admin,
        Some(json!({"name": name, "role": role})),
    )
    .await?;
    anyhow::ensure!(status == StatusCode::CREATED, "{status} {v}");
    Ok(v["token"].as_str().unwrap_or_default().to_owned())
}

#[tokio::test]
async fn signing_keys_are_admin_only_and_bad_input_names_the_field() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let dir = tempfile::tempdir()?;
    let router = common::api_router(&env, dir.path()).await?;
    let admin = env.admin_token().to_owned();
    let operator = token(&router, &admin, "deployer", "operator").await?;
    let viewer = token(&router, &admin, "watcher", "viewer").await?;
    let alice = DeclarationSigner::from_seed([5; 32]);
    let key = json!({"name": "alice", "key": alice.public_key_hex()});

    // Only an admin decides which keys make a node run code.
    for (who, method, uri, body) in [
        (&operator, "POST", "/v1/signing-keys", Some(key.clone())),
        (&operator, "GET", "/v1/signing-keys", None),
        (&operator, "DELETE", "/v1/signing-keys/alice", None),
        (&viewer, "GET", "/v1/signing-keys", None),
    ] {
        let (status, v) = call(&router, method, uri, who, body).await?;
        assert_eq!(status, StatusCode::FORBIDDEN, "{method} {uri}: {v}");
    }

    // Bad input: 422, naming the field.
    for (body, field) in [
        (json!({"name": "alice", "key": "not-hex"}), "key"),
        (json!({"name": "alice", "key": "ab".repeat(31)}), "key"),
        (
            json!({"name": "Alice Smith", "key": alice.public_key_hex()}),
            "name",
        ),
        (
            json!({"name": "controller", "key": alice.public_key_hex()}),
            "name",
        ),
    ] {
        let (status, v) = call(&router, "POST", "/v1/signing-keys", &admin, Some(body)).await?;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
        assert_eq!(v["field"], field, "{v}");
    }
    // An unknown field is refused too.
    let (status, v) = call(
        &router,
        "POST",
        "/v1/signing-keys",
        &admin,
        Some(json!({"name": "alice", "key": alice.public_key_hex(), "trusted": true})),
    )
    .await?;
    assert!(status.is_client_error(), "{status} {v}");

    // The admin adds, lists and removes.
    let (status, v) = call(
        &router,
        "POST",
        "/v1/signing-keys",
        &admin,
        Some(key.clone()),
    )
    .await?;
    assert_eq!(status, StatusCode::CREATED, "{v}");
    assert_eq!(v["added_by"], "bootstrap-admin", "{v}");
    let (status, v) = call(&router, "POST", "/v1/signing-keys", &admin, Some(key)).await?;
    assert_eq!(status, StatusCode::OK, "the same key again: {v}");
    let (status, v) = call(
        &router,
        "POST",
        "/v1/signing-keys",
        &admin,
        Some(
            json!({"name": "alice", "key": DeclarationSigner::from_seed([6; 32]).public_key_hex()}),
        ),
    )
    .await?;
    assert_eq!(
        status,
        StatusCode::CONFLICT,
        "another key under the name: {v}"
    );
    let (status, v) = call(&router, "GET", "/v1/signing-keys", &admin, None).await?;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["keys"][0]["key"], alice.public_key_hex(), "{v}");
    assert!(
        v.get("controller_key").is_none(),
        "the default trusts no controller key: {v}"
    );

    // Signatures: an operator's route, the digest checked first.
    let d = ArtifactDigest::of(b"never pushed");
    let sig = ArtifactSignature::sign(&alice, &d);
    let body = json!({"key": sig.key, "signature": sig.signature});
    let (status, v) = call(
        &router,
        "POST",
        "/v1/artifacts/latest/signatures",
        &operator,
        Some(body.clone()),
    )
    .await?;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
    assert_eq!(v["field"], "digest", "{v}");
    let (status, v) = call(
        &router,
        "POST",
        &format!("/v1/artifacts/{d}/signatures"),
        &operator,
        Some(body),
    )
    .await?;
    assert_eq!(status, StatusCode::NOT_FOUND, "{v}");

    let (status, v) = call(&router, "DELETE", "/v1/signing-keys/alice", &admin, None).await?;
    assert_eq!(status, StatusCode::OK, "{v}");
    let (status, v) = call(&router, "DELETE", "/v1/signing-keys/alice", &admin, None).await?;
    assert_eq!(status, StatusCode::NOT_FOUND, "{v}");
    env.teardown().await?;
    Ok(())
}
