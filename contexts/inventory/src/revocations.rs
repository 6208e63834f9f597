//! Which nodes are revoked, in memory (decision 0050): identity's newest word
//! on each node it revoked or re-admitted, kept in `inventory.revocations`,
//! loaded at start ([`crate::Inventory::load_revocations`]) and kept current
//! from the record (`identity.node.revoked` / `.readmitted` / `.enrolled`).
//! The controller's pipeline asks [`Revocations::snapshot`] once per batch of
//! reports and dead-letters a revoked node's with reason `revoked`: no
//! database read per report, heartbeats included.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, RwLock};

use chrono::{DateTime, Utc};
use mesh_protocol::NodeId;
use sqlx::{PgConnection, PgPool};

use crate::Error;

/// The revoked nodes, and changes waiting for their transaction to commit.
#[derive(Default)]
pub(crate) struct Revocations {
    revoked: RwLock<Arc<HashSet<NodeId>>>,
    /// Changes handled in a transaction not yet committed, in order.
    pending: Mutex<Vec<(NodeId, bool)>>,
}

impl Revocations {
    /// The revoked nodes now (cheap: one shared set).
    pub(crate) fn snapshot(&self) -> Arc<HashSet<NodeId>> {
        self.revoked
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn replace(&self, set: HashSet<NodeId>) {
        *self.revoked.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(set);
    }

    /// Fill the set from `inventory.revocations` (at start, before reports
    /// are consumed). Returns how many nodes are revoked.
    pub(crate) async fn load(&self, pool: &PgPool) -> Result<usize, Error> {
        let rows: Vec<String> =
            sqlx::query_scalar("SELECT node FROM inventory.revocations WHERE revoked")
                .fetch_all(pool)
                .await?;
        let set: HashSet<NodeId> = rows.iter().filter_map(|n| NodeId::parse(n).ok()).collect();
        let n = set.len();
        self.replace(set);
        Ok(n)
    }

    /// Record identity's word on `node` at `at` in the handler's transaction,
    /// unless a newer word is kept; the set changes once it commits
    /// ([`Revocations::committed`]). A revocation also enters the set at
    /// once: refusing a node's reports a moment early is harmless, admitting
    /// them is not.
    pub(crate) async fn record(
        &self,
        tx: &mut PgConnection,
        node: &NodeId,
        revoked: bool,
        at: DateTime<Utc>,
    ) -> Result<(), Error> {
        let applied: Option<bool> = sqlx::query_scalar(
            "INSERT INTO inventory.revocations AS r (node, revoked, at) VALUES ($1, $2, $3) \
             ON CONFLICT (node) DO UPDATE SET revoked = excluded.revoked, at = excluded.at \
             WHERE r.at < excluded.at RETURNING revoked",
        )
        .bind(node.as_str())
        .bind(revoked)
        .bind(at)
        .fetch_optional(&mut *tx)
        .await?;
        if applied.is_none() {
            return Ok(());
        }
        if revoked {
            self.set(node, true);
        }
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((node.clone(), revoked));
        Ok(())
    }

    fn set(&self, node: &NodeId, revoked: bool) {
        let mut guard = self.revoked.write().unwrap_or_else(|e| e.into_inner());
        if guard.contains(node) == revoked {
            return;
        }
        let mut next = HashSet::clone(&guard);
        if revoked {
            next.insert(node.clone());
        } else {
            next.remove(node);
        }
        *guard = Arc::new(next);
    }

    /// A transaction of the context committed: apply what it recorded.
    pub(crate) fn committed(&self) {
        let pending = std::mem::take(&mut *self.pending.lock().unwrap_or_else(|e| e.into_inner()));
        for (node, revoked) in pending {
            if !revoked {
                tracing::info!(%node, "node re-admitted: its reports count again");
            }
            self.set(&node, revoked);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(n: &str) -> NodeId {
        NodeId::parse(n).expect("node")
    }

    #[test]
    fn a_re_admission_counts_only_once_committed() {
        let r = Revocations::default();
        r.set(&node("web-1"), true);
        r.pending.lock().expect("lock").push((node("web-1"), false));
        assert!(r.snapshot().contains(&node("web-1")));
        r.committed();
        assert!(!r.snapshot().contains(&node("web-1")));
        r.committed();
        assert!(r.snapshot().is_empty());
    }
}
