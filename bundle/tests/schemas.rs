//! Rule 2, over every pair: each context's role is denied every other context's
//! schema (read, write, create), on a real PostgreSQL.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use mesh_bundle::CONTEXTS;
use mesh_testkit::TestEnv;
use sqlx::{AssertSqlSafe, Connection as _, PgConnection};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_context_role_is_denied_every_other_schema() {
    let env = TestEnv::new().await.unwrap();
    let mut conns = Vec::new();
    for ctx in CONTEXTS {
        let mut c = PgConnection::connect(&env.database_url(ctx)).await.unwrap();
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE TABLE {ctx}.t (x int); INSERT INTO {ctx}.t VALUES (1)"
        )))
        .execute(&mut c)
        .await
        .unwrap_or_else(|e| panic!("{ctx} in its own schema: {e}"));
        conns.push((ctx, c));
    }
    let mut checked = 0;
    for (me, conn) in conns.iter_mut() {
        for other in CONTEXTS.iter().filter(|o| *o != me) {
            for sql in [
                format!("SELECT * FROM {other}.t"),
                format!("INSERT INTO {other}.t VALUES (2)"),
                format!("UPDATE {other}.t SET x = 3"),
                format!("DELETE FROM {other}.t"),
                format!("CREATE TABLE {other}.intruder (x int)"),
            ] {
                let err = sqlx::raw_sql(AssertSqlSafe(sql.clone()))
                    .execute(&mut *conn)
                    .await
                    .expect_err(&format!("`{sql}` as {me} must be refused"))
                    .to_string();
                assert!(
                    err.contains(&format!("permission denied for schema {other}")),
                    "`{sql}` as {me}: {err}"
                );
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 7 * 6 * 5);
    for (_, c) in conns {
        c.close().await.unwrap();
    }
    env.teardown().await.unwrap();
}
