//! The settings layers' storage (`config.settings`) and the effective view.
//! Each layer is written whole (its ETag is its revision); every write
//! reconciles, and only nodes whose rendered files change get a generation.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use mesh_plumbing::audit::Audit;
use mesh_plumbing::etag::Preconditions;
use mesh_protocol::{Labels, NodeId, SettingsFile, validate_labels};
use serde::Serialize;
use sqlx::PgConnection;
use sqlx::types::Json;

use crate::settings::{self, Effective, Layer, Scope, Values};
use crate::{Config, Error, module_dir};

/// A layer as the API shows it.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct LayerView {
    #[serde(flatten)]
    pub scope: Scope,
    /// Label layers only: the pairs a node's labels must contain.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub selector: Option<Labels>,
    #[schema(value_type = Object)]
    pub values: Values,
    /// The ETag's revision.
    pub revision: i64,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

type Row = (
    String,
    String,
    Option<Json<Labels>>,
    Json<Values>,
    i64,
    DateTime<Utc>,
    DateTime<Utc>,
);

fn view(row: Row) -> Option<LayerView> {
    let (scope, name, selector, values, revision, created_at, updated_at) = row;
    Some(LayerView {
        scope: Scope::from_key(&scope, &name)?,
        selector: selector.map(|s| s.0),
        values: values.0,
        revision,
        created_at,
        updated_at,
    })
}

/// Every layer, for a reconcile.
pub(crate) async fn all(tx: &mut PgConnection) -> Result<Vec<Layer>, Error> {
    type LayerRow = (String, String, Option<Json<Labels>>, Json<Values>);
    let rows: Vec<LayerRow> =
        sqlx::query_as(r#"SELECT scope, name, selector, "values" FROM config.settings"#)
            .fetch_all(&mut *tx)
            .await?;
    Ok(rows
        .into_iter()
        .filter_map(|(scope, name, selector, values)| {
            Some(Layer {
                scope: Scope::from_key(&scope, &name)?,
                selector: selector.map(|s| s.0),
                values: values.0,
            })
        })
        .collect())
}

/// Check a layer's name for its scope.
pub fn validate_scope(scope: &Scope) -> Result<(), Error> {
    match scope {
        Scope::Global => Ok(()),
        Scope::Labels { name } => crate::query::validate_name(name),
        Scope::Node { name } => NodeId::parse(name).map(|_| ()).map_err(Error::from),
        Scope::Module { name } => crate::secrets::validate_module(name),
    }
}

/// One module's effective settings on one node.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct NodeSettings {
    pub node: String,
    /// Whether the module runs there now (as the record says).
    pub runs: bool,
    pub settings: BTreeMap<String, Effective>,
}

/// `GET /v1/modules/{name}/settings/effective`.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct EffectiveView {
    pub module: String,
    /// The settings files the module declares, at `/modules/<module>/<name>`.
    pub files: Vec<SettingsFile>,
    /// Where the files go on each node.
    pub dir: String,
    pub nodes: Vec<NodeSettings>,
}

impl Config {
    /// Create or replace a layer whole, under the request's preconditions.
    pub async fn put_layer(
        &self,
        scope: &Scope,
        selector: Option<Labels>,
        values: Values,
        pre: &Preconditions,
        audit: &Audit,
    ) -> Result<(LayerView, bool), Error> {
        validate_scope(scope)?;
        settings::validate_values(&values)?;
        match (scope, &selector) {
            (Scope::Labels { .. }, Some(s)) => validate_labels("selector", s)?,
            (Scope::Labels { .. }, None) => {
                return Err(Error::Invalid {
                    field: "selector".into(),
                    reason: "a label layer needs a selector (`{}` matches every node)".into(),
                });
            }
            (_, Some(_)) => {
                return Err(Error::Invalid {
                    field: "selector".into(),
                    reason: "only a label layer has a selector".into(),
                });
            }
            (_, None) => {}
        }
        let (kind, name) = scope.key();
        let mut tx = self.pool.begin().await?;
        let current: Option<i64> = sqlx::query_scalar(
            "SELECT revision FROM config.settings WHERE scope = $1 AND name = $2 FOR UPDATE",
        )
        .bind(kind)
        .bind(name)
        .fetch_optional(&mut *tx)
        .await?;
        pre.check_write(current, &format!("settings layer `{}`", scope.path()))?;
        let row: Row = sqlx::query_as(
            r#"INSERT INTO config.settings AS s (scope, name, selector, "values") VALUES ($1, $2, $3, $4)
               ON CONFLICT (scope, name) DO UPDATE SET selector = excluded.selector,
               "values" = excluded."values", revision = s.revision + 1, updated_at = now()
               RETURNING scope, name, selector, "values", revision, created_at, updated_at"#,
        )
        .bind(kind)
        .bind(name)
        .bind(selector.as_ref().map(Json))
        .bind(Json(&values))
        .fetch_one(&mut *tx)
        .await?;
        self.commit_change(tx, audit, "values").await?;
        let view = view(row).ok_or_else(|| Error::Corrupt {
            what: "settings scope".into(),
            reason: kind.into(),
        })?;
        Ok((view, current.is_none()))
    }

    /// Delete a layer; its keys fall back to weaker layers on every node.
    pub async fn delete_layer(
        &self,
        scope: &Scope,
        pre: &Preconditions,
        audit: &Audit,
    ) -> Result<(), Error> {
        let (kind, name) = scope.key();
        let mut tx = self.pool.begin().await?;
        let current: Option<i64> = sqlx::query_scalar(
            "SELECT revision FROM config.settings WHERE scope = $1 AND name = $2 FOR UPDATE",
        )
        .bind(kind)
        .bind(name)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(revision) = current else {
            return Err(Error::NotFound(format!(
                "no settings layer `{}`",
                scope.path().chars().take(120).collect::<String>()
            )));
        };
        pre.check_delete(revision, &format!("settings layer `{}`", scope.path()))?;
        sqlx::query("DELETE FROM config.settings WHERE scope = $1 AND name = $2")
            .bind(kind)
            .bind(name)
            .execute(&mut *tx)
            .await?;
        self.commit_change(tx, audit, "body").await?;
        Ok(())
    }

    /// One layer.
    pub async fn layer(&self, scope: &Scope) -> Result<Option<LayerView>, Error> {
        let (kind, name) = scope.key();
        let row: Option<Row> = sqlx::query_as(
            r#"SELECT scope, name, selector, "values", revision, created_at, updated_at
               FROM config.settings WHERE scope = $1 AND name = $2"#,
        )
        .bind(kind)
        .bind(name)
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.and_then(view))
    }

    /// Every layer, weakest scope first, then by name.
    pub async fn layers(&self) -> Result<Vec<LayerView>, Error> {
        let rows: Vec<Row> = sqlx::query_as(
            r#"SELECT scope, name, selector, "values", revision, created_at, updated_at
               FROM config.settings
               ORDER BY array_position(ARRAY['global','labels','node','module'], scope), name"#,
        )
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.into_iter().filter_map(view).collect())
    }

    /// The effective settings of `module` on each node that runs it (or on
    /// `node` alone, whether it runs it or not), each value with its layer.
    pub async fn effective(
        &self,
        module: &str,
        node: Option<&NodeId>,
    ) -> Result<EffectiveView, Error> {
        crate::secrets::validate_module(module)?;
        let mut conn = self.pool.acquire().await?;
        let placed: Option<(Vec<String>, Json<Vec<SettingsFile>>)> = sqlx::query_as(
            "SELECT nodes, settings_files FROM config.modules WHERE module = $1 AND NOT removed",
        )
        .bind(module)
        .fetch_optional(&mut *conn)
        .await?;
        let (runs_on, files) = placed.map(|(n, f)| (n, f.0)).unwrap_or_default();
        let wanted: Vec<String> = match node {
            Some(n) => vec![n.as_str().to_owned()],
            None => runs_on.clone(),
        };
        let labels: BTreeMap<String, Json<Labels>> = sqlx::query_as::<_, (String, Json<Labels>)>(
            "SELECT node, labels FROM config.nodes WHERE node = ANY($1)",
        )
        .bind(&wanted)
        .fetch_all(&mut *conn)
        .await?
        .into_iter()
        .collect();
        let layers = all(&mut conn).await?;
        let nodes = wanted
            .into_iter()
            .map(|n| {
                let l = labels.get(&n).map(|l| l.0.clone()).unwrap_or_default();
                NodeSettings {
                    settings: settings::effective(&layers, module, &n, &l),
                    runs: runs_on.contains(&n),
                    node: n,
                }
            })
            .collect();
        Ok(EffectiveView {
            module: module.to_owned(),
            dir: module_dir(module),
            files,
            nodes,
        })
    }
}
