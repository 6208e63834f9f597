//! Reports and record events: catching nodes up on their config section
//! (the section component), and nodes as inventory describes them.

use std::collections::BTreeMap;

use mesh_protocol::{Envelope, ModuleEvent, NodeId, NodeLabelsChanged, ProtocolRange, Report};
use sqlx::PgConnection;
use sqlx::types::Json;

use crate::reconcile::{Scope, reconcile};
use crate::secrets::Keyring;
use crate::{ConfigSettings, Error, SECTIONS};

/// Hellos and heartbeats: a node behind its config section is sent it again (at
/// once on hello, at most once per `resend_after` on heartbeats), a node ahead
/// of it gets a generation above its own. What nodes applied is inventory's
/// record, not config's: `applied` reports change nothing here.
///
/// A hello also states the node's seal key (what its secrets are sealed to);
/// a node whose key is new or changed is reconciled, so that its secrets are
/// sealed to the key it holds now.
pub(crate) async fn handle(
    tx: &mut PgConnection,
    reports: &[Envelope<Report>],
    settings: &ConfigSettings,
    keyring: &Keyring,
) -> Result<(), Error> {
    SECTIONS.on_hello(tx, reports).await?;
    SECTIONS
        .on_heartbeat(tx, reports, settings.resend_after)
        .await?;
    seal_keys(tx, reports, keyring).await
}

/// Keep the seal key of each hello (the node is the broker-verified sender,
/// never a field of the body) and reconcile the nodes whose key changed.
async fn seal_keys(
    tx: &mut PgConnection,
    reports: &[Envelope<Report>],
    keyring: &Keyring,
) -> Result<(), Error> {
    let mut keys: BTreeMap<&str, &str> = BTreeMap::new();
    for env in reports {
        if let Report::Hello(h) = &env.body
            && h.refusal(ProtocolRange::THIS).is_none()
            && let Some(key) = h.seal_key.as_deref()
        {
            keys.insert(env.node.as_str(), key);
        }
    }
    if keys.is_empty() {
        return Ok(());
    }
    let (nodes, keys): (Vec<&str>, Vec<&str>) = keys.into_iter().unzip();
    let changed: Vec<String> = sqlx::query_scalar(
        "INSERT INTO config.node_keys AS k (node, seal_key) \
         SELECT * FROM UNNEST($1::text[], $2::text[]) ORDER BY 1 \
         ON CONFLICT (node) DO UPDATE SET seal_key = excluded.seal_key, updated_at = now() \
         WHERE k.seal_key <> excluded.seal_key RETURNING node",
    )
    .bind(&nodes)
    .bind(&keys)
    .fetch_all(&mut *tx)
    .await?;
    reconcile_named(tx, changed, keyring).await
}

/// Reconcile the nodes named (ids stored by config itself), if any.
pub(crate) async fn reconcile_named(
    tx: &mut PgConnection,
    names: impl IntoIterator<Item = String>,
    keyring: &Keyring,
) -> Result<(), Error> {
    let mut nodes = Vec::new();
    for n in names {
        match NodeId::parse(&n) {
            Ok(id) => nodes.push(id),
            Err(e) => tracing::warn!(node = %n, error = %e, "not a node id; skipped"),
        }
    }
    nodes.sort();
    nodes.dedup();
    if nodes.is_empty() {
        return Ok(());
    }
    reconcile(tx, Scope::Nodes(&nodes), keyring).await?;
    Ok(())
}

/// `inventory.module.placed` / `.removed` events of a batch: keep each
/// module's newest (by version; older ones are ignored), then reconcile the
/// nodes it ran on before and runs on now, all at once.
pub(crate) async fn modules_changed(
    tx: &mut PgConnection,
    events: &[ModuleEvent<'_>],
    keyring: &Keyring,
) -> Result<(), Error> {
    let newest = ModuleEvent::newest(events);
    if newest.is_empty() {
        return Ok(());
    }
    let columns = ModuleEvent::columns(&newest);
    let (modules, versions, removed) = (columns.modules, columns.versions, columns.removed);
    let nodes: Vec<_> = columns.nodes.into_iter().map(Json).collect();
    let files = ModuleEvent::column(&newest, |p| Json(p.settings_files.clone()));
    // One statement for the batch: each module's row is replaced when the
    // event is newer (keys unique and sorted: rows locked in key order), and
    // the nodes it ran on before (the statement's snapshot) and runs on now
    // come back for the modules that changed.
    let changed: Vec<(String, Vec<String>, Vec<String>)> = sqlx::query_as(
        "WITH u AS (SELECT * FROM UNNEST($1::text[], $2::bigint[], $3::bool[], $4::jsonb[], $5::jsonb[]) \
                    AS u(module, version, removed, nodes, files)), \
              before AS (SELECT m.module, m.nodes FROM config.modules m JOIN u USING (module)), \
              up AS (INSERT INTO config.modules AS m (module, version, removed, nodes, settings_files) \
                     SELECT module, version, removed, \
                            ARRAY(SELECT jsonb_array_elements_text(u.nodes)), files FROM u ORDER BY module \
                     ON CONFLICT (module) DO UPDATE SET version = excluded.version, \
                     removed = excluded.removed, nodes = excluded.nodes, \
                     settings_files = excluded.settings_files \
                     WHERE m.version < excluded.version RETURNING m.module, m.nodes) \
         SELECT up.module, coalesce(before.nodes, '{}'), up.nodes FROM up LEFT JOIN before USING (module)",
    )
    .bind(&modules)
    .bind(&versions)
    .bind(&removed)
    .bind(&nodes)
    .bind(&files)
    .fetch_all(&mut *tx)
    .await?;
    if changed.len() < newest.len() {
        tracing::debug!(
            stale = newest.len() - changed.len(),
            "ignoring stale module events"
        );
    }
    let affected = changed
        .into_iter()
        .flat_map(|(_, before, now)| before.into_iter().chain(now));
    reconcile_named(tx, affected, keyring).await
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
    keyring: &Keyring,
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
    reconcile(tx, Scope::Nodes(&changed), keyring).await?;
    Ok(())
}
