//! Node drains as the reconcile sees them: a draining node's drain finishes
//! when nothing that must run is left on it; until then the node says what
//! blocks it (`drain_blocked`). Starting and ending a drain is
//! [`crate::Inventory::set_drain`].

use std::collections::BTreeMap;

use mesh_plumbing::audit::{self, Audit};
use mesh_protocol::{DesiredState, NodeId};
use sqlx::PgConnection;

use crate::state::{self, Assignments, Module, NodeRow, RETIRING, ReconcileReport};
use crate::{Error, Inventory, SCHEMA};

/// Each draining node's verdict: what blocks it (none: nothing) and whether it
/// is done.
pub(crate) type Verdicts = BTreeMap<String, (Option<String>, bool)>;

/// Judge every draining node against the assignments after placement
/// (pure): finished when nothing that must run is left on the node.
pub(crate) fn judge(
    nodes: &BTreeMap<String, NodeRow>,
    modules: &BTreeMap<String, Module>,
    after: &Assignments,
    not_authoritative: Option<&String>,
) -> Verdicts {
    let mut drains: BTreeMap<String, (Option<String>, bool)> = BTreeMap::new();
    for n in nodes.values().filter(|n| n.admin_state == "draining") {
        let mut reasons = Vec::new();
        let mut left = false;
        for a in after.values().filter(|a| a.node == n.id) {
            let Some(m) = modules.get(&a.module) else {
                continue;
            };
            if a.role == RETIRING {
                left = true;
                reasons.push(format!(
                    "`{}` waits for its replacement to run elsewhere",
                    a.name
                ));
            } else if m.spec.placement.is_pinned() {
                if m.spec.desired == DesiredState::Running {
                    left = true;
                    let what = if m.spec.stateful {
                        "stateful and pinned"
                    } else {
                        "pinned"
                    };
                    reasons.push(format!(
                        "module `{}` is {what} to this node: move it (change its exact_node) or stop it \
                         (desired stopped, or delete it) to let the drain finish",
                        a.module
                    ));
                }
            } else {
                left = true;
                reasons.push(format!(
                    "`{}` cannot be moved yet: {}",
                    a.name,
                    m.placement_error
                        .clone()
                        .or_else(|| not_authoritative.cloned())
                        .unwrap_or_else(|| "no eligible node".into())
                ));
            }
        }
        let reason = (!reasons.is_empty()).then(|| reasons.join("; "));
        drains.insert(n.id.clone(), (reason, !left));
    }
    drains
}

/// Write the verdicts: a finished drain makes the node `drained` (and is
/// reported), a blocked one records why where that changed.
pub(crate) async fn write(
    tx: &mut PgConnection,
    nodes: &BTreeMap<String, NodeRow>,
    drains: Verdicts,
    report: &mut ReconcileReport,
) -> Result<(), Error> {
    for (id, (reason, done)) in drains {
        let was = nodes.get(&id).and_then(|n| n.drain_blocked.clone());
        if done {
            sqlx::query(
                "UPDATE inventory.nodes SET admin_state = 'drained', drain_blocked = NULL WHERE id = $1",
            )
            .bind(&id)
            .execute(&mut *tx)
            .await?;
            report.drained.push(id);
        } else if was != reason {
            sqlx::query("UPDATE inventory.nodes SET drain_blocked = $2 WHERE id = $1")
                .bind(&id)
                .bind(&reason)
                .execute(&mut *tx)
                .await?;
        }
    }
    Ok(())
}

impl Inventory {
    /// Start (`drain`) or end a node's drain, then reconcile, with the request's
    /// audit entry. Returns the node's administrative state and what blocks its
    /// drain.
    pub async fn set_drain(
        &self,
        id: &NodeId,
        drain: bool,
        audit: &Audit,
    ) -> Result<(String, Option<String>), Error> {
        let mut tx = self.pool.begin().await?;
        state::lock(&mut tx).await?;
        let admin: Option<String> =
            sqlx::query_scalar("SELECT admin_state FROM inventory.nodes WHERE id = $1 FOR UPDATE")
                .bind(id.as_str())
                .fetch_optional(&mut *tx)
                .await?;
        let Some(admin) = admin else {
            return Err(Error::NodeNotFound(id.to_string()));
        };
        if admin == "revoked" {
            return Err(Error::Conflict(format!("node `{id}` is revoked")));
        }
        let next = match (drain, admin.as_str()) {
            (true, "drained") => "drained",
            (true, _) => "draining",
            (false, _) => "active",
        };
        sqlx::query(
            "UPDATE inventory.nodes SET admin_state = $2, \
             drain_blocked = CASE WHEN $2 = 'draining' THEN drain_blocked ELSE NULL END WHERE id = $1",
        )
        .bind(id.as_str())
        .bind(next)
        .execute(&mut *tx)
        .await
        ?;
        let report = self.reconcile_in(&mut tx).await?;
        let (admin, blocked): (String, Option<String>) =
            sqlx::query_as("SELECT admin_state, drain_blocked FROM inventory.nodes WHERE id = $1")
                .bind(id.as_str())
                .fetch_one(&mut *tx)
                .await?;
        audit::record_ok(&mut tx, SCHEMA, audit).await?;
        tx.commit().await?;
        if report.changed() {
            self.signal.notify();
        }
        Ok((admin, blocked))
    }
}
