//! The transactional outbox: declarations and record events are rows written in
//! the same transaction as the state change that caused them. The controller's
//! relay publishes them with publisher confirms and only then marks them sent.

use mesh_protocol::topology::{DECLARATIONS_EXCHANGE, RECORD_EXCHANGE};
use mesh_protocol::{Declaration, Envelope, NodeId, RecordEvent};
use sqlx::{AssertSqlSafe, PgConnection, PgPool};
use uuid::Uuid;

/// One message waiting to be published.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct OutboxRow {
    pub id: i64,
    pub message_id: Uuid,
    pub exchange: String,
    pub routing_key: String,
    pub kind: String,
    /// Target node of a declaration; none for record events.
    pub node: Option<String>,
    pub payload: Vec<u8>,
}

/// One row to write, as [`OutboxRow`] holds it once written.
struct NewRow<'a> {
    message_id: Uuid,
    exchange: &'a str,
    routing_key: &'a str,
    kind: &'a str,
    node: Option<&'a str>,
    payload: Vec<u8>,
}

async fn insert(tx: &mut PgConnection, schema: &str, row: NewRow<'_>) -> Result<(), sqlx::Error> {
    let sql = format!(
        "INSERT INTO {schema}.outbox (message_id, exchange, routing_key, kind, node, payload) \
         VALUES ($1, $2, $3, $4, $5, $6)"
    );
    sqlx::query(AssertSqlSafe(sql))
        .bind(row.message_id)
        .bind(row.exchange)
        .bind(row.routing_key)
        .bind(row.kind)
        .bind(row.node)
        .bind(row.payload)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// Queue a declaration for `node` in `schema`'s outbox.
pub async fn declare(
    tx: &mut PgConnection,
    schema: &str,
    node: &NodeId,
    declaration: Declaration,
) -> Result<Uuid, sqlx::Error> {
    let generation = declaration.generation;
    let envelope = Envelope::new(node.clone(), generation, declaration);
    let id = envelope.id;
    let row = NewRow {
        message_id: id,
        exchange: DECLARATIONS_EXCHANGE,
        routing_key: node.as_str(),
        kind: Declaration::KIND,
        node: Some(node.as_str()),
        payload: envelope.encode(),
    };
    insert(tx, schema, row).await?;
    Ok(id)
}

/// Queue many declarations in `schema`'s outbox with one statement per chunk of
/// rows, for reconciles that touch thousands of nodes in one transaction. Each
/// row is exactly what [`declare`] writes.
pub async fn declare_many(
    tx: &mut PgConnection,
    schema: &str,
    declarations: Vec<(NodeId, Declaration)>,
) -> Result<Vec<Uuid>, sqlx::Error> {
    const CHUNK: usize = 500;
    let sql = format!(
        "INSERT INTO {schema}.outbox (message_id, exchange, routing_key, kind, node, payload) \
         SELECT u.id, $2, u.node, $3, u.node, u.payload FROM UNNEST($1::uuid[], $4::text[], $5::bytea[]) AS u(id, node, payload)"
    );
    let mut all = Vec::with_capacity(declarations.len());
    let mut rows = declarations.into_iter().peekable();
    while rows.peek().is_some() {
        let (mut ids, mut nodes, mut payloads) = (Vec::new(), Vec::new(), Vec::new());
        for (node, declaration) in rows.by_ref().take(CHUNK) {
            let generation = declaration.generation;
            let envelope = Envelope::new(node.clone(), generation, declaration);
            ids.push(envelope.id);
            payloads.push(envelope.encode());
            nodes.push(node.as_str().to_owned());
        }
        sqlx::query(AssertSqlSafe(sql.clone()))
            .bind(&ids)
            .bind(DECLARATIONS_EXCHANGE)
            .bind(Declaration::KIND)
            .bind(&nodes)
            .bind(&payloads)
            .execute(&mut *tx)
            .await?;
        all.extend(ids);
    }
    Ok(all)
}

/// Queue a record event in `schema`'s outbox.
pub async fn record(
    tx: &mut PgConnection,
    schema: &str,
    event: &RecordEvent,
) -> Result<(), sqlx::Error> {
    let key = event.routing_key();
    let row = NewRow {
        message_id: event.id,
        exchange: RECORD_EXCHANGE,
        routing_key: &key,
        kind: event.event(),
        node: None,
        payload: event.encode(),
    };
    insert(tx, schema, row).await
}

/// Queue many record events in `schema`'s outbox, in their order, with one
/// statement per chunk of rows (a batch of hellos joins hundreds of nodes).
/// Each row is exactly what [`record`] writes.
pub async fn record_many(
    tx: &mut PgConnection,
    schema: &str,
    events: &[RecordEvent],
) -> Result<(), sqlx::Error> {
    const CHUNK: usize = 500;
    // WITH ORDINALITY keeps the events' order in the rows' ids.
    let sql = format!(
        "INSERT INTO {schema}.outbox (message_id, exchange, routing_key, kind, node, payload) \
         SELECT u.id, $2, u.key, u.kind, NULL, u.payload \
         FROM UNNEST($1::uuid[], $3::text[], $4::text[], $5::bytea[]) WITH ORDINALITY AS u(id, key, kind, payload, n) \
         ORDER BY u.n"
    );
    for chunk in events.chunks(CHUNK) {
        let mut ids = Vec::with_capacity(chunk.len());
        let mut keys = Vec::with_capacity(chunk.len());
        let mut kinds = Vec::with_capacity(chunk.len());
        let mut payloads = Vec::with_capacity(chunk.len());
        for event in chunk {
            ids.push(event.id);
            keys.push(event.routing_key());
            kinds.push(event.event());
            payloads.push(event.encode());
        }
        sqlx::query(AssertSqlSafe(sql.clone()))
            .bind(&ids)
            .bind(RECORD_EXCHANGE)
            .bind(&keys)
            .bind(&kinds)
            .bind(&payloads)
            .execute(&mut *tx)
            .await?;
    }
    Ok(())
}

/// The oldest unsent rows, at most `limit`.
pub async fn pending(
    pool: &PgPool,
    schema: &str,
    limit: i64,
) -> Result<Vec<OutboxRow>, sqlx::Error> {
    pending_after(pool, schema, 0, limit).await
}

/// The oldest unsent rows with an id above `after`, at most `limit`: a relay
/// that has rows in flight reads on past them instead of reading them again.
///
/// Ids come from a sequence, and transactions commit out of order: a row can
/// become visible below an id already read. A reader using `after > 0` must
/// therefore read from 0 again whenever it has nothing in flight.
pub async fn pending_after(
    pool: &PgPool,
    schema: &str,
    after: i64,
    limit: i64,
) -> Result<Vec<OutboxRow>, sqlx::Error> {
    let sql = format!(
        "SELECT id, message_id, exchange, routing_key, kind, node, payload FROM {schema}.outbox \
         WHERE sent_at IS NULL AND id > $1 ORDER BY id LIMIT $2"
    );
    sqlx::query_as(AssertSqlSafe(sql))
        .bind(after)
        .bind(limit)
        .fetch_all(pool)
        .await
}

/// Mark rows as confirmed by the broker.
pub async fn mark_sent(pool: &PgPool, schema: &str, ids: &[i64]) -> Result<(), sqlx::Error> {
    let sql = format!("UPDATE {schema}.outbox SET sent_at = now() WHERE id = ANY($1)");
    sqlx::query(AssertSqlSafe(sql))
        .bind(ids)
        .execute(pool)
        .await?;
    Ok(())
}

/// Number of rows not yet sent (a gauge for metrics).
pub async fn backlog(pool: &PgPool, schema: &str) -> Result<i64, sqlx::Error> {
    let sql = format!("SELECT count(*) FROM {schema}.outbox WHERE sent_at IS NULL");
    sqlx::query_scalar(AssertSqlSafe(sql)).fetch_one(pool).await
}

/// Age of the oldest row not yet sent, in seconds (by the database's clock);
/// `None` when nothing waits. A gauge for metrics: a relay that cannot
/// publish shows here as a growing age. The row with the lowest unsent id is
/// taken as the oldest (one read of the `outbox_unsent` index, whatever the
/// backlog); ids are allocated before commit, so it is the oldest give or
/// take one transaction's length.
pub async fn oldest_unsent(pool: &PgPool, schema: &str) -> Result<Option<f64>, sqlx::Error> {
    let sql = format!(
        "SELECT greatest(extract(epoch FROM now() - created_at), 0)::float8 FROM {schema}.outbox \
         WHERE sent_at IS NULL ORDER BY id LIMIT 1"
    );
    sqlx::query_scalar(AssertSqlSafe(sql))
        .fetch_optional(pool)
        .await
}

/// Delete sent rows older than `keep`.
pub async fn prune(
    pool: &PgPool,
    schema: &str,
    keep: std::time::Duration,
) -> Result<u64, sqlx::Error> {
    let sql =
        format!("DELETE FROM {schema}.outbox WHERE sent_at < now() - make_interval(secs => $1)");
    let done = sqlx::query(AssertSqlSafe(sql))
        .bind(keep.as_secs_f64())
        .execute(pool)
        .await?;
    Ok(done.rows_affected())
}
