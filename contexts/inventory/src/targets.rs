//! Which revision each node's replicas of a module run, as delivery tells the
//! record (`delivery.module.targets`): kept whole per module, the newest
//! `version` winning (`inventory.module_targets`), and the inventory sections
//! a change of them declares. Delivery decides the revision; inventory stays
//! the only declarer of units: a replica on a node the targets name runs the
//! revision's unit, every other replica the module's own spec.

use std::collections::{BTreeMap, BTreeSet};

use mesh_protocol::{ModuleTargets, NodeTarget, RevisionUnit};
use sqlx::PgConnection;
use sqlx::types::Json;
use uuid::Uuid;

use crate::Error;

/// A module's targets as kept: each targeted node's revision.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Targets {
    revisions: BTreeMap<Uuid, RevisionUnit>,
    /// Node id to revision id; only revisions `revisions` holds.
    nodes: BTreeMap<String, Uuid>,
}

impl Targets {
    fn new(revisions: Vec<RevisionUnit>, targets: Vec<NodeTarget>) -> Self {
        let revisions: BTreeMap<Uuid, RevisionUnit> =
            revisions.into_iter().map(|r| (r.id, r)).collect();
        // The protocol refuses a target naming a revision the event does not
        // carry; one that slipped through runs the module's own spec.
        let nodes = targets
            .into_iter()
            .filter(|t| revisions.contains_key(&t.revision))
            .map(|t| (t.node.as_str().to_owned(), t.revision))
            .collect();
        Targets { revisions, nodes }
    }

    /// The revision `node`'s replicas run (none: the module's own spec).
    pub(crate) fn of(&self, node: &str) -> Option<&RevisionUnit> {
        self.nodes.get(node).and_then(|id| self.revisions.get(id))
    }

    /// The nodes whose revision differs between `self` and `other`.
    fn differing(&self, other: &Targets) -> BTreeSet<String> {
        self.nodes
            .keys()
            .chain(other.nodes.keys())
            .filter(|n| self.of(n) != other.of(n))
            .cloned()
            .collect()
    }
}

#[derive(sqlx::FromRow)]
struct Row {
    module: String,
    version: i64,
    revisions: Json<serde_json::Value>,
    targets: Json<serde_json::Value>,
}

impl Row {
    fn decode(self) -> Result<(String, Targets), Error> {
        let corrupt = |what: &str, e: serde_json::Error| Error::Corrupt {
            node: self.module.clone(),
            reason: format!("module targets, {what}: {e}"),
        };
        let revisions: Vec<RevisionUnit> =
            serde_json::from_value(self.revisions.0).map_err(|e| corrupt("revisions", e))?;
        let targets: Vec<NodeTarget> =
            serde_json::from_value(self.targets.0).map_err(|e| corrupt("targets", e))?;
        Ok((self.module, Targets::new(revisions, targets)))
    }
}

/// Every module's targets, by module.
pub(crate) async fn load(tx: &mut PgConnection) -> Result<BTreeMap<String, Targets>, Error> {
    let rows: Vec<Row> =
        sqlx::query_as("SELECT module, version, revisions, targets FROM inventory.module_targets")
            .fetch_all(&mut *tx)
            .await?;
    rows.into_iter().map(Row::decode).collect()
}

/// Keep `delivery.module.targets` if it is newer than what is kept for its
/// module, and return the nodes whose revision changed (the caller, `retarget`
/// in fleet.rs, holds the fleet lock and declares their sections). A
/// stale event (its version not above the kept one) changes nothing; so does
/// one for a module inventory does not have (deleted, or never created: a
/// module created again later runs its own spec until delivery targets it
/// anew).
pub(crate) async fn record(
    tx: &mut PgConnection,
    body: &ModuleTargets,
) -> Result<BTreeSet<String>, Error> {
    let exists: Option<String> =
        sqlx::query_scalar("SELECT name FROM inventory.modules WHERE name = $1")
            .bind(&body.module)
            .fetch_optional(&mut *tx)
            .await?;
    if exists.is_none() {
        tracing::debug!(module = %body.module, "targets of a module inventory does not have");
        return Ok(BTreeSet::new());
    }
    let kept: Option<Row> = sqlx::query_as(
        "SELECT module, version, revisions, targets FROM inventory.module_targets WHERE module = $1",
    )
    .bind(&body.module)
    .fetch_optional(&mut *tx)
    .await?;
    let old = match kept {
        Some(row) if row.version >= body.version => {
            tracing::debug!(
                module = %body.module,
                version = body.version,
                kept = row.version,
                "stale module targets"
            );
            return Ok(BTreeSet::new());
        }
        Some(row) => row.decode()?.1,
        None => Targets::default(),
    };
    sqlx::query(
        "INSERT INTO inventory.module_targets AS t (module, version, revisions, targets) \
         VALUES ($1, $2, $3, $4) \
         ON CONFLICT (module) DO UPDATE SET version = excluded.version, \
             revisions = excluded.revisions, targets = excluded.targets, updated_at = now() \
         WHERE t.version < excluded.version",
    )
    .bind(&body.module)
    .bind(body.version)
    .bind(Json(&body.revisions))
    .bind(Json(&body.targets))
    .execute(&mut *tx)
    .await?;
    let new = Targets::new(body.revisions.clone(), body.targets.clone());
    Ok(old.differing(&new))
}

/// Forget a module's targets (the module is deleted).
pub(crate) async fn forget(tx: &mut PgConnection, module: &str) -> Result<(), Error> {
    sqlx::query("DELETE FROM inventory.module_targets WHERE module = $1")
        .bind(module)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn revision(id: u128, command: &str) -> RevisionUnit {
        RevisionUnit {
            id: Uuid::from_u128(id),
            artifact: None,
            command: command.to_owned(),
            args: Vec::new(),
            env: BTreeMap::new(),
            working_dir: None,
            restart: Default::default(),
            probes: Vec::new(),
        }
    }

    fn target(node: &str, id: u128) -> NodeTarget {
        NodeTarget {
            node: mesh_protocol::NodeId::parse(node).unwrap(),
            revision: Uuid::from_u128(id),
        }
    }

    #[test]
    fn only_nodes_whose_revision_changed_differ() {
        let old = Targets::new(
            vec![revision(1, "/bin/a")],
            vec![target("n1", 1), target("n2", 1)],
        );
        let new = Targets::new(
            vec![revision(1, "/bin/a"), revision(2, "/bin/b")],
            vec![target("n1", 1), target("n2", 2), target("n3", 2)],
        );
        let changed: Vec<String> = old.differing(&new).into_iter().collect();
        assert_eq!(changed, ["n2", "n3"]);
        assert_eq!(new.of("n3").map(|r| r.command.as_str()), Some("/bin/b"));
        assert!(new.of("n4").is_none());
        // Back to nothing: every targeted node differs.
        let none = Targets::default();
        let changed: Vec<String> = new.differing(&none).into_iter().collect();
        assert_eq!(changed, ["n1", "n2", "n3"]);
    }

    #[test]
    fn a_target_naming_an_unknown_revision_runs_the_spec() {
        let t = Targets::new(vec![revision(1, "/bin/a")], vec![target("n1", 9)]);
        assert!(t.of("n1").is_none());
    }
}
