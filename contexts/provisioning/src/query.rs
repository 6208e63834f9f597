//! The read model of `GET /v1/grants`: each grant, who asks and who serves,
//! its state and what each provider node reported. Never a credential.

use std::collections::{BTreeMap, HashMap};

use chrono::{DateTime, Utc};
use mesh_protocol::ResourceKind;
use serde::Serialize;
use sqlx::types::Json;
use uuid::Uuid;

use crate::reconcile::{GrantState, consumer_file, module_secret_path};
use crate::{Error, Provisioning};

/// What one provider node's agent reported of a grant.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct ProviderNodeView {
    pub node: String,
    /// `ready`, `waiting`, `failed`, `revoked` or `deleted`.
    pub state: String,
    /// The credential version the user has (ready).
    pub credential_version: Option<i64>,
    /// The agent's or the server's words.
    pub reason: Option<String>,
    pub reported_at: DateTime<Utc>,
}

/// One grant: a requirement of a consumer module, served by a provider
/// module. Holds no credential.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct GrantView {
    pub id: Uuid,
    /// The consumer module.
    pub consumer: String,
    /// `requires[].name` in the consumer's spec.
    pub requirement: String,
    pub kind: ResourceKind,
    /// The provider module; null while none is chosen.
    pub provider: Option<String>,
    /// The name on the provider's server: `<consumer>-<requirement>`.
    pub resource: String,
    /// The login role, broker user or S3 key id; null before a credential
    /// is issued.
    pub user: Option<String>,
    pub options: BTreeMap<String, String>,
    /// Deleted at once on revocation instead of kept for the retention.
    pub delete: bool,
    pub state: GrantState,
    /// Why it waits, failed or was revoked.
    pub reason: Option<String>,
    /// 0 before a credential is issued.
    pub credential_version: i64,
    /// Where the consumer's processes read the credential on its nodes.
    pub credential_file: String,
    /// The nodes the consumer module runs on.
    pub consumer_nodes: Vec<String>,
    /// What each provider node's agent reported.
    pub provider_nodes: Vec<ProviderNodeView>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub revoked_at: Option<DateTime<Utc>>,
    /// A revoked grant: when its kept data is deleted.
    pub retain_until: Option<DateTime<Utc>>,
}

/// Which grants a list holds.
#[derive(Debug, Clone, Default)]
pub struct GrantFilter<'a> {
    /// Whose consumer or provider module is this one.
    pub module: Option<&'a str>,
    pub resource: Option<&'a str>,
    pub kind: Option<ResourceKind>,
    pub state: Option<GrantState>,
    /// After this grant, in the list's order.
    pub after: Option<Uuid>,
}

#[derive(sqlx::FromRow)]
struct Row {
    id: Uuid,
    consumer: String,
    requirement: String,
    kind: String,
    options: Json<BTreeMap<String, String>>,
    delete_on_revoke: bool,
    provider: Option<String>,
    resource: String,
    login: Option<String>,
    credential_version: i64,
    state: String,
    reason: Option<String>,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
    revoked_at: Option<DateTime<Utc>>,
    retain_until: Option<DateTime<Utc>>,
}

const COLUMNS: &str = "id, consumer, requirement, kind, options, delete_on_revoke, provider, resource, \
     login, credential_version, state, reason, created_at, updated_at, revoked_at, retain_until";

impl Provisioning {
    /// A page of grants, by consumer, requirement and id.
    pub async fn grants(
        &self,
        filter: &GrantFilter<'_>,
        limit: i64,
    ) -> Result<Vec<GrantView>, Error> {
        let after: Option<(String, String)> = match filter.after {
            Some(id) => Some(
                sqlx::query_as(
                    "SELECT consumer, requirement FROM provisioning.grants WHERE id = $1",
                )
                .bind(id)
                .fetch_optional(&self.pool)
                .await?
                .ok_or_else(|| Error::Invalid {
                    field: "after".to_owned(),
                    reason: format!("no grant {id} (deleted since?): list again from the start"),
                })?,
            ),
            None => None,
        };
        let sql = format!(
            "SELECT {COLUMNS} FROM provisioning.grants \
             WHERE ($1::text IS NULL OR consumer = $1 OR provider = $1) \
               AND ($2::text IS NULL OR resource = $2) \
               AND ($3::text IS NULL OR kind = $3) \
               AND ($4::text IS NULL OR state = $4) \
               AND ($5::uuid IS NULL OR (consumer, requirement, id) > ($6, $7, $5)) \
             ORDER BY consumer, requirement, id LIMIT $8"
        );
        let (after_consumer, after_requirement) = after.unzip();
        let rows: Vec<Row> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(filter.module)
            .bind(filter.resource)
            .bind(filter.kind.map(ResourceKind::as_str))
            .bind(filter.state.map(GrantState::as_str))
            .bind(filter.after)
            .bind(after_consumer)
            .bind(after_requirement)
            .bind(limit)
            .fetch_all(&self.pool)
            .await?;
        self.views(rows).await
    }

    /// One grant.
    pub async fn grant(&self, id: Uuid) -> Result<GrantView, Error> {
        let sql = format!("SELECT {COLUMNS} FROM provisioning.grants WHERE id = $1");
        let row: Option<Row> = sqlx::query_as(sqlx::AssertSqlSafe(sql))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        let row = row.ok_or_else(|| Error::NotFound(format!("no grant {id}")))?;
        self.views(vec![row])
            .await?
            .pop()
            .ok_or_else(|| Error::NotFound(format!("no grant {id}")))
    }

    async fn views(&self, rows: Vec<Row>) -> Result<Vec<GrantView>, Error> {
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<Uuid> = rows.iter().map(|r| r.id).collect();
        let consumers: Vec<&str> = rows.iter().map(|r| r.consumer.as_str()).collect();
        type StatusRow = (
            Uuid,
            String,
            String,
            Option<i64>,
            Option<String>,
            DateTime<Utc>,
        );
        let statuses: Vec<StatusRow> = sqlx::query_as(
            "SELECT grant_id, node, state, credential_version, reason, reported_at \
             FROM provisioning.statuses WHERE grant_id = ANY($1) ORDER BY grant_id, node",
        )
        .bind(&ids)
        .fetch_all(&self.pool)
        .await?;
        let mut by_grant: HashMap<Uuid, Vec<ProviderNodeView>> = HashMap::new();
        for (grant, node, state, credential_version, reason, reported_at) in statuses {
            by_grant.entry(grant).or_default().push(ProviderNodeView {
                node,
                state,
                credential_version,
                reason,
                reported_at,
            });
        }
        let nodes: Vec<(String, Vec<String>)> = sqlx::query_as(
            "SELECT module, nodes FROM provisioning.modules WHERE module = ANY($1) AND NOT removed",
        )
        .bind(&consumers)
        .fetch_all(&self.pool)
        .await?;
        let nodes: HashMap<String, Vec<String>> = nodes.into_iter().collect();
        let mut out = Vec::with_capacity(rows.len());
        for r in rows {
            let what = || format!("grant {}", r.id);
            out.push(GrantView {
                kind: ResourceKind::parse(&r.kind)
                    .ok_or_else(|| Error::corrupt(what(), format!("kind `{}`", r.kind)))?,
                state: GrantState::parse(&r.state)
                    .ok_or_else(|| Error::corrupt(what(), format!("state `{}`", r.state)))?,
                credential_file: module_secret_path(&r.consumer, &consumer_file(&r.requirement)),
                consumer_nodes: nodes.get(&r.consumer).cloned().unwrap_or_default(),
                provider_nodes: by_grant.remove(&r.id).unwrap_or_default(),
                id: r.id,
                consumer: r.consumer,
                requirement: r.requirement,
                provider: r.provider,
                resource: r.resource,
                user: r.login,
                options: r.options.0,
                delete: r.delete_on_revoke,
                reason: r.reason,
                credential_version: r.credential_version,
                created_at: r.created_at,
                updated_at: r.updated_at,
                revoked_at: r.revoked_at,
                retain_until: r.retain_until,
            });
        }
        Ok(out)
    }
}
