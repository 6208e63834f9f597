//! The identity schema against a real PostgreSQL: the audit log is append-only
//! for identity's own role (no privilege, and a trigger behind it); tokens
//! made before the tokens-that-end migration get the default lifetime.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use mesh_testkit::TestEnv;
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection as _, PgConnection};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_audit_log_is_append_only_even_for_its_owner() {
    let env = TestEnv::new().await.unwrap();
    let url = env.database_url("identity");
    let applied = mesh_identity::migrate(&url).await.unwrap();
    assert!(applied.len() >= 3, "{applied:?}");
    let mut c = PgConnection::connect(&url).await.unwrap();
    sqlx::raw_sql(
        "INSERT INTO identity.audit (event_id, context, principal_id, principal, role, action, \
         target, request_id, at, outcome, status) VALUES (gen_random_uuid(), 'config', \
         gen_random_uuid(), 'p', 'admin', 'PUT /v1/files/{name}', '/v1/files/x', \
         gen_random_uuid(), now(), 'ok', 200)",
    )
    .execute(&mut c)
    .await
    .unwrap();
    for sql in [
        "UPDATE identity.audit SET outcome = 'failed'",
        "DELETE FROM identity.audit",
        "TRUNCATE identity.audit",
    ] {
        let err = sqlx::raw_sql(sql)
            .execute(&mut c)
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("permission denied"), "`{sql}`: {err}");
    }
    // The owner can grant itself the privileges back (the residual risk of
    // docs/security.md); the trigger still refuses.
    sqlx::raw_sql("GRANT UPDATE, DELETE, TRUNCATE ON identity.audit TO CURRENT_USER")
        .execute(&mut c)
        .await
        .unwrap();
    for sql in [
        "UPDATE identity.audit SET outcome = 'failed'",
        "DELETE FROM identity.audit",
        "TRUNCATE identity.audit",
    ] {
        let err = sqlx::raw_sql(sql)
            .execute(&mut c)
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("append-only"), "`{sql}`: {err}");
    }
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM identity.audit")
        .fetch_one(&mut c)
        .await
        .unwrap();
    assert_eq!(n, 1);
    c.close().await.unwrap();
    env.teardown().await.unwrap();
}

/// Issue 29, point 2: tokens made before the upgrade get the default
/// lifetime, counted from the upgrade (none is cut off by it).
#[tokio::test]
async fn tokens_made_before_the_upgrade_get_the_default_lifetime() -> anyhow::Result<()> {
    let env = TestEnv::new().await?;
    let url = env.database_url("identity");
    mesh_plumbing::migrate(
        &url,
        "identity",
        mesh_identity::migrations().set_target(refinery::Target::Version(3)),
    )
    .await?;
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await?;
    sqlx::query(
        "INSERT INTO identity.tokens (id, name, role, token_sha256, created_by) \
         VALUES (gen_random_uuid(), 'old', 'admin', repeat('a', 64), 'bundle')",
    )
    .execute(&pool)
    .await?;
    let applied = mesh_identity::migrate(&url).await?;
    assert_eq!(
        applied.first().map(String::as_str),
        Some("V4__tokens_that_end"),
        "{applied:?}"
    );
    let left: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM expires_at - now())::float8 FROM identity.tokens WHERE name = 'old'",
    )
    .fetch_one(&pool)
    .await?;
    let days = left / 86_400.0;
    assert!((89.9..=90.0).contains(&days), "{days} days");
    pool.close().await;
    env.teardown().await
}
