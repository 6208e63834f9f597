//! Reports and record events: catching nodes up on their config section
//! (the section component), and nodes as inventory describes them.

use std::collections::BTreeMap;

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

/// `inventory.node.joined` / `inventory.node.updated` events of a batch, in
/// delivery order: keep each node's labels if an event is newer than what is
/// stored, then reconcile the nodes whose labels were kept, all at once (one
/// upsert, one reconcile for the batch instead of one each per event).
///
/// The outcome is the one-by-one handling's: of a node's events, the first
/// with the highest version is the one a sequence of "newer than stored"
/// upserts keeps, and it is kept only if newer than what is stored. The
/// reconcile is level-triggered, so reconciling a node once after its last
/// change declares what reconciling it after each change declares last
/// (intermediate generations are skipped, not lost).
pub(crate) async fn nodes_changed(
    tx: &mut PgConnection,
    bodies: &[&NodeLabelsChanged],
) -> Result<(), Error> {
    let mut newest: BTreeMap<&str, &NodeLabelsChanged> = BTreeMap::new();
    for body in bodies {
        match newest.get(body.node.as_str()) {
            Some(kept) if kept.version >= body.version => {}
            _ => {
                newest.insert(body.node.as_str(), body);
            }
        }
    }
    if newest.is_empty() {
        return Ok(());
    }
    let n = newest.len();
    let (mut nodes, mut labels, mut versions) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    for (node, body) in &newest {
        nodes.push(*node);
        labels.push(Json(&body.labels));
        versions.push(body.version);
    }
    // Keys unique and sorted: rows are locked in key order.
    let newer: Vec<String> = sqlx::query_scalar(
        "INSERT INTO config.nodes AS n (node, labels, version) \
         SELECT u.node, u.labels, u.version FROM UNNEST($1::text[], $2::jsonb[], $3::bigint[]) \
              AS u(node, labels, version) ORDER BY u.node \
         ON CONFLICT (node) DO UPDATE SET labels = excluded.labels, version = excluded.version \
         WHERE n.version < excluded.version RETURNING node",
    )
    .bind(&nodes)
    .bind(&labels)
    .bind(&versions)
    .fetch_all(&mut *tx)
    .await?;
    if newer.len() < n {
        tracing::debug!(stale = n - newer.len(), "ignoring stale node events");
    }
    let mut changed = Vec::with_capacity(newer.len());
    for node in newer {
        if let Some(body) = newest.get(node.as_str()) {
            changed.push(body.node.clone());
        }
    }
    if changed.is_empty() {
        return Ok(());
    }
    reconcile(tx, Scope::Nodes(&changed)).await?;
    Ok(())
}
