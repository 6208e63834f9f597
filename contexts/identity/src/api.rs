//! HTTP routes of the identity context. Errors are problem+json naming the field.
//! Who may call which route is the controller's auth layer's business; every
//! mutating handler takes the [`Audit`] it put in the extensions and writes the
//! entry in the transaction of its change.

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use chrono::{DateTime, Utc};
use mesh_plumbing::api::{ApiJson, Problem, Role};
use mesh_plumbing::audit::Audit;
use mesh_plumbing::openapi::{
    BadRequest, BodyErrors, Conflict, Forbidden, NotFound, Unauthorized, Unavailable, Unprocessable,
};
use mesh_plumbing::page::{ListQuery, NoFilters, Page};
use mesh_plumbing::path::NodePath;
use serde::{Deserialize, Serialize};
use serde_json::json;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use uuid::Uuid;

use crate::{AuditFilter, AuditPage, Error, Identity, JoinRequest, TokenView};

/// The identity routes, each with its OpenAPI description.
pub(crate) fn routes() -> OpenApiRouter<Arc<Identity>> {
    OpenApiRouter::new()
        .routes(routes!(join))
        .routes(routes!(create_join_token))
        .routes(routes!(revoke_node))
        .routes(routes!(readmit_node))
        .routes(routes!(create_token, list_tokens))
        .routes(routes!(revoke_token))
        .routes(routes!(rotate_token))
        .routes(routes!(audit))
}

/// Answer of `POST /v1/nodes/{id}/join-tokens` (the document's schema).
#[derive(utoipa::ToSchema)]
#[allow(dead_code)]
struct JoinTokenCreated {
    node: String,
    /// Shown once; give it to the node's `mesh-agent join`.
    token: String,
    expires_at: DateTime<Utc>,
    /// The API's advertised URL, for `mesh-agent join --api` (absent on a
    /// loopback-only mesh).
    api_url: Option<String>,
    /// The mesh CA's pin, `sha256:<hex>` of its public key, for `mesh-agent
    /// join --ca-hash` (absent without a CA).
    ca_hash: Option<String>,
}

/// Answer of `POST /v1/join` (the document's schema).
#[derive(utoipa::ToSchema)]
#[allow(dead_code)]
struct JoinAnswer {
    node: String,
    /// The node's own broker URL, with its password: shown once.
    broker_url: String,
    /// The key every declaration to the node is signed with (hex).
    controller_key: String,
    /// The API's advertised URL (absent on a loopback-only mesh).
    api_url: Option<String>,
    /// The mesh CA's certificate, PEM (absent without a CA).
    ca_certificate: Option<String>,
}

#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct JoinTokenBody {
    /// Validity in seconds (default 3600).
    #[schema(minimum = 1)]
    ttl_secs: Option<u64>,
    /// Labels bound to the token: the node that enrols with it gets them as
    /// its operator labels (what selects it), whatever it says of itself.
    /// Keys under `mesh.io/` are reserved. Default none.
    #[serde(default)]
    labels: mesh_protocol::Labels,
}

/// Create a join token for a node (the body is optional).
#[utoipa::path(
    post,
    path = "/v1/nodes/{id}/join-tokens",
    params(NodePath),
    request_body(content = Option<JoinTokenBody>, description = "Optional: the token's validity and the labels bound to it"),
    responses(
        (status = 201, description = "The token, shown once", body = JoinTokenCreated),
        Unprocessable,
        Conflict,
    )
)]
async fn create_join_token(
    State(identity): State<Arc<Identity>>,
    audit: Audit,
    NodePath(node): NodePath,
    body: axum::body::Bytes,
) -> Result<(StatusCode, Json<serde_json::Value>), Problem> {
    // The body is optional: no body means the default validity.
    let body: JoinTokenBody = optional_body(&body)?;
    let created = identity
        .create_join_token(
            &node,
            body.ttl_secs.map(Duration::from_secs),
            &body.labels,
            &audit,
        )
        .await?;
    Ok((
        StatusCode::CREATED,
        Json(json!({
            "node": created.node,
            "token": created.token.expose(),
            "expires_at": created.expires_at,
            "api_url": identity.settings().api_url,
            "ca_hash": identity.settings().ca_pin,
        })),
    ))
}

/// Enrol a node with its join token: records its public key, creates its
/// broker user, answers how to reach the broker. Authenticated by the join
/// token, not by an API token.
#[utoipa::path(
    post,
    path = "/v1/join",
    request_body = JoinRequest,
    responses(
        (status = 201, description = "Enrolled", body = JoinAnswer),
        BodyErrors,
        Unauthorized,
        Forbidden,
        Conflict,
        Unavailable,
    )
)]
async fn join(
    State(identity): State<Arc<Identity>>,
    ApiJson(req): ApiJson<JoinRequest>,
) -> Result<(StatusCode, Json<serde_json::Value>), Problem> {
    let enrolled = identity.join(&req).await?;
    Ok((
        StatusCode::CREATED,
        Json(json!({
            "node": enrolled.node,
            "broker_url": enrolled.broker_url.expose(),
            "controller_key": enrolled.controller_key,
            "api_url": enrolled.api_url,
            "ca_certificate": enrolled.ca_certificate,
        })),
    ))
}

/// Revoke a node: its identity, its broker user and connections.
#[utoipa::path(
    delete,
    path = "/v1/nodes/{id}",
    params(NodePath),
    responses(
        (status = 200, description = "Revoked", body = crate::Revoked),
        NotFound,
        Unprocessable,
        Unavailable,
    )
)]
async fn revoke_node(
    State(identity): State<Arc<Identity>>,
    NodePath(node): NodePath,
    audit: Audit,
) -> Result<Json<crate::Revoked>, Problem> {
    Ok(Json(identity.revoke_node(&node, &audit).await?))
}

/// Re-admit a revoked node (admin): it may be given credentials again (a join
/// token, `mesh-bundle node-add`) and its reports count again. It has no
/// broker user until then.
#[utoipa::path(
    post,
    path = "/v1/nodes/{id}/readmit",
    params(NodePath),
    responses(
        (status = 200, description = "Re-admitted", body = crate::Readmitted),
        NotFound,
        Conflict,
        Unprocessable,
    )
)]
async fn readmit_node(
    State(identity): State<Arc<Identity>>,
    NodePath(node): NodePath,
    audit: Audit,
) -> Result<Json<crate::Readmitted>, Problem> {
    Ok(Json(identity.readmit_node(&node, &audit).await?))
}

/// Body of `POST /v1/tokens`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct TokenBody {
    /// 1 to 64 of A-Z a-z 0-9 . _ @ -
    name: String,
    role: Role,
    /// Lifetime in seconds: 60 to 31,622,400 (366 days). Default 7,776,000
    /// (90 days).
    #[schema(minimum = 60, maximum = 31_622_400)]
    ttl_secs: Option<u64>,
}

/// Body of `POST /v1/tokens/{id}/rotate` (optional).
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct RotateBody {
    /// The new token's lifetime in seconds, as at creation. Default 90 days.
    #[schema(minimum = 60, maximum = 31_622_400)]
    ttl_secs: Option<u64>,
}

#[derive(Serialize, utoipa::ToSchema)]
struct CreatedToken {
    #[serde(flatten)]
    view: TokenView,
    /// Shown once; only its hash is kept.
    token: String,
}

/// Create an API token.
#[utoipa::path(
    post,
    path = "/v1/tokens",
    request_body = TokenBody,
    responses(
        (status = 201, description = "The token; its secret is shown once", body = CreatedToken),
        BodyErrors,
    )
)]
async fn create_token(
    State(identity): State<Arc<Identity>>,
    audit: Audit,
    ApiJson(body): ApiJson<TokenBody>,
) -> Result<(StatusCode, Json<CreatedToken>), Problem> {
    let created = identity
        .create_token(
            &body.name,
            body.role,
            body.ttl_secs.map(std::time::Duration::from_secs),
            &audit,
        )
        .await?;
    Ok((
        StatusCode::CREATED,
        Json(CreatedToken {
            view: created.view,
            token: created.token.expose().clone(),
        }),
    ))
}

#[derive(Serialize, utoipa::ToSchema)]
struct TokenList {
    tokens: Vec<TokenView>,
    #[serde(skip_serializing_if = "Option::is_none")]
    next: Option<Uuid>,
}

/// List API tokens (never their secrets), by id, a page at a time: `after`
/// is a token's id, `limit` defaults to and is cut to the identity settings'
/// `max_page` (1000).
#[utoipa::path(
    get,
    path = "/v1/tokens",
    params(Page),
    responses(
        (status = 200, description = "A page of tokens", body = TokenList),
        BadRequest,
        Unprocessable,
    )
)]
async fn list_tokens(
    State(identity): State<Arc<Identity>>,
    ListQuery(page, NoFilters {}): ListQuery<NoFilters>,
) -> Result<Json<TokenList>, Problem> {
    let max = identity.settings.max_page;
    let limit = page.limit_capped(max, max)?;
    let tokens = identity.tokens(page.after(Uuid::parse_str)?, limit).await?;
    let next = mesh_plumbing::page::next(&tokens, limit, |t| t.id);
    Ok(Json(TokenList { tokens, next }))
}

/// Rotate an API token: a new secret with the same name and role (shown
/// once), and the old one revoked.
#[utoipa::path(
    post,
    path = "/v1/tokens/{id}/rotate",
    params(("id" = String, Path, description = "The token's id (a UUID)")),
    request_body(content = Option<RotateBody>, description = "Optional: the new token's lifetime"),
    responses(
        (status = 201, description = "The new token; its secret is shown once", body = CreatedToken),
        NotFound,
        BodyErrors,
    )
)]
async fn rotate_token(
    State(identity): State<Arc<Identity>>,
    Path(id): Path<String>,
    audit: Audit,
    body: axum::body::Bytes,
) -> Result<(StatusCode, Json<CreatedToken>), Problem> {
    let id = token_id(&id)?;
    // The body is optional: no body means the default lifetime.
    let body: RotateBody = optional_body(&body)?;
    let created = identity
        .rotate_token(
            id,
            body.ttl_secs.map(std::time::Duration::from_secs),
            &audit,
        )
        .await?;
    Ok((
        StatusCode::CREATED,
        Json(CreatedToken {
            view: created.view,
            token: created.token.expose().clone(),
        }),
    ))
}

/// Revoke an API token, for good.
#[utoipa::path(
    delete,
    path = "/v1/tokens/{id}",
    params(("id" = String, Path, description = "The token's id (a UUID)")),
    responses(
        (status = 200, description = "Revoked", body = TokenView),
        NotFound,
    )
)]
async fn revoke_token(
    State(identity): State<Arc<Identity>>,
    Path(id): Path<String>,
    audit: Audit,
) -> Result<Json<TokenView>, Problem> {
    let id = token_id(&id)?;
    Ok(Json(identity.revoke_token(id, &audit).await?))
}

/// The audit log, oldest first, filtered and paged: `after` is an entry's
/// position (the previous page's `next`), `limit` defaults to and is cut to
/// the identity settings' `max_page` (1000).
#[utoipa::path(
    get,
    path = "/v1/audit",
    params(AuditFilter, Page),
    responses(
        (status = 200, description = "A page of the audit log", body = AuditPage),
        BadRequest,
        Unprocessable,
    )
)]
async fn audit(
    State(identity): State<Arc<Identity>>,
    ListQuery(page, filter): ListQuery<AuditFilter>,
) -> Result<Json<AuditPage>, Problem> {
    let max = identity.settings.max_page;
    let limit = page.limit_capped(max, max)?;
    let after = page.after(|a| a.parse::<i64>())?;
    Ok(Json(identity.audit(&filter, after, limit).await?))
}

/// A token id from the path; one that is no UUID is a token that does not
/// exist (quoted, shortened).
fn token_id(id: &str) -> Result<Uuid, Error> {
    Uuid::parse_str(id).map_err(|_| {
        Error::NotFound(format!(
            "no token `{}`",
            id.chars().take(40).collect::<String>()
        ))
    })
}

/// An optional JSON body: none (or blank) means the defaults; one that does
/// not parse is a 422 naming what serde found wrong.
fn optional_body<T: Default + serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, Problem> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(body).map_err(|e| Problem::unprocessable("body", e.to_string()))
}
