//! What provisioning learns: modules from the record (`inventory.module.*`)
//! and the `resources` reports of provider nodes.

use std::collections::BTreeMap;

use mesh_protocol::{Envelope, ModuleEvent, Report, ResourceStatus};
use sqlx::PgConnection;
use sqlx::types::Json;
use uuid::Uuid;

use crate::Error;

/// Keep the newest event of each module (by version); whether any changed.
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
    let nodes: Vec<Vec<String>> = columns
        .nodes
        .into_iter()
        .map(|n| n.into_iter().map(str::to_owned).collect())
        .collect();
    let nodes: Vec<_> = nodes.into_iter().map(Json).collect();
    let requires = ModuleEvent::column(&newest, |p| Json(p.requires.clone()));
    let provides = ModuleEvent::column(&newest, |p| Json(p.provides.clone()));
    let changed: Vec<String> = sqlx::query_scalar(
        "INSERT INTO provisioning.modules AS m (module, version, removed, nodes, requires, provides) \
         SELECT u.module, u.version, u.removed, ARRAY(SELECT jsonb_array_elements_text(u.nodes)), \
                u.requires, u.provides \
         FROM UNNEST($1::text[], $2::bigint[], $3::bool[], $4::jsonb[], $5::jsonb[], $6::jsonb[]) \
              AS u(module, version, removed, nodes, requires, provides) ORDER BY u.module \
         ON CONFLICT (module) DO UPDATE SET version = excluded.version, removed = excluded.removed, \
             nodes = excluded.nodes, requires = excluded.requires, provides = excluded.provides \
         WHERE m.version < excluded.version RETURNING module",
    )
    .bind(&modules)
    .bind(&versions)
    .bind(&removed)
    .bind(&nodes)
    .bind(&requires)
    .bind(&provides)
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

/// Record the `resources` reports of a batch: each node's whole list
/// replaces its rows, of the grants its provider module serves only (a node
/// cannot speak for another's grants). One query finds which reported
/// grants each node serves, one upsert writes them (a node's later report
/// in the batch wins; a grant repeated in a report counts with its last
/// entry), one delete forgets what a node no longer reports. Whether any
/// report was recorded.
pub(crate) async fn resources(
    tx: &mut PgConnection,
    reports: &[Envelope<Report>],
) -> Result<bool, Error> {
    // The last report of each node, and in it the last entry of each grant.
    let mut last: BTreeMap<&str, BTreeMap<Uuid, &ResourceStatus>> = BTreeMap::new();
    for env in reports {
        if let Report::Resources(body) = &env.body {
            let entries = body.resources.iter().map(|s| (s.grant, s)).collect();
            last.insert(env.node.as_str(), entries);
        }
    }
    if last.is_empty() {
        return Ok(false);
    }
    let (mut grants, mut nodes) = (Vec::new(), Vec::new());
    for (node, entries) in &last {
        for grant in entries.keys() {
            grants.push(*grant);
            nodes.push(*node);
        }
    }
    let served: Vec<(Uuid, String)> = sqlx::query_as(
        "SELECT u.grant_id, u.node FROM UNNEST($1::uuid[], $2::text[]) AS u(grant_id, node) \
         JOIN provisioning.grants g ON g.id = u.grant_id \
         JOIN provisioning.modules m ON m.module = g.provider AND NOT m.removed \
         WHERE u.node = ANY(m.nodes)",
    )
    .bind(&grants)
    .bind(&nodes)
    .fetch_all(&mut *tx)
    .await?;
    let ignored = grants.len() - served.len();
    if ignored > 0 {
        tracing::debug!(
            ignored,
            "resources reported by nodes whose provider module does not serve the grant: ignored"
        );
    }
    let n = served.len();
    let (mut ids, mut at, mut states, mut versions, mut reasons, mut recreated) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    for (grant, node) in &served {
        let Some(s) = last.get(node.as_str()).and_then(|e| e.get(grant)) else {
            continue;
        };
        ids.push(*grant);
        at.push(node.as_str());
        states.push(s.state.as_str());
        versions.push(s.credential_version);
        reasons.push(s.reason.as_deref());
        recreated.push(s.recreated);
    }
    let reporting: Vec<&str> = last.keys().copied().collect();
    sqlx::query(
        "DELETE FROM provisioning.statuses s WHERE s.node = ANY($1) AND NOT EXISTS \
         (SELECT 1 FROM UNNEST($2::uuid[], $3::text[]) AS u(grant_id, node) \
          WHERE u.grant_id = s.grant_id AND u.node = s.node)",
    )
    .bind(&reporting)
    .bind(&ids)
    .bind(&at)
    .execute(&mut *tx)
    .await?;
    if !ids.is_empty() {
        sqlx::query(
            "INSERT INTO provisioning.statuses AS s (grant_id, node, state, credential_version, \
                 reason, recreated, reported_at) \
             SELECT u.grant_id, u.node, u.state, u.version, u.reason, u.recreated, now() \
             FROM UNNEST($1::uuid[], $2::text[], $3::text[], $4::bigint[], $5::text[], $6::bool[]) \
                  AS u(grant_id, node, state, version, reason, recreated) \
             ON CONFLICT (grant_id, node) DO UPDATE SET state = excluded.state, \
                 credential_version = excluded.credential_version, reason = excluded.reason, \
                 recreated = excluded.recreated, reported_at = now()",
        )
        .bind(&ids)
        .bind(&at)
        .bind(&states)
        .bind(&versions)
        .bind(&reasons)
        .bind(&recreated)
        .execute(&mut *tx)
        .await?;
    }
    Ok(true)
}
