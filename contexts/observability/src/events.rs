//! `observability.events`: appending the record, pruning it, reading pages.

use std::time::Duration;

use chrono::{DateTime, Utc};
use mesh_plumbing::reads::Reads;
use mesh_protocol::RecordEvent;
use serde::Serialize;
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use crate::Error;

/// A position in the stream: the SSE event id, `observability.events.position`.
/// `0` is before the first event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct Position(pub i64);

impl Position {
    /// Parse a `Last-Event-ID` or `after` value: a non-negative integer.
    pub fn parse(field: &str, s: &str) -> Result<Position, Error> {
        match s.trim().parse::<i64>() {
            Ok(n) if n >= 0 => Ok(Position(n)),
            _ => Err(Error::Invalid {
                field: field.to_owned(),
                reason: format!(
                    "`{s}` is not a position of the event stream (a non-negative integer)"
                ),
            }),
        }
    }
}

/// Which events a stream carries; every `Some` must match.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// The context that wrote the event, e.g. `inventory`.
    pub context: Option<String>,
    /// The event's name within its context, e.g. `node.joined`.
    pub kind: Option<String>,
    /// The node the body names (`node`).
    pub node: Option<String>,
    /// The module the body names (`module`).
    pub module: Option<String>,
}

/// One event of the stream.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct EventView {
    pub position: i64,
    pub id: Uuid,
    pub context: String,
    pub event: String,
    pub node: Option<String>,
    pub module: Option<String>,
    pub sent_at: DateTime<Utc>,
    pub body: serde_json::Value,
}

/// Serializes appenders, so positions commit in the order they are taken
/// and a stream that has read position `n` never later sees a smaller one.
const APPEND_LOCK: i64 = 0x6f62_7365_7276; // "observ"

/// Append `events` (already filtered by the inbox), in order.
pub(crate) async fn append(tx: &mut PgConnection, events: &[&RecordEvent]) -> Result<(), Error> {
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(APPEND_LOCK)
        .execute(&mut *tx)
        .await?;
    let mut ids = Vec::with_capacity(events.len());
    let mut contexts = Vec::with_capacity(events.len());
    let mut names = Vec::with_capacity(events.len());
    let mut nodes: Vec<Option<String>> = Vec::with_capacity(events.len());
    let mut modules: Vec<Option<String>> = Vec::with_capacity(events.len());
    let mut sent = Vec::with_capacity(events.len());
    let mut bodies = Vec::with_capacity(events.len());
    for e in events {
        // The wire form is the one place the body is rendered.
        let wire: serde_json::Value =
            serde_json::from_slice(&e.encode()).map_err(|e| Error::Corrupt {
                what: "record event".to_owned(),
                reason: e.to_string(),
            })?;
        let body = wire.get("body").cloned().unwrap_or(serde_json::Value::Null);
        let named = |key: &str| body.get(key).and_then(|v| v.as_str()).map(str::to_owned);
        ids.push(e.id);
        contexts.push(e.context().to_owned());
        names.push(e.event().to_owned());
        nodes.push(named("node"));
        modules.push(named("module"));
        sent.push(e.sent_at);
        bodies.push(body);
    }
    sqlx::query(
        "INSERT INTO observability.events (event_id, context, event, node, module, sent_at, body) \
         SELECT i, c, e, n, m, s, b \
         FROM UNNEST($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], \
                     $6::timestamptz[], $7::jsonb[]) WITH ORDINALITY AS t(i, c, e, n, m, s, b, ordinality) \
         ORDER BY ordinality \
         ON CONFLICT (event_id) DO NOTHING",
    )
    .bind(&ids)
    .bind(&contexts)
    .bind(&names)
    .bind(&nodes)
    .bind(&modules)
    .bind(&sent)
    .bind(&bodies)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Delete events received longer than `retention` ago and raise the horizon
/// to the newest position deleted.
pub(crate) async fn prune(tx: &mut PgConnection, retention: Duration) -> Result<u64, Error> {
    let (count, through): (i64, Option<i64>) = sqlx::query_as(
        "WITH gone AS (DELETE FROM observability.events \
                       WHERE received_at < now() - make_interval(secs => $1) \
                       RETURNING position) \
         SELECT count(*), max(position) FROM gone",
    )
    .bind(retention.as_secs_f64())
    .fetch_one(&mut *tx)
    .await?;
    let Some(through) = through else {
        return Ok(0);
    };
    sqlx::query("UPDATE observability.horizon SET through = greatest(through, $1)")
        .bind(through)
        .execute(&mut *tx)
        .await?;
    Ok(u64::try_from(count).unwrap_or(0))
}

/// The newest position pruned (a client resuming from an older one missed
/// events) and the newest position appended.
pub(crate) async fn bounds(pool: &PgPool) -> Result<(Position, Position), Error> {
    let (through, newest): (i64, Option<i64>) = sqlx::query_as(
        "SELECT h.through, (SELECT max(position) FROM observability.events) \
         FROM observability.horizon h",
    )
    .fetch_one(pool)
    .await?;
    Ok((
        Position(through),
        Position(newest.unwrap_or(through).max(through)),
    ))
}

/// [`page`] for a history that must hold every event through `through`:
/// on the replica when it is usable and has replayed that far (positions
/// commit in order on the primary and the replica replays commits in that
/// order, so holding `through` is holding everything before it), else on
/// the primary.
pub(crate) async fn history(
    reads: &Reads,
    through: Position,
    after: Position,
    filter: &Filter,
    limit: i64,
) -> Result<Vec<EventView>, Error> {
    Ok(reads
        .lag_tolerant_if(
            |pool| async move {
                let held: Option<i64> =
                    sqlx::query_scalar("SELECT max(position) FROM observability.events")
                        .fetch_one(&pool)
                        .await?;
                Ok(held.is_some_and(|held| held >= through.0))
            },
            |pool| async move { rows(&pool, after, filter, limit).await },
        )
        .await?
        .into_iter()
        .map(view)
        .collect())
}

/// Up to `limit` events after `after` that pass `filter`, oldest first.
pub(crate) async fn page(
    pool: &PgPool,
    after: Position,
    filter: &Filter,
    limit: i64,
) -> Result<Vec<EventView>, Error> {
    Ok(rows(pool, after, filter, limit)
        .await?
        .into_iter()
        .map(view)
        .collect())
}

type Row = (
    i64,
    Uuid,
    String,
    String,
    Option<String>,
    Option<String>,
    DateTime<Utc>,
    serde_json::Value,
);

async fn rows(
    pool: &PgPool,
    after: Position,
    filter: &Filter,
    limit: i64,
) -> Result<Vec<Row>, sqlx::Error> {
    sqlx::query_as(
        "SELECT position, event_id, context, event, node, module, sent_at, body \
         FROM observability.events \
         WHERE position > $1 \
           AND ($2::text IS NULL OR context = $2) \
           AND ($3::text IS NULL OR event = $3) \
           AND ($4::text IS NULL OR node = $4) \
           AND ($5::text IS NULL OR module = $5) \
         ORDER BY position LIMIT $6",
    )
    .bind(after.0)
    .bind(&filter.context)
    .bind(&filter.kind)
    .bind(&filter.node)
    .bind(&filter.module)
    .bind(limit)
    .fetch_all(pool)
    .await
}

fn view((position, id, context, event, node, module, sent_at, body): Row) -> EventView {
    EventView {
        position,
        id,
        context,
        event,
        node,
        module,
        sent_at,
        body,
    }
}
