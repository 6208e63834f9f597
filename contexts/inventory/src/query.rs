//! Read side: what the API and the controller's composed views ask of inventory.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use mesh_protocol::{Labels, NodeId};
use serde::Serialize;
use sqlx::types::Json;

use crate::reports::effective;
use crate::{Error, Inventory};

/// One node in `GET /v1/nodes`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NodeSummary {
    pub id: String,
    pub hostname: String,
    /// Effective labels.
    pub labels: Labels,
    pub state: String,
    pub last_seen: DateTime<Utc>,
}

/// A node's labels, where they come from, and what they add up to.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LabelsView {
    /// From the node's hello.
    pub reported: Labels,
    /// Set through the API; override reported labels key by key.
    pub operator: Labels,
    /// `reported` overridden by `operator`: what selectors match.
    pub effective: Labels,
}

impl LabelsView {
    pub(crate) fn new(reported: Labels, operator: Labels) -> Self {
        let effective = effective(&reported, &operator);
        LabelsView {
            reported,
            operator,
            effective,
        }
    }
}

/// What a node has applied of one section.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AppliedView {
    /// Newest generation applied successfully (0: none known).
    pub generation: i64,
    /// Last reported outcome: `applied`, `failed` or `rejected`.
    pub outcome: Option<String>,
    /// The generation that outcome concerns.
    pub outcome_generation: Option<i64>,
    pub error: Option<String>,
    pub updated_at: DateTime<Utc>,
}

/// Everything inventory knows of one node.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NodeView {
    pub id: String,
    pub hostname: String,
    pub arch: String,
    pub cpus: i64,
    pub memory_bytes: i64,
    pub agent_version: String,
    pub public_key: Option<String>,
    pub labels: LabelsView,
    pub state: String,
    pub first_seen: DateTime<Utc>,
    pub last_seen: DateTime<Utc>,
    pub last_seq: i64,
    /// Grows whenever the effective labels change.
    pub version: i64,
    /// Per section name.
    pub applied: BTreeMap<String, AppliedView>,
}

#[derive(sqlx::FromRow)]
struct NodeRow {
    id: String,
    hostname: String,
    arch: String,
    cpus: i64,
    memory_bytes: i64,
    agent_version: String,
    public_key: Option<String>,
    reported_labels: Json<Labels>,
    operator_labels: Json<Labels>,
    state: String,
    first_seen: DateTime<Utc>,
    last_seen: DateTime<Utc>,
    last_seq: i64,
    version: i64,
}

#[derive(sqlx::FromRow)]
struct AppliedRow {
    section: String,
    generation: i64,
    outcome: Option<String>,
    outcome_generation: Option<i64>,
    error: Option<String>,
    updated_at: DateTime<Utc>,
}

impl Inventory {
    /// One node with its facts, labels, liveness and applied generations; `None`
    /// when inventory has never heard of it.
    pub async fn node(&self, id: &NodeId) -> Result<Option<NodeView>, Error> {
        let row: Option<NodeRow> = sqlx::query_as(
            "SELECT id, hostname, arch, cpus, memory_bytes, agent_version, public_key, reported_labels, \
             operator_labels, state, first_seen, last_seen, last_seq, version FROM inventory.nodes WHERE id = $1",
        )
        .bind(id.as_str())
        .fetch_optional(&self.pool)
        .await?;
        let Some(n) = row else { return Ok(None) };
        let applied: Vec<AppliedRow> = sqlx::query_as(
            "SELECT section, generation, outcome, outcome_generation, error, updated_at \
             FROM inventory.applied WHERE node = $1 ORDER BY section",
        )
        .bind(id.as_str())
        .fetch_all(&self.pool)
        .await?;
        Ok(Some(NodeView {
            id: n.id,
            hostname: n.hostname,
            arch: n.arch,
            cpus: n.cpus,
            memory_bytes: n.memory_bytes,
            agent_version: n.agent_version,
            public_key: n.public_key,
            labels: LabelsView::new(n.reported_labels.0, n.operator_labels.0),
            state: n.state,
            first_seen: n.first_seen,
            last_seen: n.last_seen,
            last_seq: n.last_seq,
            version: n.version,
            applied: applied
                .into_iter()
                .map(|a| {
                    let view = AppliedView {
                        generation: a.generation,
                        outcome: a.outcome,
                        outcome_generation: a.outcome_generation,
                        error: a.error,
                        updated_at: a.updated_at,
                    };
                    (a.section, view)
                })
                .collect(),
        }))
    }

    /// Nodes ordered by id, those after `after`, at most `limit` (capped by
    /// [`crate::InventorySettings::max_page`]).
    pub async fn nodes(&self, after: Option<&str>, limit: i64) -> Result<Vec<NodeSummary>, Error> {
        let limit = limit.clamp(1, self.settings.max_page.max(1));
        type Row = (
            String,
            String,
            Json<Labels>,
            Json<Labels>,
            String,
            DateTime<Utc>,
        );
        let rows: Vec<Row> = sqlx::query_as(
            "SELECT id, hostname, reported_labels, operator_labels, state, last_seen FROM inventory.nodes \
             WHERE $1::text IS NULL OR id > $1 ORDER BY id LIMIT $2",
        )
        .bind(after)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(
                |(id, hostname, reported, operator, state, last_seen)| NodeSummary {
                    id,
                    hostname,
                    labels: effective(&reported.0, &operator.0),
                    state,
                    last_seen,
                },
            )
            .collect())
    }
}
