//! The fleet's rows as a reconcile reads and writes them (nodes, modules,
//! assignments), what a reconcile reports, and the fleet lock every fleet
//! writer takes first. Below `fleet.rs` and `drains.rs`, which share them.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use mesh_protocol::Labels;
use serde::Serialize;
use sqlx::PgConnection;
use sqlx::types::Json;

use crate::Error;
use crate::module::ModuleSpec;
use crate::placement::Intent;
use crate::targets::Targets;

/// Advisory lock of the fleet reconcile ("invf" in ASCII).
const LOCK_FLEET: i64 = 0x696e_7666;

/// What one reconcile did.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ReconcileReport {
    /// Replicas placed on a node (new, or replacing one).
    pub placed: usize,
    /// Assignments removed (scaled down, module deleted, replaced, surplus).
    pub removed: usize,
    /// Nodes a new inventory section generation was declared to.
    pub declared: usize,
    /// Nodes whose drain finished in this pass.
    pub drained: Vec<String>,
    /// Why placement is paused (none: it is not).
    pub paused: Option<String>,
    /// `inventory.module.placed` / `.removed` events written (where modules
    /// run, or their settings files, changed; modules deleted).
    pub published: usize,
    /// The version of the `inventory.fleet.conditions` event written (none:
    /// the conditions found are those last told).
    pub conditions: Option<i64>,
}

impl ReconcileReport {
    pub fn changed(&self) -> bool {
        self.placed > 0
            || self.removed > 0
            || self.declared > 0
            || self.published > 0
            || self.conditions.is_some()
            || !self.drained.is_empty()
    }
}

#[derive(sqlx::FromRow)]
pub(crate) struct NodeRow {
    pub(crate) id: String,
    pub(crate) reported_labels: Json<Labels>,
    pub(crate) operator_labels: Json<Labels>,
    pub(crate) cpus: i64,
    pub(crate) memory_bytes: i64,
    pub(crate) state: String,
    pub(crate) admin_state: String,
    pub(crate) drain_blocked: Option<String>,
}

#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub(crate) struct Assignment {
    pub(crate) node: String,
    pub(crate) name: String,
    pub(crate) module: String,
    pub(crate) replica: i32,
    pub(crate) role: String,
    pub(crate) placed_at: DateTime<Utc>,
    pub(crate) unit_state: Option<String>,
}

pub(crate) const ACTIVE: &str = "active";
pub(crate) const RETIRING: &str = "retiring";

pub(crate) struct Module {
    pub(crate) spec: ModuleSpec,
    pub(crate) intent: Intent,
    pub(crate) placement_error: Option<String>,
    /// Which revision each targeted node's replicas run
    /// (`delivery.module.targets`; default: none targeted).
    pub(crate) targets: Targets,
}

/// The assignments of a pass, keyed (node, unit name).
pub(crate) type Assignments = BTreeMap<(String, String), Assignment>;

pub(crate) async fn lock(tx: &mut PgConnection) -> Result<(), Error> {
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(LOCK_FLEET)
        .execute(&mut *tx)
        .await?;
    Ok(())
}
