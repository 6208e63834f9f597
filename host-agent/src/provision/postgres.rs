//! PostgreSQL: a database and a login role with rights on it alone, through
//! `psql` over the server's Unix socket as its local administrator. PUBLIC's
//! CONNECT and TEMPORARY on `postgres` and `template1` are revoked on every
//! pass, so that no grant's login opens the server's own databases.
//!
//! The SQL goes on stdin (never argv). The password is a string literal in
//! that SQL; it stays out of every reason and log because the session runs
//! with `VERBOSITY terse` (psql prints no `LINE` context of a failing
//! statement) and `log_min_error_statement = panic`, `log_statement =
//! 'none'` (the server logs no statement text).

use mesh_protocol::{ResourceItem, Secret};

use super::{DriverError, run, truncate_reason};

/// `psql` exit codes: 2 = the connection failed; 3 = a statement failed
/// under ON_ERROR_STOP; 1 = psql's own fatal error.
async fn psql(item: &ResourceItem, sql: &str) -> Result<String, DriverError> {
    let socket_dir = item
        .admin
        .socket_dir
        .as_deref()
        .ok_or_else(|| DriverError::Refused("admin.socket_dir is missing".into()))?;
    let mut cmd = tokio::process::Command::new("psql");
    cmd.args(["-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-h"])
        .arg(socket_dir)
        .arg("-p")
        .arg(item.port.to_string())
        .arg("-U")
        .arg(item.admin.postgres_user())
        .args(["-d", "postgres"])
        .env_remove("PGPASSWORD")
        .env_remove("PGOPTIONS");
    let script = format!(
        "\\set VERBOSITY terse\nSET log_min_error_statement = panic;\nSET log_statement = 'none';\n{sql}"
    );
    let (code, stdout, stderr) = run(cmd, &script).await?;
    match code {
        Some(0) => Ok(stdout),
        Some(3) if transient(&stderr) => Err(DriverError::Transient(truncate_reason(&stderr))),
        Some(3) => Err(DriverError::Refused(truncate_reason(&stderr))),
        _ => Err(DriverError::Unavailable(truncate_reason(&stderr))),
    }
}

/// A refusal that says nothing of the request: the catalog row a statement
/// changes was changed or removed by another session meanwhile (e.g. the
/// database dropped between the pass's look and its `ALTER DATABASE`), a
/// deadlock, a serialization failure. The first is an internal error whose
/// words are never translated; the others match the server's English
/// messages only (`lc_messages` other than English: they fail the grant).
fn transient(stderr: &str) -> bool {
    [
        "tuple concurrently updated",
        "tuple concurrently deleted",
        "deadlock detected",
        "could not serialize access",
    ]
    .iter()
    .any(|w| stderr.contains(w))
}

/// `"name"` (names are `[a-z0-9-]`, but quote whatever comes).
fn ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

/// `'value'` with standard_conforming_strings (on by default since 9.1).
fn literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

pub(super) async fn exists(item: &ResourceItem) -> Result<bool, DriverError> {
    let out = psql(
        item,
        &format!(
            "SELECT count(*) FROM pg_database WHERE datname = {};\n",
            literal(&item.name)
        ),
    )
    .await?;
    Ok(out.trim() != "0")
}

pub(super) async fn ensure(
    item: &ResourceItem,
    password: &Secret<String>,
) -> Result<(), DriverError> {
    let role = ident(&item.user);
    let db = ident(&item.name);
    let mut connection_limit = -1i32;
    let mut encoding = None;
    for (k, v) in &item.options {
        match k.as_str() {
            "connection_limit" => {
                connection_limit = v.trim().parse().map_err(|_| {
                    DriverError::Refused(format!("connection_limit: `{v}` is not an integer"))
                })?;
            }
            "encoding" => encoding = Some(v.as_str()),
            other => {
                return Err(DriverError::Refused(format!(
                    "unknown option `{other}` for a postgres.database"
                )));
            }
        }
    }
    let encoding = encoding
        .map(|e| format!(" ENCODING {} TEMPLATE template0", literal(e)))
        .unwrap_or_default();
    let pw = literal(password.expose());
    // The server is the provider module's own: by PostgreSQL's defaults
    // PUBLIC may connect to (and make temporary tables in) `postgres` and
    // `template1`, so every grant's login could. Taken away first, on every
    // pass (idempotent); the local administrator keeps them as superuser.
    let sql = format!(
        "REVOKE CONNECT, TEMPORARY ON DATABASE postgres, template1 FROM PUBLIC;\n\
         SELECT count(*) > 0 AS role_exists FROM pg_roles WHERE rolname = {user} \\gset\n\
         \\if :role_exists\n\
         ALTER ROLE {role} LOGIN PASSWORD {pw} CONNECTION LIMIT {connection_limit};\n\
         \\else\n\
         CREATE ROLE {role} LOGIN PASSWORD {pw} CONNECTION LIMIT {connection_limit};\n\
         \\endif\n\
         SELECT count(*) > 0 AS db_exists FROM pg_database WHERE datname = {name} \\gset\n\
         \\if :db_exists\n\
         ALTER DATABASE {db} OWNER TO {role};\n\
         \\else\n\
         CREATE DATABASE {db} OWNER {role}{encoding};\n\
         \\endif\n\
         REVOKE CONNECT, TEMPORARY ON DATABASE {db} FROM PUBLIC;\n\
         GRANT CONNECT ON DATABASE {db} TO {role};\n",
        user = literal(&item.user),
        name = literal(&item.name),
    );
    psql(item, &sql).await.map(|_| ())
}

pub(super) async fn revoke(item: &ResourceItem) -> Result<(), DriverError> {
    let sql = format!(
        "SELECT count(*) > 0 AS role_exists FROM pg_roles WHERE rolname = {user} \\gset\n\
         \\if :role_exists\n\
         ALTER ROLE {role} NOLOGIN;\n\
         SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE usename = {user};\n\
         \\endif\n",
        user = literal(&item.user),
        role = ident(&item.user),
    );
    psql(item, &sql).await.map(|_| ())
}

pub(super) async fn delete(item: &ResourceItem) -> Result<(), DriverError> {
    let sql = format!(
        "DROP DATABASE IF EXISTS {db} WITH (FORCE);\nDROP ROLE IF EXISTS {role};\n",
        db = ident(&item.name),
        role = ident(&item.user),
    );
    psql(item, &sql).await.map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::transient;

    #[test]
    fn a_concurrent_catalog_change_is_transient_a_bad_option_is_not() {
        assert!(transient(
            "psql:<stdin>:12: ERROR:  tuple concurrently deleted\n"
        ));
        assert!(transient("ERROR:  tuple concurrently updated"));
        assert!(transient("ERROR:  deadlock detected"));
        assert!(!transient(
            "ERROR:  BOGUS is not a valid encoding name at character 41"
        ));
        assert!(!transient("ERROR:  permission denied to create database"));
    }
}
