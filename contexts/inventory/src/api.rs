//! HTTP routes of the inventory context. Errors are problem+json naming the field.

use std::sync::Arc;

use axum::Json;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use mesh_plumbing::api::Problem;
use mesh_plumbing::openapi::{BadRequest, BodyErrors, NotFound, Unprocessable};
use mesh_protocol::{Labels, NodeId, validate_labels};
use serde::{Deserialize, Serialize};
use sqlx::types::Json as SqlJson;

use crate::nodes::{effective, emit};
use crate::query::{LabelsView, NodeSummary};
use crate::{Error, Inventory, SCHEMA};
use mesh_plumbing::api::ApiJson;
use mesh_plumbing::audit::{self, Audit};
use utoipa::IntoParams;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

/// The node routes, each with its OpenAPI description.
pub(crate) fn routes() -> OpenApiRouter<Arc<Inventory>> {
    OpenApiRouter::new()
        .routes(routes!(list_nodes))
        .routes(routes!(put_labels))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
struct ListParams {
    /// Return nodes whose id sorts after this one (the previous page's `next`).
    after: Option<String>,
    /// At most this many (the server caps it at its page size).
    #[param(minimum = 1)]
    limit: Option<i64>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
struct NodeList {
    nodes: Vec<NodeSummary>,
    /// Pass as `after` to get the next page; absent on the last page.
    #[serde(skip_serializing_if = "Option::is_none")]
    next: Option<String>,
    /// The fleet's heartbeat interval and grace now, and the detection time
    /// they give (the budget stretches them as the fleet grows).
    heartbeat: crate::HeartbeatView,
}

/// List nodes, by id, a page at a time.
#[utoipa::path(
    get,
    path = "/v1/nodes",
    tag = "inventory",
    params(ListParams),
    responses(
        (status = 200, description = "A page of nodes", body = NodeList),
        BadRequest,
        Unprocessable,
    )
)]
async fn list_nodes(
    State(inventory): State<Arc<Inventory>>,
    params: Result<Query<ListParams>, QueryRejection>,
) -> Result<Json<NodeList>, Problem> {
    let Query(params) = params.map_err(|e| Problem::new(StatusCode::BAD_REQUEST, e.body_text()))?;
    let limit = params.limit.unwrap_or(inventory.settings.max_page);
    if limit < 1 {
        return Err(Problem::unprocessable("limit", "must be at least 1"));
    }
    let nodes = inventory.nodes(params.after.as_deref(), limit).await?;
    let full =
        i64::try_from(nodes.len()).unwrap_or(i64::MAX) >= limit.min(inventory.settings.max_page);
    let next = if full {
        nodes.last().map(|n| n.id.clone())
    } else {
        None
    };
    Ok(Json(NodeList {
        nodes,
        next,
        heartbeat: inventory.heartbeat(),
    }))
}

/// Body of `PUT /v1/nodes/{id}/labels`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct LabelsBody {
    /// The operator's labels; they replace the previous ones whole.
    labels: Labels,
}

/// Response of `PUT /v1/nodes/{id}/labels`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
struct LabelsResponse {
    id: String,
    labels: LabelsView,
    version: i64,
}

/// Replace a node's operator labels.
#[utoipa::path(
    put,
    path = "/v1/nodes/{id}/labels",
    tag = "inventory",
    params(("id" = String, Path, description = "The node's id")),
    request_body = LabelsBody,
    responses(
        (status = 200, description = "The node's labels now", body = LabelsResponse),
        NotFound,
        BodyErrors,
    )
)]
async fn put_labels(
    State(inventory): State<Arc<Inventory>>,
    Path(id): Path<String>,
    audit: Audit,
    ApiJson(body): ApiJson<LabelsBody>,
) -> Result<Json<LabelsResponse>, Problem> {
    let id = NodeId::parse(&id).map_err(|_| Error::NodeNotFound(id.chars().take(80).collect()))?;
    validate_labels("labels", &body.labels).map_err(Error::from)?;
    let (labels, version) = inventory
        .set_operator_labels(&id, body.labels, &audit)
        .await?;
    Ok(Json(LabelsResponse {
        id: id.to_string(),
        labels,
        version,
    }))
}

impl Inventory {
    /// Replace a node's operator labels. Emits `inventory.node.updated` (and
    /// wakes the relay) when the effective labels change; writes the request's
    /// audit entry in the same transaction. Returns the labels and the node's
    /// version.
    pub async fn set_operator_labels(
        &self,
        id: &NodeId,
        operator: Labels,
        audit: &Audit,
    ) -> Result<(LabelsView, i64), Error> {
        validate_labels("labels", &operator)?;
        let mut tx = self.pool.begin().await?;
        let row: Option<(SqlJson<Labels>, SqlJson<Labels>, i64)> = sqlx::query_as(
            "SELECT reported_labels, operator_labels, version FROM inventory.nodes WHERE id = $1 FOR UPDATE",
        )
        .bind(id.as_str())
        .fetch_optional(&mut *tx)
        .await?;
        let Some((reported, before, version)) = row else {
            return Err(Error::NodeNotFound(id.to_string()));
        };
        let old = effective(&reported.0, &before.0);
        let view = LabelsView::new(reported.0, operator);
        let changed = old != view.effective;
        let version = if changed { version + 1 } else { version };
        sqlx::query("UPDATE inventory.nodes SET operator_labels = $2, version = $3 WHERE id = $1")
            .bind(id.as_str())
            .bind(SqlJson(&view.operator))
            .bind(version)
            .execute(&mut *tx)
            .await?;
        if changed {
            emit(
                &mut tx,
                mesh_protocol::RecordKind::NodeUpdated,
                id,
                view.effective.clone(),
                version,
            )
            .await?;
        }
        audit::record_ok(&mut tx, SCHEMA, audit).await?;
        tx.commit().await?;
        if changed {
            self.signal.notify();
        }
        Ok((view, version))
    }
}

/// The API layer's mapping of the context's errors to problem+json (domain
/// methods return [`Error`]; only the routes speak HTTP).
impl From<Error> for Problem {
    fn from(e: Error) -> Self {
        match e {
            Error::NodeNotFound(id) => Problem::not_found(format!("no node `{id}`")),
            Error::Invalid { field, reason } => Problem::unprocessable(field, reason),
            Error::NotFound(detail) => Problem::not_found(detail),
            Error::PreconditionFailed(detail) => {
                Problem::new(StatusCode::PRECONDITION_FAILED, detail)
            }
            Error::PreconditionRequired(detail) => {
                Problem::new(StatusCode::PRECONDITION_REQUIRED, detail)
            }
            Error::Conflict(detail) => Problem::new(StatusCode::CONFLICT, detail),
            other => Problem::internal(other),
        }
    }
}

impl axum::response::IntoResponse for Error {
    fn into_response(self) -> axum::response::Response {
        Problem::from(self).into_response()
    }
}
