//! HTTP routes of the inventory context. Errors are problem+json naming the field.
//!
//! A node's operator labels have an ETag, `"<labels_revision>"`: a `PUT` must
//! say which revision it replaces (`If-Match`, or `*`), else 428; a stale one
//! gets 412 (see [`mesh_plumbing::etag`]).

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::header::IF_MATCH;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use mesh_plumbing::api::Problem;
use mesh_plumbing::etag::{Precondition, check_write, conditional_get, precondition, with_etag};
use mesh_plumbing::openapi::{
    BadRequest, BodyErrors, NotFound, NotModified, PreconditionFailed, PreconditionRequired,
    Unprocessable,
};
use mesh_plumbing::page::{ListQuery, Page};
use mesh_plumbing::path::NodePath;
use mesh_protocol::{Labels, NodeId, validate_labels};
use serde::{Deserialize, Serialize};
use sqlx::types::Json as SqlJson;

use crate::nodes::emit;
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
        .routes(routes!(get_labels, put_labels))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
struct NodeFilters {
    /// Only nodes whose effective labels hold every `key=value` pair of this
    /// comma-separated list, e.g. `role=web,zone=eu`.
    #[param(example = "role=web,zone=eu")]
    selector: Option<String>,
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

/// List nodes, by id, a page at a time; `selector` keeps the nodes whose
/// effective labels match it (pages and `next` count only those). `after` is
/// a node's id; `limit` defaults to and is cut to the inventory settings'
/// `max_page` (1000).
#[utoipa::path(
    get,
    path = "/v1/nodes",
    params(NodeFilters, Page),
    responses(
        (status = 200, description = "A page of nodes", body = NodeList),
        BadRequest,
        Unprocessable,
    )
)]
async fn list_nodes(
    State(inventory): State<Arc<Inventory>>,
    ListQuery(page, filters): ListQuery<NodeFilters>,
) -> Result<Json<NodeList>, Problem> {
    let max = inventory.settings.max_page;
    let limit = page.limit_capped(max, max)?;
    let selector = filters
        .selector
        .as_deref()
        .map(|s| mesh_protocol::parse_selector("selector", s))
        .transpose()
        .map_err(Error::from)?;
    let nodes = inventory
        .nodes(page.after.as_deref(), limit, selector.as_ref())
        .await?;
    let next = mesh_plumbing::page::next(&nodes, limit, |n| n.id.clone());
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

/// Answer of `GET` and `PUT /v1/nodes/{id}/labels`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
struct LabelsResponse {
    id: String,
    labels: LabelsView,
    /// The node's version (of its `inventory.node.*` events).
    version: i64,
    /// The operator labels' revision: the ETag is `"<revision>"`.
    revision: i64,
}

/// The node a route's `{id}` names (documented as `params(NodePath)`): an
/// id that cannot be a node's names no node, so inventory's node routes
/// answer it 404, as for a node it does not know.
pub(crate) fn known_node(id: &str) -> Result<NodeId, Error> {
    NodeId::parse(id).map_err(|_| Error::NodeNotFound(id.chars().take(80).collect()))
}

fn labels_body(id: &NodeId, labels: NodeLabels) -> LabelsResponse {
    LabelsResponse {
        id: id.to_string(),
        labels: labels.view,
        version: labels.version,
        revision: labels.revision,
    }
}

/// A node's labels (reported, operator, effective) with the operator labels'
/// ETag; `If-None-Match` with the current tag answers 304.
#[utoipa::path(
    get,
    path = "/v1/nodes/{id}/labels",
    params(
        NodePath,
        ("If-None-Match" = Option<String>, Header, nullable = false, description = "The quoted revisions you hold: 304 if one is current"),
    ),
    responses(
        (status = 200, description = "The node's labels", body = LabelsResponse, headers(("ETag" = String, description = "`\"<revision>\"` of the operator labels: give it as `If-Match` to replace them"))),
        NotModified,
        NotFound,
    )
)]
async fn get_labels(
    State(inventory): State<Arc<Inventory>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Response, Problem> {
    let id = known_node(&id)?;
    let labels = inventory
        .node_labels(&id)
        .await?
        .ok_or_else(|| Error::NodeNotFound(id.to_string()))?;
    let revision = labels.revision;
    Ok(conditional_get(
        &headers,
        revision,
        labels_body(&id, labels),
    ))
}

/// Replace a node's operator labels. Needs `If-Match`: the ETag of the
/// labels replaced (from `GET` or the last `PUT`), or `*`.
#[utoipa::path(
    put,
    path = "/v1/nodes/{id}/labels",
    params(
        NodePath,
        ("If-Match" = String, Header, pattern = r#"^(\*|(W/)?\"[0-9]+\"( *, *(W/)?\"[0-9]+\")*)$"#, description = "`*` or the quoted revisions of the operator labels this write replaces"),
    ),
    request_body = LabelsBody,
    responses(
        (status = 200, description = "The node's labels now", body = LabelsResponse, headers(("ETag" = String, description = "`\"<revision>\"` of the operator labels: give it as `If-Match` to replace them"))),
        NotFound,
        BodyErrors,
        PreconditionFailed,
        PreconditionRequired,
    )
)]
async fn put_labels(
    State(inventory): State<Arc<Inventory>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    audit: Audit,
    ApiJson(body): ApiJson<LabelsBody>,
) -> Result<Response, Problem> {
    let id = known_node(&id)?;
    validate_labels("labels", &body.labels).map_err(Error::from)?;
    let if_match = precondition(&headers, IF_MATCH)?;
    let labels = inventory
        .set_operator_labels(&id, body.labels, if_match.as_ref(), &audit)
        .await?;
    let revision = labels.revision;
    Ok(with_etag(
        StatusCode::OK,
        revision,
        labels_body(&id, labels),
    ))
}

/// A node's labels as the labels routes show them.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeLabels {
    pub view: LabelsView,
    /// The node's version (of its `inventory.node.*` events).
    pub version: i64,
    /// The operator labels' revision (their ETag).
    pub revision: i64,
}

impl Inventory {
    /// A node's labels, its version and its operator labels' revision (none:
    /// no such node).
    pub async fn node_labels(&self, id: &NodeId) -> Result<Option<NodeLabels>, Error> {
        let row: Option<(SqlJson<Labels>, SqlJson<Labels>, i64, i64)> = sqlx::query_as(
            "SELECT reported_labels, operator_labels, version, labels_revision FROM inventory.nodes \
             WHERE id = $1",
        )
        .bind(id.as_str())
        .fetch_optional(&self.pool)
        .await?;
        Ok(
            row.map(|(reported, operator, version, revision)| NodeLabels {
                view: LabelsView::new(
                    &self.settings.label_trust,
                    id.as_str(),
                    reported.0,
                    operator.0,
                ),
                version,
                revision,
            }),
        )
    }

    /// Replace a node's operator labels if `if_match` holds (required: the
    /// labels' revision, or `*`), raising their revision. Emits
    /// `inventory.node.updated` (and wakes the relay) when the effective labels
    /// change; writes the request's audit entry in the same transaction.
    pub async fn set_operator_labels(
        &self,
        id: &NodeId,
        operator: Labels,
        if_match: Option<&Precondition>,
        audit: &Audit,
    ) -> Result<NodeLabels, Error> {
        validate_labels("labels", &operator)?;
        if let Some(key) = operator
            .keys()
            .find(|k| k.starts_with(mesh_protocol::RESERVED_LABEL_PREFIX))
        {
            return Err(Error::Invalid {
                field: format!("labels.{key}"),
                reason: format!(
                    "keys under `{}` are reserved for what the controller verifies itself",
                    mesh_protocol::RESERVED_LABEL_PREFIX
                ),
            });
        }
        let mut tx = self.pool.begin().await?;
        let row: Option<(SqlJson<Labels>, SqlJson<Labels>, i64, i64)> = sqlx::query_as(
            "SELECT reported_labels, operator_labels, version, labels_revision FROM inventory.nodes \
             WHERE id = $1 FOR UPDATE",
        )
        .bind(id.as_str())
        .fetch_optional(&mut *tx)
        .await?;
        let Some((reported, before, version, revision)) = row else {
            return Err(Error::NodeNotFound(id.to_string()));
        };
        check_write(
            Some(revision),
            if_match,
            None,
            &format!("the operator labels of node `{id}`"),
        )?;
        let trust = &self.settings.label_trust;
        let old = trust.effective(id.as_str(), &reported.0, &before.0);
        let view = LabelsView::new(trust, id.as_str(), reported.0, operator);
        let changed = old != view.effective;
        let version = if changed { version + 1 } else { version };
        let revision = revision + 1;
        sqlx::query(
            "UPDATE inventory.nodes SET operator_labels = $2, version = $3, labels_revision = $4 \
             WHERE id = $1",
        )
        .bind(id.as_str())
        .bind(SqlJson(&view.operator))
        .bind(version)
        .bind(revision)
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
        Ok(NodeLabels {
            view,
            version,
            revision,
        })
    }
}
