//! Secrets (write-only values, encrypted at rest) and grants (which module may
//! receive which secret), with the master keyring that wraps every data key.
//!
//! No function here returns a secret's value to a caller outside this crate:
//! the value leaves the config schema only sealed to a node (`derive.rs`).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::RwLock;

use chrono::{DateTime, Utc};
use mesh_credentials::{MasterKey, MasterKeys};
use mesh_plumbing::audit::{self, Audit};
use mesh_plumbing::etag::Preconditions;
use serde::Serialize;
use sqlx::PgConnection;

use crate::crypt::{self, CryptError};
use crate::query::validate_name;
use crate::{Config, Error, SCHEMA};

/// A secret's value is at most this many bytes.
pub const MAX_SECRET_BYTES: usize = 64 * 1024;

/// The master keyring of the running controller: the keys of the file it was
/// read from, and the lock that keeps secret writes out of a rotation.
pub struct Keyring {
    path: Option<PathBuf>,
    keys: RwLock<Option<MasterKeys>>,
    /// Secret writes hold it shared, a rotation exclusively: no data key is
    /// wrapped under a key that a rotation is retiring.
    writes: tokio::sync::RwLock<()>,
}

impl Keyring {
    /// The keyring of the file at `path` (none: the controller keeps no
    /// secrets, and says so on every secret write).
    pub fn load(path: Option<PathBuf>) -> Result<Keyring, Error> {
        let keys = match &path {
            Some(p) => Some(MasterKeys::load(p).map_err(|e| Error::Keyring(e.to_string()))?),
            None => None,
        };
        Ok(Keyring {
            path,
            keys: RwLock::new(keys),
            writes: tokio::sync::RwLock::new(()),
        })
    }

    fn with<T>(&self, f: impl FnOnce(&MasterKeys) -> Result<T, Error>) -> Result<T, Error> {
        let guard = self
            .keys
            .read()
            .map_err(|_| Error::Keyring("keyring lock poisoned".into()))?;
        match guard.as_ref() {
            Some(keys) => f(keys),
            None => Err(Error::NoMasterKey),
        }
    }

    /// The current key's id and bytes.
    fn current(&self) -> Result<(String, [u8; 32]), Error> {
        self.with(|k| {
            k.current()
                .map(|c| (c.id.clone(), c.bytes()))
                .ok_or(Error::NoMasterKey)
        })
    }

    /// The bytes of key `id`.
    pub(crate) fn key(&self, id: &str) -> Result<[u8; 32], Error> {
        self.with(|k| {
            k.get(id).map(MasterKey::bytes).ok_or_else(|| {
                Error::Keyring(format!("master key `{id}` is not in the keyring file"))
            })
        })
    }

    /// The ids of the keys held, current first.
    pub fn ids(&self) -> Vec<String> {
        self.with(|k| Ok(k.keys.iter().map(|k| k.id.clone()).collect()))
            .unwrap_or_default()
    }

    fn replace(&self, keys: MasterKeys) -> Result<(), Error> {
        if let Some(path) = &self.path {
            keys.write(path)
                .map_err(|e| Error::Keyring(e.to_string()))?;
        }
        let mut guard = self
            .keys
            .write()
            .map_err(|_| Error::Keyring("keyring lock poisoned".into()))?;
        *guard = Some(keys);
        Ok(())
    }
}

/// One version of a secret, without its value.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct SecretVersion {
    pub version: i64,
    pub created_at: DateTime<Utc>,
    /// The API token's name that wrote it.
    pub created_by: String,
}

/// A grant: module `module` receives the secret as
/// `/modules/<module>/secrets/<file>` (mode 0600) on every node that runs it.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct GrantView {
    pub module: String,
    pub secret: String,
    pub file: String,
    /// The path on the node.
    pub path: String,
    /// The ETag's revision.
    pub revision: i64,
    pub created_at: DateTime<Utc>,
    pub created_by: String,
}

/// A secret's metadata: never its value.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct SecretView {
    pub name: String,
    /// The newest version (the ETag).
    pub version: i64,
    pub created_at: DateTime<Utc>,
    pub created_by: String,
    pub updated_at: DateTime<Utc>,
    /// Every version, newest first.
    pub versions: Vec<SecretVersion>,
    /// The modules granted it.
    pub grants: Vec<GrantView>,
}

/// What a master key rotation did.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct RotationReport {
    /// The new current key's id.
    pub key_id: String,
    /// The keys retired (no longer in the keyring).
    pub retired: Vec<String>,
    /// Data keys re-wrapped under the new key.
    pub rewrapped: u64,
}

/// Who manages the secrets that the credentials of resource grants are
/// (`provisioned.rs`); operators cannot change those.
pub const MANAGED_BY: &str = "provisioning";

/// The file-name prefix reserved for the credentials of grants.
pub const GRANT_FILE_PREFIX: &str = "grant-";

/// The path on a node of a granted secret's file.
pub fn grant_path(module: &str, file: &str) -> String {
    format!("/modules/{module}/secrets/{file}")
}

/// The newest value of every secret in `names`, decrypted (for sealing to the
/// nodes whose section carries it). A secret that does not open is left out,
/// with its reason.
pub(crate) async fn values(
    tx: &mut PgConnection,
    keyring: &Keyring,
    names: &[String],
) -> Result<Vec<(String, i64, Result<Vec<u8>, String>)>, Error> {
    if names.is_empty() {
        return Ok(Vec::new());
    }
    type Row = (String, i64, String, Vec<u8>, Vec<u8>);
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT s.name, s.version, s.key_id, s.wrapped_key, v.ciphertext FROM config.secrets s \
         JOIN config.secret_versions v ON v.secret = s.name AND v.version = s.version \
         WHERE s.name = ANY($1) ORDER BY s.name",
    )
    .bind(names)
    .fetch_all(&mut *tx)
    .await?;
    let mut out = Vec::with_capacity(rows.len());
    for (name, version, key_id, wrapped, ct) in rows {
        let value = keyring
            .key(&key_id)
            .and_then(|master| crypt::unwrap_key(&master, &name, &wrapped).map_err(Error::from))
            .and_then(|dk| crypt::decrypt_value(&dk, &name, version, &ct).map_err(Error::from))
            .map_err(|e| e.to_string());
        out.push((name, version, value));
    }
    Ok(out)
}

impl From<CryptError> for Error {
    fn from(e: CryptError) -> Self {
        Error::Keyring(e.0)
    }
}

fn check_value(value: &str) -> Result<(), Error> {
    if value.len() > MAX_SECRET_BYTES {
        return Err(Error::Invalid {
            field: "value".into(),
            reason: format!("{} bytes, limit {MAX_SECRET_BYTES}", value.len()),
        });
    }
    Ok(())
}

impl Config {
    /// Store a new version of secret `name` (creating it when absent), then
    /// re-declare the config section of exactly the nodes that run a module
    /// granted it. The audit entry names the secret, never the value.
    pub async fn put_secret(
        &self,
        name: &str,
        value: &str,
        pre: &Preconditions,
        audit: &Audit,
    ) -> Result<(SecretView, bool), Error> {
        validate_name(name)?;
        check_value(value)?;
        let _writing = self.keyring.writes.read().await;
        let by = audit.principal().name.clone();
        let mut tx = self.pool.begin().await?;
        refuse_managed(&mut tx, name).await?;
        let current: Option<(i64, String, Vec<u8>)> = sqlx::query_as(
            "SELECT version, key_id, wrapped_key FROM config.secrets WHERE name = $1 FOR UPDATE",
        )
        .bind(name)
        .fetch_optional(&mut *tx)
        .await?;
        pre.check_write(current.as_ref().map(|c| c.0), &format!("secret `{name}`"))?;
        let (version, data_key) = match current {
            None => {
                let (key_id, master) = self.keyring.current()?;
                let dk = crypt::new_data_key();
                let wrapped = crypt::wrap_key(&master, name, &dk)?;
                sqlx::query(
                    "INSERT INTO config.secrets (name, version, key_id, wrapped_key, created_by) \
                     VALUES ($1, 1, $2, $3, $4)",
                )
                .bind(name)
                .bind(&key_id)
                .bind(&wrapped)
                .bind(&by)
                .execute(&mut *tx)
                .await?;
                (1, dk)
            }
            Some((version, key_id, wrapped)) => {
                let master = self.keyring.key(&key_id)?;
                let dk = crypt::unwrap_key(&master, name, &wrapped)?;
                sqlx::query(
                    "UPDATE config.secrets SET version = $2, updated_at = now() WHERE name = $1",
                )
                .bind(name)
                .bind(version + 1)
                .execute(&mut *tx)
                .await?;
                (version + 1, dk)
            }
        };
        let ct = crypt::encrypt_value(&data_key, name, version, value.as_bytes())?;
        sqlx::query(
            "INSERT INTO config.secret_versions (secret, version, ciphertext, created_by) \
             VALUES ($1, $2, $3, $4)",
        )
        .bind(name)
        .bind(version)
        .bind(&ct)
        .bind(&by)
        .execute(&mut *tx)
        .await?;
        self.commit_change(tx, audit, "value").await?;
        let mut conn = self.pool.acquire().await?;
        let view = secret_view(&mut conn, name)
            .await?
            .ok_or_else(|| Error::NotFound(format!("no secret `{name}`")))?;
        Ok((view, version == 1))
    }

    /// Delete secret `name`, its versions and its grants; the nodes that held
    /// it get a section without it (the file is removed).
    pub async fn delete_secret(
        &self,
        name: &str,
        pre: &Preconditions,
        audit: &Audit,
    ) -> Result<(), Error> {
        let mut tx = self.pool.begin().await?;
        refuse_managed(&mut tx, name).await?;
        let current: Option<i64> =
            sqlx::query_scalar("SELECT version FROM config.secrets WHERE name = $1 FOR UPDATE")
                .bind(name)
                .fetch_optional(&mut *tx)
                .await?;
        let Some(version) = current else {
            return Err(Error::NotFound(format!("no secret `{}`", clip(name))));
        };
        pre.check_delete(version, &format!("secret `{name}`"))?;
        sqlx::query("DELETE FROM config.secrets WHERE name = $1")
            .bind(name)
            .execute(&mut *tx)
            .await?;
        self.commit_change(tx, audit, "body").await?;
        Ok(())
    }

    /// Secret `name`'s metadata.
    pub async fn secret(&self, name: &str) -> Result<Option<SecretView>, Error> {
        let mut conn = self.pool.acquire().await?;
        secret_view(&mut conn, name).await
    }

    /// Every secret's metadata, by name.
    pub async fn secrets(&self) -> Result<Vec<SecretView>, Error> {
        let mut conn = self.pool.acquire().await?;
        secret_views(&mut conn, None).await
    }

    /// Grant secret `secret` to module `module` (as file `file`, default the
    /// secret's name), then declare it to every node that runs the module.
    pub async fn put_grant(
        &self,
        module: &str,
        secret: &str,
        file: Option<&str>,
        pre: &Preconditions,
        audit: &Audit,
    ) -> Result<(GrantView, bool), Error> {
        validate_module(module)?;
        validate_name(secret)?;
        let file = file.unwrap_or(secret);
        validate_file(file)?;
        let by = audit.principal().name.clone();
        let mut tx = self.pool.begin().await?;
        refuse_managed(&mut tx, secret).await?;
        refuse_reserved_file(file)?;
        let exists: Option<i64> =
            sqlx::query_scalar("SELECT version FROM config.secrets WHERE name = $1 FOR SHARE")
                .bind(secret)
                .fetch_optional(&mut *tx)
                .await?;
        if exists.is_none() {
            return Err(Error::NotFound(format!("no secret `{}`", clip(secret))));
        }
        let current: Option<i64> = sqlx::query_scalar(
            "SELECT revision FROM config.grants WHERE module = $1 AND secret = $2 FOR UPDATE",
        )
        .bind(module)
        .bind(secret)
        .fetch_optional(&mut *tx)
        .await?;
        pre.check_write(
            current,
            &format!("grant of `{secret}` to module `{module}`"),
        )?;
        let taken: Option<String> = sqlx::query_scalar(
            "SELECT secret FROM config.grants WHERE module = $1 AND file = $2 AND secret <> $3",
        )
        .bind(module)
        .bind(file)
        .bind(secret)
        .fetch_optional(&mut *tx)
        .await?;
        if let Some(other) = taken {
            return Err(Error::Conflict(format!(
                "module `{module}` already receives secret `{other}` as file `{file}`: choose another `file`"
            )));
        }
        sqlx::query(
            "INSERT INTO config.grants (module, secret, file, created_by) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (module, secret) DO UPDATE SET file = excluded.file, \
             revision = config.grants.revision + 1",
        )
        .bind(module)
        .bind(secret)
        .bind(file)
        .bind(&by)
        .execute(&mut *tx)
        .await?;
        self.commit_change(tx, audit, "secret").await?;
        let mut conn = self.pool.acquire().await?;
        let view = grants(&mut conn, Some(module), Some(secret))
            .await?
            .into_iter()
            .next()
            .ok_or_else(|| Error::NotFound(format!("no grant of `{secret}` to `{module}`")))?;
        Ok((view, current.is_none()))
    }

    /// Revoke a grant: the secret's file is removed from the module's nodes.
    pub async fn delete_grant(
        &self,
        module: &str,
        secret: &str,
        pre: &Preconditions,
        audit: &Audit,
    ) -> Result<(), Error> {
        let mut tx = self.pool.begin().await?;
        refuse_managed(&mut tx, secret).await?;
        let current: Option<i64> = sqlx::query_scalar(
            "SELECT revision FROM config.grants WHERE module = $1 AND secret = $2 FOR UPDATE",
        )
        .bind(module)
        .bind(secret)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(revision) = current else {
            return Err(Error::NotFound(format!(
                "no grant of `{}` to module `{}`",
                clip(secret),
                clip(module)
            )));
        };
        pre.check_delete(
            revision,
            &format!("grant of `{secret}` to module `{module}`"),
        )?;
        sqlx::query("DELETE FROM config.grants WHERE module = $1 AND secret = $2")
            .bind(module)
            .bind(secret)
            .execute(&mut *tx)
            .await?;
        self.commit_change(tx, audit, "body").await?;
        Ok(())
    }

    /// The grants of `module` (or of one secret to it).
    pub async fn grants(
        &self,
        module: &str,
        secret: Option<&str>,
    ) -> Result<Vec<GrantView>, Error> {
        let mut conn = self.pool.acquire().await?;
        grants(&mut conn, Some(module), secret).await
    }

    /// Make a new master key current, re-wrap every data key under it, and
    /// retire the old keys, while the controller keeps serving: secret writes
    /// wait for the rotation; reads and deliveries go on (every key a
    /// committed row names stays in the keyring until the re-wrap committed).
    /// A crash at any step leaves a keyring that opens every row: the new key
    /// is written to the file beside the old ones before any row uses it, and
    /// the old ones leave the file only after the re-wrap committed.
    pub async fn rotate_master_key(&self, audit: &Audit) -> Result<RotationReport, Error> {
        let _rotating = self.keyring.writes.write().await;
        let old = self.keyring.with(|k| Ok(k.clone()))?;
        let id = format!("m-{}", hex::encode(rand::random::<[u8; 6]>()));
        let new_key = MasterKey::new(id.clone(), rand::random());
        let new_bytes = new_key.bytes();
        let mut both = vec![new_key.clone()];
        both.extend(old.keys.iter().cloned());
        self.keyring.replace(MasterKeys::new(both))?;

        let mut tx = self.pool.begin().await?;
        let rows: Vec<(String, String, Vec<u8>)> = sqlx::query_as(
            "SELECT name, key_id, wrapped_key FROM config.secrets ORDER BY name FOR UPDATE",
        )
        .fetch_all(&mut *tx)
        .await?;
        let mut names = Vec::with_capacity(rows.len());
        let mut wrapped = Vec::with_capacity(rows.len());
        for (name, key_id, w) in &rows {
            let master = self.keyring.key(key_id)?;
            let dk = crypt::unwrap_key(&master, name, w)?;
            wrapped.push(crypt::wrap_key(&new_bytes, name, &dk)?);
            names.push(name.clone());
        }
        sqlx::query(
            "UPDATE config.secrets s SET key_id = $1, wrapped_key = u.w \
             FROM UNNEST($2::text[], $3::bytea[]) AS u(name, w) WHERE s.name = u.name",
        )
        .bind(&id)
        .bind(&names)
        .bind(&wrapped)
        .execute(&mut *tx)
        .await?;
        audit::record_ok(&mut tx, SCHEMA, audit).await?;
        tx.commit().await?;

        self.keyring.replace(MasterKeys::new(vec![new_key]))?;
        tracing::info!(key_id = %id, rewrapped = names.len(), "secrets master key rotated");
        Ok(RotationReport {
            key_id: id,
            retired: old.keys.into_iter().map(|k| k.id).collect(),
            rewrapped: names.len() as u64,
        })
    }
}

/// Refuse an operator's write to a secret provisioning manages.
pub(crate) async fn refuse_managed(tx: &mut PgConnection, name: &str) -> Result<(), Error> {
    let by: Option<Option<String>> =
        sqlx::query_scalar("SELECT managed_by FROM config.secrets WHERE name = $1")
            .bind(name)
            .fetch_optional(&mut *tx)
            .await?;
    if let Some(Some(by)) = by {
        return Err(Error::Conflict(format!(
            "secret `{name}` is managed by {by} (the credential of a resource grant): \
             it changes only with its grant"
        )));
    }
    Ok(())
}

/// Refuse an operator's grant under a file name reserved for grants.
pub(crate) fn refuse_reserved_file(file: &str) -> Result<(), Error> {
    if file.starts_with(GRANT_FILE_PREFIX) {
        return Err(Error::Invalid {
            field: "file".to_owned(),
            reason: format!(
                "`{GRANT_FILE_PREFIX}…` file names are reserved for the credentials of resource grants"
            ),
        });
    }
    Ok(())
}

fn clip(s: &str) -> String {
    s.chars().take(80).collect()
}

/// A module's name, as the record names modules.
pub(crate) fn validate_module(module: &str) -> Result<(), Error> {
    mesh_protocol::validate_module_name("module", module).map_err(Error::from)
}

/// A granted secret's file name under the module's `secrets/` directory.
pub(crate) fn validate_file(file: &str) -> Result<(), Error> {
    mesh_protocol::validate_file_name("file", file).map_err(Error::from)
}

async fn secret_view(conn: &mut PgConnection, name: &str) -> Result<Option<SecretView>, Error> {
    Ok(secret_views(conn, Some(name)).await?.into_iter().next())
}

/// The metadata of secret `name` (`None`: of every secret, by name), in three
/// queries whatever their number.
async fn secret_views(
    conn: &mut PgConnection,
    name: Option<&str>,
) -> Result<Vec<SecretView>, Error> {
    type Row = (String, i64, DateTime<Utc>, String, DateTime<Utc>);
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT name, version, created_at, created_by, updated_at FROM config.secrets \
         WHERE $1::text IS NULL OR name = $1 ORDER BY name",
    )
    .bind(name)
    .fetch_all(&mut *conn)
    .await?;
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    let versions: Vec<(String, i64, DateTime<Utc>, String)> = sqlx::query_as(
        "SELECT secret, version, created_at, created_by FROM config.secret_versions \
         WHERE $1::text IS NULL OR secret = $1 ORDER BY secret, version DESC",
    )
    .bind(name)
    .fetch_all(&mut *conn)
    .await?;
    let mut versions_of: BTreeMap<String, Vec<SecretVersion>> = BTreeMap::new();
    for (secret, version, created_at, created_by) in versions {
        versions_of.entry(secret).or_default().push(SecretVersion {
            version,
            created_at,
            created_by,
        });
    }
    let mut grants_of: BTreeMap<String, Vec<GrantView>> = BTreeMap::new();
    for g in grants(conn, None, name).await? {
        grants_of.entry(g.secret.clone()).or_default().push(g);
    }
    Ok(rows
        .into_iter()
        .map(
            |(name, version, created_at, created_by, updated_at)| SecretView {
                versions: versions_of.remove(&name).unwrap_or_default(),
                grants: grants_of.remove(&name).unwrap_or_default(),
                name,
                version,
                created_at,
                created_by,
                updated_at,
            },
        )
        .collect())
}

async fn grants(
    conn: &mut PgConnection,
    module: Option<&str>,
    secret: Option<&str>,
) -> Result<Vec<GrantView>, Error> {
    let rows: Vec<(String, String, String, i64, DateTime<Utc>, String)> = sqlx::query_as(
        "SELECT module, secret, file, revision, created_at, created_by FROM config.grants \
         WHERE ($1::text IS NULL OR module = $1) AND ($2::text IS NULL OR secret = $2) \
         ORDER BY module, secret",
    )
    .bind(module)
    .bind(secret)
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(
            |(module, secret, file, revision, created_at, created_by)| GrantView {
                path: grant_path(&module, &file),
                module,
                secret,
                file,
                revision,
                created_at,
                created_by,
            },
        )
        .collect())
}
