//! Reports and record events: what nodes applied, re-sending to nodes that are
//! behind, and nodes as inventory describes them.

use std::collections::BTreeMap;

use mesh_plumbing::applied;
use mesh_plumbing::outbox;
use mesh_protocol::{
    Applied, Declaration, DeclarationItems, Envelope, Hello, NodeId, NodeLabelsChanged,
    ProtocolRange, Report, Section,
};
use sqlx::PgConnection;
use sqlx::types::Json;

use crate::reconcile::{Scope, reconcile};
use crate::{ConfigSettings, Error, SCHEMA};

fn to_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn to_u64(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

pub(crate) async fn handle(
    tx: &mut PgConnection,
    reports: &[Envelope<Report>],
    settings: &ConfigSettings,
) -> Result<(), Error> {
    let mut heartbeats: BTreeMap<&str, i64> = BTreeMap::new();
    let mut applied = Vec::new();
    for env in reports {
        match &env.body {
            // An agent this controller cannot speak to is declared nothing
            // (inventory records why; decision 0020).
            Report::Hello(h) if h.refusal(ProtocolRange::THIS).is_some() => {}
            Report::Hello(h) => hello(tx, &env.node, h).await?,
            Report::Heartbeat(hb) => {
                let g = to_i64(hb.applied.get(&Section::Config).copied().unwrap_or(0));
                let entry = heartbeats.entry(env.node.as_str()).or_insert(0);
                *entry = (*entry).max(g);
            }
            Report::Applied(a) if a.section == Some(Section::Config) => applied.push((env, a)),
            Report::Applied(_) | Report::Units(_) => {}
        }
    }
    heartbeat_batch(tx, heartbeats, settings).await?;
    applied_batch(tx, &applied).await
}

/// On hello, a node behind its declared generation is sent the current section
/// again at once. A node ahead of it (the database was restored from an older
/// backup) is declared the same items under a generation above its own, so it
/// does not ignore what follows.
async fn hello(tx: &mut PgConnection, node: &NodeId, hello: &Hello) -> Result<(), Error> {
    let reported = to_i64(hello.applied.get(&Section::Config).copied().unwrap_or(0));
    let row: Option<(i64, Json<DeclarationItems>)> =
        sqlx::query_as("SELECT generation, items FROM config.sections WHERE node = $1 FOR UPDATE")
            .bind(node.as_str())
            .fetch_optional(&mut *tx)
            .await?;
    let Some((generation, items)) = row else {
        return Ok(());
    };
    if reported == generation {
        sqlx::query("UPDATE config.sections SET applied_generation = $2 WHERE node = $1 AND applied_generation < $2")
            .bind(node.as_str())
            .bind(reported)
            .execute(&mut *tx)
            .await?;
        return Ok(());
    }
    let generation = if reported > generation {
        reported + 1
    } else {
        generation
    };
    sqlx::query(
        "UPDATE config.sections SET generation = $2, last_sent_at = now(), \
         declared_at = CASE WHEN generation = $2 THEN declared_at ELSE now() END, \
         applied_generation = greatest(applied_generation, least($3, $2)) WHERE node = $1",
    )
    .bind(node.as_str())
    .bind(generation)
    .bind(reported)
    .execute(&mut *tx)
    .await?;
    let declaration = Declaration {
        section: Section::Config,
        generation: to_u64(generation),
        items: items.0,
    };
    outbox::declare(tx, SCHEMA, node, declaration).await?;
    Ok(())
}

/// Heartbeats: one statement records newer applied generations and finds the
/// nodes behind whose section was last sent longer than `resend_after` ago
/// (marking it sent now); one bulk insert re-declares them. A row marked sent
/// by this statement is the one whose `last_sent_at` is now the transaction's
/// `now()` (it was older than `now()` minus `resend_after` before).
async fn heartbeat_batch(
    tx: &mut PgConnection,
    applied: BTreeMap<&str, i64>,
    settings: &ConfigSettings,
) -> Result<(), Error> {
    if applied.is_empty() {
        return Ok(());
    }
    let (nodes, generations): (Vec<&str>, Vec<i64>) = applied.into_iter().unzip();
    let touched: Vec<(String, i64, Json<DeclarationItems>, bool)> = sqlx::query_as(
        "UPDATE config.sections AS s SET \
           last_sent_at = CASE WHEN r.applied < s.generation \
                               AND s.last_sent_at < now() - make_interval(secs => $3) \
                          THEN now() ELSE s.last_sent_at END, \
           applied_generation = greatest(s.applied_generation, r.applied) \
         FROM UNNEST($1::text[], $2::bigint[]) AS r(node, applied) \
         WHERE s.node = r.node \
           AND ((r.applied < s.generation AND s.last_sent_at < now() - make_interval(secs => $3)) \
                OR r.applied > s.applied_generation) \
         RETURNING s.node, s.generation, s.items, \
           (r.applied < s.generation AND s.last_sent_at = now())",
    )
    .bind(&nodes)
    .bind(&generations)
    .bind(settings.resend_after.as_secs_f64())
    .fetch_all(&mut *tx)
    .await?;
    let resend: Vec<_> = touched
        .into_iter()
        .filter(|(_, _, _, resend)| *resend)
        .map(|(node, generation, items, _)| (node, generation, items))
        .collect();
    if resend.is_empty() {
        return Ok(());
    }
    let mut declarations = Vec::with_capacity(resend.len());
    for (node, generation, items) in resend {
        let node = NodeId::parse(&node).map_err(|e| Error::Corrupt {
            what: "node id".into(),
            reason: e.to_string(),
        })?;
        let declaration = Declaration {
            section: Section::Config,
            generation: to_u64(generation),
            items: items.0,
        };
        declarations.push((node, declaration));
    }
    tracing::debug!(
        nodes = declarations.len(),
        "re-sending config sections to nodes behind"
    );
    outbox::declare_many(tx, SCHEMA, declarations).await?;
    Ok(())
}

/// Applied reports of the config section, one statement per batch. The applied
/// generation only advances on outcome `applied`; outcome and error are the
/// newest report's unless it concerns an older generation than the recorded one.
async fn applied_batch(
    tx: &mut PgConnection,
    reports: &[(&Envelope<Report>, &Applied)],
) -> Result<(), Error> {
    let rows = applied::fold(reports, |env, _| Some(env.node.as_str()));
    if rows.is_empty() {
        return Ok(());
    }
    let (mut nodes, mut applied, mut outcomes, mut generations, mut errors) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (node, row) in rows {
        nodes.push(node);
        applied.push(row.applied);
        outcomes.push(row.outcome);
        generations.push(row.generation);
        errors.push(row.error);
    }
    sqlx::query(
        "UPDATE config.sections AS s SET \
           applied_generation = greatest(s.applied_generation, coalesce(u.applied, 0)), \
           applied_outcome = CASE WHEN u.generation IS NULL OR s.applied_outcome_generation IS NULL \
             OR u.generation >= s.applied_outcome_generation THEN u.outcome ELSE s.applied_outcome END, \
           applied_error = CASE WHEN u.generation IS NULL OR s.applied_outcome_generation IS NULL \
             OR u.generation >= s.applied_outcome_generation THEN u.error ELSE s.applied_error END, \
           applied_outcome_generation = CASE WHEN u.generation IS NULL OR s.applied_outcome_generation IS NULL \
             OR u.generation >= s.applied_outcome_generation THEN u.generation ELSE s.applied_outcome_generation END, \
           applied_at = now() \
         FROM UNNEST($1::text[], $2::bigint[], $3::text[], $4::bigint[], $5::text[]) \
              AS u(node, applied, outcome, generation, error) \
         WHERE s.node = u.node",
    )
    .bind(&nodes)
    .bind(&applied)
    .bind(&outcomes)
    .bind(&generations)
    .bind(&errors)
    .execute(&mut *tx)
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
