//! The migration runner every context's `migrate()` uses: refinery, run as
//! the context's own role, with its history table in the context's own
//! schema, so no context's migrations touch another's schema.

use refinery::Runner;
use thiserror::Error;
use tokio_postgres::NoTls;

#[derive(Debug, Error)]
pub enum MigrateError {
    #[error("connecting as the {schema} role: {source}")]
    Connect {
        schema: String,
        source: tokio_postgres::Error,
    },
    #[error("migrating schema {schema}: {source}")]
    Migrate {
        schema: String,
        source: refinery::Error,
    },
}

/// Apply `runner`'s migrations to `schema`, connected as the context's own role
/// (`url`), with the history in `<schema>.refinery_schema_history`. Because the
/// role has rights on its own schema only, a migration cannot touch another's.
/// Returns the names of the migrations applied now.
pub async fn migrate(
    url: &str,
    schema: &str,
    mut runner: Runner,
) -> Result<Vec<String>, MigrateError> {
    let (mut client, connection) = tokio_postgres::connect(url, NoTls)
        .await
        .map_err(|source| MigrateError::Connect {
            schema: schema.to_owned(),
            source,
        })?;
    let conn = tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::warn!(error = %e, "migration connection ended");
        }
    });
    runner.set_migration_table_name(format!("{schema}.refinery_schema_history"));
    let report = runner
        .run_async(&mut client)
        .await
        .map_err(|source| MigrateError::Migrate {
            schema: schema.to_owned(),
            source,
        })?;
    drop(client);
    let _ = conn.await;
    Ok(report
        .applied_migrations()
        .iter()
        .map(|m| m.to_string())
        .collect())
}
