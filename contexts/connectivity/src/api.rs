//! HTTP routes of the connectivity context: read-only views (viewer role).
//! Errors are problem+json naming the field.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use mesh_plumbing::api::{ApiQuery, Problem};
use mesh_plumbing::openapi::{BadRequest, Unprocessable};
use mesh_protocol::NodeId;
use serde::Deserialize;
use utoipa::IntoParams;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::Connectivity;
use crate::query::{CertificatesView, OverlayView};

/// The routes, each with its OpenAPI description.
pub(crate) fn routes() -> OpenApiRouter<Arc<Connectivity>> {
    OpenApiRouter::new()
        .routes(routes!(get_overlay))
        .routes(routes!(list_certificates))
}

/// The overlay: its network, policy and domain, every node's address,
/// WireGuard key and endpoint, nodes left without an address (the network
/// is full), and which nodes serve each public name.
#[utoipa::path(
    get,
    path = "/v1/overlay",
    responses((status = 200, description = "The overlay", body = OverlayView))
)]
async fn get_overlay(State(conn): State<Arc<Connectivity>>) -> Result<Json<OverlayView>, Problem> {
    Ok(Json(conn.overlay_view().await?))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
struct CertificatesParams {
    /// Only this node's certificates and requests.
    node: Option<String>,
}

/// Every certificate the mesh CA issued (node, name, serial, subject,
/// expiry and remaining lifetime, what the node says it holds and why its
/// renewal failed), and the latest refused or waiting request per node and
/// name, with the reason.
#[utoipa::path(
    get,
    path = "/v1/certificates",
    params(CertificatesParams),
    responses(
        (status = 200, description = "Certificates and unsigned requests", body = CertificatesView),
        BadRequest,
        Unprocessable,
    )
)]
async fn list_certificates(
    State(conn): State<Arc<Connectivity>>,
    ApiQuery(params): ApiQuery<CertificatesParams>,
) -> Result<Json<CertificatesView>, Problem> {
    if let Some(node) = &params.node {
        NodeId::parse(node).map_err(|e| Problem::unprocessable("node", e.to_string()))?;
    }
    Ok(Json(conn.certificates_view(params.node.as_deref()).await?))
}
