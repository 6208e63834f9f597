//! What delivery learns: from nodes, their units (`units`: which revision runs
//! where, in which state) and the outcome of their delivery section's
//! artifacts (`applied`); from the record, where modules run
//! (`inventory.module.placed` / `.removed`) and each replica's health
//! (`observability.module.health`). Each keeps the newest (the report's `seq`,
//! the event's `version`), so a redelivered or late message changes nothing.

use mesh_protocol::{Envelope, RecordEvent, RecordKind, Report, Section};
use sqlx::PgConnection;

use crate::Error;

/// Units and applied reports of a batch.
pub(crate) async fn reports(
    tx: &mut PgConnection,
    reports: &[Envelope<Report>],
) -> Result<bool, Error> {
    let mut changed = false;
    for env in reports {
        match &env.body {
            Report::Units(body) => {
                let seq = i64::try_from(env.seq).unwrap_or(i64::MAX);
                let newer: Option<i64> = sqlx::query_scalar(
                    "INSERT INTO delivery.unit_reports AS u (node, seq) VALUES ($1, $2) \
                     ON CONFLICT (node) DO UPDATE SET seq = excluded.seq WHERE u.seq < excluded.seq \
                     RETURNING seq",
                )
                .bind(env.node.as_str())
                .bind(seq)
                .fetch_optional(&mut *tx)
                .await?;
                if newer.is_none() {
                    continue;
                }
                sqlx::query("DELETE FROM delivery.units WHERE node = $1")
                    .bind(env.node.as_str())
                    .execute(&mut *tx)
                    .await?;
                // One statement for the node's whole list (names are unique
                // per node: the agent's declaration says so).
                let names: Vec<&str> = body.units.iter().map(|u| u.name.as_str()).collect();
                let modules: Vec<&str> = body.units.iter().map(|u| u.module.as_str()).collect();
                let states: Vec<&str> = body.units.iter().map(|u| u.state.as_str()).collect();
                let revisions: Vec<Option<uuid::Uuid>> =
                    body.units.iter().map(|u| u.revision).collect();
                let restarts: Vec<i32> = body
                    .units
                    .iter()
                    .map(|u| i32::try_from(u.restarts).unwrap_or(i32::MAX))
                    .collect();
                let started: Vec<Option<chrono::DateTime<chrono::Utc>>> =
                    body.units.iter().map(|u| u.started_at).collect();
                sqlx::query(
                    "INSERT INTO delivery.units (node, unit, module, state, revision, restarts, started_at) \
                     SELECT $1, u.unit, u.module, u.state, u.revision, u.restarts, u.started_at \
                     FROM UNNEST($2::text[], $3::text[], $4::text[], $5::uuid[], $6::int[], $7::timestamptz[]) \
                          AS u(unit, module, state, revision, restarts, started_at) \
                     ON CONFLICT (node, unit) DO NOTHING",
                )
                .bind(env.node.as_str())
                .bind(&names)
                .bind(&modules)
                .bind(&states)
                .bind(&revisions)
                .bind(&restarts)
                .bind(&started)
                .execute(&mut *tx)
                .await?;
                changed = true;
            }
            Report::Applied(body) if body.section == Some(Section::Delivery) => {
                let Some(generation) = body.generation else {
                    continue;
                };
                let generation = i64::try_from(generation).unwrap_or(i64::MAX);
                for item in &body.items {
                    let Some(digest) = item.item.strip_prefix("artifact:") else {
                        continue;
                    };
                    let error = item.error.as_ref().map(|e| {
                        e.chars()
                            .take(mesh_protocol::MAX_ERROR_CHARS)
                            .collect::<String>()
                    });
                    sqlx::query(
                        "INSERT INTO delivery.artifact_outcomes AS a (node, digest, generation, ok, error) \
                         VALUES ($1, $2, $3, $4, $5) ON CONFLICT (node, digest) DO UPDATE SET \
                         generation = excluded.generation, ok = excluded.ok, error = excluded.error \
                         WHERE a.generation <= excluded.generation",
                    )
                    .bind(env.node.as_str())
                    .bind(digest)
                    .bind(generation)
                    .bind(item.ok)
                    .bind(&error)
                    .execute(&mut *tx)
                    .await?;
                }
                changed = true;
            }
            _ => {}
        }
    }
    Ok(changed)
}

/// Module placements and replica health.
pub(crate) async fn events(tx: &mut PgConnection, events: &[&RecordEvent]) -> Result<bool, Error> {
    let mut changed = false;
    for event in events {
        match &event.kind {
            RecordKind::ModulePlaced(p) => {
                let nodes: Vec<&str> = p.nodes.iter().map(|n| n.as_str()).collect();
                sqlx::query(
                    "INSERT INTO delivery.modules AS m (module, nodes, version) VALUES ($1, $2, $3) \
                     ON CONFLICT (module) DO UPDATE SET nodes = excluded.nodes, version = excluded.version \
                     WHERE m.version < excluded.version",
                )
                .bind(&p.module)
                .bind(&nodes)
                .bind(p.version)
                .execute(&mut *tx)
                .await?;
                changed = true;
            }
            RecordKind::ModuleRemoved(r) => {
                sqlx::query(
                    "INSERT INTO delivery.modules AS m (module, nodes, version) VALUES ($1, '{}', $2) \
                     ON CONFLICT (module) DO UPDATE SET nodes = '{}', version = excluded.version \
                     WHERE m.version < excluded.version",
                )
                .bind(&r.module)
                .bind(r.version)
                .execute(&mut *tx)
                .await?;
                changed = true;
            }
            RecordKind::ModuleHealth(h) => {
                for replica in &h.replicas {
                    sqlx::query(
                        "INSERT INTO delivery.health AS x (module, node, health, reason, version) \
                         VALUES ($1, $2, $3, $4, $5) ON CONFLICT (module, node) DO UPDATE SET \
                         health = excluded.health, reason = excluded.reason, version = excluded.version \
                         WHERE x.version <= excluded.version",
                    )
                    .bind(&h.module)
                    .bind(replica.node.as_str())
                    .bind(replica.health.as_str())
                    .bind(&replica.reason)
                    .bind(h.version)
                    .execute(&mut *tx)
                    .await?;
                }
                changed = true;
            }
            _ => {
                tracing::debug!(key = %event.routing_key(), "not an event delivery acts on");
            }
        }
    }
    Ok(changed)
}
