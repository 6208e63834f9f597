//! Version skew (decision 0020): a hello states which envelope versions the
//! agent speaks. A node whose agent shares none with this controller is
//! refused: it is recorded with the reason (its view shows it), never
//! scheduled, told nothing on the record, and declared nothing, until a hello
//! this controller can speak arrives.

use chrono::{DateTime, Utc};
use mesh_protocol::{Envelope, Hello, Labels, NodeId, RecordKind, Report};
use sqlx::PgConnection;
use sqlx::types::Json;

use crate::Error;
use crate::nodes::{LabelTrust, emit, to_i64};

/// Record a refused hello: the node's facts (a node first heard of now gets
/// its row, so that `GET /v1/nodes/{id}` says why), its range and the reason.
/// Liveness, labels of a known node, generations and sections are untouched.
pub(crate) async fn refuse(
    tx: &mut PgConnection,
    env: &Envelope<Report>,
    hello: &Hello,
    reason: &str,
    heard_at: DateTime<Utc>,
) -> Result<(), Error> {
    let range = hello.protocol();
    tracing::warn!(node = %env.node, agent_version = hello.agent_version, reason, "refused an agent");
    sqlx::query(
        "INSERT INTO inventory.nodes (id, hostname, arch, cpus, memory_bytes, agent_version, public_key, \
         reported_labels, last_seen, hello_at, last_seq, heard_at, protocol_min, protocol_max, refused) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $9, $10, $11, $12, $13, $14) \
         ON CONFLICT (id) DO UPDATE SET agent_version = excluded.agent_version, \
         protocol_min = excluded.protocol_min, protocol_max = excluded.protocol_max, \
         refused = excluded.refused",
    )
    .bind(env.node.as_str())
    .bind(&hello.hostname)
    .bind(&hello.arch)
    .bind(i64::from(hello.cpus))
    .bind(to_i64(hello.memory_bytes))
    .bind(&hello.agent_version)
    .bind(&hello.public_key)
    .bind(Json(&hello.labels))
    .bind(env.sent_at.min(Utc::now()))
    .bind(to_i64(env.seq))
    .bind(heard_at)
    .bind(i32::from(range.min))
    .bind(i32::from(range.max))
    .bind(reason)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Whether `node` is refused now (locks its row, if any, before the hello is
/// handled).
pub(crate) async fn was_refused(tx: &mut PgConnection, node: &NodeId) -> Result<bool, Error> {
    let refused: Option<Option<String>> =
        sqlx::query_scalar("SELECT refused FROM inventory.nodes WHERE id = $1 FOR UPDATE")
            .bind(node.as_str())
            .fetch_optional(&mut *tx)
            .await?;
    Ok(matches!(refused, Some(Some(_))))
}

/// After a hello this controller can speak was handled: keep the agent's range
/// and lift a refusal. A node that was refused joins the record now (config
/// and the others learn of it as of a first hello).
pub(crate) async fn accepted(
    tx: &mut PgConnection,
    node: &NodeId,
    hello: &Hello,
    was_refused: bool,
    trust: &LabelTrust,
) -> Result<(), Error> {
    let range = hello.protocol();
    let row: Option<(Json<Labels>, Json<Labels>, i64)> = sqlx::query_as(
        "UPDATE inventory.nodes SET protocol_min = $2, protocol_max = $3, refused = NULL \
         WHERE id = $1 RETURNING reported_labels, operator_labels, version",
    )
    .bind(node.as_str())
    .bind(i32::from(range.min))
    .bind(i32::from(range.max))
    .fetch_optional(&mut *tx)
    .await?;
    if was_refused && let Some((reported, operator, version)) = row {
        tracing::info!(%node, "agent speaks this controller's protocol again; refusal lifted");
        let labels = trust.effective(node.as_str(), &reported.0, &operator.0);
        emit(tx, RecordKind::NodeJoined, node, labels, version).await?;
    }
    Ok(())
}
