//! Re-sending the inventory section to nodes that are behind on it, as config
//! does for its section: at once on hello, at most once per `resend_after` on
//! heartbeats. A lost or dropped declaration is repaired by that timer.

use std::collections::BTreeMap;
use std::time::Duration;

use mesh_plumbing::outbox;
use mesh_protocol::{Declaration, DeclarationItems, Envelope, Hello, NodeId, Report, Section};
use sqlx::PgConnection;
use sqlx::types::Json;

use crate::reports::to_i64;
use crate::{Error, SCHEMA};

fn to_u64(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

/// On hello, a node behind its declared inventory generation is sent the section
/// again. A node ahead of it (the database was restored from an older backup) is
/// declared the same items under a generation above its own, so it does not
/// ignore what follows.
pub(crate) async fn on_hello(
    tx: &mut PgConnection,
    node: &NodeId,
    hello: &Hello,
) -> Result<(), Error> {
    let reported = to_i64(hello.applied.get(&Section::Inventory).copied().unwrap_or(0));
    let row: Option<(i64, Json<DeclarationItems>)> = sqlx::query_as(
        "SELECT generation, items FROM inventory.sections WHERE node = $1 FOR UPDATE",
    )
    .bind(node.as_str())
    .fetch_optional(&mut *tx)
    .await?;
    let Some((generation, items)) = row else {
        return Ok(());
    };
    if reported == generation {
        return Ok(());
    }
    let generation = if reported > generation {
        reported + 1
    } else {
        generation
    };
    sqlx::query(
        "UPDATE inventory.sections SET generation = $2, last_sent_at = now() WHERE node = $1",
    )
    .bind(node.as_str())
    .bind(generation)
    .execute(&mut *tx)
    .await?;
    let declaration = Declaration {
        section: Section::Inventory,
        generation: to_u64(generation),
        items: items.0,
    };
    outbox::declare(tx, SCHEMA, node, declaration).await?;
    Ok(())
}

/// Heartbeats: one statement finds the nodes behind whose section was last sent
/// longer than `resend_after` ago (and marks it sent now); one bulk insert
/// re-declares them.
pub(crate) async fn on_heartbeats(
    tx: &mut PgConnection,
    heartbeats: &[&Envelope<Report>],
    resend_after: Duration,
) -> Result<(), Error> {
    let mut applied: BTreeMap<&str, i64> = BTreeMap::new();
    for env in heartbeats {
        if let Report::Heartbeat(hb) = &env.body {
            let g = to_i64(hb.applied.get(&Section::Inventory).copied().unwrap_or(0));
            let entry = applied.entry(env.node.as_str()).or_insert(0);
            *entry = (*entry).max(g);
        }
    }
    if applied.is_empty() {
        return Ok(());
    }
    let (nodes, generations): (Vec<&str>, Vec<i64>) = applied.into_iter().unzip();
    let resend: Vec<(String, i64, Json<DeclarationItems>)> = sqlx::query_as(
        "UPDATE inventory.sections AS s SET last_sent_at = now() \
         FROM UNNEST($1::text[], $2::bigint[]) AS r(node, applied) \
         WHERE s.node = r.node AND r.applied < s.generation \
           AND s.last_sent_at < now() - make_interval(secs => $3) \
         RETURNING s.node, s.generation, s.items",
    )
    .bind(&nodes)
    .bind(&generations)
    .bind(resend_after.as_secs_f64())
    .fetch_all(&mut *tx)
    .await?;
    if resend.is_empty() {
        return Ok(());
    }
    let mut declarations = Vec::with_capacity(resend.len());
    for (node, generation, items) in resend {
        let node = NodeId::parse(&node).map_err(|e| Error::Corrupt {
            node: node.clone(),
            reason: e.to_string(),
        })?;
        declarations.push((
            node,
            Declaration {
                section: Section::Inventory,
                generation: to_u64(generation),
                items: items.0,
            },
        ));
    }
    tracing::debug!(
        nodes = declarations.len(),
        "re-sending inventory sections to nodes behind"
    );
    outbox::declare_many(tx, SCHEMA, declarations).await?;
    Ok(())
}
