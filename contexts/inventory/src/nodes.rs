//! Node facts and events shared by every other module (the bottom of the
//! crate's module graph: it depends on none of them). Effective labels, the
//! record events about a node (labels changed, liveness) written to the outbox,
//! and the wire-to-column conversion of counters.

use mesh_plumbing::outbox;
use mesh_protocol::{Labels, NodeId, NodeLabelsChanged, NodeLiveness, RecordEvent, RecordKind};
use sqlx::PgConnection;

use crate::{Error, SCHEMA};

/// Effective labels: reported, overridden key by key by the operator's.
pub(crate) fn effective(reported: &Labels, operator: &Labels) -> Labels {
    let mut labels = reported.clone();
    labels.extend(operator.iter().map(|(k, v)| (k.clone(), v.clone())));
    labels
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
