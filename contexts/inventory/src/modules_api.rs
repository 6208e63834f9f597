//! HTTP routes of the fleet: modules (with ETag / If-Match), their intent
//! layers, node drains. Every write reconciles the fleet in its own
//! transaction, so the answer already shows where replicas go.
//!
//! Optimistic concurrency: a module's ETag is `"<revision>"`. A `PUT` that
//! replaces an existing module must say which revision it replaces (`If-Match`),
//! else 428; a stale one gets 412. `If-Match: *` replaces whatever is there;
//! `If-None-Match: *` only creates. `DELETE` checks `If-Match` when given.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::header::{ETAG, IF_MATCH, IF_NONE_MATCH};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use mesh_plumbing::api::{ApiJson, Problem, Role, created_status};
use mesh_plumbing::audit::{self, Audit};
use mesh_plumbing::etag::{Precondition, check_write, conditional_get, etag, precondition};
use mesh_plumbing::openapi::{
    BadRequest, BodyErrors, Conflict, NotFound, NotModified, PreconditionFailed,
    PreconditionRequired, Unprocessable,
};
use mesh_plumbing::page::{ListQuery, NoFilters, Page};
use mesh_plumbing::path::NodePath;

use serde::Serialize;
use sqlx::types::Json as SqlJson;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::fleet;
use crate::module::{AutoscalerIntent, MAX_REPLICAS, ModuleSpec, PolicyIntent, validate_name};
use crate::placement::Bounds;
use crate::query::ModuleView;
use crate::{Error, Inventory, SCHEMA};

/// The fleet routes, each with its OpenAPI description.
pub(crate) fn routes() -> OpenApiRouter<Arc<Inventory>> {
    OpenApiRouter::new()
        .routes(routes!(list_modules))
        .routes(routes!(get_module, put_module, delete_module))
        .routes(routes!(get_intent, put_intent, delete_intent))
        .routes(routes!(drain))
        .routes(routes!(undrain))
}

/// The value of an intent layer: [`Bounds`] for `policy`, [`AutoscalerIntent`]
/// for `autoscaler` (the document's schema of the intent routes' bodies).
#[derive(Serialize, utoipa::ToSchema)]
#[serde(untagged)]
#[allow(dead_code)]
enum IntentValue {
    Policy(Bounds),
    Autoscaler(AutoscalerIntent),
}

fn parse_name(name: &str) -> Result<(), Problem> {
    validate_name(name).map_err(Problem::from)
}

fn with_etag(status: StatusCode, view: ModuleView) -> Response {
    mesh_plumbing::etag::with_etag(status, view.revision, view)
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
struct ModuleList {
    modules: Vec<ModuleView>,
    #[serde(skip_serializing_if = "Option::is_none")]
    next: Option<String>,
}

/// List modules, by name, a page at a time: `after` is a module's name,
/// `limit` defaults to 100 and is cut to the inventory settings' `max_page`.
#[utoipa::path(
    get,
    path = "/v1/modules",
    params(Page),
    responses(
        (status = 200, description = "A page of modules", body = ModuleList),
        BadRequest,
        Unprocessable,
    )
)]
async fn list_modules(
    State(inventory): State<Arc<Inventory>>,
    ListQuery(page, NoFilters {}): ListQuery<NoFilters>,
) -> Result<Json<ModuleList>, Problem> {
    let limit = page.limit_capped(100, inventory.settings.max_page)?;
    let names = inventory.module_names(page.after.as_deref(), limit).await?;
    let next = mesh_plumbing::page::next(&names, limit, String::clone);
    let mut modules = Vec::with_capacity(names.len());
    for name in names {
        if let Some(m) = inventory.module(&name).await? {
            modules.push(m);
        }
    }
    Ok(Json(ModuleList { modules, next }))
}

/// A module with its revision, intent layers and assignments;
/// `If-None-Match` with the current tag answers 304.
#[utoipa::path(
    get,
    path = "/v1/modules/{name}",
    params(
        ("name" = String, Path, description = "The module's name: 1 to 48 of a-z 0-9 -, not ending in -<digits>"),
        ("If-None-Match" = Option<String>, Header, nullable = false, description = "The quoted revisions you hold: 304 if one is current"),
    ),
    responses(
        (status = 200, description = "The module", body = ModuleView, headers(("ETag" = String, description = "`\"<revision>\"`: give it as `If-Match` to replace or delete this revision"))),
        NotModified,
        NotFound,
        Unprocessable,
    )
)]
async fn get_module(
    State(inventory): State<Arc<Inventory>>,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Result<Response, Problem> {
    parse_name(&name)?;
    let view = inventory
        .module(&name)
        .await?
        .ok_or_else(|| Problem::not_found(format!("no module `{name}`")))?;
    Ok(conditional_get(&headers, view.revision, &view))
}

/// Create or replace a module, then reconcile the fleet. Replacing needs
/// `If-Match` (the ETag of the revision replaced, or `*`); `If-None-Match: *`
/// only creates. A module whose unit runs as root (`unit.user: root`) needs
/// the admin role (403 otherwise), and its audit entry says so.
#[utoipa::path(
    put,
    path = "/v1/modules/{name}",
    params(
        ("name" = String, Path, description = "The module's name: 1 to 48 of a-z 0-9 -, not ending in -<digits>"),
        ("If-Match" = Option<String>, Header, nullable = false, pattern = r#"^(\*|(W/)?\"[0-9]+\"( *, *(W/)?\"[0-9]+\")*)$"#, description = "`*` or the quoted revisions this write replaces"),
        ("If-None-Match" = Option<String>, Header, nullable = false, pattern = r#"^\*$"#, description = "`*`: only create"),
    ),
    request_body = ModuleSpec,
    responses(
        (status = 200, description = "Replaced", body = ModuleView, headers(("ETag" = String, description = "`\"<revision>\"`: give it as `If-Match` to replace or delete this revision"))),
        (status = 201, description = "Created", body = ModuleView, headers(("ETag" = String, description = "`\"<revision>\"`: give it as `If-Match` to replace or delete this revision"))),
        BodyErrors,
        (status = 403, description = "The token's role is smaller than `operator`; or the module runs as root (`unit.user: root`) and the token's role is not `admin`: `detail` says which.", body = Problem, content_type = "application/problem+json"),
        PreconditionFailed,
        PreconditionRequired,
    )
)]
async fn put_module(
    State(inventory): State<Arc<Inventory>>,
    Path(name): Path<String>,
    headers: HeaderMap,
    audit: Audit,
    ApiJson(spec): ApiJson<ModuleSpec>,
) -> Result<Response, Problem> {
    spec.validate(&name)?;
    if spec.runs_as_root() {
        // Said in the entry of the change, or of its refusal (decision 0051).
        audit.note(format!("module `{name}` runs as root (unit.user: root)"));
        let principal = audit.principal();
        if principal.role < Role::Admin {
            return Err(Problem::forbidden(format!(
                "module `{name}` asks to run as root (`unit.user: root`): that needs the admin role; token `{}` has {}",
                principal.name, principal.role
            )));
        }
    }
    let if_match = precondition(&headers, IF_MATCH)?;
    let if_none_match = precondition(&headers, IF_NONE_MATCH)?;
    let created = inventory
        .put_module(
            &name,
            &spec,
            if_match.as_ref(),
            if_none_match.as_ref(),
            &audit,
        )
        .await?;
    let view = inventory
        .module(&name)
        .await?
        .ok_or_else(|| Problem::internal("module vanished after its write"))?;
    Ok(with_etag(created_status(created), view))
}

/// Delete a module (and its replicas, through reconcile).
#[utoipa::path(
    delete,
    path = "/v1/modules/{name}",
    params(
        ("name" = String, Path, description = "The module's name: 1 to 48 of a-z 0-9 -, not ending in -<digits>"),
        ("If-Match" = Option<String>, Header, nullable = false, pattern = r#"^(\*|(W/)?\"[0-9]+\"( *, *(W/)?\"[0-9]+\")*)$"#, description = "Delete only if the module is at one of these quoted revisions"),
    ),
    responses(
        (status = 204, description = "Deleted"),
        BadRequest,
        NotFound,
        PreconditionFailed,
        Unprocessable,
    )
)]
async fn delete_module(
    State(inventory): State<Arc<Inventory>>,
    Path(name): Path<String>,
    headers: HeaderMap,
    audit: Audit,
) -> Result<StatusCode, Problem> {
    parse_name(&name)?;
    let if_match = precondition(&headers, IF_MATCH)?;
    inventory
        .delete_module(&name, if_match.as_ref(), &audit)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// The writable intent layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layer {
    Policy,
    Autoscaler,
}

fn parse_layer(layer: &str) -> Result<Layer, Problem> {
    match layer {
        "policy" => Ok(Layer::Policy),
        "autoscaler" => Ok(Layer::Autoscaler),
        "user" => Err(Problem::unprocessable(
            "layer",
            "the user layer is the module's own placement.match_labels.replicas: PUT the module",
        )),
        other => Err(Problem::not_found(format!(
            "no intent layer `{}` (policy, autoscaler)",
            other.chars().take(40).collect::<String>()
        ))),
    }
}

impl Layer {
    fn as_str(self) -> &'static str {
        match self {
            Layer::Policy => "policy",
            Layer::Autoscaler => "autoscaler",
        }
    }
}

/// One intent layer of a module.
#[utoipa::path(
    get,
    path = "/v1/modules/{name}/intent/{layer}",
    params(("name" = String, Path, description = "The module's name: 1 to 48 of a-z 0-9 -, not ending in -<digits>"), ("layer" = String, Path, description = "`policy` or `autoscaler` (the `user` layer is the module's own replica count)")),
    responses(
        (status = 200, description = "The layer's value", body = IntentValue, headers(("ETag" = String, description = "`\"<revision>\"`: give it as `If-Match` to replace or delete this revision"))),
        NotFound,
        Unprocessable,
    )
)]
async fn get_intent(
    State(inventory): State<Arc<Inventory>>,
    Path((name, layer)): Path<(String, String)>,
) -> Result<Response, Problem> {
    parse_name(&name)?;
    let layer = parse_layer(&layer)?;
    let row: Option<(SqlJson<serde_json::Value>, i64)> = sqlx::query_as(
        "SELECT value, revision FROM inventory.intents WHERE module = $1 AND layer = $2",
    )
    .bind(&name)
    .bind(layer.as_str())
    .fetch_optional(&inventory.pool)
    .await
    .map_err(Error::from)?;
    let (value, revision) = row.ok_or_else(|| {
        Problem::not_found(format!("module `{name}` has no {} intent", layer.as_str()))
    })?;
    Ok(([(ETAG, etag(revision))], Json(value.0)).into_response())
}

/// Set one intent layer of a module, then reconcile the fleet.
#[utoipa::path(
    put,
    path = "/v1/modules/{name}/intent/{layer}",
    params(("name" = String, Path, description = "The module's name: 1 to 48 of a-z 0-9 -, not ending in -<digits>"), ("layer" = String, Path, description = "`policy` or `autoscaler` (the `user` layer is the module's own replica count)")),
    request_body = IntentValue,
    responses(
        (status = 200, description = "The layer's value now", body = IntentValue, headers(("ETag" = String, description = "`\"<revision>\"`: give it as `If-Match` to replace or delete this revision"))),
        BodyErrors,
        NotFound,
    )
)]
async fn put_intent(
    State(inventory): State<Arc<Inventory>>,
    Path((name, layer)): Path<(String, String)>,
    audit: Audit,
    ApiJson(body): ApiJson<serde_json::Value>,
) -> Result<Response, Problem> {
    parse_name(&name)?;
    let layer = parse_layer(&layer)?;
    let value = match layer {
        Layer::Policy => {
            let p: PolicyIntent = serde_json::from_value(body)
                .map_err(|e| Problem::unprocessable("body", e.to_string()))?;
            if let (Some(min), Some(max)) = (p.min, p.max)
                && min > max
            {
                return Err(Problem::unprocessable("min", "must not exceed max"));
            }
            if p.min.unwrap_or(0) > MAX_REPLICAS || p.max.unwrap_or(0) > MAX_REPLICAS {
                return Err(Problem::unprocessable(
                    "max",
                    format!("at most {MAX_REPLICAS}"),
                ));
            }
            serde_json::to_value(p)
        }
        Layer::Autoscaler => {
            let a: AutoscalerIntent = serde_json::from_value(body)
                .map_err(|e| Problem::unprocessable("replicas", e.to_string()))?;
            if a.replicas > MAX_REPLICAS {
                return Err(Problem::unprocessable(
                    "replicas",
                    format!("at most {MAX_REPLICAS}"),
                ));
            }
            serde_json::to_value(a)
        }
    }
    .map_err(Problem::internal)?;
    let revision = inventory
        .put_intent(&name, layer.as_str(), &value, &audit)
        .await?;
    Ok(([(ETAG, etag(revision))], Json(value)).into_response())
}

/// Remove one intent layer of a module, then reconcile the fleet.
#[utoipa::path(
    delete,
    path = "/v1/modules/{name}/intent/{layer}",
    params(("name" = String, Path, description = "The module's name: 1 to 48 of a-z 0-9 -, not ending in -<digits>"), ("layer" = String, Path, description = "`policy` or `autoscaler` (the `user` layer is the module's own replica count)")),
    responses(
        (status = 204, description = "Removed"),
        NotFound,
        Unprocessable,
    )
)]
async fn delete_intent(
    State(inventory): State<Arc<Inventory>>,
    Path((name, layer)): Path<(String, String)>,
    audit: Audit,
) -> Result<StatusCode, Problem> {
    parse_name(&name)?;
    let layer = parse_layer(&layer)?;
    inventory
        .delete_intent(&name, layer.as_str(), &audit)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Answer of drain / undrain.
#[derive(Debug, Serialize, utoipa::ToSchema)]
struct DrainView {
    id: String,
    admin_state: String,
    drain_blocked: Option<String>,
}

/// `POST /v1/nodes/{id}/drain` and `/undrain`: one route declaration, one
/// handler ([`set_drain`]); they differ by their path, their description and
/// whether the node drains.
macro_rules! drain_route {
    ($(#[doc = $doc:literal])* $handler:ident, $path:literal, $drain:literal) => {
        $(#[doc = $doc])*
        #[utoipa::path(
            post,
            path = $path,
            params(NodePath),
            responses(
                (status = 200, description = "The node's administrative state", body = DrainView),
                NotFound,
                Conflict,
            )
        )]
        async fn $handler(
            inventory: State<Arc<Inventory>>,
            id: Path<String>,
            audit: Audit,
        ) -> Result<Json<DrainView>, Problem> {
            set_drain(inventory, id, $drain, audit).await
        }
    };
}

drain_route!(
    /// Start draining a node: its replicas move elsewhere, nothing new lands on it.
    drain,
    "/v1/nodes/{id}/drain",
    true
);
drain_route!(
    /// End a node's drain: it takes replicas again.
    undrain,
    "/v1/nodes/{id}/undrain",
    false
);

/// Start (`drain`) or end a node's drain.
async fn set_drain(
    State(inventory): State<Arc<Inventory>>,
    Path(id): Path<String>,
    drain: bool,
    audit: Audit,
) -> Result<Json<DrainView>, Problem> {
    let id = crate::api::known_node(&id)?;
    let (admin_state, drain_blocked) = inventory.set_drain(&id, drain, &audit).await?;
    Ok(Json(DrainView {
        id: id.to_string(),
        admin_state,
        drain_blocked,
    }))
}

/// Take the fleet lock, then the module `name`'s row: its revision, or
/// `None` when there is no such module. The fleet lock first, as every fleet
/// writer takes it: no lock cycles with the sweeper.
async fn lock_module(tx: &mut sqlx::PgConnection, name: &str) -> Result<Option<i64>, Error> {
    crate::state::lock(&mut *tx).await?;
    let revision =
        sqlx::query_scalar("SELECT revision FROM inventory.modules WHERE name = $1 FOR UPDATE")
            .bind(name)
            .fetch_optional(&mut *tx)
            .await?;
    Ok(revision)
}

impl Inventory {
    /// Create or replace a module under the preconditions given, then reconcile,
    /// with the request's audit entry. True if it was created.
    async fn put_module(
        &self,
        name: &str,
        spec: &ModuleSpec,
        if_match: Option<&Precondition>,
        if_none_match: Option<&Precondition>,
        audit: &Audit,
    ) -> Result<bool, Error> {
        let mut tx = self.pool.begin().await?;
        let current = lock_module(&mut tx, name).await?;
        check_write(
            current,
            if_match,
            if_none_match,
            &format!("module `{name}`"),
        )?;
        let created = current.is_none();
        if created {
            sqlx::query("INSERT INTO inventory.modules (name, spec) VALUES ($1, $2)")
                .bind(name)
                .bind(SqlJson(spec))
                .execute(&mut *tx)
                .await?;
        } else {
            sqlx::query(
                "UPDATE inventory.modules SET spec = $2, revision = revision + 1, updated_at = now() \
                 WHERE name = $1",
            )
            .bind(name)
            .bind(SqlJson(spec))
            .execute(&mut *tx)
            .await?;
        }
        let report = fleet::reconcile(&mut tx, &self.pass(chrono::Utc::now())).await?;
        audit::record_ok(&mut tx, SCHEMA, audit).await?;
        tx.commit().await?;
        if report.changed() {
            self.signal.notify();
        }
        Ok(created)
    }

    async fn delete_module(
        &self,
        name: &str,
        if_match: Option<&Precondition>,
        audit: &Audit,
    ) -> Result<(), Error> {
        let mut tx = self.pool.begin().await?;
        let current = lock_module(&mut tx, name).await?;
        let Some(rev) = current else {
            return Err(Error::NotFound(format!("no module `{name}`")));
        };
        // Deleting needs no precondition; one given must hold.
        if if_match.is_some() {
            check_write(Some(rev), if_match, None, &format!("module `{name}`"))?;
        }
        sqlx::query("DELETE FROM inventory.modules WHERE name = $1")
            .bind(name)
            .execute(&mut *tx)
            .await?;
        // Its health as observability told it goes too (a module created
        // again under the name is told anew).
        sqlx::query("DELETE FROM inventory.module_health WHERE module = $1")
            .bind(name)
            .execute(&mut *tx)
            .await?;
        // So do its targets: a module created again under the name runs its
        // own spec until delivery targets it anew.
        crate::targets::forget(&mut tx, name).await?;
        let report = fleet::reconcile(&mut tx, &self.pass(chrono::Utc::now())).await?;
        audit::record_ok(&mut tx, SCHEMA, audit).await?;
        tx.commit().await?;
        if report.changed() {
            self.signal.notify();
        }
        Ok(())
    }

    async fn put_intent(
        &self,
        name: &str,
        layer: &str,
        value: &serde_json::Value,
        audit: &Audit,
    ) -> Result<i64, Error> {
        let mut tx = self.pool.begin().await?;
        if lock_module(&mut tx, name).await?.is_none() {
            return Err(Error::NotFound(format!("no module `{name}`")));
        }
        let revision: i64 = sqlx::query_scalar(
            "INSERT INTO inventory.intents AS i (module, layer, value) VALUES ($1, $2, $3) \
             ON CONFLICT (module, layer) DO UPDATE SET value = excluded.value, revision = i.revision + 1, \
             updated_at = now() RETURNING revision",
        )
        .bind(name)
        .bind(layer)
        .bind(SqlJson(value))
        .fetch_one(&mut *tx)
        .await
        ?;
        let report = fleet::reconcile(&mut tx, &self.pass(chrono::Utc::now())).await?;
        audit::record_ok(&mut tx, SCHEMA, audit).await?;
        tx.commit().await?;
        if report.changed() {
            self.signal.notify();
        }
        Ok(revision)
    }

    async fn delete_intent(&self, name: &str, layer: &str, audit: &Audit) -> Result<(), Error> {
        let mut tx = self.pool.begin().await?;
        crate::state::lock(&mut tx).await?;
        let gone: Option<String> = sqlx::query_scalar(
            "DELETE FROM inventory.intents WHERE module = $1 AND layer = $2 RETURNING module",
        )
        .bind(name)
        .bind(layer)
        .fetch_optional(&mut *tx)
        .await?;
        if gone.is_none() {
            return Err(Error::NotFound(format!(
                "module `{name}` has no {layer} intent"
            )));
        }
        let report = fleet::reconcile(&mut tx, &self.pass(chrono::Utc::now())).await?;
        audit::record_ok(&mut tx, SCHEMA, audit).await?;
        tx.commit().await?;
        if report.changed() {
            self.signal.notify();
        }
        Ok(())
    }
}
