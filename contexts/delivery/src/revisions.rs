//! Artifacts and revisions: what delivery takes from source to node.
//!
//! An artifact is pushed through the API and stored in the OCI registry by
//! its digest (the [`ArtifactStore`] the controller implements over
//! `mesh-oci`); operators sign it with keys they hold and upload the
//! signature, which the store keeps beside it (decision 0048). The controller
//! signs it at push time only in a fleet that trusts the controller's key. A revision is a module's runnable
//! definition (artifact digest, unit, settings digest): immutable, with its
//! own id; the same definition of a module is the same revision.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;

use chrono::{DateTime, Utc};
use mesh_protocol::{ArtifactDigest, ArtifactSignature, Probe, RestartPolicy, RevisionUnit};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use sqlx::{AssertSqlSafe, PgConnection};
use uuid::Uuid;

use crate::Error;

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Where artifacts live: the controller implements it over the OCI
/// registry (`mesh-oci`); the context knows no HTTP.
pub trait ArtifactStore: Send + Sync + 'static {
    /// Store `bytes` by digest, and, when the fleet trusts the controller's
    /// key ([`ArtifactStore::controller_trusted`]), the controller's
    /// signature beside them; returns the digest and that signature's key
    /// (hex), if it signed.
    fn push<'a>(
        &'a self,
        bytes: &'a [u8],
    ) -> BoxFuture<'a, Result<(ArtifactDigest, Option<String>), String>>;
    /// Keep `signature` beside its artifact (verified by the caller), with
    /// the signatures already there by other keys.
    fn attach_signature<'a>(
        &'a self,
        signature: &'a ArtifactSignature,
    ) -> BoxFuture<'a, Result<(), String>>;
    /// The controller's own public key (hex).
    fn controller_key(&self) -> String;
    /// Whether nodes trust the controller's own signatures
    /// (`trust_controller_artifact_signatures`; default no).
    fn controller_trusted(&self) -> bool;
    /// The registry base URL agents pull from, and the repository.
    fn pull_location(&self) -> (String, String);
}

/// An artifact as the API shows it.
#[derive(Debug, Clone, Serialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct ArtifactView {
    pub digest: String,
    pub size: i64,
    /// The controller's public key (hex) when it signed the artifact at push
    /// time (a fleet that trusts it); absent otherwise.
    pub signed_by: Option<String>,
    /// The names of the signing keys whose signatures were uploaded for it
    /// (`POST /v1/artifacts/{digest}/signatures`), oldest first; a key
    /// removed since is still named here, but no node trusts it.
    pub signers: Vec<String>,
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
/// The columns of an [`ArtifactView`], from `delivery.artifacts a`.
const ARTIFACT_COLUMNS: &str = "a.digest, a.size, a.signed_by, \
     ARRAY(SELECT s.key_name FROM delivery.artifact_signatures s WHERE s.digest = a.digest \
           ORDER BY s.uploaded_at, s.key_name) AS signers, \
     a.pushed_by, a.pushed_at";

pub async fn record_artifact(
    tx: &mut PgConnection,
    digest: &ArtifactDigest,
    size: usize,
    signed_by: Option<&str>,
    by: &str,
) -> Result<(ArtifactView, bool), Error> {
    let inserted: Option<String> = sqlx::query_scalar(
        "INSERT INTO delivery.artifacts (digest, size, signed_by, pushed_by) VALUES ($1, $2, $3, $4) \
         ON CONFLICT (digest) DO NOTHING RETURNING digest",
    )
    .bind(digest.as_str())
    .bind(i64::try_from(size).unwrap_or(i64::MAX))
    .bind(signed_by)
    .bind(by)
    .fetch_optional(&mut *tx)
    .await?;
    if inserted.is_none() && signed_by.is_some() {
        // Pushed before the fleet trusted the controller: it signed now.
        sqlx::query(
            "UPDATE delivery.artifacts SET signed_by = $2 WHERE digest = $1 AND signed_by IS NULL",
        )
        .bind(digest.as_str())
        .bind(signed_by)
        .execute(&mut *tx)
        .await?;
    }
    let v = artifact(tx, digest)
        .await?
        .ok_or_else(|| Error::NotFound(format!("artifact {digest}")))?;
    Ok((v, inserted.is_some()))
}

/// One artifact pushed through the API.
pub async fn artifact(
    tx: &mut PgConnection,
    digest: &ArtifactDigest,
) -> Result<Option<ArtifactView>, Error> {
    Ok(sqlx::query_as(AssertSqlSafe(format!(
        "SELECT {ARTIFACT_COLUMNS} FROM delivery.artifacts a WHERE a.digest = $1"
    )))
    .bind(digest.as_str())
    .fetch_optional(&mut *tx)
    .await?)
}

pub async fn list_artifacts(tx: &mut PgConnection) -> Result<Vec<ArtifactView>, Error> {
    Ok(sqlx::query_as(AssertSqlSafe(format!(
        "SELECT {ARTIFACT_COLUMNS} FROM delivery.artifacts a ORDER BY a.pushed_at, a.digest"
    )))
    .fetch_all(&mut *tx)
    .await?)
}
