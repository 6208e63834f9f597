//! The connectivity section of every node, computed from what the schema
//! holds: addresses allocated first, then the snapshot of the mesh, then each
//! node's items (the pure [`crate::plan`]), handed to the section component,
//! which declares a new generation only where the digest changed.
//!
//! Every transaction of this context that writes takes [`lock`] first, before
//! any row: handlers, events and the resync are serialized, so two never
//! allocate one address, compute from a stale snapshot or lock section rows
//! in opposite orders.

use std::collections::{BTreeMap, BTreeSet};

use mesh_plumbing::section::{Declared, Items};
use mesh_protocol::{CertificateItem, DeclarationItems, FileItem, FileMode, Labels, NodeId};
use sqlx::PgConnection;
use sqlx::types::Json;

use crate::plan::{self, Module, Node, Snapshot};
use crate::{Error, SECTIONS, Settings};

/// Advisory lock of every writing transaction: "conn" in ASCII, key 0.
const LOCK: i32 = 0x636f_6e6e;

/// Take the context's lock for the rest of the transaction.
pub(crate) async fn lock(tx: &mut PgConnection) -> Result<(), Error> {
    sqlx::query("SELECT pg_advisory_xact_lock($1, 0)")
        .bind(LOCK)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

pub(crate) fn node_id(text: &str) -> Result<NodeId, Error> {
    NodeId::parse(text).map_err(|e| Error::Corrupt {
        what: "node id".to_owned(),
        reason: e.to_string(),
    })
}

/// Give every known node that is not revoked an overlay address: the lowest
/// free host address of the overlay network, unique by the table's
/// constraint. An address outside the network (the setting changed) is given
/// up first. Returns the nodes left without one because the network is full.
pub(crate) async fn allocate(
    tx: &mut PgConnection,
    settings: &Settings,
) -> Result<Vec<String>, Error> {
    let cidr = settings.plan.cidr;
    let outside =
        sqlx::query("DELETE FROM connectivity.addresses WHERE address NOT BETWEEN $1 AND $2")
            .bind(i64::from(cidr.first_host()))
            .bind(i64::from(cidr.last_host()))
            .execute(&mut *tx)
            .await?;
    if outside.rows_affected() > 0 {
        tracing::warn!(
            count = outside.rows_affected(),
            cidr = %cidr,
            "overlay addresses outside the overlay network were given up"
        );
    }
    let needing: Vec<String> = sqlx::query_scalar(
        "SELECT n.node FROM connectivity.nodes n \
         LEFT JOIN connectivity.addresses a USING (node) \
         WHERE n.revoked_at IS NULL AND a.node IS NULL ORDER BY n.node",
    )
    .fetch_all(&mut *tx)
    .await?;
    if needing.is_empty() {
        return Ok(Vec::new());
    }
    let used: Vec<i64> = sqlx::query_scalar("SELECT address FROM connectivity.addresses")
        .fetch_all(&mut *tx)
        .await?;
    let used: BTreeSet<u32> = used
        .into_iter()
        .filter_map(|a| u32::try_from(a).ok())
        .collect();
    let free = plan::lowest_free(&cidr, &used, needing.len());
    let given = free.len();
    let (nodes, addresses): (Vec<&str>, Vec<i64>) = needing
        .iter()
        .zip(free)
        .map(|(n, a)| (n.as_str(), i64::from(a)))
        .unzip();
    sqlx::query(
        "INSERT INTO connectivity.addresses (node, address) \
         SELECT * FROM UNNEST($1::text[], $2::bigint[])",
    )
    .bind(&nodes)
    .bind(&addresses)
    .execute(&mut *tx)
    .await?;
    let left: Vec<String> = needing[given..].to_vec();
    if !left.is_empty() {
        tracing::error!(
            cidr = %cidr,
            nodes = left.len(),
            "the overlay network is full: nodes left without an overlay address"
        );
    }
    Ok(left)
}

#[derive(sqlx::FromRow)]
struct NodeRow {
    node: String,
    public_key: Option<String>,
    endpoint: Option<String>,
    labels: Json<Labels>,
    address: Option<i64>,
}

#[derive(sqlx::FromRow)]
struct ModuleRow {
    module: String,
    nodes: Vec<String>,
    ports: Json<Vec<mesh_protocol::ModulePort>>,
}

/// The mesh as the schema holds it: nodes not revoked, modules not removed.
pub(crate) async fn snapshot(tx: &mut PgConnection) -> Result<Snapshot, Error> {
    let rows: Vec<NodeRow> = sqlx::query_as(
        "SELECT n.node, n.public_key, n.endpoint, n.labels, a.address \
         FROM connectivity.nodes n LEFT JOIN connectivity.addresses a USING (node) \
         WHERE n.revoked_at IS NULL ORDER BY n.node",
    )
    .fetch_all(&mut *tx)
    .await?;
    let mut snapshot = Snapshot::default();
    for r in rows {
        let id = node_id(&r.node)?;
        snapshot.nodes.insert(
            id.clone(),
            Node {
                id,
                address: r.address.and_then(|a| u32::try_from(a).ok()),
                public_key: r.public_key,
                endpoint: r.endpoint,
                labels: r.labels.0,
            },
        );
    }
    let modules: Vec<ModuleRow> = sqlx::query_as(
        "SELECT module, nodes, ports FROM connectivity.modules WHERE NOT removed ORDER BY module",
    )
    .fetch_all(&mut *tx)
    .await?;
    for m in modules {
        let mut nodes = Vec::with_capacity(m.nodes.len());
        for n in &m.nodes {
            nodes.push(node_id(n)?);
        }
        snapshot.modules.insert(
            m.module.clone(),
            Module {
                name: m.module,
                nodes,
                ports: m.ports.0,
            },
        );
    }
    Ok(snapshot)
}

/// The newest certificate of each (node, name), not revoked and not expired,
/// that the node may still hold: its own, and those of modules it runs.
async fn certificates(
    tx: &mut PgConnection,
    snapshot: &Snapshot,
    ca_pem: Option<&str>,
) -> Result<BTreeMap<String, Vec<CertificateItem>>, Error> {
    let Some(ca) = ca_pem else {
        return Ok(BTreeMap::new());
    };
    let rows: Vec<(
        String,
        String,
        String,
        chrono::DateTime<chrono::Utc>,
        String,
    )> = sqlx::query_as(
        "SELECT DISTINCT ON (node, name) node, name, serial, not_after, certificate \
             FROM connectivity.certificates WHERE revoked_at IS NULL AND not_after > now() \
             ORDER BY node, name, issued_at DESC",
    )
    .fetch_all(&mut *tx)
    .await?;
    let mut out: BTreeMap<String, Vec<CertificateItem>> = BTreeMap::new();
    for (node, name, serial, not_after, certificate) in rows {
        let allowed = name == mesh_protocol::NODE_CERTIFICATE
            || snapshot
                .modules
                .get(&name)
                .is_some_and(|m| m.nodes.iter().any(|n| n.as_str() == node));
        if !allowed {
            continue;
        }
        out.entry(node).or_default().push(CertificateItem {
            name,
            serial,
            not_after,
            certificate,
            ca: ca.to_owned(),
        });
    }
    Ok(out)
}

/// Whose sections a change recomputes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Scope {
    /// Every node: what changed is in every node's section (a node joined or
    /// left the overlay, a module moved, a label under hub-and-spoke).
    All,
    /// Only these nodes: what changed is in their own sections alone (a node
    /// off the overlay first heard of, a certificate signed for it).
    Nodes(BTreeSet<NodeId>),
}

impl Scope {
    pub(crate) fn none() -> Scope {
        Scope::Nodes(BTreeSet::new())
    }

    /// Widen to include `other`.
    pub(crate) fn add(&mut self, other: Scope) {
        match (&mut *self, other) {
            (Scope::All, _) => {}
            (_, Scope::All) => *self = Scope::All,
            (Scope::Nodes(a), Scope::Nodes(b)) => a.extend(b),
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        matches!(self, Scope::Nodes(n) if n.is_empty())
    }

    fn holds(&self, node: &NodeId) -> bool {
        match self {
            Scope::All => true,
            Scope::Nodes(n) => n.contains(node),
        }
    }
}

/// The desired connectivity section of every node not revoked, inside `tx`
/// (the caller holds [`lock`]): the names file for all, the overlay and the
/// packet filter for those on the overlay, and their current certificates.
pub(crate) async fn desired(
    tx: &mut PgConnection,
    settings: &Settings,
) -> Result<Vec<(NodeId, Items)>, Error> {
    desired_of(tx, settings, &Scope::All).await
}

/// [`desired`] of the nodes of `scope` only (the snapshot is the whole
/// mesh's: the names file and peers are every node's).
async fn desired_of(
    tx: &mut PgConnection,
    settings: &Settings,
    scope: &Scope,
) -> Result<Vec<(NodeId, Items)>, Error> {
    allocate(tx, settings).await?;
    let snapshot = snapshot(tx).await?;
    let mut certs = certificates(tx, &snapshot, settings.ca_pem()).await?;
    let hosts = FileItem {
        path: plan::HOSTS_PATH.to_owned(),
        content: snapshot.hosts(&settings.plan.domain),
        mode: FileMode::new(0o644)?,
    };
    let mut desired = Vec::with_capacity(snapshot.nodes.len());
    for id in snapshot.nodes.keys().filter(|n| scope.holds(n)) {
        let items = DeclarationItems {
            files: vec![hosts.clone()],
            overlay: snapshot.overlay(id, &settings.plan),
            firewall: snapshot.firewall(id, &settings.plan),
            certificates: certs.remove(id.as_str()).unwrap_or_default(),
            ..DeclarationItems::default()
        };
        desired.push((id.clone(), Items::new(items)?));
    }
    Ok(desired)
}

/// Recompute the sections of `scope` and declare what changed (the caller
/// holds [`lock`]).
pub(crate) async fn reconcile(
    tx: &mut PgConnection,
    settings: &Settings,
    scope: &Scope,
) -> Result<Declared, Error> {
    if scope.is_empty() {
        return Ok(Declared::default());
    }
    let desired = desired_of(tx, settings, scope).await?;
    let report = SECTIONS.declare(tx, desired).await?;
    if !report.too_large.is_empty() {
        tracing::error!(nodes = ?report.too_large, "connectivity sections an agent would refuse");
    }
    Ok(report)
}
