//! Rollouts: a new revision of a module, one run per target node, in steps.
//!
//! A rollout is level-triggered: [`tick`] (the controller's clock, and soon
//! after reports or events committed) compares each run with what its node
//! stated (artifact outcomes from `applied`, units from `units`, replica health
//! from `observability.module.health`) and moves it on. Runs go
//! `queued → staging` (the artifact declared in the node's delivery section,
//! pulled and verified there) `→ deploying` (inventory told, through
//! `delivery.module.targets`, to run the revision on the node) `→ settling`
//! (the new unit runs) `→ succeeded` (running, not restarted and not
//! unhealthy, for `settle_secs`). At most `max_unavailable` runs are deploying
//! or settling at once; up to `max_extra` more may stage their artifact ahead.
//! `failure_threshold` failed runs stop the rollout and, with `auto_rollback`,
//! put every node it changed back on its previous revision. `canary` pauses
//! after the first runs until an operator continues; a freeze with
//! `pause_in_flight` pauses at the next step.
//!
//! Every transition appends a receipt to its run's log in the same
//! transaction (`receipts::append`).

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Utc};
use mesh_plumbing::outbox;
use mesh_protocol::{ArtifactDigest, ModuleTargets, NodeId, NodeTarget, RecordEvent, RecordKind};
use serde::{Deserialize, Serialize};
use serde_json::json;
use sqlx::PgConnection;
use uuid::Uuid;

use crate::receipts::{self, Receipt, kinds};
use crate::revisions::{self, RevisionView};
use crate::{Error, SCHEMA};

/// Advisory lock key of every writer of the delivery schema.
const LOCK: i32 = 0x6465_6c76; // "delv"

pub(crate) async fn lock(tx: &mut PgConnection) -> Result<(), Error> {
    sqlx::query("SELECT pg_advisory_xact_lock($1, 0)")
        .bind(LOCK)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// `POST /v1/rollouts`.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RolloutRequest {
    pub module: String,
    pub revision: Uuid,
    /// Runs deploying or settling at once (nodes whose replica may be down). Default 1.
    #[serde(default = "one")]
    pub max_unavailable: i32,
    /// Runs that may stage their artifact ahead of a free slot (surge of
    /// pulls, not of replicas). Default 0.
    #[serde(default)]
    pub max_extra: i32,
    /// How long a new unit must run, not restarted and not unhealthy, for its
    /// run to succeed. Default 10 s.
    #[serde(default = "ten")]
    pub settle_secs: i32,
    /// A run neither succeeded nor failed this long after it deployed fails.
    /// Default 300 s.
    #[serde(default = "five_minutes")]
    pub deadline_secs: i32,
    /// Failed runs that stop the rollout. Default 1.
    #[serde(default = "one")]
    pub failure_threshold: i32,
    /// Put every changed node back on its previous revision when the
    /// rollout stops on failures. Default true.
    #[serde(default = "yes")]
    pub auto_rollback: bool,
    /// Runs to complete before pausing for an operator's continue. Default 0.
    #[serde(default)]
    pub canary: i32,
}

fn one() -> i32 {
    1
}
fn ten() -> i32 {
    10
}
fn five_minutes() -> i32 {
    300
}
fn yes() -> bool {
    true
}

impl RolloutRequest {
    fn validate(&self) -> Result<(), Error> {
        mesh_protocol::validate_module_name("module", &self.module)?;
        let range = |field: &str, v: i32, lo: i32, hi: i32| {
            if (lo..=hi).contains(&v) {
                Ok(())
            } else {
                Err(Error::invalid(field, format!("{v} is outside {lo}..={hi}")))
            }
        };
        range("max_unavailable", self.max_unavailable, 1, 1000)?;
        range("max_extra", self.max_extra, 0, 1000)?;
        range("settle_secs", self.settle_secs, 0, 86_400)?;
        range("deadline_secs", self.deadline_secs, 1, 86_400)?;
        range("failure_threshold", self.failure_threshold, 1, 1000)?;
        range("canary", self.canary, 0, 1000)
    }
}

/// The freeze, as `GET /v1/freeze` shows it.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct FreezeView {
    pub frozen: bool,
    pub reason: Option<String>,
    pub since: Option<DateTime<Utc>>,
    pub by: Option<String>,
    /// Whether rollouts in progress pause at their next step.
    pub pause_in_flight: bool,
}

/// `PUT /v1/freeze`.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FreezeRequest {
    pub reason: String,
    /// Pause rollouts in progress at their next step (default true); false
    /// lets them finish and refuses only new ones.
    #[serde(default = "yes")]
    pub pause_in_flight: bool,
}

/// A run as the API shows it.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct RunView {
    pub id: Uuid,
    pub rollout: Uuid,
    pub module: String,
    pub node: String,
    pub state: String,
    pub revision: Uuid,
    pub previous_revision: Option<Uuid>,
    /// The step this run belongs to (1-based).
    pub step: i32,
    pub reason: Option<String>,
    pub updated_at: DateTime<Utc>,
    pub last_receipt: Option<Receipt>,
}

/// A rollout as the API shows it.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct RolloutView {
    pub id: Uuid,
    pub module: String,
    pub revision: Uuid,
    pub previous_revision: Option<Uuid>,
    pub state: String,
    pub paused_reason: Option<String>,
    pub reason: Option<String>,
    /// The step in progress (1-based; the last when done).
    pub step: i32,
    pub steps: i32,
    pub nodes_done: i32,
    pub nodes_total: i32,
    pub max_unavailable: i32,
    pub max_extra: i32,
    pub settle_secs: i32,
    pub deadline_secs: i32,
    pub failure_threshold: i32,
    pub auto_rollback: bool,
    pub canary: i32,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub created_by: String,
    pub runs: Vec<RunView>,
}

#[derive(Debug, Clone, sqlx::FromRow)]
struct RolloutRow {
    id: Uuid,
    module: String,
    revision: Uuid,
    previous_revision: Option<Uuid>,
    state: String,
    paused_reason: Option<String>,
    reason: Option<String>,
    max_unavailable: i32,
    max_extra: i32,
    settle_secs: i32,
    deadline_secs: i32,
    failure_threshold: i32,
    auto_rollback: bool,
    canary: i32,
    canary_passed: bool,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
    created_by: String,
}

#[derive(Debug, Clone, sqlx::FromRow)]
struct RunRow {
    id: Uuid,
    rollout: Uuid,
    node: String,
    position: i32,
    revision: Uuid,
    previous_revision: Option<Uuid>,
    state: String,
    reason: Option<String>,
    staged_generation: Option<i64>,
    deployed_at: Option<DateTime<Utc>>,
    healthy_since: Option<DateTime<Utc>>,
    updated_at: DateTime<Utc>,
}

const ROLLOUT_COLUMNS: &str = "id, module, revision, previous_revision, state, paused_reason, reason, \
     max_unavailable, max_extra, settle_secs, deadline_secs, failure_threshold, auto_rollback, canary, \
     canary_passed, created_at, updated_at, created_by";
const RUN_COLUMNS: &str = "id, rollout, node, position, revision, previous_revision, state, reason, \
     staged_generation, deployed_at, healthy_since, updated_at";

/// Rollout states in which it still acts.
const ACTIVE: [&str; 3] = ["awaiting_approval", "running", "paused"];

// ------------------------------------------------------------------ freeze

pub async fn freeze(tx: &mut PgConnection) -> Result<FreezeView, Error> {
    let row: Option<(String, bool, DateTime<Utc>, String)> =
        sqlx::query_as("SELECT reason, pause_in_flight, since, frozen_by FROM delivery.freeze")
            .fetch_optional(&mut *tx)
            .await?;
    Ok(match row {
        Some((reason, pause_in_flight, since, by)) => FreezeView {
            frozen: true,
            reason: Some(reason),
            since: Some(since),
            by: Some(by),
            pause_in_flight,
        },
        None => FreezeView {
            frozen: false,
            reason: None,
            since: None,
            by: None,
            pause_in_flight: false,
        },
    })
}

pub async fn set_freeze(
    tx: &mut PgConnection,
    req: &FreezeRequest,
    by: &str,
    now: DateTime<Utc>,
) -> Result<FreezeView, Error> {
    let reason = req.reason.trim();
    if reason.is_empty() || reason.len() > 1000 {
        return Err(Error::invalid("reason", "1 to 1000 characters: say why"));
    }
    lock(tx).await?;
    sqlx::query(
        "INSERT INTO delivery.freeze (id, reason, pause_in_flight, since, frozen_by) VALUES (1, $1, $2, $3, $4) \
         ON CONFLICT (id) DO UPDATE SET reason = excluded.reason, pause_in_flight = excluded.pause_in_flight, \
         frozen_by = excluded.frozen_by",
    )
    .bind(reason)
    .bind(req.pause_in_flight)
    .bind(now)
    .bind(by)
    .execute(&mut *tx)
    .await?;
    freeze(tx).await
}

/// Lift the freeze: rollouts it paused go on. Returns whether one was set.
pub async fn lift_freeze(tx: &mut PgConnection, now: DateTime<Utc>) -> Result<bool, Error> {
    lock(tx).await?;
    let lifted = sqlx::query("DELETE FROM delivery.freeze")
        .execute(&mut *tx)
        .await?
        .rows_affected()
        > 0;
    let paused: Vec<Uuid> = sqlx::query_scalar(
        "UPDATE delivery.rollouts SET state = 'running', paused_reason = NULL, updated_at = $1 \
         WHERE state = 'paused' AND paused_reason LIKE 'freeze:%' RETURNING id",
    )
    .bind(now)
    .fetch_all(&mut *tx)
    .await?;
    for rollout in paused {
        resume_receipts(tx, rollout, "the freeze was lifted", now).await?;
    }
    Ok(lifted)
}

async fn resume_receipts(
    tx: &mut PgConnection,
    rollout: Uuid,
    why: &str,
    now: DateTime<Utc>,
) -> Result<(), Error> {
    note_queued(tx, rollout, kinds::RUN_RESUMED, why, now).await
}

/// Append `kind` with `why` to the log of every queued run of `rollout`.
async fn note_queued(
    tx: &mut PgConnection,
    rollout: Uuid,
    kind: &str,
    why: &str,
    now: DateTime<Utc>,
) -> Result<(), Error> {
    let queued: Vec<Uuid> = sqlx::query_scalar(
        "SELECT id FROM delivery.runs WHERE rollout = $1 AND state = 'queued' ORDER BY position",
    )
    .bind(rollout)
    .fetch_all(&mut *tx)
    .await?;
    for run in queued {
        receipts::append(tx, run, kind, now, json!({ "reason": why })).await?;
    }
    Ok(())
}

// ------------------------------------------------------------------ create

/// The nodes `module` runs on (from `inventory.module.placed`), in node order.
async fn module_nodes(tx: &mut PgConnection, module: &str) -> Result<Vec<String>, Error> {
    let nodes: Option<Vec<String>> =
        sqlx::query_scalar("SELECT nodes FROM delivery.modules WHERE module = $1")
            .bind(module)
            .fetch_optional(&mut *tx)
            .await?;
    let mut nodes = nodes.unwrap_or_default();
    nodes.sort();
    nodes.dedup();
    Ok(nodes)
}

pub async fn create(
    tx: &mut PgConnection,
    req: &RolloutRequest,
    by: &str,
    now: DateTime<Utc>,
) -> Result<Uuid, Error> {
    req.validate()?;
    lock(tx).await?;
    let frozen = freeze(tx).await?;
    if frozen.frozen {
        return Err(Error::Conflict(format!(
            "deliveries are frozen since {} by {}: {}",
            frozen.since.map(|t| t.to_rfc3339()).unwrap_or_default(),
            frozen.by.unwrap_or_default(),
            frozen.reason.unwrap_or_default()
        )));
    }
    let revision = revisions::get(tx, req.revision)
        .await?
        .ok_or_else(|| Error::NotFound(format!("revision {}", req.revision)))?;
    if revision.module != req.module {
        return Err(Error::invalid(
            "revision",
            format!(
                "revision {} is of module `{}`, not `{}`",
                revision.id, revision.module, req.module
            ),
        ));
    }
    let active: Option<Uuid> = sqlx::query_scalar(
        "SELECT id FROM delivery.rollouts WHERE module = $1 AND state = ANY($2)",
    )
    .bind(&req.module)
    .bind(&ACTIVE[..])
    .fetch_optional(&mut *tx)
    .await?;
    if let Some(id) = active {
        return Err(Error::Conflict(format!(
            "module `{}` has rollout {id} in progress: continue, cancel or wait for it",
            req.module
        )));
    }
    let nodes = module_nodes(tx, &req.module).await?;
    if nodes.is_empty() {
        return Err(Error::Conflict(format!(
            "module `{}` runs on no node: nothing to roll out to",
            req.module
        )));
    }
    let current: BTreeMap<String, Uuid> = sqlx::query_as::<_, (String, Uuid)>(
        "SELECT node, revision FROM delivery.targets WHERE module = $1",
    )
    .bind(&req.module)
    .fetch_all(&mut *tx)
    .await?
    .into_iter()
    .collect();
    let targets: Vec<&String> = nodes
        .iter()
        .filter(|n| current.get(*n) != Some(&revision.id))
        .collect();
    if targets.is_empty() {
        return Err(Error::Conflict(format!(
            "every node of `{}` already runs revision {}",
            req.module, revision.id
        )));
    }
    let approval: bool =
        sqlx::query_scalar("SELECT require_approval FROM delivery.policies WHERE module = $1")
            .bind(&req.module)
            .fetch_optional(&mut *tx)
            .await?
            .unwrap_or(false);
    let previous = targets.first().and_then(|n| current.get(*n).copied());
    let id = Uuid::now_v7();
    let state = if approval {
        "awaiting_approval"
    } else {
        "running"
    };
    sqlx::query(
        "INSERT INTO delivery.rollouts (id, module, revision, previous_revision, state, max_unavailable, \
         max_extra, settle_secs, deadline_secs, failure_threshold, auto_rollback, canary, created_at, \
         updated_at, created_by) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $13, $14)",
    )
    .bind(id)
    .bind(&req.module)
    .bind(revision.id)
    .bind(previous)
    .bind(state)
    .bind(req.max_unavailable)
    .bind(req.max_extra)
    .bind(req.settle_secs)
    .bind(req.deadline_secs)
    .bind(req.failure_threshold)
    .bind(req.auto_rollback)
    .bind(req.canary)
    .bind(now)
    .bind(by)
    .execute(&mut *tx)
    .await?;
    let run_state = if approval {
        "awaiting_approval"
    } else {
        "queued"
    };
    for (position, node) in targets.iter().enumerate() {
        let run = Uuid::now_v7();
        let prev = current.get(*node).copied();
        sqlx::query(
            "INSERT INTO delivery.runs (id, rollout, node, position, revision, previous_revision, state, updated_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        )
        .bind(run)
        .bind(id)
        .bind(node.as_str())
        .bind(i32::try_from(position).unwrap_or(i32::MAX))
        .bind(revision.id)
        .bind(prev)
        .bind(run_state)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        let detail = json!({
            "rollout": id, "module": req.module, "node": node, "revision": revision.id,
            "previous_revision": prev, "artifact": revision.artifact, "by": by,
        });
        receipts::append(tx, run, kinds::RUN_QUEUED, now, detail).await?;
        if approval {
            receipts::append(
                tx,
                run,
                kinds::APPROVAL_REQUESTED,
                now,
                json!({ "policy": "require_approval" }),
            )
            .await?;
        }
    }
    Ok(id)
}

// ------------------------------------------------------------------ decisions

/// Approve or deny the rollout `run` belongs to: every run of it waiting for
/// approval gets the decision in its receipts, `decided_by` the operator's
/// token identity.
pub async fn decide(
    tx: &mut PgConnection,
    run: Uuid,
    approve: bool,
    reason: Option<&str>,
    by: &str,
    now: DateTime<Utc>,
) -> Result<Uuid, Error> {
    if !approve && reason.is_none_or(|r| r.trim().is_empty()) {
        return Err(Error::invalid("reason", "a denial needs a reason"));
    }
    if reason.is_some_and(|r| r.len() > 1000) {
        return Err(Error::invalid("reason", "at most 1000 characters"));
    }
    lock(tx).await?;
    let rollout: Uuid = sqlx::query_scalar("SELECT rollout FROM delivery.runs WHERE id = $1")
        .bind(run)
        .fetch_optional(&mut *tx)
        .await?
        .ok_or_else(|| Error::NotFound(format!("run {run}")))?;
    let row = rollout_row(tx, rollout).await?;
    if row.state != "awaiting_approval" {
        return Err(Error::Conflict(format!(
            "rollout {rollout} is {}, not awaiting approval",
            row.state
        )));
    }
    let waiting: Vec<Uuid> = sqlx::query_scalar(
        "SELECT id FROM delivery.runs WHERE rollout = $1 AND state = 'awaiting_approval' ORDER BY position",
    )
    .bind(rollout)
    .fetch_all(&mut *tx)
    .await?;
    let detail = json!({ "decided_by": by, "reason": reason, "decided_on_run": run });
    for r in &waiting {
        if approve {
            receipts::append(tx, *r, kinds::APPROVAL_APPROVED, now, detail.clone()).await?;
        } else {
            receipts::append(tx, *r, kinds::APPROVAL_DENIED, now, detail.clone()).await?;
            receipts::append(
                tx,
                *r,
                kinds::RUN_CANCELED,
                now,
                json!({ "reason": format!("denied by {by}: {}", reason.unwrap_or_default()) }),
            )
            .await?;
        }
    }
    let (rollout_state, run_state) = if approve {
        ("running", "queued")
    } else {
        ("denied", "canceled")
    };
    let why = (!approve).then(|| format!("denied by {by}: {}", reason.unwrap_or_default()));
    sqlx::query(
        "UPDATE delivery.runs SET state = $2, reason = $3, updated_at = $4 \
         WHERE rollout = $1 AND state = 'awaiting_approval'",
    )
    .bind(rollout)
    .bind(run_state)
    .bind(&why)
    .bind(now)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "UPDATE delivery.rollouts SET state = $2, reason = $3, updated_at = $4 WHERE id = $1",
    )
    .bind(rollout)
    .bind(rollout_state)
    .bind(&why)
    .bind(now)
    .execute(&mut *tx)
    .await?;
    Ok(rollout)
}

/// Continue a paused rollout (after its canary, or a freeze that is lifted).
pub async fn resume(
    tx: &mut PgConnection,
    id: Uuid,
    by: &str,
    now: DateTime<Utc>,
) -> Result<(), Error> {
    lock(tx).await?;
    let row = rollout_row(tx, id).await?;
    if row.state != "paused" {
        return Err(Error::Conflict(format!(
            "rollout {id} is {}, not paused",
            row.state
        )));
    }
    let frozen = freeze(tx).await?;
    if frozen.frozen && frozen.pause_in_flight {
        return Err(Error::Conflict(format!(
            "deliveries are frozen: {}; lift the freeze first",
            frozen.reason.unwrap_or_default()
        )));
    }
    sqlx::query(
        "UPDATE delivery.rollouts SET state = 'running', paused_reason = NULL, canary_passed = true, \
         updated_at = $2 WHERE id = $1",
    )
    .bind(id)
    .bind(now)
    .execute(&mut *tx)
    .await?;
    resume_receipts(tx, id, &format!("continued by {by}"), now).await
}

/// Cancel a rollout: runs not yet deployed are canceled; nodes already on
/// the new revision stay on it (roll back with a rollout of the previous one).
pub async fn cancel(
    tx: &mut PgConnection,
    id: Uuid,
    by: &str,
    now: DateTime<Utc>,
) -> Result<(), Error> {
    lock(tx).await?;
    let row = rollout_row(tx, id).await?;
    if !ACTIVE.contains(&row.state.as_str()) {
        return Err(Error::Conflict(format!(
            "rollout {id} is {} already",
            row.state
        )));
    }
    let why = format!("canceled by {by}");
    cancel_pending(tx, id, &why, now).await?;
    set_rollout_state(tx, id, "canceled", Some(&why), now).await
}

async fn cancel_pending(
    tx: &mut PgConnection,
    rollout: Uuid,
    why: &str,
    now: DateTime<Utc>,
) -> Result<(), Error> {
    let pending: Vec<Uuid> = sqlx::query_scalar(
        "UPDATE delivery.runs SET state = 'canceled', reason = $2, updated_at = $3 \
         WHERE rollout = $1 AND state IN ('queued', 'awaiting_approval', 'staging') RETURNING id",
    )
    .bind(rollout)
    .bind(why)
    .bind(now)
    .fetch_all(&mut *tx)
    .await?;
    let mut pending = pending;
    pending.sort();
    for run in pending {
        receipts::append(tx, run, kinds::RUN_CANCELED, now, json!({ "reason": why })).await?;
    }
    Ok(())
}

async fn set_rollout_state(
    tx: &mut PgConnection,
    id: Uuid,
    state: &str,
    reason: Option<&str>,
    now: DateTime<Utc>,
) -> Result<(), Error> {
    sqlx::query(
        "UPDATE delivery.rollouts SET state = $2, reason = COALESCE($3, reason), paused_reason = NULL, \
         updated_at = $4 WHERE id = $1",
    )
    .bind(id)
    .bind(state)
    .bind(reason)
    .bind(now)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

async fn rollout_row(tx: &mut PgConnection, id: Uuid) -> Result<RolloutRow, Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {ROLLOUT_COLUMNS} FROM delivery.rollouts WHERE id = $1"
    )))
    .bind(id)
    .fetch_optional(&mut *tx)
    .await?
    .ok_or_else(|| Error::NotFound(format!("rollout {id}")))
}

// ------------------------------------------------------------------ the tick

/// What a tick changed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Tick {
    /// Modules whose targets changed (their `delivery.module.targets` is written).
    pub modules: BTreeSet<String>,
    /// Whether any run started staging (the delivery sections must be declared).
    pub staged: bool,
    /// Runs that moved.
    pub moved: usize,
}

#[derive(Debug, Clone, sqlx::FromRow)]
struct UnitRow {
    state: String,
    restarts: i32,
    unit: String,
}

/// Move every active rollout on, as far as what nodes stated allows.
pub async fn tick(tx: &mut PgConnection, now: DateTime<Utc>) -> Result<Tick, Error> {
    lock(tx).await?;
    let rollouts: Vec<RolloutRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {ROLLOUT_COLUMNS} FROM delivery.rollouts WHERE state = 'running' ORDER BY created_at, id"
    )))
    .fetch_all(&mut *tx)
    .await?;
    let frozen = freeze(tx).await?;
    let mut out = Tick::default();
    for r in rollouts {
        step(tx, &r, &frozen, now, &mut out).await?;
    }
    Ok(out)
}

async fn runs_of(tx: &mut PgConnection, rollout: Uuid) -> Result<Vec<RunRow>, Error> {
    Ok(sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {RUN_COLUMNS} FROM delivery.runs WHERE rollout = $1 ORDER BY position"
    )))
    .bind(rollout)
    .fetch_all(&mut *tx)
    .await?)
}

async fn set_run(
    tx: &mut PgConnection,
    run: Uuid,
    state: &str,
    reason: Option<&str>,
    now: DateTime<Utc>,
) -> Result<(), Error> {
    sqlx::query("UPDATE delivery.runs SET state = $2, reason = COALESCE($3, reason), updated_at = $4 WHERE id = $1")
        .bind(run)
        .bind(state)
        .bind(reason)
        .bind(now)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

async fn fail_run(
    tx: &mut PgConnection,
    run: &RunRow,
    reason: &str,
    now: DateTime<Utc>,
) -> Result<(), Error> {
    set_run(tx, run.id, "failed", Some(reason), now).await?;
    receipts::append(
        tx,
        run.id,
        kinds::RUN_FAILED,
        now,
        json!({ "reason": reason, "node": run.node }),
    )
    .await?;
    Ok(())
}

/// The target of `module` on `node` becomes `revision` (none: the module's own spec).
async fn set_target(
    tx: &mut PgConnection,
    module: &str,
    node: &str,
    revision: Option<Uuid>,
) -> Result<(), Error> {
    match revision {
        Some(rev) => {
            sqlx::query(
                "INSERT INTO delivery.targets (module, node, revision) VALUES ($1, $2, $3) \
                 ON CONFLICT (module, node) DO UPDATE SET revision = excluded.revision",
            )
            .bind(module)
            .bind(node)
            .bind(rev)
            .execute(&mut *tx)
            .await?;
        }
        None => {
            sqlx::query("DELETE FROM delivery.targets WHERE module = $1 AND node = $2")
                .bind(module)
                .bind(node)
                .execute(&mut *tx)
                .await?;
        }
    }
    Ok(())
}

async fn step(
    tx: &mut PgConnection,
    r: &RolloutRow,
    frozen: &FreezeView,
    now: DateTime<Utc>,
    out: &mut Tick,
) -> Result<(), Error> {
    let revision = revisions::get(tx, r.revision)
        .await?
        .ok_or_else(|| Error::Corrupt {
            what: format!("rollout {}", r.id),
            reason: format!("revision {} is missing", r.revision),
        })?;
    let runs = runs_of(tx, r.id).await?;
    let deadline = chrono::Duration::seconds(i64::from(r.deadline_secs));
    let settle = chrono::Duration::seconds(i64::from(r.settle_secs));
    let mut active = runs
        .iter()
        .filter(|x| matches!(x.state.as_str(), "deploying" | "settling"))
        .count();

    // Deploying and settling runs: what the node's units say.
    for run in runs
        .iter()
        .filter(|x| matches!(x.state.as_str(), "deploying" | "settling"))
    {
        let unit: Option<UnitRow> = sqlx::query_as(
            "SELECT state, restarts, unit FROM delivery.units WHERE node = $1 AND module = $2 AND revision = $3 \
             ORDER BY unit LIMIT 1",
        )
        .bind(&run.node)
        .bind(&r.module)
        .bind(run.revision)
        .fetch_optional(&mut *tx)
        .await?;
        let since_deploy = run
            .deployed_at
            .map_or(chrono::Duration::zero(), |t| now - t);
        let broken = unit.as_ref().and_then(|u| {
            if matches!(u.state.as_str(), "failed" | "exited") || u.restarts > 0 {
                Some(format!(
                    "unit {} of revision {} is {} after {} restart(s)",
                    u.unit, run.revision, u.state, u.restarts
                ))
            } else {
                None
            }
        });
        if let Some(why) = broken {
            fail_run(tx, run, &why, now).await?;
            active -= 1;
            out.moved += 1;
            continue;
        }
        let running = unit.as_ref().is_some_and(|u| u.state == "running");
        if run.state == "deploying" {
            if running {
                sqlx::query(
                    "UPDATE delivery.runs SET state = 'settling', healthy_since = $2, updated_at = $2 WHERE id = $1",
                )
                .bind(run.id)
                .bind(now)
                .execute(&mut *tx)
                .await?;
                let name = unit.as_ref().map(|u| u.unit.clone());
                receipts::append(
                    tx,
                    run.id,
                    kinds::UNIT_RUNNING,
                    now,
                    json!({ "unit": name }),
                )
                .await?;
                out.moved += 1;
            } else if since_deploy > deadline {
                fail_run(
                    tx,
                    run,
                    &format!(
                        "the unit of revision {} was not running within {} s",
                        run.revision, r.deadline_secs
                    ),
                    now,
                )
                .await?;
                active -= 1;
                out.moved += 1;
            }
            continue;
        }
        // Settling: running, not restarted; not unhealthy for the settle time.
        let health: Option<(String, Option<String>)> = sqlx::query_as(
            "SELECT health, reason FROM delivery.health WHERE module = $1 AND node = $2",
        )
        .bind(&r.module)
        .bind(&run.node)
        .fetch_optional(&mut *tx)
        .await?;
        // With probes, only `healthy` passes (a new unit's probes start
        // `unknown`); without, running unrestarted is the gate and only a
        // replica observability calls unhealthy holds it.
        let probed = !revision.unit.probes.is_empty();
        let unhealthy: Option<(String, Option<String>)> = match health {
            Some((h, reason))
                if matches!(h.as_str(), "unhealthy" | "down") || (probed && h != "healthy") =>
            {
                Some((h, reason))
            }
            None if probed => Some((
                "unknown".to_owned(),
                Some("no health reported yet".to_owned()),
            )),
            _ => None,
        };
        if !running || unhealthy.is_some() {
            if since_deploy > deadline {
                let why = match &unhealthy {
                    Some((h, reason)) => format!(
                        "replica on {} {h} for too long: {}",
                        run.node,
                        reason.clone().unwrap_or_default()
                    ),
                    None => format!("the unit of revision {} stopped running", run.revision),
                };
                fail_run(tx, run, &why, now).await?;
                active -= 1;
                out.moved += 1;
            } else {
                sqlx::query("UPDATE delivery.runs SET healthy_since = $2 WHERE id = $1")
                    .bind(run.id)
                    .bind(now)
                    .execute(&mut *tx)
                    .await?;
            }
            continue;
        }
        if run.healthy_since.is_some_and(|t| now - t >= settle) {
            set_run(tx, run.id, "succeeded", None, now).await?;
            receipts::append(
                tx,
                run.id,
                kinds::RUN_SUCCEEDED,
                now,
                json!({ "revision": run.revision, "settled_secs": r.settle_secs }),
            )
            .await?;
            active -= 1;
            out.moved += 1;
        }
    }

    // Staging runs: the node's word on the artifact; deploy when a slot is free.
    for run in runs_of(tx, r.id)
        .await?
        .iter()
        .filter(|x| x.state == "staging")
    {
        let staged = match &revision.artifact {
            None => Some(Ok(())),
            Some(digest) => artifact_outcome(tx, &run.node, digest, run.staged_generation).await?,
        };
        let waited = now - run.updated_at;
        match staged {
            None if waited > deadline => {
                let digest = revision
                    .artifact
                    .as_ref()
                    .map(ArtifactDigest::as_str)
                    .unwrap_or("-");
                let why = format!(
                    "node {} did not report holding artifact {digest} within {} s (is its agent older than artifacts, or the registry out of its reach?)",
                    run.node, r.deadline_secs
                );
                fail_run(tx, run, &why, now).await?;
                out.moved += 1;
            }
            Some(Err(error)) => {
                fail_run(
                    tx,
                    run,
                    &format!(
                        "node {} refused artifact {}: {error}",
                        run.node,
                        revision
                            .artifact
                            .as_ref()
                            .map(ArtifactDigest::as_str)
                            .unwrap_or("-")
                    ),
                    now,
                )
                .await?;
                out.moved += 1;
            }
            Some(Ok(())) if active < usize::try_from(r.max_unavailable).unwrap_or(1) => {
                if let Some(d) = &revision.artifact {
                    receipts::append(
                        tx,
                        run.id,
                        kinds::ARTIFACT_STAGED,
                        now,
                        json!({ "artifact": d }),
                    )
                    .await?;
                }
                set_target(tx, &r.module, &run.node, Some(run.revision)).await?;
                sqlx::query(
                    "UPDATE delivery.runs SET state = 'deploying', deployed_at = $2, updated_at = $2 WHERE id = $1",
                )
                .bind(run.id)
                .bind(now)
                .execute(&mut *tx)
                .await?;
                receipts::append(
                    tx,
                    run.id,
                    kinds::UNIT_DEPLOYED,
                    now,
                    json!({ "revision": run.revision, "previous_revision": run.previous_revision }),
                )
                .await?;
                out.modules.insert(r.module.clone());
                active += 1;
                out.moved += 1;
            }
            _ => {}
        }
    }

    // Failures: stop, and roll back what was changed.
    let runs = runs_of(tx, r.id).await?;
    let failed: Vec<&RunRow> = runs.iter().filter(|x| x.state == "failed").collect();
    if failed.len() >= usize::try_from(r.failure_threshold).unwrap_or(1) {
        let first = failed
            .first()
            .and_then(|x| x.reason.clone())
            .unwrap_or_default();
        let why = format!(
            "{} run(s) failed (threshold {}): {first}",
            failed.len(),
            r.failure_threshold
        );
        cancel_pending(tx, r.id, &format!("the rollout stopped: {why}"), now).await?;
        let changed: Vec<&RunRow> = runs
            .iter()
            .filter(|x| {
                x.deployed_at.is_some()
                    && matches!(
                        x.state.as_str(),
                        "deploying" | "settling" | "succeeded" | "failed"
                    )
            })
            .collect();
        if r.auto_rollback && !changed.is_empty() {
            for run in &changed {
                set_target(tx, &r.module, &run.node, run.previous_revision).await?;
                set_run(tx, run.id, "rolled_back", None, now).await?;
                receipts::append(
                    tx,
                    run.id,
                    kinds::RUN_ROLLED_BACK,
                    now,
                    json!({ "to_revision": run.previous_revision, "reason": why }),
                )
                .await?;
            }
            out.modules.insert(r.module.clone());
            set_rollout_state(
                tx,
                r.id,
                "rolled_back",
                Some(&format!("{why}; rolled back")),
                now,
            )
            .await?;
        } else {
            set_rollout_state(tx, r.id, "failed", Some(&why), now).await?;
        }
        return Ok(());
    }

    // Done?
    if runs.iter().all(|x| x.state == "succeeded") {
        set_rollout_state(tx, r.id, "succeeded", None, now).await?;
        return Ok(());
    }

    // Canary: after the first `canary` runs succeeded, wait for an operator.
    let limit = if r.canary > 0 && !r.canary_passed {
        let canaries = usize::try_from(r.canary).unwrap_or(1);
        if runs.iter().take(canaries).all(|x| x.state == "succeeded") {
            pause(
                tx,
                r.id,
                &format!("canary: {canaries} node(s) on the new revision; continue to proceed"),
                now,
            )
            .await?;
            return Ok(());
        }
        canaries
    } else {
        runs.len()
    };

    // Start the next runs: at most max_unavailable + max_extra in progress.
    let window = usize::try_from(r.max_unavailable + r.max_extra).unwrap_or(1);
    let mut in_progress = runs
        .iter()
        .filter(|x| matches!(x.state.as_str(), "staging" | "deploying" | "settling"))
        .count();
    let queued: Vec<&RunRow> = runs
        .iter()
        .take(limit)
        .filter(|x| x.state == "queued")
        .collect();
    if queued.is_empty() {
        return Ok(());
    }
    if frozen.frozen && frozen.pause_in_flight {
        if in_progress == 0 {
            pause(
                tx,
                r.id,
                &format!("freeze: {}", frozen.reason.clone().unwrap_or_default()),
                now,
            )
            .await?;
        }
        return Ok(());
    }
    let steps = steps(runs.len(), r.max_unavailable);
    for run in queued {
        if in_progress >= window {
            break;
        }
        set_run(tx, run.id, "staging", None, now).await?;
        receipts::append(
            tx,
            run.id,
            kinds::RUN_STARTED,
            now,
            json!({
                "revision": run.revision, "artifact": revision.artifact,
                "step": step_of(run.position, r.max_unavailable), "steps": steps,
            }),
        )
        .await?;
        in_progress += 1;
        out.staged = true;
        out.moved += 1;
    }
    Ok(())
}

async fn pause(
    tx: &mut PgConnection,
    id: Uuid,
    why: &str,
    now: DateTime<Utc>,
) -> Result<(), Error> {
    sqlx::query(
        "UPDATE delivery.rollouts SET state = 'paused', paused_reason = $2, updated_at = $3 WHERE id = $1",
    )
    .bind(id)
    .bind(why)
    .bind(now)
    .execute(&mut *tx)
    .await?;
    note_queued(tx, id, kinds::RUN_PAUSED, why, now).await
}

/// What the node said of `digest` at or after `generation`: none yet, ok, or
/// its error.
async fn artifact_outcome(
    tx: &mut PgConnection,
    node: &str,
    digest: &ArtifactDigest,
    generation: Option<i64>,
) -> Result<Option<Result<(), String>>, Error> {
    let Some(generation) = generation else {
        return Ok(None);
    };
    let row: Option<(bool, Option<String>)> = sqlx::query_as(
        "SELECT ok, error FROM delivery.artifact_outcomes WHERE node = $1 AND digest = $2 AND generation >= $3",
    )
    .bind(node)
    .bind(digest.as_str())
    .bind(generation)
    .fetch_optional(&mut *tx)
    .await?;
    Ok(row.map(|(ok, error)| {
        if ok {
            Ok(())
        } else {
            Err(error.unwrap_or_else(|| "refused (no reason given)".to_owned()))
        }
    }))
}

/// After the delivery sections were declared: each staging run remembers the
/// generation that carries its artifact.
pub(crate) async fn note_staged_generations(tx: &mut PgConnection) -> Result<(), Error> {
    sqlx::query(
        "UPDATE delivery.runs r SET staged_generation = s.generation FROM delivery.sections s \
         WHERE r.state = 'staging' AND r.staged_generation IS NULL AND s.node = r.node",
    )
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Tell the record the targets of each module of `modules`, whole, under a
/// new version.
pub(crate) async fn publish_targets(
    tx: &mut PgConnection,
    modules: &BTreeSet<String>,
) -> Result<(), Error> {
    let mut events = Vec::new();
    for module in modules {
        let rows: Vec<(String, Uuid)> = sqlx::query_as(
            "SELECT node, revision FROM delivery.targets WHERE module = $1 ORDER BY node",
        )
        .bind(module)
        .fetch_all(&mut *tx)
        .await?;
        let mut revs: BTreeMap<Uuid, RevisionView> = BTreeMap::new();
        let mut targets = Vec::with_capacity(rows.len());
        for (node, rev) in rows {
            if !revs.contains_key(&rev)
                && let Some(v) = revisions::get(tx, rev).await?
            {
                revs.insert(rev, v);
            }
            let node = NodeId::parse(&node).map_err(|e| Error::Corrupt {
                what: "node id".to_owned(),
                reason: e.to_string(),
            })?;
            targets.push(NodeTarget {
                node,
                revision: rev,
            });
        }
        let version: i64 = sqlx::query_scalar(
            "INSERT INTO delivery.target_versions AS v (module, version) VALUES ($1, 1) \
             ON CONFLICT (module) DO UPDATE SET version = v.version + 1 RETURNING version",
        )
        .bind(module)
        .fetch_one(&mut *tx)
        .await?;
        events.push(RecordEvent::new(RecordKind::ModuleTargets(ModuleTargets {
            module: module.clone(),
            version,
            revisions: revs.values().map(RevisionView::runnable).collect(),
            targets,
        })));
    }
    outbox::record_many(tx, SCHEMA, &events).await?;
    Ok(())
}

/// Every node's delivery section: the artifacts of the revisions it is
/// targeted to run and of the runs staging or deploying on it.
pub(crate) async fn desired_artifacts(
    tx: &mut PgConnection,
) -> Result<BTreeMap<String, BTreeSet<ArtifactDigest>>, Error> {
    // Every node that holds a section stays in the map, so one whose last
    // artifact went away is declared an empty section.
    let mut out: BTreeMap<String, BTreeSet<ArtifactDigest>> = BTreeMap::new();
    let nodes: Vec<String> = sqlx::query_scalar("SELECT node FROM delivery.sections")
        .fetch_all(&mut *tx)
        .await?;
    for n in nodes {
        out.entry(n).or_default();
    }
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT t.node, v.artifact FROM delivery.targets t JOIN delivery.revisions v ON v.id = t.revision \
         WHERE v.artifact IS NOT NULL \
         UNION SELECT r.node, v.artifact FROM delivery.runs r JOIN delivery.revisions v ON v.id = r.revision \
         WHERE v.artifact IS NOT NULL AND r.state IN ('staging', 'deploying', 'settling')",
    )
    .fetch_all(&mut *tx)
    .await?;
    for (node, digest) in rows {
        let d = ArtifactDigest::parse("artifact", &digest).map_err(|e| Error::Corrupt {
            what: "artifact digest".to_owned(),
            reason: e.to_string(),
        })?;
        out.entry(node).or_default().insert(d);
    }
    Ok(out)
}

fn steps(runs: usize, max_unavailable: i32) -> i32 {
    let per = usize::try_from(max_unavailable.max(1)).unwrap_or(1);
    i32::try_from(runs.div_ceil(per)).unwrap_or(i32::MAX)
}

fn step_of(position: i32, max_unavailable: i32) -> i32 {
    position / max_unavailable.max(1) + 1
}

// ------------------------------------------------------------------ views

async fn run_view(
    tx: &mut PgConnection,
    module: &str,
    max_unavailable: i32,
    run: RunRow,
) -> Result<RunView, Error> {
    let last: Option<Receipt> = sqlx::query_as(
        "SELECT id, run, seq, kind, at, detail FROM delivery.receipts WHERE run = $1 ORDER BY seq DESC LIMIT 1",
    )
    .bind(run.id)
    .fetch_optional(&mut *tx)
    .await?;
    Ok(RunView {
        id: run.id,
        rollout: run.rollout,
        module: module.to_owned(),
        node: run.node,
        state: run.state,
        revision: run.revision,
        previous_revision: run.previous_revision,
        step: step_of(run.position, max_unavailable),
        reason: run.reason,
        updated_at: run.updated_at,
        last_receipt: last,
    })
}

pub async fn view(tx: &mut PgConnection, id: Uuid) -> Result<RolloutView, Error> {
    let r = rollout_row(tx, id).await?;
    let rows = runs_of(tx, id).await?;
    let total = rows.len();
    let done = rows.iter().filter(|x| x.state == "succeeded").count();
    let current = rows
        .iter()
        .find(|x| !matches!(x.state.as_str(), "succeeded"))
        .or(rows.last())
        .map_or(1, |x| step_of(x.position, r.max_unavailable));
    let mut runs = Vec::with_capacity(total);
    for row in rows {
        runs.push(run_view(tx, &r.module, r.max_unavailable, row).await?);
    }
    Ok(RolloutView {
        id: r.id,
        module: r.module,
        revision: r.revision,
        previous_revision: r.previous_revision,
        state: r.state,
        paused_reason: r.paused_reason,
        reason: r.reason,
        step: current,
        steps: steps(total, r.max_unavailable),
        nodes_done: i32::try_from(done).unwrap_or(i32::MAX),
        nodes_total: i32::try_from(total).unwrap_or(i32::MAX),
        max_unavailable: r.max_unavailable,
        max_extra: r.max_extra,
        settle_secs: r.settle_secs,
        deadline_secs: r.deadline_secs,
        failure_threshold: r.failure_threshold,
        auto_rollback: r.auto_rollback,
        canary: r.canary,
        created_at: r.created_at,
        updated_at: r.updated_at,
        created_by: r.created_by,
        runs,
    })
}

pub async fn list(
    tx: &mut PgConnection,
    module: Option<&str>,
    state: Option<&str>,
) -> Result<Vec<RolloutView>, Error> {
    let ids: Vec<Uuid> = sqlx::query_scalar(
        "SELECT id FROM delivery.rollouts WHERE ($1::text IS NULL OR module = $1) \
         AND ($2::text IS NULL OR state = $2) ORDER BY created_at DESC, id DESC LIMIT 100",
    )
    .bind(module)
    .bind(state)
    .fetch_all(&mut *tx)
    .await?;
    let mut out = Vec::with_capacity(ids.len());
    for id in ids {
        out.push(view(tx, id).await?);
    }
    Ok(out)
}

/// Which runs `GET /v1/runs` lists; every given filter must hold.
#[derive(Debug, Default)]
pub struct RunFilter<'a> {
    pub rollout: Option<Uuid>,
    pub module: Option<&'a str>,
    pub node: Option<&'a str>,
    pub state: Option<&'a str>,
    /// Runs created before this one (ids are UUID v7: creation order).
    pub before: Option<Uuid>,
}

/// Runs, newest first, at most `limit`, filtered.
pub async fn list_runs(
    tx: &mut PgConnection,
    filter: &RunFilter<'_>,
    limit: i64,
) -> Result<Vec<RunView>, Error> {
    let rows: Vec<RunRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {RUN_COLUMNS} FROM delivery.runs \
         WHERE ($1::uuid IS NULL OR rollout = $1) \
         AND ($2::text IS NULL OR rollout IN (SELECT r.id FROM delivery.rollouts r WHERE r.module = $2)) \
         AND ($3::text IS NULL OR node = $3) \
         AND ($4::text IS NULL OR state = $4) \
         AND ($5::uuid IS NULL OR id < $5) \
         ORDER BY id DESC LIMIT $6"
    )))
    .bind(filter.rollout)
    .bind(filter.module)
    .bind(filter.node)
    .bind(filter.state)
    .bind(filter.before)
    .bind(limit)
    .fetch_all(&mut *tx)
    .await?;
    let mut rollouts: std::collections::HashMap<Uuid, (String, i32)> = Default::default();
    let mut out = Vec::with_capacity(rows.len());
    for row in rows {
        let (module, max_unavailable) = match rollouts.get(&row.rollout) {
            Some(r) => r.clone(),
            None => {
                let r = rollout_row(tx, row.rollout).await?;
                let v = (r.module, r.max_unavailable);
                rollouts.insert(row.rollout, v.clone());
                v
            }
        };
        out.push(run_view(tx, &module, max_unavailable, row).await?);
    }
    Ok(out)
}

pub async fn run(tx: &mut PgConnection, id: Uuid) -> Result<RunView, Error> {
    let row: RunRow = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {RUN_COLUMNS} FROM delivery.runs WHERE id = $1"
    )))
    .bind(id)
    .fetch_optional(&mut *tx)
    .await?
    .ok_or_else(|| Error::NotFound(format!("run {id}")))?;
    let r = rollout_row(tx, row.rollout).await?;
    run_view(tx, &r.module, r.max_unavailable, row).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_follow_max_unavailable() {
        assert_eq!(steps(3, 1), 3);
        assert_eq!(steps(3, 2), 2);
        assert_eq!(steps(4, 2), 2);
        assert_eq!(step_of(0, 1), 1);
        assert_eq!(step_of(2, 1), 3);
        assert_eq!(step_of(3, 2), 2);
    }
}
