//! HTTP routes of the provisioning context: read-only views of grants
//! (viewer role). Errors are problem+json naming the field. No answer ever
//! carries a credential.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, State};
use mesh_plumbing::api::Problem;
use mesh_plumbing::openapi::{BadRequest, NotFound, Unprocessable};
use mesh_plumbing::page::{ListQuery, Page};
use mesh_protocol::ResourceKind;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use uuid::Uuid;

use crate::query::{GrantFilter, GrantView};
use crate::reconcile::GrantState;
use crate::{MAX_GRANTS_PAGE, Provisioning};

/// The routes, each with its OpenAPI description.
pub(crate) fn routes() -> OpenApiRouter<Arc<Provisioning>> {
    OpenApiRouter::new()
        .routes(routes!(list_grants))
        .routes(routes!(get_grant))
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
struct GrantFilters {
    /// Only grants whose consumer or provider module is this one.
    module: Option<String>,
    /// Only grants whose resource on the provider's server has this name
    /// (e.g. `app-db`).
    resource: Option<String>,
    /// Only grants of this kind (`postgres.database`, `amqp.vhost`,
    /// `s3.bucket`).
    kind: Option<String>,
    /// Only grants in this state (`requested`, `provisioning`, `ready`,
    /// `failed`, `revoked`).
    state: Option<String>,
}

/// A page of grants.
#[derive(Debug, Serialize, ToSchema)]
struct GrantList {
    grants: Vec<GrantView>,
    /// Pass as `after` for the next page; absent on the last.
    #[serde(skip_serializing_if = "Option::is_none")]
    next: Option<Uuid>,
}

fn parse_id(field: &str, s: &str) -> Result<Uuid, Problem> {
    Uuid::parse_str(s).map_err(|_| {
        Problem::unprocessable(
            field,
            format!(
                "`{}` is not a grant id (a UUID)",
                s.chars().take(60).collect::<String>()
            ),
        )
    })
}

fn cut(s: &str) -> String {
    s.chars().take(60).collect()
}

/// Resource grants, by consumer, requirement and id, filtered, a page at a
/// time: who asks, who serves, the state and what each provider node
/// reported. Never a credential. `after` is a grant's id (the previous
/// page's `next`), `limit` 1 to 500, default 100.
#[utoipa::path(get, path = "/v1/grants", params(GrantFilters, Page),
    responses((status = 200, description = "A page of grants", body = GrantList), BadRequest, Unprocessable))]
async fn list_grants(
    State(prov): State<Arc<Provisioning>>,
    ListQuery(page, params): ListQuery<GrantFilters>,
) -> Result<Json<GrantList>, Problem> {
    if let Some(m) = &params.module {
        mesh_protocol::validate_module_name("module", m)?;
    }
    if let Some(r) = &params.resource {
        mesh_protocol::validate_resource_name("resource", r)?;
    }
    let kind = match &params.kind {
        Some(k) => Some(ResourceKind::parse(k).ok_or_else(|| {
            Problem::unprocessable(
                "kind",
                format!(
                    "`{}` is not a resource kind (postgres.database, amqp.vhost, s3.bucket)",
                    cut(k)
                ),
            )
        })?),
        None => None,
    };
    let state = match &params.state {
        Some(s) => Some(GrantState::parse(s).ok_or_else(|| {
            Problem::unprocessable(
                "state",
                format!(
                    "`{}` is not a grant state (requested, provisioning, ready, failed, revoked)",
                    cut(s)
                ),
            )
        })?),
        None => None,
    };
    let after = page.after_id()?;
    let limit = page.limit(100, MAX_GRANTS_PAGE)?;
    let filter = GrantFilter {
        module: params.module.as_deref(),
        resource: params.resource.as_deref(),
        kind,
        state,
        after,
    };
    let grants = prov.grants(&filter, limit).await?;
    let next = mesh_plumbing::page::next(&grants, limit, |g| g.id);
    Ok(Json(GrantList { grants, next }))
}

/// One grant.
#[utoipa::path(get, path = "/v1/grants/{id}",
    params(("id" = String, Path, description = "The grant's id (UUID)")),
    responses((status = 200, description = "The grant", body = GrantView), NotFound, Unprocessable))]
async fn get_grant(
    State(prov): State<Arc<Provisioning>>,
    Path(id): Path<String>,
) -> Result<Json<GrantView>, Problem> {
    let id = parse_id("id", &id)?;
    Ok(Json(prov.grant(id).await?))
}
