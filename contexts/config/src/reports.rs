//! Reports and record events: catching nodes up on their config section
//! (the section component), and nodes as inventory describes them.

use mesh_protocol::{Envelope, NodeLabelsChanged, Report};
use sqlx::PgConnection;
use sqlx::types::Json;

use crate::reconcile::{Scope, reconcile};
use crate::{ConfigSettings, Error, SECTIONS};

/// Hellos and heartbeats: a node behind its config section is sent it again (at
/// once on hello, at most once per `resend_after` on heartbeats), a node ahead
/// of it gets a generation above its own. What nodes applied is inventory's
/// record, not config's: `applied` reports change nothing here.
pub(crate) async fn handle(
    tx: &mut PgConnection,
    reports: &[Envelope<Report>],
    settings: &ConfigSettings,
) -> Result<(), Error> {
    SECTIONS.on_hello(tx, reports).await?;
    SECTIONS
        .on_heartbeat(tx, reports, settings.resend_after)
        .await?;
    Ok(())
}

/// `inventory.node.joined` / `inventory.node.updated`: keep the node's labels if
/// the event is newer than what is stored, then reconcile that node.
pub(crate) async fn node_changed(
    tx: &mut PgConnection,
    body: &NodeLabelsChanged,
) -> Result<(), Error> {
    let newer: Option<String> = sqlx::query_scalar(
        "INSERT INTO config.nodes AS n (node, labels, version) VALUES ($1, $2, $3) \
         ON CONFLICT (node) DO UPDATE SET labels = excluded.labels, version = excluded.version \
         WHERE n.version < excluded.version RETURNING node",
    )
    .bind(body.node.as_str())
    .bind(Json(&body.labels))
    .bind(body.version)
    .fetch_optional(&mut *tx)
    .await?;
    if newer.is_none() {
        tracing::debug!(node = %body.node, version = body.version, "ignoring stale node event");
        return Ok(());
    }
    reconcile(tx, Scope::Node(&body.node)).await?;
    Ok(())
}
