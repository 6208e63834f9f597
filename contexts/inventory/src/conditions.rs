//! Fleet conditions: what the reconcile found wrong with the fleet (a module
//! it cannot place in full, a pinned module on an unreachable node,
//! re-placement paused), told to the record as `inventory.fleet.conditions`.
//! Inventory keeps no alerts: observability turns each condition into one.
//!
//! Level-triggered like the module placements: each pass compares the set it
//! found with what inventory last told (`inventory.conditions`) and, only
//! when they differ, writes one event with the whole set (a condition absent
//! is over) and a `version` from `inventory.conditions_version`, in the
//! pass's transaction.

use std::collections::BTreeMap;

use mesh_plumbing::outbox;
use mesh_protocol::{
    FleetCondition, FleetConditions, MAX_CONDITIONS, MAX_EVENT_BYTES, NodeId, RecordEvent,
    RecordKind,
};
use sqlx::PgConnection;

use crate::{Error, SCHEMA};

/// What the envelope of the event takes besides its conditions (id, names,
/// time, version), generously: the conditions get the rest of
/// [`MAX_EVENT_BYTES`].
const ENVELOPE_BYTES: usize = 4096;

/// One condition as a pass finds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Condition {
    pub kind: &'static str,
    pub node: Option<String>,
    pub module: Option<String>,
    pub stateful: bool,
    pub message: String,
}

/// The conditions a pass found, by key (stable while the condition holds).
pub(crate) type Found = BTreeMap<String, Condition>;

#[derive(sqlx::FromRow)]
struct Row {
    key: String,
    kind: String,
    node: Option<String>,
    module: Option<String>,
    stateful: bool,
    message: String,
}

fn node_id(node: &str) -> Result<NodeId, Error> {
    NodeId::parse(node).map_err(|e| Error::Corrupt {
        node: node.to_owned(),
        reason: e.to_string(),
    })
}

/// The set as the record is told it, in key order, bounded so that one event
/// carries it: at most [`MAX_CONDITIONS`] and within [`MAX_EVENT_BYTES`].
/// Deterministic (what is left out is always the same for the same set), so
/// a set too large to tell whole is not told again at every pass.
fn bounded(found: Found) -> Result<Vec<FleetCondition>, Error> {
    let total = found.len();
    let mut budget = MAX_EVENT_BYTES - ENVELOPE_BYTES;
    let mut told = Vec::with_capacity(total.min(MAX_CONDITIONS));
    for (key, c) in found {
        let condition = FleetCondition {
            key,
            kind: c.kind.to_owned(),
            node: c.node.as_deref().map(node_id).transpose()?,
            module: c.module,
            stateful: c.stateful,
            message: c.message,
        };
        // Serializing plain data cannot fail; the comma between two counts too.
        let size = serde_json::to_vec(&condition).map_or(0, |v| v.len()) + 1;
        if told.len() == MAX_CONDITIONS || size > budget {
            break;
        }
        budget -= size;
        told.push(condition);
    }
    if told.len() < total {
        tracing::warn!(
            found = total,
            told = told.len(),
            "more fleet conditions than one event carries: the first by key are told"
        );
    }
    Ok(told)
}

/// Tell the record the conditions this pass found, if they differ from what
/// it was last told: one `inventory.fleet.conditions` event with the whole
/// set, and `inventory.conditions` becomes that set. Returns the event's
/// version (none: nothing changed, nothing written).
pub(crate) async fn tell(tx: &mut PgConnection, found: Found) -> Result<Option<i64>, Error> {
    let desired = bounded(found)?;
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT key, kind, node, module, stateful, message FROM inventory.conditions ORDER BY key",
    )
    .fetch_all(&mut *tx)
    .await?;
    let unchanged = rows.len() == desired.len()
        && rows.iter().zip(&desired).all(|(r, c)| {
            r.key == c.key
                && r.kind == c.kind
                && r.node.as_deref() == c.node.as_ref().map(NodeId::as_str)
                && r.module == c.module
                && r.stateful == c.stateful
                && r.message == c.message
        });
    if unchanged {
        return Ok(None);
    }
    let version: i64 = sqlx::query_scalar("SELECT nextval('inventory.conditions_version')")
        .fetch_one(&mut *tx)
        .await?;
    sqlx::query("DELETE FROM inventory.conditions")
        .execute(&mut *tx)
        .await?;
    let n = desired.len();
    let (mut keys, mut kinds, mut nodes, mut modules, mut stateful, mut messages) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    for c in &desired {
        keys.push(c.key.as_str());
        kinds.push(c.kind.as_str());
        nodes.push(c.node.as_ref().map(NodeId::as_str));
        modules.push(c.module.as_deref());
        stateful.push(c.stateful);
        messages.push(c.message.as_str());
    }
    if n > 0 {
        sqlx::query(
            "INSERT INTO inventory.conditions (key, kind, node, module, stateful, message, version) \
             SELECT u.key, u.kind, u.node, u.module, u.stateful, u.message, $7 \
             FROM UNNEST($1::text[], $2::text[], $3::text[], $4::text[], $5::bool[], $6::text[]) \
                  AS u(key, kind, node, module, stateful, message)",
        )
        .bind(&keys)
        .bind(&kinds)
        .bind(&nodes)
        .bind(&modules)
        .bind(&stateful)
        .bind(&messages)
        .bind(version)
        .execute(&mut *tx)
        .await?;
    }
    let event = RecordEvent::new(RecordKind::FleetConditions(FleetConditions {
        version,
        conditions: desired,
    }));
    outbox::record(tx, SCHEMA, &event).await?;
    Ok(Some(version))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unplaced(i: usize, message: &str) -> (String, Condition) {
        (
            format!("unplaced:m{i:05}"),
            Condition {
                kind: "placement_unsatisfied",
                node: None,
                module: Some(format!("m{i:05}")),
                stateful: false,
                message: message.to_owned(),
            },
        )
    }

    #[test]
    fn a_set_too_large_for_one_event_is_cut_the_same_way_every_time() {
        let message = "x".repeat(400);
        let found: Found = (0..2000).map(|i| unplaced(i, &message)).collect();
        let told = bounded(found.clone()).unwrap();
        assert!(told.len() < 2000 && told.len() > 500, "{}", told.len());
        assert_eq!(told, bounded(found).unwrap(), "deterministic");
        assert_eq!(told[0].key, "unplaced:m00000", "the first by key");
        let event = RecordEvent::new(RecordKind::FleetConditions(FleetConditions {
            version: i64::MAX,
            conditions: told,
        }));
        let bytes = event.encode();
        assert!(bytes.len() <= MAX_EVENT_BYTES, "{}", bytes.len());
        assert_eq!(RecordEvent::decode(&bytes).unwrap(), event);
    }

    #[test]
    fn a_small_set_is_told_whole_and_a_bad_node_is_corrupt() {
        let found: Found = (0..3).map(|i| unplaced(i, "m")).collect();
        assert_eq!(bounded(found).unwrap().len(), 3);
        let mut bad = Found::new();
        bad.insert(
            "pinned_unreachable:db".into(),
            Condition {
                kind: "pinned_unreachable",
                node: Some("Not A Node".into()),
                module: Some("db".into()),
                stateful: true,
                message: "m".into(),
            },
        );
        assert!(matches!(bounded(bad), Err(Error::Corrupt { .. })));
    }
}
