//! The audit log: appended from `*.operator.audit` record events (each context
//! that served an operator's mutation writes one), read with filters and paging.
//! The table is append-only: identity's role has no UPDATE, DELETE or TRUNCATE on
//! it, and a trigger refuses them (migrations/identity/V3).

use chrono::{DateTime, Utc};
use mesh_protocol::{AuditEntry, RecordEvent};
use serde::Serialize;
use sqlx::PgConnection;
use uuid::Uuid;

use crate::{Error, Identity};

/// Append `entry` (carried by `event`); a redelivered event appends nothing.
pub(crate) async fn append(
    tx: &mut PgConnection,
    event: &RecordEvent,
    entry: &AuditEntry,
) -> Result<(), Error> {
    sqlx::query(
        "INSERT INTO identity.audit (event_id, context, principal_id, principal, role, action, \
         target, request_id, at, outcome, status, detail) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12) ON CONFLICT (event_id) DO NOTHING",
    )
    .bind(event.id)
    .bind(event.context())
    .bind(entry.principal_id)
    .bind(&entry.principal)
    .bind(&entry.role)
    .bind(&entry.action)
    .bind(&entry.target)
    .bind(entry.request_id)
    .bind(entry.at)
    .bind(&entry.outcome)
    .bind(i32::from(entry.status))
    .bind(entry.detail.as_deref())
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// One audit entry as `GET /v1/audit` returns it.
#[derive(Debug, Clone, Serialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct AuditRow {
    /// Position in the log; pass the last one as `after` for the next page.
    pub seq: i64,
    pub context: String,
    pub principal_id: Uuid,
    pub principal: String,
    pub role: String,
    pub action: String,
    pub target: String,
    pub request_id: Uuid,
    pub at: DateTime<Utc>,
    pub outcome: String,
    pub status: i32,
    /// What the route alone does not say (e.g. that the module written runs
    /// as root); absent for most entries.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// Filters of `GET /v1/audit` (its query parameters beside the page's);
/// every one optional, all must hold.
#[derive(Debug, Clone, Default, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct AuditFilter {
    /// The token name that acted.
    pub principal: Option<String>,
    /// Exact action, e.g. `PUT /v1/files/{name}`.
    pub action: Option<String>,
    /// Exact target path, e.g. `/v1/files/motd`.
    pub target: Option<String>,
    /// `ok`, `denied` or `failed`.
    pub outcome: Option<String>,
    pub since: Option<DateTime<Utc>>,
    pub until: Option<DateTime<Utc>>,
}

#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct AuditPage {
    pub entries: Vec<AuditRow>,
    /// Pass as `after` for the next page; absent on the last page.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next: Option<i64>,
}

impl Identity {
    /// The audit log, oldest first, filtered and paged. Tolerates lag: served
    /// by the replica when one is usable ([`Identity::reads`]); a page ends
    /// where the replica is, and its `next` goes on from there.
    /// `after` is the previous page's `next` (a `seq`); `limit` is cut to
    /// the settings' `max_page`.
    pub async fn audit(
        &self,
        f: &AuditFilter,
        after: Option<i64>,
        limit: i64,
    ) -> Result<AuditPage, Error> {
        let limit = limit.clamp(1, self.settings.max_page.max(1));
        let entries: Vec<AuditRow> = self
            .reads
            .lag_tolerant(|pool| async move {
                sqlx::query_as(
            "SELECT seq, context, principal_id, principal, role, action, target, request_id, at, \
             outcome, status, detail FROM identity.audit \
             WHERE ($1::text IS NULL OR principal = $1) \
               AND ($2::text IS NULL OR action = $2) \
               AND ($3::text IS NULL OR target = $3) \
               AND ($4::text IS NULL OR outcome = $4) \
               AND ($5::timestamptz IS NULL OR at >= $5) \
               AND ($6::timestamptz IS NULL OR at < $6) \
               AND ($7::bigint IS NULL OR seq > $7) \
             ORDER BY seq LIMIT $8",
        )
        .bind(&f.principal)
        .bind(&f.action)
        .bind(&f.target)
        .bind(&f.outcome)
        .bind(f.since)
        .bind(f.until)
        .bind(after)
        .bind(limit)
        .fetch_all(&pool)
        .await
            })
            .await?;
        let next = mesh_plumbing::page::next(&entries, limit, |e| e.seq);
        Ok(AuditPage { entries, next })
    }
}
