//! Fleet alerts: what the reconcile wants open (placement unsatisfied, pinned
//! module on an unreachable node, re-placement paused), kept in
//! `inventory.alerts` exactly as the last pass saw them.

use std::collections::BTreeMap;

use sqlx::PgConnection;

use crate::Error;

/// One alert as the reconcile wants it open.
pub(crate) struct Alert {
    pub kind: &'static str,
    pub node: Option<String>,
    pub module: Option<String>,
    pub message: String,
}

/// Make the open alerts exactly `alerts`: new ones raised, gone ones cleared,
/// the rest keep when they were raised.
pub(crate) async fn sync(
    tx: &mut PgConnection,
    alerts: BTreeMap<String, Alert>,
) -> Result<(), Error> {
    let keys: Vec<&str> = alerts.keys().map(String::as_str).collect();
    sqlx::query("DELETE FROM inventory.alerts WHERE NOT (key = ANY($1))")
        .bind(&keys)
        .execute(&mut *tx)
        .await?;
    for (key, a) in &alerts {
        sqlx::query(
            "INSERT INTO inventory.alerts AS a (key, kind, node, module, message) VALUES ($1, $2, $3, $4, $5) \
             ON CONFLICT (key) DO UPDATE SET message = excluded.message, node = excluded.node, \
             updated_at = CASE WHEN a.message = excluded.message THEN a.updated_at ELSE now() END",
        )
        .bind(key)
        .bind(a.kind)
        .bind(&a.node)
        .bind(&a.module)
        .bind(&a.message)
        .execute(&mut *tx)
        .await?;
    }
    Ok(())
}
