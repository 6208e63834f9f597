//! The HTTP API: one interface in front of every context. Each route is served
//! by the context that owns the resource; this module adds what belongs to no
//! context: health, metrics, views composed from several contexts, a
//! module's unit output fetched through the agents (logs.rs), and the
//! OpenAPI document of them all (openapi.rs). The operator dashboard's static
//! files (dashboard.rs) are served beside it, open and outside `/v1`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::extract::State;
use axum::http::StatusCode;
use axum::http::header::CONTENT_TYPE;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json, Router};
use mesh_plumbing::api::Problem;
use mesh_plumbing::openapi::{NotFound, Unprocessable};
use mesh_plumbing::path::NodePath;
use mesh_protocol::Section;
use prometheus_client::registry::Registry;
use serde_json::json;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::auth;
use crate::openapi;
use crate::router::Contexts;

#[derive(Clone)]
pub struct ApiState {
    pub contexts: Arc<Contexts>,
    pub registry: Arc<Registry>,
    pub broker_up: Arc<AtomicBool>,
    /// Wakes the relay after the auth layer wrote an audit event.
    pub signal: mesh_plumbing::OutboxSignal,
    /// The controller's metrics: the auth layer's counters (unauthenticated,
    /// unaudited, lost entries), the request metrics, the gauges the
    /// observability work sets (`set_module_health_counts`, `set_open_alerts`).
    pub metrics: crate::metrics::Metrics,
    /// The latest reading of the broker's queues (`None` before the first):
    /// `crate::broker_stats`.
    pub queue_depths: crate::broker_stats::QueueDepthsWatch,
    /// Logs requests to the agents and their answers, in memory (logs.rs).
    pub logs: Arc<crate::logs::LogsHub>,
}

/// Every route, each context's behind the auth layer that knows the context
/// (auth.rs: the role each route needs; audit events to that context's outbox),
/// and the OpenAPI document of them all at `/v1/openapi.json`: each route is
/// registered with its description (`routes!`), so none is served undescribed.
/// An unknown path answers 404 and a method a path does not serve 405, both
/// problem+json. The dashboard's files (dashboard.rs) are merged in without
/// the auth layer (they hold no data) and without a place in the document
/// (they are not the API). Around all of it, the request id, the access log
/// and the request metrics (access.rs).
pub fn router(state: ApiState) -> Router {
    let metrics = state.metrics.clone();
    let (router, document) = routes(state).split_for_parts();
    let document = Document(Arc::new(
        serde_json::to_value(openapi::finish(document))
            .map(|mut doc| {
                openapi::open_all_of(&mut doc);
                serde_json::to_vec(&doc).unwrap_or_default()
            })
            .unwrap_or_default(),
    ));
    let router = router
        .layer(Extension(document))
        // The dashboard's static files: open, outside /v1 and its document.
        .merge(crate::dashboard::router())
        .fallback(|| async { Problem::not_found("no such route") })
        .method_not_allowed_fallback(method_not_allowed);
    // Last, so that they wrap every route and both fallbacks.
    crate::access::layered(router, metrics)
}

/// The routes and their document, before the controller completes it.
fn routes(state: ApiState) -> OpenApiRouter {
    let c = &state.contexts;
    let failpoint: Option<Arc<str>> = std::env::var(auth::API_FAILPOINT_ENV).ok().map(Into::into);
    let guarded = |routes: OpenApiRouter, context: &'static str, pool: &sqlx::PgPool| {
        routes.layer(axum::middleware::from_fn_with_state(
            auth::Guard {
                identity: c.identity.clone(),
                context,
                pool: pool.clone(),
                signal: state.signal.clone(),
                metrics: state.metrics.clone(),
                failpoint: failpoint.clone(),
            },
            auth::guard,
        ))
    };
    let own = OpenApiRouter::new()
        .routes(routes!(healthz))
        .routes(routes!(metrics))
        .routes(routes!(node))
        .routes(routes!(document))
        .with_state(state.clone());
    use mesh_plumbing::Context as _;
    guarded(own, mesh_identity::SCHEMA, c.identity.pool())
        .merge(guarded(
            c.inventory.clone().routes(),
            mesh_inventory::Inventory::SCHEMA,
            c.inventory.pool(),
        ))
        .merge(guarded(
            c.config.clone().routes(),
            mesh_config::Config::SCHEMA,
            c.config.pool(),
        ))
        .merge(guarded(
            c.identity.clone().routes(),
            mesh_identity::SCHEMA,
            c.identity.pool(),
        ))
        .merge(guarded(
            c.connectivity.clone().routes(),
            mesh_connectivity::SCHEMA,
            c.connectivity.pool(),
        ))
        .merge(guarded(
            c.observability.clone().routes(),
            mesh_observability::SCHEMA,
            c.observability.pool(),
        ))
        .merge(guarded(
            c.delivery.clone().routes(),
            mesh_delivery::SCHEMA,
            c.delivery.pool(),
        ))
        .merge(guarded(
            c.provisioning.clone().routes(),
            mesh_provisioning::SCHEMA,
            c.provisioning.pool(),
        ))
        // A module's unit output: served by the controller (it needs the
        // broker), audited as inventory's (the module's owner).
        .merge(guarded(
            crate::logs::routes(crate::logs::LogsApi {
                contexts: c.clone(),
                hub: state.logs.clone(),
            }),
            mesh_inventory::Inventory::SCHEMA,
            c.inventory.pool(),
        ))
}

/// The document, serialized once when the router is built.
#[derive(Clone)]
struct Document(Arc<Vec<u8>>);

/// This API's OpenAPI document.
#[utoipa::path(
    get,
    path = "/v1/openapi.json",
    tag = "api",
    responses((status = 200, description = "The OpenAPI 3.1 document of every route", body = Object))
)]
async fn document(Extension(Document(doc)): Extension<Document>) -> Response {
    ([(CONTENT_TYPE, "application/json")], doc.to_vec()).into_response()
}

/// A method the path does not serve (axum adds the `Allow` header).
async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> Problem {
    Problem::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!(
            "`{method}` is not served on `{}`; `Allow` lists what is",
            uri.path().chars().take(200).collect::<String>()
        ),
    )
}

/// What `/healthz` answers.
#[derive(serde::Serialize, utoipa::ToSchema)]
#[allow(dead_code)]
struct Health {
    /// `ok` or `degraded`.
    status: String,
    /// `broker` and each context's database: `ok` or `down`.
    checks: std::collections::BTreeMap<String, String>,
}

/// 200 when the broker connection is up and every context's database answers.
#[utoipa::path(
    get,
    path = "/healthz",
    tag = "api",
    responses(
        (status = 200, description = "Everything answers", body = Health),
        (status = 503, description = "Something does not; `checks` says what", body = Health),
    )
)]
async fn healthz(State(state): State<ApiState>) -> Response {
    let mut checks = serde_json::Map::new();
    let broker = state.broker_up.load(Ordering::Relaxed);
    checks.insert("broker".into(), json!(if broker { "ok" } else { "down" }));
    let mut ok = broker;
    for (schema, pool) in state.contexts.schemas() {
        let up = mesh_plumbing::reachable(pool).await;
        ok &= up;
        checks.insert(schema.into(), json!(if up { "ok" } else { "down" }));
    }
    let status = if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        Json(json!({ "status": if ok { "ok" } else { "degraded" }, "checks": checks })),
    )
        .into_response()
}

/// The controller's metrics, in the OpenMetrics text format.
#[utoipa::path(
    get,
    path = "/metrics",
    tag = "api",
    responses((status = 200, description = "Every metric", body = String, content_type = "application/openmetrics-text"))
)]
async fn metrics(State(state): State<ApiState>) -> Response {
    let mut text = String::new();
    if let Err(e) = prometheus_client::encoding::text::encode(&mut text, &state.registry) {
        return Problem::internal(e).into_response();
    }
    (
        [(
            CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

/// One section of a node: what its owning context declared, next to what the
/// node reported it applied.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
struct SectionView {
    /// Newest generation declared (none: nothing was ever declared).
    declared: Option<i64>,
    /// Newest generation the node reported applied (none: never).
    applied: Option<i64>,
    /// Last outcome the node reported for this section, with its error.
    outcome: Option<String>,
    error: Option<String>,
    declared_at: Option<chrono::DateTime<chrono::Utc>>,
}

#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
struct NodeDetail {
    #[serde(flatten)]
    node: mesh_inventory::NodeView,
    /// Each section (`config`, `inventory`, `connectivity`, `provisioning`),
    /// declared next to applied.
    #[schema(value_type = std::collections::BTreeMap<String, SectionView>)]
    sections: std::collections::BTreeMap<&'static str, SectionView>,
    /// The node's health and each replica it runs, with the unit state and
    /// probe results that decided it (observability; none until the record
    /// told observability of the node).
    health: Option<mesh_observability::NodeHealthView>,
}

/// A node as inventory knows it, with each section's declared generation from the
/// context that owns the section, next to the generation the node applied.
/// A node as inventory knows it, with each section's declared and applied
/// generations.
#[utoipa::path(
    get,
    path = "/v1/nodes/{id}",
    tag = "inventory",
    params(NodePath),
    responses(
        (status = 200, description = "The node", body = NodeDetail),
        NotFound,
        Unprocessable,
    )
)]
async fn node(
    State(state): State<ApiState>,
    NodePath(id): NodePath,
) -> Result<Json<NodeDetail>, Problem> {
    let node = state
        .contexts
        .inventory
        .node(&id)
        .await
        .map_err(Problem::internal)?
        .ok_or_else(|| Problem::not_found(format!("no node `{id}`")))?;
    let config = state
        .contexts
        .config
        .section(&id)
        .await
        .map_err(Problem::internal)?;
    let inventory = state
        .contexts
        .inventory
        .section(&id)
        .await
        .map_err(Problem::internal)?;
    let connectivity = state
        .contexts
        .connectivity
        .section(&id)
        .await
        .map_err(Problem::internal)?;
    let provisioning = state
        .contexts
        .provisioning
        .section(&id)
        .await
        .map_err(Problem::internal)?;
    let section = |section: Section, declared: Option<(i64, chrono::DateTime<chrono::Utc>)>| {
        let applied = node.applied.get(section.as_str());
        SectionView {
            declared: declared.map(|d| d.0),
            applied: applied.map(|a| a.generation).filter(|g| *g > 0),
            outcome: applied.and_then(|a| a.outcome.clone()),
            error: applied.and_then(|a| a.error.clone()),
            declared_at: declared.map(|d| d.1),
        }
    };
    let sections = [
        (
            Section::Config.as_str(),
            section(
                Section::Config,
                config.as_ref().map(|c| (c.generation, c.declared_at)),
            ),
        ),
        (
            Section::Inventory.as_str(),
            section(Section::Inventory, inventory),
        ),
        (
            Section::Connectivity.as_str(),
            section(
                Section::Connectivity,
                connectivity.as_ref().map(|c| (c.generation, c.declared_at)),
            ),
        ),
        (
            Section::Provisioning.as_str(),
            section(
                Section::Provisioning,
                provisioning.as_ref().map(|c| (c.generation, c.declared_at)),
            ),
        ),
    ]
    .into_iter()
    .collect();
    let (_, nodes) = state
        .contexts
        .observability
        .health()
        .await
        .map_err(Problem::internal)?;
    let health = nodes.into_iter().find(|n| n.node == id.as_str());
    Ok(Json(NodeDetail {
        node,
        sections,
        health,
    }))
}
