//! HTTP routes of settings: the layers (`/v1/settings/global`,
//! `/v1/settings/{labels|nodes|modules}/{name}`), each written whole with
//! ETag / If-Match, and a module's effective settings.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use mesh_plumbing::api::{ApiJson, ApiQuery, Problem};
use mesh_plumbing::audit::Audit;
use mesh_plumbing::etag::{self, Preconditions};
use mesh_plumbing::openapi::{
    BadRequest, BodyErrors, NotFound, NotModified, PreconditionFailed, PreconditionRequired,
    Unprocessable,
};
use mesh_protocol::{Labels, NodeId};
use serde::{Deserialize, Serialize};
use utoipa::IntoParams;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::api::IF_MATCH;
use crate::layers::{EffectiveView, LayerView};
use crate::settings::{Scope, Values};
use crate::{Config, Error};
use mesh_plumbing::api::created_status;

pub(crate) fn routes() -> OpenApiRouter<Arc<Config>> {
    OpenApiRouter::new()
        .routes(routes!(list_layers))
        .routes(routes!(get_global, put_global, delete_global))
        .routes(routes!(get_layer, put_layer, delete_layer))
        .routes(routes!(effective))
}

/// Body of a layer's `PUT`: the whole layer.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct LayerBody {
    /// Key → string, number or boolean. Keys: 1 to 128 of A-Z a-z 0-9 _,
    /// not starting with a digit.
    #[schema(value_type = Object)]
    values: Values,
    /// Label layers only: the pairs a node's labels must contain (`{}`: every node).
    #[serde(default)]
    selector: Option<Labels>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
struct LayerList {
    layers: Vec<LayerView>,
}

fn scope_of(kind: &str, name: String) -> Result<Scope, Problem> {
    let scope = match kind {
        "labels" => Scope::Labels { name },
        "nodes" => Scope::Node { name },
        "modules" => Scope::Module { name },
        other => {
            return Err(Problem::unprocessable(
                "scope",
                format!(
                    "`{}`: one of labels, nodes, modules (or the path /v1/settings/global)",
                    other.chars().take(40).collect::<String>()
                ),
            ));
        }
    };
    crate::layers::validate_scope(&scope)?;
    Ok(scope)
}

async fn get(config: &Config, scope: Scope, headers: &HeaderMap) -> Result<Response, Problem> {
    let Some(layer) = config.layer(&scope).await? else {
        return Err(Error::NotFound(format!("no settings layer `{}`", scope.path())).into());
    };
    Ok(etag::conditional_get(headers, layer.revision, &layer))
}

async fn put(
    config: &Config,
    scope: Scope,
    headers: &HeaderMap,
    audit: &Audit,
    body: LayerBody,
) -> Result<Response, Problem> {
    let pre = Preconditions::from_headers(headers)?;
    let (layer, created) = config
        .put_layer(&scope, body.selector, body.values, &pre, audit)
        .await?;
    Ok(etag::with_etag(
        created_status(created),
        layer.revision,
        layer,
    ))
}

async fn delete(
    config: &Config,
    scope: Scope,
    headers: &HeaderMap,
    audit: &Audit,
) -> Result<StatusCode, Problem> {
    let pre = Preconditions::from_headers(headers)?;
    config.delete_layer(&scope, &pre, audit).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Every settings layer, global first, then label, node and module layers.
#[utoipa::path(get, path = "/v1/settings",
    responses((status = 200, description = "Every layer", body = LayerList)))]
async fn list_layers(State(config): State<Arc<Config>>) -> Result<Json<LayerList>, Problem> {
    Ok(Json(LayerList {
        layers: config.layers().await?,
    }))
}

/// The global layer (the weakest).
#[utoipa::path(get, path = "/v1/settings/global",
    params(("If-None-Match" = Option<String>, Header, nullable = false, description = "The ETag you hold: 304 while it is current")),
    responses((status = 200, description = "The layer", body = LayerView, headers(("ETag" = String, description = "`\"<revision>\"`"))),
        NotModified, NotFound))]
async fn get_global(
    State(config): State<Arc<Config>>,
    headers: HeaderMap,
) -> Result<Response, Problem> {
    get(&config, Scope::Global, &headers).await
}

/// Create or replace the global layer whole.
#[utoipa::path(put, path = "/v1/settings/global",
    params(
        ("If-Match" = Option<String>, Header, nullable = false, description = IF_MATCH),
        ("If-None-Match" = Option<String>, Header, nullable = false, description = "`*`: only create"),
    ),
    request_body = LayerBody,
    responses(
        (status = 200, description = "Replaced", body = LayerView, headers(("ETag" = String, description = "`\"<revision>\"`"))),
        (status = 201, description = "Created", body = LayerView, headers(("ETag" = String, description = "`\"<revision>\"`"))),
        BodyErrors, PreconditionFailed, PreconditionRequired))]
async fn put_global(
    State(config): State<Arc<Config>>,
    audit: Audit,
    headers: HeaderMap,
    ApiJson(body): ApiJson<LayerBody>,
) -> Result<Response, Problem> {
    put(&config, Scope::Global, &headers, &audit, body).await
}

/// Delete the global layer.
#[utoipa::path(delete, path = "/v1/settings/global",
    params(("If-Match" = Option<String>, Header, nullable = false, description = "Delete only at one of these quoted revisions")),
    responses((status = 204, description = "Deleted"), BadRequest, NotFound, PreconditionFailed))]
async fn delete_global(
    State(config): State<Arc<Config>>,
    audit: Audit,
    headers: HeaderMap,
) -> Result<StatusCode, Problem> {
    delete(&config, Scope::Global, &headers, &audit).await
}

/// A label, node or module layer.
#[utoipa::path(get, path = "/v1/settings/{scope}/{name}",
    params(
        ("scope" = String, Path, description = "`labels`, `nodes` or `modules`"),
        ("name" = String, Path, description = "The label layer's name (a-z 0-9 . _ -), the node id or the module name"),
        ("If-None-Match" = Option<String>, Header, nullable = false, description = "The ETag you hold: 304 while it is current"),
    ),
    responses((status = 200, description = "The layer", body = LayerView, headers(("ETag" = String, description = "`\"<revision>\"`"))),
        NotModified, NotFound, Unprocessable))]
async fn get_layer(
    State(config): State<Arc<Config>>,
    Path((kind, name)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Response, Problem> {
    get(&config, scope_of(&kind, name)?, &headers).await
}

/// Create or replace a label, node or module layer whole. A label layer has
/// a `selector`; the others have none.
#[utoipa::path(put, path = "/v1/settings/{scope}/{name}",
    params(
        ("scope" = String, Path, description = "`labels`, `nodes` or `modules`"),
        ("name" = String, Path, description = "The label layer's name (a-z 0-9 . _ -), the node id or the module name"),
        ("If-Match" = Option<String>, Header, nullable = false, description = IF_MATCH),
        ("If-None-Match" = Option<String>, Header, nullable = false, description = "`*`: only create"),
    ),
    request_body = LayerBody,
    responses(
        (status = 200, description = "Replaced", body = LayerView, headers(("ETag" = String, description = "`\"<revision>\"`"))),
        (status = 201, description = "Created", body = LayerView, headers(("ETag" = String, description = "`\"<revision>\"`"))),
        BodyErrors, PreconditionFailed, PreconditionRequired))]
async fn put_layer(
    State(config): State<Arc<Config>>,
    Path((kind, name)): Path<(String, String)>,
    audit: Audit,
    headers: HeaderMap,
    ApiJson(body): ApiJson<LayerBody>,
) -> Result<Response, Problem> {
    put(&config, scope_of(&kind, name)?, &headers, &audit, body).await
}

/// Delete a label, node or module layer.
#[utoipa::path(delete, path = "/v1/settings/{scope}/{name}",
    params(
        ("scope" = String, Path, description = "`labels`, `nodes` or `modules`"),
        ("name" = String, Path, description = "The label layer's name, the node id or the module name"),
        ("If-Match" = Option<String>, Header, nullable = false, description = "Delete only at one of these quoted revisions"),
    ),
    responses((status = 204, description = "Deleted"), BadRequest, NotFound, PreconditionFailed, Unprocessable))]
async fn delete_layer(
    State(config): State<Arc<Config>>,
    Path((kind, name)): Path<(String, String)>,
    audit: Audit,
    headers: HeaderMap,
) -> Result<StatusCode, Problem> {
    delete(&config, scope_of(&kind, name)?, &headers, &audit).await
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
struct EffectiveParams {
    /// Show the settings on this node (whether the module runs there or not)
    /// instead of on every node that runs it.
    node: Option<String>,
}

/// A module's effective settings on each node that runs it: every value with
/// the layer it came from, the layers it shadows, and any tie between equally
/// specific label layers.
#[utoipa::path(get, path = "/v1/modules/{name}/settings/effective",
    params(("name" = String, Path, description = "The module's name"), EffectiveParams),
    responses((status = 200, description = "The effective settings", body = EffectiveView), BadRequest, Unprocessable))]
async fn effective(
    State(config): State<Arc<Config>>,
    Path(name): Path<String>,
    ApiQuery(params): ApiQuery<EffectiveParams>,
) -> Result<Json<EffectiveView>, Problem> {
    let node = params
        .node
        .as_deref()
        .map(NodeId::parse)
        .transpose()
        .map_err(Error::from)?;
    Ok(Json(config.effective(&name, node.as_ref()).await?))
}
