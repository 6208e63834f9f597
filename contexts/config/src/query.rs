//! Files (write and read side) and section status.

use chrono::{DateTime, Utc};
use mesh_plumbing::audit::Audit;
use mesh_plumbing::etag::Preconditions;
use mesh_protocol::{FileMode, Labels, MAX_FILE_BYTES, NodeId, validate_labels, validate_path};
use serde::Serialize;
use sqlx::types::Json;

use crate::{Config, Error, SECTIONS};

/// Who a file is for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// Exactly this node.
    Node(NodeId),
    /// Every node whose labels contain all these pairs; `{}` matches every node.
    Selector(Labels),
}

/// A validated file declaration (what `PUT /v1/files/{name}` parses into).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileSpec {
    pub path: String,
    pub content: String,
    pub mode: FileMode,
    pub target: Target,
}

impl FileSpec {
    /// Check every field, naming the first that is wrong.
    pub fn validate(&self) -> Result<(), Error> {
        validate_path("path", &self.path)?;
        if self.path.starts_with("/modules/") {
            return Err(Error::Invalid {
                field: "path".into(),
                reason:
                    "`/modules/` is where modules' settings and secrets go: choose another path"
                        .into(),
            });
        }
        if self.content.len() > MAX_FILE_BYTES {
            return Err(Error::Invalid {
                field: "content".into(),
                reason: format!("{} bytes, limit {MAX_FILE_BYTES}", self.content.len()),
            });
        }
        if let Target::Selector(selector) = &self.target {
            validate_labels("selector", selector)?;
        }
        Ok(())
    }
}

/// Check a file name: 1 to 63 characters of `[a-z0-9._-]`.
pub fn validate_name(name: &str) -> Result<(), Error> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-')
        });
    if ok {
        Ok(())
    } else {
        Err(Error::Invalid {
            field: "name".into(),
            reason: format!(
                "`{}`: 1 to 63 characters of a-z 0-9 . _ -",
                name.chars().take(80).collect::<String>()
            ),
        })
    }
}

/// A file as the API returns it.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct FileView {
    pub name: String,
    pub path: String,
    /// The file's text: shown to operators and admins only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// Content length in bytes.
    pub size: i64,
    /// The ETag's revision.
    pub revision: i64,
    /// Octal, e.g. `"0644"`.
    pub mode: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub selector: Option<Labels>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// A file in `GET /v1/files`: everything but the content.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct FileSummary {
    pub name: String,
    pub path: String,
    pub mode: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub selector: Option<Labels>,
    /// Content length in bytes.
    pub size: i64,
    pub updated_at: DateTime<Utc>,
}

/// The config section declared to one node (what the node applied is in
/// inventory's view of the node).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SectionStatus {
    /// Declared generation.
    pub generation: i64,
    pub digest: String,
    /// Paths of the declared files.
    pub paths: Vec<String>,
    pub declared_at: DateTime<Utc>,
    pub last_sent_at: DateTime<Utc>,
}

#[derive(sqlx::FromRow)]
struct FileViewRow {
    name: String,
    path: String,
    content: String,
    revision: i64,
    mode: i32,
    node: Option<String>,
    selector: Option<Json<Labels>>,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
}

#[derive(sqlx::FromRow)]
struct PutRow {
    #[sqlx(flatten)]
    file: FileViewRow,
    inserted: bool,
}

fn octal(mode: i32) -> String {
    format!("{mode:04o}")
}

impl From<FileViewRow> for FileView {
    fn from(r: FileViewRow) -> Self {
        FileView {
            name: r.name,
            path: r.path,
            size: r.content.len() as i64,
            content: Some(r.content),
            revision: r.revision,
            mode: octal(r.mode),
            node: r.node,
            selector: r.selector.map(|s| s.0),
            created_at: r.created_at,
            updated_at: r.updated_at,
        }
    }
}

impl Config {
    /// Create or replace file `name`, reconcile every node and declare what
    /// changed, in one transaction with the request's audit entry. Returns the
    /// file and whether it was created. Refused (nothing changes) when a node's
    /// section would become larger than an agent accepts.
    pub async fn put_file(
        &self,
        name: &str,
        spec: FileSpec,
        pre: &Preconditions,
        audit: &Audit,
    ) -> Result<(FileView, bool), Error> {
        validate_name(name)?;
        spec.validate()?;
        let (node, selector) = match &spec.target {
            Target::Node(n) => (Some(n.as_str()), None),
            Target::Selector(s) => (None, Some(Json(s))),
        };
        let mode = i32::try_from(spec.mode.bits()).unwrap_or(0);
        let mut tx = self.pool.begin().await?;
        let current: Option<i64> =
            sqlx::query_scalar("SELECT revision FROM config.files WHERE name = $1 FOR UPDATE")
                .bind(name)
                .fetch_optional(&mut *tx)
                .await?;
        pre.check_write(current, &format!("file `{name}`"))?;
        let row: PutRow = sqlx::query_as(
            "INSERT INTO config.files AS f (name, path, content, mode, node, selector) \
             VALUES ($1, $2, $3, $4, $5, $6) \
             ON CONFLICT (name) DO UPDATE SET path = excluded.path, content = excluded.content, \
             mode = excluded.mode, node = excluded.node, selector = excluded.selector, \
             revision = f.revision + 1, updated_at = now() \
             RETURNING name, path, content, revision, mode, node, selector, created_at, updated_at, (xmax = 0) AS inserted",
        )
        .bind(name)
        .bind(&spec.path)
        .bind(&spec.content)
        .bind(mode)
        .bind(node)
        .bind(selector)
        .fetch_one(&mut *tx)
        .await?;
        self.commit_change(tx, audit, "content").await?;
        Ok((row.file.into(), row.inserted))
    }

    /// Delete file `name` and declare the resulting sections (a node left with
    /// no files gets a generation with none), with the request's audit entry.
    pub async fn delete_file(
        &self,
        name: &str,
        pre: &Preconditions,
        audit: &Audit,
    ) -> Result<(), Error> {
        let mut tx = self.pool.begin().await?;
        let current: Option<i64> =
            sqlx::query_scalar("SELECT revision FROM config.files WHERE name = $1 FOR UPDATE")
                .bind(name)
                .fetch_optional(&mut *tx)
                .await?;
        let Some(revision) = current else {
            return Err(Error::FileNotFound(name.chars().take(80).collect()));
        };
        pre.check_delete(revision, &format!("file `{name}`"))?;
        sqlx::query("DELETE FROM config.files WHERE name = $1")
            .bind(name)
            .execute(&mut *tx)
            .await?;
        self.commit_change(tx, audit, "body").await?;
        Ok(())
    }

    pub async fn file(&self, name: &str) -> Result<Option<FileView>, Error> {
        let row: Option<FileViewRow> = sqlx::query_as(
            "SELECT name, path, content, revision, mode, node, selector, created_at, updated_at FROM config.files WHERE name = $1",
        )
        .bind(name)
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.map(FileView::from))
    }

    /// Every file, by name, without content.
    pub async fn files(&self) -> Result<Vec<FileSummary>, Error> {
        type Row = (
            String,
            String,
            i32,
            Option<String>,
            Option<Json<Labels>>,
            i64,
            DateTime<Utc>,
        );
        let rows: Vec<Row> = sqlx::query_as(
            "SELECT name, path, mode, node, selector, octet_length(content)::bigint, updated_at \
                 FROM config.files ORDER BY name",
        )
        .fetch_all(&self.pool)
        .await?;
        Ok(rows
            .into_iter()
            .map(
                |(name, path, mode, node, selector, size, updated_at)| FileSummary {
                    name,
                    path,
                    mode: octal(mode),
                    node,
                    selector: selector.map(|s| s.0),
                    size,
                    updated_at,
                },
            )
            .collect())
    }

    /// The config section declared to `node`, if any.
    pub async fn section(&self, node: &NodeId) -> Result<Option<SectionStatus>, Error> {
        let stored = SECTIONS.stored(&self.pool, node).await?;
        Ok(stored.map(|s| SectionStatus {
            generation: s.generation,
            digest: s.digest,
            paths: s
                .items
                .files
                .iter()
                .map(|f| f.path.clone())
                .chain(s.items.secrets.iter().map(|f| f.path.clone()))
                .collect(),
            declared_at: s.declared_at,
            last_sent_at: s.last_sent_at,
        }))
    }
}
