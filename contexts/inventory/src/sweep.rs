//! The sweeper: judge liveness (rule 8: only after a full grace of observation),
//! then reconcile the fleet. The controller calls [`Inventory::sweep`] on a timer.

use chrono::{DateTime, Utc};
use mesh_protocol::{Labels, LivenessState, NodeId, NodeLiveness, RecordKind};
use serde::Serialize;
use sqlx::PgConnection;
use sqlx::types::Json;

use crate::fleet::{self, Pass};
use crate::nodes::{LabelTrust, emit, emit_liveness};
use crate::state;
use crate::state::ReconcileReport;
use crate::{Error, Inventory};

/// What one sweep did.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct SweepReport {
    /// Why liveness was not judged (none: it was).
    pub not_judged: Option<String>,
    /// Nodes judged unreachable in this sweep.
    pub unreachable: Vec<String>,
    /// Nodes told again on the record (flagged by a migration).
    pub announced: usize,
    pub reconcile: ReconcileReport,
}

impl Inventory {
    pub(crate) fn pass(&self, now: DateTime<Utc>) -> Pass {
        Pass {
            now,
            not_observed: self.not_observed(now),
            controller_node: self
                .settings
                .controller_node
                .as_ref()
                .map(|n| n.as_str().to_owned()),
            max_unreachable_share: self.settings.max_unreachable_share,
            plan: self.carried(),
            trust: self.settings.label_trust.clone(),
        }
    }

    /// Judge liveness at `now` and reconcile, in one transaction. A node not heard
    /// from for longer than the grace becomes unreachable (record event
    /// `inventory.node.unreachable`) — but only once the controller has observed
    /// reports for a full grace: after a controller or broker outage what it last
    /// heard is stale for every node, and judging on it would mark the whole fleet
    /// unreachable.
    ///
    /// First it writes what was heard since the last liveness write (judging
    /// only on written times), and chooses the fleet's heartbeat interval from
    /// the budget; when that changed, every node's inventory section is
    /// declared again with the new plan. A node is judged by the fleet's grace,
    /// or by its own interval times the grace's intervals when it beats slower
    /// (an agent that keeps its own interval).
    pub async fn sweep(&self, now: DateTime<Utc>) -> Result<SweepReport, Error> {
        self.write_liveness().await?;
        let mut tx = self.pool.begin().await?;
        state::lock(&mut tx).await?;
        let replan = self.choose_interval(&mut tx).await?;
        // The first sweep after start tells every node the endpoints of the
        // settings (a controller restored in a new home, or reconfigured).
        let announce = self.settings.endpoints.is_some()
            && !self
                .endpoints_told
                .load(std::sync::atomic::Ordering::Relaxed);
        let pass = self.pass(now);
        let mut report = SweepReport {
            not_judged: pass.not_observed.clone(),
            ..SweepReport::default()
        };
        if pass.not_observed.is_none() {
            let grace_ms = i64::try_from(self.grace().as_millis()).unwrap_or(i64::MAX);
            // The grace counted in the node's own intervals.
            let per_interval = self.settings.grace.as_secs_f64()
                / self.settings.heartbeat_floor.as_secs_f64().max(0.001);
            let judged: Vec<(String, DateTime<Utc>)> = sqlx::query_as(
                "UPDATE inventory.nodes SET state = 'unreachable', unreachable_since = $1 \
                 WHERE state = 'alive' AND admin_state <> 'revoked' \
                   AND heard_at < $1 - make_interval(secs => greatest($2::bigint, \
                       (coalesce(beat_ms, 0) * $3::float8)::bigint) / 1000.0) \
                 RETURNING id, heard_at",
            )
            .bind(now)
            .bind(grace_ms)
            .bind(per_interval)
            .fetch_all(&mut *tx)
            .await?;
            for (id, heard_at) in judged {
                let node = NodeId::parse(&id).map_err(|e| Error::Corrupt {
                    node: id.clone(),
                    reason: e.to_string(),
                })?;
                tracing::warn!(node = %id, last_heard = %heard_at, "node unreachable");
                emit_liveness(
                    &mut tx,
                    NodeLiveness {
                        node,
                        state: LivenessState::Unreachable,
                        at: now,
                        last_heard: Some(heard_at),
                    },
                )
                .await?;
                report.unreachable.push(id);
            }
        }
        report.announced = announce_flagged(&mut tx, &pass.trust).await?;
        report.reconcile = fleet::reconcile(&mut tx, &pass).await?;
        if replan || announce {
            let desired = fleet::desired_sections(&mut tx, &pass.plan).await?;
            let declared = crate::SECTIONS.declare(&mut tx, desired).await?;
            report.reconcile.declared += declared.declared;
        }
        tx.commit().await?;
        if announce {
            self.endpoints_told
                .store(true, std::sync::atomic::Ordering::Relaxed);
        }
        self.judged_unreachable(&report.unreachable);
        if !report.unreachable.is_empty() || report.announced > 0 || report.reconcile.changed() {
            self.signal.notify();
        }
        Ok(report)
    }

    /// Reconcile the fleet inside `tx` (which it locks), at the controller's
    /// now: what a write does in its own transaction before it commits.
    pub(crate) async fn reconcile_in(
        &self,
        tx: &mut PgConnection,
    ) -> Result<ReconcileReport, Error> {
        fleet::reconcile(tx, &self.pass(Utc::now())).await
    }

    /// Reconcile the fleet now (what the API does after a write), and wake the
    /// relay if anything was declared.
    pub async fn reconcile(&self) -> Result<ReconcileReport, Error> {
        let pass = self.pass(Utc::now());
        let mut tx = self.pool.begin().await?;
        let report = fleet::reconcile(&mut tx, &pass).await?;
        tx.commit().await?;
        if report.changed() {
            self.signal.notify();
        }
        Ok(report)
    }
}

/// Most nodes one sweep tells again.
const ANNOUNCE_BATCH: i64 = 1000;

/// Tell the record again about nodes flagged `announce` (a migration that
/// changed what effective labels hold flags every node): each gets
/// `inventory.node.updated` with its effective labels and a raised version,
/// so every context's copy is brought up to date. At most [`ANNOUNCE_BATCH`]
/// a sweep; returns how many.
async fn announce_flagged(tx: &mut PgConnection, trust: &LabelTrust) -> Result<usize, Error> {
    let mut rows: Vec<(String, Json<Labels>, Json<Labels>, i64)> = sqlx::query_as(
        "UPDATE inventory.nodes SET announce = false, version = version + 1 \
         WHERE id IN (SELECT id FROM inventory.nodes WHERE announce ORDER BY id LIMIT $1) \
         RETURNING id, reported_labels, operator_labels, version",
    )
    .bind(ANNOUNCE_BATCH)
    .fetch_all(&mut *tx)
    .await?;
    // Told in id order, as every batch of the record is.
    rows.sort_by(|a, b| a.0.cmp(&b.0));
    for (id, reported, operator, version) in &rows {
        let node = NodeId::parse(id).map_err(|e| Error::Corrupt {
            node: id.clone(),
            reason: e.to_string(),
        })?;
        let labels = trust.effective(id, &reported.0, &operator.0);
        emit(tx, RecordKind::NodeUpdated, &node, labels, *version).await?;
    }
    if !rows.is_empty() {
        tracing::info!(nodes = rows.len(), "nodes told again on the record");
    }
    Ok(rows.len())
}
