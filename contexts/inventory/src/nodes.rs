//! Node facts and events shared by every other module (the bottom of the
//! crate's module graph: it depends on none of them). Effective labels, the
//! record events about a node (labels changed, liveness) written to the outbox,
//! and the wire-to-column conversion of counters.

use mesh_plumbing::outbox;
use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Utc};

use mesh_protocol::{
    Labels, NODE_LABEL, NodeId, NodeIdentityChanged, NodeLabelsChanged, NodeLiveness,
    RESERVED_LABEL_PREFIX, RecordEvent, RecordKind,
};
use sqlx::PgConnection;
use sqlx::types::Json;

use crate::{Error, SCHEMA};

/// Which label keys a node's own statement may set (the controller's
/// `trusted_stated_labels`; issue 29). By default none: what a node says
/// about itself is kept and shown as stated, and selects nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelTrust {
    keys: BTreeSet<String>,
}

impl LabelTrust {
    /// Trust the stated labels of these keys (never one under
    /// [`RESERVED_LABEL_PREFIX`]: those are dropped).
    pub fn new(keys: impl IntoIterator<Item = String>) -> Self {
        LabelTrust {
            keys: keys
                .into_iter()
                .filter(|k| !k.starts_with(RESERVED_LABEL_PREFIX))
                .collect(),
        }
    }

    /// The keys trusted, for SQL (`= ANY($n)`).
    pub(crate) fn keys(&self) -> Vec<String> {
        self.keys.iter().cloned().collect()
    }

    /// Effective labels, what selectors, placement, roles and grants see:
    /// the stated labels of trusted keys, overridden key by key by the
    /// operator's, and the facts the controller verified itself: node's id
    /// as [`NODE_LABEL`]. Nothing under the reserved prefix comes from the
    /// node or the operator.
    pub(crate) fn effective(&self, node: &str, stated: &Labels, operator: &Labels) -> Labels {
        let mut labels: Labels = stated
            .iter()
            .filter(|(k, _)| self.keys.contains(*k))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        labels.extend(
            operator
                .iter()
                .filter(|(k, _)| !k.starts_with(RESERVED_LABEL_PREFIX))
                .map(|(k, v)| (k.clone(), v.clone())),
        );
        labels.insert(NODE_LABEL.to_owned(), node.to_owned());
        labels
    }
}

/// A wire counter (u64) as a PostgreSQL `bigint`, saturating.
pub(crate) fn to_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// Write `inventory.node.joined` or `.updated` (`event`) with the node's
/// effective labels to the outbox.
pub(crate) async fn emit(
    tx: &mut PgConnection,
    event: fn(NodeLabelsChanged) -> RecordKind,
    node: &NodeId,
    labels: Labels,
    version: i64,
) -> Result<(), Error> {
    let body = NodeLabelsChanged {
        node: node.clone(),
        labels,
        version,
    };
    outbox::record(tx, SCHEMA, &RecordEvent::new(event(body))).await?;
    Ok(())
}

/// Write `inventory.node.<state>` for a liveness transition to the outbox.
pub(crate) async fn emit_liveness(tx: &mut PgConnection, body: NodeLiveness) -> Result<(), Error> {
    outbox::record(tx, SCHEMA, &RecordEvent::new(body.into_kind())).await?;
    Ok(())
}

/// The labels an operator bound to the join token `body.node` enrolled with
/// (issue 29): kept for the node's first hello, which takes them as its
/// operator labels; a node already known (a re-join) gets them over its
/// operator labels now, key by key, and `inventory.node.updated` when its
/// effective labels change. Only an enrolment newer than the last identity
/// change counts.
pub(crate) async fn enrolled_labels(
    tx: &mut PgConnection,
    body: &NodeIdentityChanged,
    labels: &Labels,
    trust: &LabelTrust,
) -> Result<(), Error> {
    let labels: Labels = labels
        .iter()
        .filter(|(k, _)| !k.starts_with(RESERVED_LABEL_PREFIX))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    sqlx::query(
        "INSERT INTO inventory.enrolled_labels (node, labels, at) VALUES ($1, $2, $3) \
         ON CONFLICT (node) DO UPDATE SET labels = excluded.labels, at = excluded.at \
         WHERE inventory.enrolled_labels.at < excluded.at",
    )
    .bind(body.node.as_str())
    .bind(Json(&labels))
    .bind(body.at)
    .execute(&mut *tx)
    .await?;
    let row: Option<(Json<Labels>, Json<Labels>, i64)> = sqlx::query_as(
        "SELECT reported_labels, operator_labels, version FROM inventory.nodes \
         WHERE id = $1 AND (identity_at IS NULL OR identity_at < $2) FOR UPDATE",
    )
    .bind(body.node.as_str())
    .bind(body.at)
    .fetch_optional(&mut *tx)
    .await?;
    let Some((stated, operator, version)) = row else {
        return Ok(());
    };
    let mut after = operator.0.clone();
    after.extend(labels);
    let before_effective = trust.effective(body.node.as_str(), &stated.0, &operator.0);
    let after_effective = trust.effective(body.node.as_str(), &stated.0, &after);
    let changed = before_effective != after_effective;
    let version = if changed { version + 1 } else { version };
    sqlx::query(
        "UPDATE inventory.nodes SET operator_labels = $2, version = $3, \
         labels_revision = labels_revision + 1 WHERE id = $1",
    )
    .bind(body.node.as_str())
    .bind(Json(&after))
    .bind(version)
    .execute(&mut *tx)
    .await?;
    if changed {
        emit(
            tx,
            RecordKind::NodeUpdated,
            &body.node,
            after_effective,
            version,
        )
        .await?;
    }
    Ok(())
}

/// A node's clock may run ahead; never record a "last seen" in the future.
pub(crate) fn clamp(sent_at: DateTime<Utc>) -> DateTime<Utc> {
    sent_at.min(Utc::now())
}

/// Raise applied generations (never lower them), one statement, keys unique.
/// Used by hello (heartbeats do the same inside their one statement). Rows
/// already at or above their generation (a node that is up to date) are
/// filtered out before the insert: an `ON CONFLICT DO UPDATE … WHERE` that
/// updates nothing still locks the row it conflicts with.
pub(crate) async fn upsert_generations(
    tx: &mut PgConnection,
    rows: BTreeMap<(&str, &str), i64>,
) -> Result<(), Error> {
    if rows.is_empty() {
        return Ok(());
    }
    let mut nodes = Vec::with_capacity(rows.len());
    let mut sections = Vec::with_capacity(rows.len());
    let mut generations = Vec::with_capacity(rows.len());
    for ((node, section), generation) in rows {
        nodes.push(node);
        sections.push(section);
        generations.push(generation);
    }
    sqlx::query(
        "INSERT INTO inventory.applied AS a (node, section, generation) \
         SELECT u.node, u.section, u.generation \
         FROM UNNEST($1::text[], $2::text[], $3::bigint[]) AS u(node, section, generation) \
         WHERE EXISTS (SELECT 1 FROM inventory.nodes n WHERE n.id = u.node) \
           AND NOT EXISTS (SELECT 1 FROM inventory.applied o WHERE o.node = u.node \
                           AND o.section = u.section AND o.generation >= u.generation) \
         ON CONFLICT (node, section) DO UPDATE SET generation = excluded.generation, updated_at = now() \
         WHERE a.generation < excluded.generation",
    )
    .bind(&nodes)
    .bind(&sections)
    .bind(&generations)
    .execute(&mut *tx)
    .await?;
    Ok(())
}
