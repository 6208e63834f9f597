//! The identity schema against a real PostgreSQL: the audit log is append-only
//! for identity's own role (no privilege, and a trigger behind it).

use mesh_testkit::TestEnv;
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
