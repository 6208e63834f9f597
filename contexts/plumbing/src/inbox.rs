//! The inbox: one row per handled message id, written in the handler's
//! transaction, so a redelivered message has no second effect.

use std::collections::HashSet;

use sqlx::{AssertSqlSafe, PgConnection};
use uuid::Uuid;

/// Record `ids` in `schema`'s inbox and return those not seen before; the caller
/// handles only these. Duplicates inside `ids` count once.
pub async fn claim(
    tx: &mut PgConnection,
    schema: &str,
    ids: &[Uuid],
) -> Result<HashSet<Uuid>, sqlx::Error> {
    let mut unique: Vec<Uuid> = ids.to_vec();
    unique.sort_unstable();
    unique.dedup();
    let sql = format!(
        "INSERT INTO {schema}.inbox (message_id) SELECT * FROM UNNEST($1::uuid[]) \
         ON CONFLICT (message_id) DO NOTHING RETURNING message_id"
    );
    let fresh: Vec<Uuid> = sqlx::query_scalar(AssertSqlSafe(sql))
        .bind(&unique)
        .fetch_all(&mut *tx)
        .await?;
    Ok(fresh.into_iter().collect())
}

/// Forget inbox rows older than `keep`; redeliveries come within minutes, not days.
pub async fn prune(
    pool: &sqlx::PgPool,
    schema: &str,
    keep: std::time::Duration,
) -> Result<u64, sqlx::Error> {
    let sql =
        format!("DELETE FROM {schema}.inbox WHERE received_at < now() - make_interval(secs => $1)");
    let done = sqlx::query(AssertSqlSafe(sql))
        .bind(keep.as_secs_f64())
        .execute(pool)
        .await?;
    Ok(done.rows_affected())
}
