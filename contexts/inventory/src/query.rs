//! Read side: what the API and the controller's composed views ask of inventory.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use mesh_protocol::{Labels, NodeId};
use serde::Serialize;
use sqlx::types::Json;

use crate::module::{AutoscalerIntent, ModuleSpec};
use crate::nodes::LabelTrust;
use crate::placement::{Intent, effective_replicas};
use crate::{Error, Inventory};

/// One node in `GET /v1/nodes`.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct NodeSummary {
    pub id: String,
    pub hostname: String,
    /// Effective labels: what selects it (operator labels over trusted
    /// stated ones, and `mesh.io/node`).
    pub labels: Labels,
    /// What the node states about itself, as stated: selecting nothing
    /// unless its key is trusted (`trusted_stated_labels`).
    pub stated: Labels,
    pub state: String,
    /// The newest `sent_at` heard from the node, as written: it lags the last
    /// heartbeat by at most the controller's `liveness_write_ms`.
    pub last_seen: DateTime<Utc>,
    /// The interval the node says it beats at, in ms (absent: an agent that
    /// does not say, which beats at its own configured interval).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub heartbeat_interval_ms: Option<i64>,
}

/// A node's labels, where they come from, and what they add up to.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct LabelsView {
    /// What the node states about itself in its hello: shown as stated, and
    /// selecting nothing unless its key is one the controller trusts
    /// (`trusted_stated_labels`).
    pub reported: Labels,
    /// Set through the API or bound to the node's join token: what selects.
    pub operator: Labels,
    /// The trusted keys of `reported`, overridden by `operator`: what
    /// selectors, placement, roles and grants match.
    pub effective: Labels,
}

impl LabelsView {
    pub(crate) fn new(trust: &LabelTrust, node: &str, reported: Labels, operator: Labels) -> Self {
        let effective = trust.effective(node, &reported, &operator);
        LabelsView {
            reported,
            operator,
            effective,
        }
    }
}

/// What a node has applied of one section.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
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
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct NodeView {
    pub id: String,
    pub hostname: String,
    pub arch: String,
    pub cpus: i64,
    pub memory_bytes: i64,
    pub agent_version: String,
    pub public_key: Option<String>,
    pub labels: LabelsView,
    /// `revoked`, else `refused`, else `unreachable`, else `draining` /
    /// `drained`, else `alive`.
    pub state: String,
    /// `alive` or `unreachable`, as the controller judges it.
    pub liveness: String,
    /// `active`, `draining`, `drained` or `revoked`, as operators decided.
    pub admin_state: String,
    /// Why a drain cannot finish yet.
    pub drain_blocked: Option<String>,
    pub unreachable_since: Option<DateTime<Utc>>,
    /// When the controller last handled a report of the node (its own clock).
    pub heard_at: DateTime<Utc>,
    /// The units assigned to the node.
    pub units: Vec<AssignmentView>,
    pub first_seen: DateTime<Utc>,
    pub last_seen: DateTime<Utc>,
    pub last_seq: i64,
    /// Grows whenever the effective labels change.
    pub version: i64,
    /// Per section name.
    pub applied: BTreeMap<String, AppliedView>,
    /// The envelope versions the node's agent speaks (from its hello).
    pub protocol: ProtocolView,
    /// Why the controller refuses the node's agent (it speaks no version the
    /// controller does): nothing is declared to it. None: not refused.
    pub refused: Option<String>,
}

/// The envelope versions an agent speaks, oldest to newest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct ProtocolView {
    pub min: i32,
    pub max: i32,
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
    liveness: String,
    admin_state: String,
    drain_blocked: Option<String>,
    unreachable_since: Option<DateTime<Utc>>,
    heard_at: DateTime<Utc>,
    first_seen: DateTime<Utc>,
    last_seen: DateTime<Utc>,
    last_seq: i64,
    version: i64,
    protocol_min: i32,
    protocol_max: i32,
    refused: Option<String>,
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
             operator_labels, CASE WHEN admin_state = 'revoked' THEN 'revoked' WHEN refused IS NOT NULL THEN 'refused' WHEN state = 'unreachable' THEN 'unreachable' WHEN admin_state IN ('draining', 'drained') THEN admin_state ELSE 'alive' END AS state, state AS liveness, admin_state, drain_blocked, unreachable_since, heard_at, \
             first_seen, last_seen, last_seq, version, protocol_min, protocol_max, refused \
             FROM inventory.nodes WHERE id = $1",
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
        let units = self.assignments(None, Some(id.as_str())).await?;
        let labels = LabelsView::new(
            &self.settings.label_trust,
            &n.id,
            n.reported_labels.0,
            n.operator_labels.0,
        );
        Ok(Some(NodeView {
            units,
            liveness: n.liveness,
            admin_state: n.admin_state,
            drain_blocked: n.drain_blocked,
            unreachable_since: n.unreachable_since,
            heard_at: n.heard_at,
            id: n.id,
            hostname: n.hostname,
            arch: n.arch,
            cpus: n.cpus,
            memory_bytes: n.memory_bytes,
            agent_version: n.agent_version,
            public_key: n.public_key,
            labels,
            state: n.state,
            first_seen: n.first_seen,
            last_seen: n.last_seen,
            last_seq: n.last_seq,
            version: n.version,
            protocol: ProtocolView {
                min: n.protocol_min,
                max: n.protocol_max,
            },
            refused: n.refused,
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

    /// The generation each reachable, unrevoked node applied of each section
    /// (`(node, section, generation)`; 0: none known): what the controller
    /// compares with what it declared to tell a node that is behind.
    pub async fn applied_generations(&self) -> Result<Vec<(String, String, i64)>, Error> {
        Ok(sqlx::query_as(
            "SELECT a.node, a.section, a.generation FROM inventory.applied a \
             JOIN inventory.nodes n ON n.id = a.node \
             WHERE n.state = 'alive' AND n.admin_state <> 'revoked'",
        )
        .fetch_all(&self.pool)
        .await?)
    }

    /// Nodes ordered by id, those after `after`, at most `limit` (capped by
    /// [`crate::InventorySettings::max_page`]).
    /// With `selector`, only those whose effective labels (the trusted keys
    /// of the stated ones, overridden by operator labels) hold every pair.
    /// Tolerates lag: served by the replica when one is usable
    /// ([`Inventory::reads`]).
    pub async fn nodes(
        &self,
        after: Option<&str>,
        limit: i64,
        selector: Option<&Labels>,
    ) -> Result<Vec<NodeSummary>, Error> {
        let limit = limit.clamp(1, self.settings.max_page.max(1));
        let trust = &self.settings.label_trust;
        let trusted = trust.keys();
        let trusted = &trusted;
        type Row = (
            String,
            String,
            Json<Labels>,
            Json<Labels>,
            String,
            DateTime<Utc>,
            Option<i64>,
        );
        let rows: Vec<Row> = self.reads.lag_tolerant(|pool| async move { sqlx::query_as(
            "SELECT id, hostname, reported_labels, operator_labels, CASE WHEN admin_state = 'revoked' THEN 'revoked' WHEN refused IS NOT NULL THEN 'refused' WHEN state = 'unreachable' THEN 'unreachable' WHEN admin_state IN ('draining', 'drained') THEN admin_state ELSE 'alive' END AS state, last_seen, beat_ms FROM inventory.nodes \
             WHERE ($1::text IS NULL OR id > $1) \
             AND ($3::jsonb IS NULL OR ((SELECT COALESCE(jsonb_object_agg(t.key, t.value), '{}'::jsonb) \
                  FROM jsonb_each(reported_labels) AS t WHERE t.key = ANY($4)) || operator_labels \
                  || jsonb_build_object('mesh.io/node', id)) @> $3) \
             ORDER BY id LIMIT $2",
        )
        .bind(after)
        .bind(limit)
        .bind(selector.map(Json))
        .bind(trusted)
        .fetch_all(&pool)
        .await }).await?;
        Ok(rows
            .into_iter()
            .map(
                |(id, hostname, reported, operator, state, last_seen, beat_ms)| NodeSummary {
                    labels: trust.effective(&id, &reported.0, &operator.0),
                    stated: reported.0,
                    id,
                    hostname,
                    state,
                    last_seen,
                    heartbeat_interval_ms: beat_ms,
                },
            )
            .collect())
    }
}

/// One assignment: a replica of a module on a node, and its unit as last reported.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct AssignmentView {
    pub module: String,
    pub replica: i32,
    pub node: String,
    /// The unit's name on the node.
    pub name: String,
    /// `active` (part of the replica set) or `retiring` (replaced; runs until its
    /// replacement runs).
    pub role: String,
    pub placed_at: DateTime<Utc>,
    /// Last reported unit state (none: not reported yet): `starting`, `running`,
    /// `exited`, `failed`, `stopped`.
    pub unit_state: Option<String>,
    pub pid: Option<i64>,
    pub exit_code: Option<i32>,
    pub restarts: i64,
    pub started_at: Option<DateTime<Utc>>,
    pub reported_at: Option<DateTime<Utc>>,
    /// Why the unit's last process ended, when its agent knows more than the
    /// exit code: `oom_killed` (over its memory limit).
    pub reason: Option<String>,
    /// Times the unit was OOM-killed since it was (re)declared on the node.
    pub oom_kills: i64,
    /// The uid the unit runs as (none: not running, or an agent older than
    /// the sandbox): its module's own user, or 0 for a module run as root.
    pub uid: Option<i64>,
    /// Bytes in the module's data volume on the node, as last reported.
    pub data_bytes: Option<i64>,
    /// The revision the replica runs, as delivery targets the module on the
    /// node (`delivery.module.targets`); null: it runs the module's own spec.
    pub revision: Option<uuid::Uuid>,
}

/// A module with its revision, intent layers, effective replicas and assignments.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct ModuleView {
    pub name: String,
    /// Inlined: the spec's own schema refuses unknown fields, the view adds some.
    #[serde(flatten)]
    #[schema(inline)]
    pub spec: ModuleSpec,
    /// Grows with every write; the ETag is `"<revision>"`.
    pub revision: i64,
    pub intent: Intent,
    pub effective_replicas: u32,
    /// Why the last reconcile could not place it as asked.
    pub placement_error: Option<String>,
    pub assignments: Vec<AssignmentView>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    /// The module's health as observability last told the record (none:
    /// not told yet): `healthy`, `degraded`, `down` or `unknown`, with each
    /// replica's and why it is not healthy. `GET /v1/health?module=` has the
    /// probe results in full.
    pub health: Option<ModuleHealthView>,
}

/// A module's health, as `observability.module.health` told it.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct ModuleHealthView {
    pub health: String,
    pub replicas: Vec<ReplicaHealthView>,
    /// When observability derived it.
    pub at: DateTime<Utc>,
}

/// One replica's health in a [`ModuleHealthView`].
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct ReplicaHealthView {
    pub node: String,
    pub unit: String,
    pub health: String,
    /// The probe results or unit state that decided it, in words.
    #[serde(default)]
    pub reason: Option<String>,
}

/// Keep `observability.module.health` (the newest of each module, by its
/// version) for the module view.
pub(crate) async fn record_module_health(
    tx: &mut sqlx::PgConnection,
    body: &mesh_protocol::ModuleHealth,
) -> Result<(), Error> {
    let replicas = serde_json::to_value(&body.replicas).unwrap_or(serde_json::Value::Null);
    sqlx::query(
        "INSERT INTO inventory.module_health AS h (module, version, health, replicas, at) \
         VALUES ($1, $2, $3, $4, $5) \
         ON CONFLICT (module) DO UPDATE SET version = excluded.version, health = excluded.health, \
             replicas = excluded.replicas, at = excluded.at \
         WHERE h.version < excluded.version",
    )
    .bind(&body.module)
    .bind(body.version)
    .bind(body.health.as_str())
    .bind(replicas)
    .bind(body.at)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

#[derive(sqlx::FromRow)]
struct ModuleRow {
    name: String,
    spec: Json<ModuleSpec>,
    revision: i64,
    placement_error: Option<String>,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
}

/// Every state [`Inventory::node_counts`] (and `GET /v1/nodes`) gives a node,
/// in the order they are judged: revoked, then refused, unreachable, draining
/// or drained, else alive.
pub const NODE_STATES: [&str; 6] = [
    "alive",
    "unreachable",
    "draining",
    "drained",
    "refused",
    "revoked",
];

impl Inventory {
    /// How many nodes are in each of [`NODE_STATES`] (a state no node is in
    /// counts 0): one scan of `inventory.nodes`, for the controller's metrics.
    pub async fn node_counts(&self) -> Result<Vec<(String, i64)>, Error> {
        let rows: Vec<(String, i64)> = sqlx::query_as(
            "SELECT CASE WHEN admin_state = 'revoked' THEN 'revoked' WHEN refused IS NOT NULL THEN 'refused' WHEN state = 'unreachable' THEN 'unreachable' WHEN admin_state IN ('draining', 'drained') THEN admin_state ELSE 'alive' END AS s, count(*) \
             FROM inventory.nodes GROUP BY 1",
        )
        .fetch_all(&self.pool)
        .await?;
        Ok(NODE_STATES
            .iter()
            .map(|state| {
                let n = rows.iter().find(|(s, _)| s == state).map_or(0, |(_, n)| *n);
                ((*state).to_owned(), n)
            })
            .collect())
    }
}

impl Inventory {
    /// Assignments of one module and/or one node, by module, replica, node.
    pub async fn assignments(
        &self,
        module: Option<&str>,
        node: Option<&str>,
    ) -> Result<Vec<AssignmentView>, Error> {
        Ok(sqlx::query_as(
            "SELECT a.module, a.replica, a.node, a.name, a.role, a.placed_at, a.unit_state, a.pid, \
             a.exit_code, a.restarts, a.started_at, a.reported_at, a.reason, a.oom_kills, a.uid, \
             a.data_bytes, \
             (SELECT (t ->> 'revision')::uuid FROM inventory.module_targets mt, \
                     jsonb_array_elements(mt.targets) AS t \
              WHERE mt.module = a.module AND t ->> 'node' = a.node \
                AND EXISTS (SELECT 1 FROM jsonb_array_elements(mt.revisions) AS r \
                            WHERE r ->> 'id' = t ->> 'revision') \
              LIMIT 1) AS revision \
             FROM inventory.assignments a \
             WHERE ($1::text IS NULL OR a.module = $1) AND ($2::text IS NULL OR a.node = $2) \
             ORDER BY a.module, a.replica, a.node",
        )
        .bind(module)
        .bind(node)
        .fetch_all(&self.pool)
        .await?)
    }

    /// The intent layers of a module (user from its spec).
    pub(crate) async fn intent(&self, name: &str, spec: &ModuleSpec) -> Result<Intent, Error> {
        let rows: Vec<(String, Json<serde_json::Value>)> =
            sqlx::query_as("SELECT layer, value FROM inventory.intents WHERE module = $1")
                .bind(name)
                .fetch_all(&self.pool)
                .await?;
        let mut intent = Intent {
            user: spec.user_replicas(),
            ..Intent::default()
        };
        for (layer, value) in rows {
            let corrupt = |e: serde_json::Error| Error::Corrupt {
                node: name.to_owned(),
                reason: format!("intent {layer}: {e}"),
            };
            match layer.as_str() {
                "policy" => intent.policy = Some(serde_json::from_value(value.0).map_err(corrupt)?),
                "autoscaler" => {
                    let a: AutoscalerIntent = serde_json::from_value(value.0).map_err(corrupt)?;
                    intent.autoscaler = Some(a.replicas);
                }
                _ => {}
            }
        }
        Ok(intent)
    }

    /// One module with everything known of it; `None` if there is none.
    pub async fn module(&self, name: &str) -> Result<Option<ModuleView>, Error> {
        let row: Option<ModuleRow> = sqlx::query_as(
            "SELECT name, spec, revision, placement_error, created_at, updated_at FROM inventory.modules \
             WHERE name = $1",
        )
        .bind(name)
        .fetch_optional(&self.pool)
        .await?;
        let Some(m) = row else { return Ok(None) };
        let intent = self.intent(name, &m.spec.0).await?;
        let effective_replicas = if m.spec.0.placement.is_pinned() {
            1
        } else {
            effective_replicas(&intent)
        };
        let health: Option<(String, serde_json::Value, DateTime<Utc>)> = sqlx::query_as(
            "SELECT health, replicas, at FROM inventory.module_health WHERE module = $1",
        )
        .bind(name)
        .fetch_optional(&self.pool)
        .await?;
        let health = health.map(|(health, replicas, at)| ModuleHealthView {
            health,
            replicas: serde_json::from_value(replicas).unwrap_or_default(),
            at,
        });
        Ok(Some(ModuleView {
            health,
            assignments: self.assignments(Some(name), None).await?,
            name: m.name,
            spec: m.spec.0,
            revision: m.revision,
            intent,
            effective_replicas,
            placement_error: m.placement_error,
            created_at: m.created_at,
            updated_at: m.updated_at,
        }))
    }

    /// Module names after `after`, at most `limit`, in name order.
    pub async fn module_names(
        &self,
        after: Option<&str>,
        limit: i64,
    ) -> Result<Vec<String>, Error> {
        let limit = limit.clamp(1, self.settings.max_page.max(1));
        Ok(sqlx::query_scalar(
            "SELECT name FROM inventory.modules WHERE $1::text IS NULL OR name > $1 ORDER BY name LIMIT $2",
        )
        .bind(after)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?)
    }
}

impl Inventory {
    /// The inventory section declared to a node: (generation, declared_at).
    pub async fn section(&self, id: &NodeId) -> Result<Option<(i64, DateTime<Utc>)>, Error> {
        let stored = crate::SECTIONS.stored(&self.pool, id).await?;
        Ok(stored.map(|s| (s.generation, s.declared_at)))
    }
}

impl Inventory {
    /// The state of each of `ids` inventory knows, as the node view shows it
    /// (`alive`, `unreachable`, `draining`, `drained`, `revoked`, `refused`):
    /// for the controller's logs requests, which ask only nodes that may
    /// answer (decision 0033).
    pub async fn node_states(&self, ids: &[String]) -> Result<Vec<(String, String)>, Error> {
        Ok(sqlx::query_as(
            "SELECT id, CASE WHEN admin_state = 'revoked' THEN 'revoked' WHEN refused IS NOT NULL THEN 'refused' WHEN state = 'unreachable' THEN 'unreachable' WHEN admin_state IN ('draining', 'drained') THEN admin_state ELSE 'alive' END \
             FROM inventory.nodes WHERE id = ANY($1) ORDER BY id",
        )
        .bind(ids)
        .fetch_all(&self.pool)
        .await?)
    }
}
