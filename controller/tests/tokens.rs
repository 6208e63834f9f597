//! Issue 29, point 2: operators' API tokens end. Through the API's router over
//! a real isolated environment: a token carries its expiry and last use, is
//! refused after it with a problem naming the expiry, can be rotated (the old
//! secret revoked, the new one of the same name and role), and a lifetime out
//! of bounds is refused naming the field. (The migration's upgrade of
//! older tokens: contexts/identity/tests/identity.rs.)

mod common;

use common::{at, call};

use axum::http::StatusCode;
use chrono::Utc;
use mesh_testkit::TestEnv;
use serde_json::json;
use sqlx::postgres::PgPoolOptions;

#[tokio::test]
async fn tokens_end_are_refused_after_and_rotate() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let dir = tempfile::tempdir()?;
    let router = common::api_router(&env, dir.path()).await?;
    let admin = env.admin_token().to_owned();

    // The bootstrap admin token lives the default 90 days.
    let (status, list) = call(&router, "GET", "/v1/tokens", &admin, None).await?;
    assert_eq!(status, StatusCode::OK, "{list}");
    let bootstrap = list["tokens"]
        .as_array()
        .and_then(|t| t.iter().find(|t| t["name"] == "bootstrap-admin"))
        .cloned()
        .ok_or_else(|| anyhow::anyhow!("no bootstrap-admin in {list}"))?;
    let left = at(&bootstrap, "expires_at")? - Utc::now();
    assert!(
        (89..=90).contains(&left.num_days()),
        "bootstrap admin token ends in {left}"
    );

    // A token with a lifetime of its own, used: its last use is kept.
    let (status, created) = call(
        &router,
        "POST",
        "/v1/tokens",
        &admin,
        Some(json!({"name": "ci-deployer", "role": "operator", "ttl_secs": 3600})),
    )
    .await?;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    let left = at(&created, "expires_at")? - Utc::now();
    assert!(
        (3590..=3600).contains(&left.num_seconds()),
        "an hour's token ends in {left}"
    );
    assert!(created["last_used_at"].is_null(), "{created}");
    let secret = created["token"].as_str().unwrap_or_default().to_owned();
    let id = created["id"].as_str().unwrap_or_default().to_owned();
    let (status, _) = call(&router, "GET", "/v1/nodes", &secret, None).await?;
    assert_eq!(status, StatusCode::OK);
    let (_, list) = call(&router, "GET", "/v1/tokens", &admin, None).await?;
    let mine = list["tokens"]
        .as_array()
        .and_then(|t| t.iter().find(|t| t["id"] == id.as_str()))
        .cloned()
        .unwrap_or_default();
    assert!(
        (Utc::now() - at(&mine, "last_used_at")?).num_seconds() < 60,
        "{mine}"
    );

    // A lifetime out of bounds is refused, naming the field.
    for ttl in [0, 59, 367 * 86_400] {
        let (status, problem) = call(
            &router,
            "POST",
            "/v1/tokens",
            &admin,
            Some(json!({"name": "bad", "role": "viewer", "ttl_secs": ttl})),
        )
        .await?;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{ttl}: {problem}");
        assert!(problem.to_string().contains("ttl_secs"), "{problem}");
    }

    // Past its expiry it is refused, and the problem says when it ended.
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect(&env.database_url("identity"))
        .await?;
    sqlx::query(
        "UPDATE identity.tokens SET expires_at = '2026-01-02T03:04:05Z' WHERE id = $1::uuid",
    )
    .bind(&id)
    .execute(&pool)
    .await?;
    let (status, problem) = call(&router, "GET", "/v1/nodes", &secret, None).await?;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{problem}");
    let detail = problem["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains("ci-deployer")
            && detail.contains("expired at 2026-01-02T03:04:05Z")
            && detail.contains("meshctl token rotate"),
        "{problem}"
    );
    assert!(!detail.contains(&secret), "the problem holds the secret");

    // Rotated: a new secret of the same name and role, the old one revoked.
    let (status, rotated) = call(
        &router,
        "POST",
        &format!("/v1/tokens/{id}/rotate"),
        &admin,
        None,
    )
    .await?;
    assert_eq!(status, StatusCode::CREATED, "{rotated}");
    assert_eq!(rotated["name"], "ci-deployer");
    assert_eq!(rotated["role"], "operator");
    assert_eq!(rotated["rotated_from"], id.as_str());
    let left = at(&rotated, "expires_at")? - Utc::now();
    assert!((89..=90).contains(&left.num_days()), "{left}");
    let new_secret = rotated["token"].as_str().unwrap_or_default().to_owned();
    assert_ne!(new_secret, secret);
    let (status, _) = call(&router, "GET", "/v1/nodes", &new_secret, None).await?;
    assert_eq!(status, StatusCode::OK);
    let (status, problem) = call(&router, "GET", "/v1/nodes", &secret, None).await?;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{problem}");
    assert!(
        problem["detail"]
            .as_str()
            .unwrap_or_default()
            .contains("revoked"),
        "{problem}"
    );
    // A revoked token stays revoked: rotating it again is a conflict.
    let (status, problem) = call(
        &router,
        "POST",
        &format!("/v1/tokens/{id}/rotate"),
        &admin,
        Some(json!({"ttl_secs": 600})),
    )
    .await?;
    assert_eq!(status, StatusCode::CONFLICT, "{problem}");
    // An operator may not rotate tokens (admin only).
    let (status, _) = call(
        &router,
        "POST",
        &format!("/v1/tokens/{}/rotate", rotated["id"].as_str().unwrap_or("")),
        &new_secret,
        None,
    )
    .await?;
    assert_eq!(status, StatusCode::FORBIDDEN);
    // The rotation's audit entry is in identity's outbox, bound for the
    // record (the audit log is written from there).
    let audited: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM identity.outbox WHERE convert_from(payload, 'UTF8') LIKE $1",
    )
    .bind(format!("%POST /v1/tokens/{{id}}/rotate%{id}%"))
    .fetch_one(&pool)
    .await?;
    assert!(audited >= 1, "no audit entry of the rotation");

    pool.close().await;
    env.teardown().await
}
