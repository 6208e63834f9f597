//! Credentials of resource grants (decision 0039): provisioning tells them on
//! the record (`provisioning.credentials.issued`, in config's own at-rest
//! form under the secrets master key) and config keeps each as a secret
//! managed by provisioning, granted to the modules the event names (the
//! consumer as `grant-<name>.env`, the provider), so they are sealed to
//! exactly those modules' nodes like every secret; `.withdrawn` deletes it
//! and its files leave every node. Operators cannot write, grant or delete
//! a managed secret, nor take a `grant-` file name for their own grants.

use base64::Engine as _;
use mesh_protocol::{CredentialsIssued, CredentialsWithdrawn};
use sqlx::PgConnection;

use crate::crypt;
use crate::secrets::{Keyring, MANAGED_BY};
use crate::{Error, reports};

fn b64(field: &str, s: &str) -> Result<Vec<u8>, Error> {
    base64::engine::general_purpose::STANDARD
        .decode(s)
        .map_err(|e| Error::Invalid {
            field: field.to_owned(),
            reason: format!("not base64: {e}"),
        })
}

/// Keep an issued credential (newer versions only) and grant it to the
/// modules named; the nodes of those modules are reconciled.
pub(crate) async fn issued(
    tx: &mut PgConnection,
    body: &CredentialsIssued,
    keyring: &Keyring,
) -> Result<(), Error> {
    let name = body.secret.as_str();
    let wrapped = b64("body.wrapped_key", &body.wrapped_key)?;
    let ct = b64("body.ciphertext", &body.ciphertext)?;
    // It must open here, now: a credential config cannot deliver is refused
    // (dead-lettered with the reason), never stored.
    let master = keyring.key(&body.key_id)?;
    let dk = crypt::unwrap_key(&master, name, &wrapped)?;
    crypt::decrypt_value(&dk, name, body.version, &ct)?;

    let current: Option<(i64, Option<String>)> =
        sqlx::query_as("SELECT version, managed_by FROM config.secrets WHERE name = $1 FOR UPDATE")
            .bind(name)
            .fetch_optional(&mut *tx)
            .await?;
    match current {
        Some((_, by)) if by.as_deref() != Some(MANAGED_BY) => {
            return Err(Error::Conflict(format!(
                "secret `{name}` exists and is not managed by provisioning"
            )));
        }
        Some((v, _)) if v >= body.version => {
            tracing::debug!(
                secret = name,
                version = body.version,
                "an older credential; ignored"
            );
            return Ok(());
        }
        _ => {}
    }
    // One data key per issue: the older versions go (a managed secret keeps
    // only its newest).
    sqlx::query(
        "INSERT INTO config.secrets (name, version, key_id, wrapped_key, created_by, managed_by) \
         VALUES ($1, $2, $3, $4, $5, $5) \
         ON CONFLICT (name) DO UPDATE SET version = excluded.version, key_id = excluded.key_id, \
         wrapped_key = excluded.wrapped_key, updated_at = now()",
    )
    .bind(name)
    .bind(body.version)
    .bind(&body.key_id)
    .bind(&wrapped)
    .bind(MANAGED_BY)
    .execute(&mut *tx)
    .await?;
    sqlx::query("DELETE FROM config.secret_versions WHERE secret = $1")
        .bind(name)
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "INSERT INTO config.secret_versions (secret, version, ciphertext, created_by) \
         VALUES ($1, $2, $3, $4)",
    )
    .bind(name)
    .bind(body.version)
    .bind(&ct)
    .bind(MANAGED_BY)
    .execute(&mut *tx)
    .await?;
    // The grants are exactly the files the event names.
    let before = modules_of(tx, name).await?;
    sqlx::query("DELETE FROM config.grants WHERE secret = $1")
        .bind(name)
        .execute(&mut *tx)
        .await?;
    for f in &body.files {
        let taken: Option<String> =
            sqlx::query_scalar("SELECT secret FROM config.grants WHERE module = $1 AND file = $2")
                .bind(&f.module)
                .bind(&f.file)
                .fetch_optional(&mut *tx)
                .await?;
        if let Some(other) = taken {
            return Err(Error::Conflict(format!(
                "module `{}` already receives secret `{other}` as file `{}`",
                f.module, f.file
            )));
        }
        sqlx::query(
            "INSERT INTO config.grants (module, secret, file, created_by) VALUES ($1, $2, $3, $4)",
        )
        .bind(&f.module)
        .bind(name)
        .bind(&f.file)
        .bind(MANAGED_BY)
        .execute(&mut *tx)
        .await?;
    }
    let mut modules = before;
    modules.extend(body.files.iter().map(|f| f.module.clone()));
    reconcile_modules(tx, &modules, keyring).await
}

/// Delete a withdrawn credential and its grants; its files leave the nodes.
pub(crate) async fn withdrawn(
    tx: &mut PgConnection,
    body: &CredentialsWithdrawn,
    keyring: &Keyring,
) -> Result<(), Error> {
    let modules = modules_of(tx, &body.secret).await?;
    let gone = sqlx::query("DELETE FROM config.secrets WHERE name = $1 AND managed_by = $2")
        .bind(&body.secret)
        .bind(MANAGED_BY)
        .execute(&mut *tx)
        .await?
        .rows_affected();
    if gone == 0 {
        tracing::debug!(secret = %body.secret, "withdrawn credential not held; nothing to do");
        return Ok(());
    }
    reconcile_modules(tx, &modules, keyring).await
}

async fn modules_of(tx: &mut PgConnection, secret: &str) -> Result<Vec<String>, Error> {
    Ok(
        sqlx::query_scalar("SELECT module FROM config.grants WHERE secret = $1")
            .bind(secret)
            .fetch_all(&mut *tx)
            .await?,
    )
}

async fn reconcile_modules(
    tx: &mut PgConnection,
    modules: &[String],
    keyring: &Keyring,
) -> Result<(), Error> {
    let nodes: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT unnest(nodes) FROM config.modules WHERE module = ANY($1) AND NOT removed",
    )
    .bind(modules)
    .fetch_all(&mut *tx)
    .await?;
    reports::reconcile_named(tx, nodes, keyring).await
}
