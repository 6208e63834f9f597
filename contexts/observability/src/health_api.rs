//! `GET /v1/health` and `GET /v1/alerts` (viewer role).

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use chrono::{DateTime, Utc};
use mesh_plumbing::api::{ApiQuery, Problem};
use mesh_plumbing::openapi::{BadRequest, Unprocessable};
use mesh_plumbing::page::{ListQuery, Page};
use mesh_protocol::NodeId;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use uuid::Uuid;

use crate::health::{ModuleHealthView, NodeHealthView};
use crate::{Error, Observability};

pub(crate) fn routes() -> OpenApiRouter<Arc<Observability>> {
    OpenApiRouter::new()
        .routes(routes!(health))
        .routes(routes!(alerts))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
struct HealthParams {
    /// Only this module (and the nodes that run it).
    module: Option<String>,
    /// Only this node (and the modules with a replica on it).
    node: Option<String>,
}

/// The fleet's health: every module (healthy, degraded, down, unknown) with
/// its replicas, and every node, each replica with the unit state and the
/// probe results that decided it.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct HealthView {
    pub modules: Vec<ModuleHealthView>,
    pub nodes: Vec<NodeHealthView>,
}

/// Health of every module, replica and node, derived from the units and
/// probe results nodes report. A replica is healthy when its unit runs and
/// every probe passes (without probes: when its unit runs), unhealthy when a
/// probe fails or the unit failed, unknown while its node is unreachable or
/// nothing decided yet; a module is healthy, degraded (some replicas
/// unhealthy), down (none healthy) or unknown.
#[utoipa::path(
    get,
    path = "/v1/health",
    tag = "observability",
    params(HealthParams),
    responses(
        (status = 200, description = "Health of the fleet", body = HealthView),
        BadRequest,
        Unprocessable,
    )
)]
async fn health(
    State(obs): State<Arc<Observability>>,
    ApiQuery(params): ApiQuery<HealthParams>,
) -> Result<Json<HealthView>, Problem> {
    if let Some(node) = &params.node {
        NodeId::parse(node).map_err(|e| Problem::unprocessable("node", e.to_string()))?;
    }
    let (mut modules, mut nodes) = obs.health().await?;
    if let Some(m) = &params.module {
        modules.retain(|v| &v.module == m);
        let on: Vec<String> = modules
            .iter()
            .flat_map(|v| v.replicas.iter().map(|r| r.node.clone()))
            .collect();
        nodes.retain(|n| on.contains(&n.node));
    }
    if let Some(n) = &params.node {
        nodes.retain(|v| &v.node == n);
        modules.retain(|v| v.replicas.iter().any(|r| &r.node == n));
    }
    Ok(Json(HealthView { modules, nodes }))
}

/// Which alerts `GET /v1/alerts` lists.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct AlertsParams {
    /// `open` (default), `resolved` or `all`.
    pub state: Option<String>,
    /// Only this kind, e.g. `node_unreachable`.
    pub kind: Option<String>,
    /// Only this subject, e.g. `node/db-1`, `module/web`, `controller`.
    pub subject: Option<String>,
}

/// One alert.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, PartialEq)]
pub struct AlertView {
    pub id: Uuid,
    pub kind: String,
    /// `info`, `warning` or `critical`.
    pub severity: String,
    /// What it is about: `node/<id>`, `module/<name>`, `unit/<node>/<unit>`,
    /// `queue/<name>`, `controller`, `fleet`.
    pub subject: String,
    /// In words, e.g. `db-1 unreachable for 6 days (…)`.
    pub message: String,
    pub since: DateTime<Utc>,
    /// When it was resolved (none: open).
    pub resolved_at: Option<DateTime<Utc>>,
    /// `open` or `resolved`.
    pub state: String,
    /// Seconds from `since` to `resolved_at`, or to now while open.
    pub duration_secs: i64,
}

/// A page of alerts, newest raised first.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct AlertList {
    pub alerts: Vec<AlertView>,
    /// Pass as `after` for the next page; none on the last.
    pub next: Option<Uuid>,
}

/// Alerts, newest raised first: open ones by default (`state=resolved` or
/// `all` for resolved ones, kept for the controller's
/// `alert_retention_secs`), filtered by kind and subject, a page at a time:
/// `after` is an alert's id (alerts raised before it), `limit` 1 to 500,
/// default 100.
#[utoipa::path(
    get,
    path = "/v1/alerts",
    tag = "observability",
    params(AlertsParams, Page),
    responses(
        (status = 200, description = "A page of alerts", body = AlertList),
        BadRequest,
        Unprocessable,
    )
)]
async fn alerts(
    State(obs): State<Arc<Observability>>,
    ListQuery(page, params): ListQuery<AlertsParams>,
) -> Result<Json<AlertList>, Problem> {
    let after = page.after_id()?;
    let limit = page.limit(100, 500)?;
    Ok(Json(obs.alerts(&params, after, limit).await?))
}

pub(crate) async fn list(
    pool: &sqlx::PgPool,
    params: &AlertsParams,
    after: Option<Uuid>,
    limit: i64,
) -> Result<AlertList, Error> {
    let state = params.state.as_deref().unwrap_or("open");
    if !matches!(state, "open" | "resolved" | "all") {
        return Err(Error::Invalid {
            field: "state".to_owned(),
            reason: format!("`{state}`: one of open, resolved, all"),
        });
    }
    type Row = (
        Uuid,
        String,
        String,
        String,
        String,
        DateTime<Utc>,
        Option<DateTime<Utc>>,
        DateTime<Utc>,
    );
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT id, kind, severity, subject, message, since, resolved_at, now() \
         FROM observability.alerts \
         WHERE ($1 = 'all' OR ($1 = 'open') = (resolved_at IS NULL)) \
           AND ($2::text IS NULL OR kind = $2) \
           AND ($3::text IS NULL OR subject = $3) \
           AND ($4::uuid IS NULL OR id < $4) \
         ORDER BY id DESC LIMIT $5",
    )
    .bind(state)
    .bind(&params.kind)
    .bind(&params.subject)
    .bind(after)
    .bind(limit + 1)
    .fetch_all(pool)
    .await?;
    let more = rows.len() as i64 > limit;
    let mut alerts: Vec<AlertView> = rows
        .into_iter()
        .take(usize::try_from(limit).unwrap_or(100))
        .map(
            |(id, kind, severity, subject, message, since, resolved_at, now)| AlertView {
                id,
                kind,
                severity,
                subject,
                message,
                since,
                state: if resolved_at.is_some() {
                    "resolved"
                } else {
                    "open"
                }
                .to_owned(),
                duration_secs: (resolved_at.unwrap_or(now) - since).num_seconds().max(0),
                resolved_at,
            },
        )
        .collect();
    alerts.shrink_to_fit();
    let next = if more {
        alerts.last().map(|a| a.id)
    } else {
        None
    };
    Ok(AlertList { alerts, next })
}
