//! Artifacts and revisions: what delivery takes from source to node.
//!
//! An artifact is pushed through the API, stored in the OCI registry by its
//! digest and signed there by the controller (the [`ArtifactStore`] the
//! controller implements over `mesh-oci`). A revision is a module's runnable
//! definition (artifact digest, unit, settings digest): immutable, with its
//! own id; the same definition of a module is the same revision.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;

use chrono::{DateTime, Utc};
use mesh_protocol::{ArtifactDigest, Probe, RestartPolicy, RevisionUnit};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::Error;

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Where artifacts live: the controller implements it over the OCI
/// registry (`mesh-oci`); the context knows no HTTP.
pub trait ArtifactStore: Send + Sync + 'static {
    /// Store `bytes` by digest and put the controller's signature beside
    /// them; returns the digest and the signing key (hex).
    fn push_signed<'a>(
        &'a self,
        bytes: &'a [u8],
    ) -> BoxFuture<'a, Result<(ArtifactDigest, String), String>>;
    /// The registry base URL agents pull from, and the repository.
    fn pull_location(&self) -> (String, String);
}

/// An artifact as the API shows it.
#[derive(Debug, Clone, Serialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct ArtifactView {
    pub digest: String,
    pub size: i64,
    /// The public key (hex) whose signature the registry holds.
    pub signed_by: String,
    pub pushed_by: String,
    pub pushed_at: DateTime<Utc>,
}

/// The unit of a revision, as `POST /v1/modules/{name}/revisions` takes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RevisionUnitSpec {
    /// Executable: relative to the artifact's directory when the revision
    /// has an artifact, else absolute or looked up in the agent's PATH.
    pub command: String,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub working_dir: Option<String>,
    #[serde(default)]
    pub restart: RestartPolicy,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schema(value_type = Vec<Object>)]
    pub probes: Vec<Probe>,
}

/// A new revision's definition.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewRevision {
    /// The artifact it runs from, by digest (`sha256:…`), never a tag.
    #[serde(default)]
    #[schema(value_type = Option<String>)]
    pub artifact: Option<ArtifactDigest>,
    pub unit: RevisionUnitSpec,
    /// The digest of the settings the revision was made with, if the
    /// operator pins them (opaque to delivery).
    #[serde(default)]
    pub settings_digest: Option<String>,
}

/// A revision as the API shows it.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct RevisionView {
    pub id: Uuid,
    pub module: String,
    #[schema(value_type = Option<String>)]
    pub artifact: Option<ArtifactDigest>,
    pub unit: RevisionUnitSpec,
    pub settings_digest: Option<String>,
    /// sha256 hex of the canonical definition.
    pub digest: String,
    pub created_at: DateTime<Utc>,
    pub created_by: String,
}

impl RevisionView {
    /// What inventory runs for this revision (`delivery.module.targets`).
    pub fn runnable(&self) -> RevisionUnit {
        runnable(self.id, self.artifact.as_ref(), &self.unit)
    }
}

#[derive(sqlx::FromRow)]
struct RevisionRow {
    id: Uuid,
    module: String,
    digest: String,
    artifact: Option<String>,
    unit: serde_json::Value,
    settings_digest: Option<String>,
    created_at: DateTime<Utc>,
    created_by: String,
}

impl TryFrom<RevisionRow> for RevisionView {
    type Error = Error;
    fn try_from(r: RevisionRow) -> Result<Self, Error> {
        let corrupt = |reason: String| Error::Corrupt {
            what: format!("revision {}", r.id),
            reason,
        };
        let unit = serde_json::from_value(r.unit.clone()).map_err(|e| corrupt(e.to_string()))?;
        let artifact = match &r.artifact {
            Some(a) => {
                Some(ArtifactDigest::parse("artifact", a).map_err(|e| corrupt(e.to_string()))?)
            }
            None => None,
        };
        Ok(RevisionView {
            id: r.id,
            module: r.module,
            artifact,
            unit,
            settings_digest: r.settings_digest,
            digest: r.digest,
            created_at: r.created_at,
            created_by: r.created_by,
        })
    }
}

impl NewRevision {
    /// Check the definition as an agent would check the unit it makes.
    pub fn validate(&self, module: &str) -> Result<(), Error> {
        mesh_protocol::validate_module_name("module", module)?;
        self.runnable(Uuid::nil())
            .unit_item(module, module, None)
            .validate("unit")?;
        if let Some(s) = &self.settings_digest
            && (s.is_empty() || s.len() > 128 || s.chars().any(char::is_control))
        {
            return Err(Error::invalid("settings_digest", "1 to 128 characters"));
        }
        Ok(())
    }

    fn runnable(&self, id: Uuid) -> RevisionUnit {
        runnable(id, self.artifact.as_ref(), &self.unit)
    }

    /// sha256 hex of the canonical JSON of the definition: equal definitions,
    /// equal digests.
    pub fn digest(&self) -> String {
        let bytes = serde_json::to_vec(self).unwrap_or_default();
        hex::encode(Sha256::digest(&bytes))
    }
}

/// The unit of revision `id`, as inventory runs it.
fn runnable(id: Uuid, artifact: Option<&ArtifactDigest>, unit: &RevisionUnitSpec) -> RevisionUnit {
    RevisionUnit {
        id,
        artifact: artifact.cloned(),
        command: unit.command.clone(),
        args: unit.args.clone(),
        env: unit.env.clone(),
        working_dir: unit.working_dir.clone(),
        restart: unit.restart,
        probes: unit.probes.clone(),
    }
}

const COLUMNS: &str = "id, module, digest, artifact, unit, settings_digest, created_at, created_by";

/// Create the revision (or find the same definition's): `(view, created)`.
pub async fn create(
    tx: &mut PgConnection,
    module: &str,
    new: &NewRevision,
    by: &str,
) -> Result<(RevisionView, bool), Error> {
    new.validate(module)?;
    let digest = new.digest();
    let unit =
        serde_json::to_value(&new.unit).map_err(|e| Error::invalid("unit", e.to_string()))?;
    let inserted: Option<RevisionRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "INSERT INTO delivery.revisions (id, module, digest, artifact, unit, settings_digest, created_by) \
         VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (module, digest) DO NOTHING RETURNING {COLUMNS}"
    )))
    .bind(Uuid::now_v7())
    .bind(module)
    .bind(&digest)
    .bind(new.artifact.as_ref().map(ArtifactDigest::as_str))
    .bind(&unit)
    .bind(&new.settings_digest)
    .bind(by)
    .fetch_optional(&mut *tx)
    .await?;
    if let Some(row) = inserted {
        return Ok((row.try_into()?, true));
    }
    let row: RevisionRow = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM delivery.revisions WHERE module = $1 AND digest = $2"
    )))
    .bind(module)
    .bind(&digest)
    .fetch_one(&mut *tx)
    .await?;
    Ok((row.try_into()?, false))
}

pub async fn get(tx: &mut PgConnection, id: Uuid) -> Result<Option<RevisionView>, Error> {
    let row: Option<RevisionRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM delivery.revisions WHERE id = $1"
    )))
    .bind(id)
    .fetch_optional(&mut *tx)
    .await?;
    row.map(RevisionView::try_from).transpose()
}

pub async fn list(tx: &mut PgConnection, module: &str) -> Result<Vec<RevisionView>, Error> {
    let rows: Vec<RevisionRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM delivery.revisions WHERE module = $1 ORDER BY created_at, id"
    )))
    .bind(module)
    .fetch_all(&mut *tx)
    .await?;
    rows.into_iter().map(RevisionView::try_from).collect()
}

/// Record a pushed artifact (idempotent): `(view, created)`.
pub async fn record_artifact(
    tx: &mut PgConnection,
    digest: &ArtifactDigest,
    size: usize,
    signed_by: &str,
    by: &str,
) -> Result<(ArtifactView, bool), Error> {
    let inserted: Option<ArtifactView> = sqlx::query_as(
        "INSERT INTO delivery.artifacts (digest, size, signed_by, pushed_by) VALUES ($1, $2, $3, $4) \
         ON CONFLICT (digest) DO NOTHING RETURNING digest, size, signed_by, pushed_by, pushed_at",
    )
    .bind(digest.as_str())
    .bind(i64::try_from(size).unwrap_or(i64::MAX))
    .bind(signed_by)
    .bind(by)
    .fetch_optional(&mut *tx)
    .await?;
    if let Some(v) = inserted {
        return Ok((v, true));
    }
    let v: ArtifactView = sqlx::query_as(
        "SELECT digest, size, signed_by, pushed_by, pushed_at FROM delivery.artifacts WHERE digest = $1",
    )
    .bind(digest.as_str())
    .fetch_one(&mut *tx)
    .await?;
    Ok((v, false))
}

pub async fn list_artifacts(tx: &mut PgConnection) -> Result<Vec<ArtifactView>, Error> {
    Ok(sqlx::query_as(
        "SELECT digest, size, signed_by, pushed_by, pushed_at FROM delivery.artifacts ORDER BY pushed_at, digest",
    )
    .fetch_all(&mut *tx)
    .await?)
}
