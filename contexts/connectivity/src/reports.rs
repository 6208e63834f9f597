//! Reports and record events: what connectivity learns of nodes (their
//! WireGuard key and endpoint from hello, their labels and revocation from
//! the record) and of modules (where they run, their ports).

use std::collections::BTreeMap;

use mesh_protocol::{
    Envelope, ModuleEvent, NodeIdentityChanged, NodeLabelsChanged, ProtocolRange, Report,
};
use sqlx::PgConnection;
use sqlx::types::Json;

use crate::Error;
use crate::reconcile::{Scope, node_id};

/// Keep what each hello of the batch states of the overlay (the node is the
/// broker-verified sender of the envelope, never a field of the body; a node
/// named twice counts with its last hello). A hello without overlay facts
/// clears them: the node is off the overlay until it states a key again.
/// Returns whose sections changed: every node's when a node on the overlay
/// (before or now) changed, else only those of the nodes first heard of.
pub(crate) async fn hellos(
    tx: &mut PgConnection,
    reports: &[Envelope<Report>],
) -> Result<Scope, Error> {
    let mut facts: BTreeMap<&str, (Option<&str>, Option<&str>)> = BTreeMap::new();
    for env in reports {
        if let Report::Hello(h) = &env.body
            && h.refusal(ProtocolRange::THIS).is_none()
        {
            let overlay = h.overlay.as_ref();
            facts.insert(
                env.node.as_str(),
                (
                    overlay.map(|o| o.public_key.as_str()),
                    overlay.and_then(|o| o.endpoint.as_deref()),
                ),
            );
        }
    }
    if facts.is_empty() {
        return Ok(Scope::none());
    }
    let n = facts.len();
    let (mut nodes, mut keys, mut endpoints) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    for (node, (key, endpoint)) in facts {
        nodes.push(node);
        keys.push(key);
        endpoints.push(endpoint);
    }
    // What was stated before (the caller holds the context's lock: nothing
    // changes it in between).
    let before: Vec<(String, Option<String>)> =
        sqlx::query_as("SELECT node, public_key FROM connectivity.nodes WHERE node = ANY($1)")
            .bind(&nodes)
            .fetch_all(&mut *tx)
            .await?;
    let had_key: BTreeMap<String, bool> =
        before.into_iter().map(|(n, k)| (n, k.is_some())).collect();
    // Keys unique and sorted: rows locked in key order. A new node, or one
    // whose facts changed, comes back.
    let changed: Vec<(String, Option<String>, bool)> = sqlx::query_as(
        "INSERT INTO connectivity.nodes AS n (node, public_key, endpoint, key_at) \
         SELECT u.node, u.key, u.endpoint, now() \
         FROM UNNEST($1::text[], $2::text[], $3::text[]) AS u(node, key, endpoint) ORDER BY u.node \
         ON CONFLICT (node) DO UPDATE SET public_key = excluded.public_key, \
             endpoint = excluded.endpoint, key_at = now() \
         WHERE n.public_key IS DISTINCT FROM excluded.public_key \
            OR n.endpoint IS DISTINCT FROM excluded.endpoint \
         RETURNING node, public_key, revoked_at IS NOT NULL",
    )
    .bind(&nodes)
    .bind(&keys)
    .bind(&endpoints)
    .fetch_all(&mut *tx)
    .await?;
    let mut scope = Scope::none();
    for (node, key, revoked) in changed {
        if revoked {
            continue;
        }
        if key.is_some() || had_key.get(&node).copied().unwrap_or(false) {
            tracing::info!(%node, "overlay facts changed");
            scope.add(Scope::All);
        } else {
            scope.add(Scope::Nodes([node_id(&node)?].into()));
        }
    }
    Ok(scope)
}

/// `inventory.node.joined` / `.updated`: keep each node's labels when the
/// event is newer than what is stored (a node first heard of this way is
/// known from now on). Returns whose sections changed: labels change
/// sections only under hub-and-spoke (every node's then); a node first heard
/// of gets its own.
pub(crate) async fn labels(
    tx: &mut PgConnection,
    bodies: &[&NodeLabelsChanged],
    hub_and_spoke: bool,
) -> Result<Scope, Error> {
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
        return Ok(Scope::none());
    }
    let (mut nodes, mut labels, mut versions) = (Vec::new(), Vec::new(), Vec::new());
    for (node, body) in &newest {
        nodes.push(*node);
        labels.push(Json(&body.labels));
        versions.push(body.version);
    }
    let newer: Vec<String> = sqlx::query_scalar(
        "INSERT INTO connectivity.nodes AS n (node, labels, labels_version) \
         SELECT * FROM UNNEST($1::text[], $2::jsonb[], $3::bigint[]) AS u(node, labels, version) \
         ORDER BY 1 \
         ON CONFLICT (node) DO UPDATE SET labels = excluded.labels, \
             labels_version = excluded.labels_version \
         WHERE n.labels_version < excluded.labels_version RETURNING node",
    )
    .bind(&nodes)
    .bind(&labels)
    .bind(&versions)
    .fetch_all(&mut *tx)
    .await?;
    if newer.is_empty() {
        return Ok(Scope::none());
    }
    if hub_and_spoke {
        return Ok(Scope::All);
    }
    let mut nodes = std::collections::BTreeSet::new();
    for n in newer {
        nodes.insert(node_id(&n)?);
    }
    Ok(Scope::Nodes(nodes))
}

/// `identity.node.enrolled` / `.revoked`, the newest (`at`) winning. A
/// revoked node leaves the overlay everywhere: its address is freed, its
/// certificates are recorded revoked and it is declared nothing more. A
/// node enrolled again after a revocation is back, but the WireGuard key
/// it stated before the revocation is forgotten: it is on the overlay again
/// once it states one in a hello after it. Returns whether anything changed.
pub(crate) async fn identity(
    tx: &mut PgConnection,
    body: &NodeIdentityChanged,
    revoked: bool,
) -> Result<bool, Error> {
    let node = body.node.as_str();
    if revoked {
        let applied: Option<String> = sqlx::query_scalar(
            "INSERT INTO connectivity.nodes AS n (node, identity_at, revoked_at) VALUES ($1, $2, $2) \
             ON CONFLICT (node) DO UPDATE SET identity_at = $2, revoked_at = $2 \
             WHERE n.identity_at IS NULL OR n.identity_at < $2 RETURNING node",
        )
        .bind(node)
        .bind(body.at)
        .fetch_optional(&mut *tx)
        .await?;
        if applied.is_none() {
            return Ok(false);
        }
        sqlx::query("DELETE FROM connectivity.addresses WHERE node = $1")
            .bind(node)
            .execute(&mut *tx)
            .await?;
        let certs = sqlx::query(
            "UPDATE connectivity.certificates SET revoked_at = now() \
             WHERE node = $1 AND revoked_at IS NULL",
        )
        .bind(node)
        .execute(&mut *tx)
        .await?;
        tracing::info!(%node, certificates = certs.rows_affected(), "node revoked: off the overlay");
        Ok(true)
    } else {
        let applied: Option<String> = sqlx::query_scalar(
            "INSERT INTO connectivity.nodes AS n (node, identity_at) VALUES ($1, $2) \
             ON CONFLICT (node) DO UPDATE SET identity_at = $2, revoked_at = NULL, \
                 public_key = CASE WHEN n.revoked_at IS NOT NULL \
                     AND (n.key_at IS NULL OR n.key_at <= n.revoked_at) THEN NULL ELSE n.public_key END, \
                 endpoint = CASE WHEN n.revoked_at IS NOT NULL \
                     AND (n.key_at IS NULL OR n.key_at <= n.revoked_at) THEN NULL ELSE n.endpoint END \
             WHERE n.identity_at IS NULL OR n.identity_at < $2 RETURNING node",
        )
        .bind(node)
        .bind(body.at)
        .fetch_optional(&mut *tx)
        .await?;
        Ok(applied.is_some())
    }
}

/// `inventory.module.placed` / `.removed`: keep each module's newest (by
/// version; older ones are ignored). Returns whether anything changed.
pub(crate) async fn modules(
    tx: &mut PgConnection,
    events: &[ModuleEvent<'_>],
) -> Result<bool, Error> {
    let newest = ModuleEvent::newest(events);
    if newest.is_empty() {
        return Ok(false);
    }
    let columns = ModuleEvent::columns(&newest);
    let (modules, versions, removed) = (columns.modules, columns.versions, columns.removed);
    let nodes: Vec<_> = columns.nodes.into_iter().map(Json).collect();
    let ports = ModuleEvent::column(&newest, |p| Json(p.ports.clone()));
    let changed: Vec<String> = sqlx::query_scalar(
        "INSERT INTO connectivity.modules AS m (module, version, removed, nodes, ports) \
         SELECT u.module, u.version, u.removed, ARRAY(SELECT jsonb_array_elements_text(u.nodes)), u.ports \
         FROM UNNEST($1::text[], $2::bigint[], $3::bool[], $4::jsonb[], $5::jsonb[]) \
              AS u(module, version, removed, nodes, ports) ORDER BY u.module \
         ON CONFLICT (module) DO UPDATE SET version = excluded.version, removed = excluded.removed, \
             nodes = excluded.nodes, ports = excluded.ports \
         WHERE m.version < excluded.version RETURNING module",
    )
    .bind(&modules)
    .bind(&versions)
    .bind(&removed)
    .bind(&nodes)
    .bind(&ports)
    .fetch_all(&mut *tx)
    .await?;
    if changed.len() < newest.len() {
        tracing::debug!(
            stale = newest.len() - changed.len(),
            "ignoring stale module events"
        );
    }
    Ok(!changed.is_empty())
}
