//! Re-sending the inventory section to nodes that are behind on it, as config
//! does for its section: at once on hello, at most once per `resend_after` on
//! heartbeats. A lost or dropped declaration is repaired by that timer. Which
//! nodes are behind on heartbeats is found by the heartbeat batch's one
//! statement (`reports::heartbeat_batch`); `resend` declares them.

use mesh_plumbing::outbox;
use mesh_protocol::{Declaration, DeclarationItems, Hello, NodeId, Section};
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

/// Declare the inventory section again to nodes a heartbeat batch found behind
/// (node, generation, items), in one bulk insert.
pub(crate) async fn resend(
    tx: &mut PgConnection,
    behind: Vec<(String, i64, DeclarationItems)>,
) -> Result<(), Error> {
    if behind.is_empty() {
        return Ok(());
    }
    let mut declarations = Vec::with_capacity(behind.len());
    for (node, generation, items) in behind {
        let node = NodeId::parse(&node).map_err(|e| Error::Corrupt {
            node: node.clone(),
            reason: e.to_string(),
        })?;
        declarations.push((
            node,
            Declaration {
                section: Section::Inventory,
                generation: to_u64(generation),
                items,
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
