//! The provisioning schema's history, applied as the provisioning role
//! against a real PostgreSQL (a database of this test's own).

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use mesh_testkit::TestEnv;
use sqlx::postgres::PgPoolOptions;

#[tokio::test]
async fn migrations_make_plumbings_tables_once_and_the_role_stays_in_its_schema() {
    let env = TestEnv::new().await.unwrap();
    let url = env.database_url("provisioning");
    let applied = mesh_provisioning::migrate(&url).await.unwrap();
    assert_eq!(applied, ["V1__plumbing", "V2__sections", "V3__grants"]);
    assert!(mesh_provisioning::migrate(&url).await.unwrap().is_empty());

    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .unwrap();
    let mut tables: Vec<String> = sqlx::query_scalar(
        "SELECT table_name::text FROM information_schema.tables \
         WHERE table_schema = 'provisioning' AND table_name NOT LIKE 'refinery%'",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    tables.sort();
    assert_eq!(
        tables,
        [
            "conditions",
            "grants",
            "inbox",
            "modules",
            "outbox",
            "sections",
            "statuses"
        ]
    );
    // What plumbing reads of every context reads here too.
    let generations = mesh_provisioning::SECTIONS
        .generations(&pool)
        .await
        .unwrap();
    assert!(generations.is_empty());
    // Its role is denied every other context's schema.
    let err = sqlx::query("SELECT count(*) FROM config.secrets")
        .execute(&pool)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("permission denied"), "{err}");
    pool.close().await;
    env.teardown().await.unwrap();
}
