//! HTTP routes of secrets and grants. A secret is write-only: no route
//! returns its value, only its metadata (versions, who wrote them, grants).

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use mesh_plumbing::api::{ApiJson, Problem};
use mesh_plumbing::audit::Audit;
use mesh_plumbing::etag::{self, Preconditions};
use mesh_plumbing::openapi::{
    BadRequest, BodyErrors, Conflict, NotFound, NotModified, PreconditionFailed,
    PreconditionRequired, Unavailable,
};
use serde::{Deserialize, Serialize};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::api::IF_MATCH;
use crate::secrets::{GrantView, RotationReport, SecretView};
use crate::{Config, Error};
use mesh_plumbing::api::created_status;

pub(crate) fn routes() -> OpenApiRouter<Arc<Config>> {
    OpenApiRouter::new()
        .routes(routes!(list_secrets))
        .routes(routes!(get_secret, put_secret, delete_secret))
        .routes(routes!(rotate))
        .routes(routes!(list_grants))
        .routes(routes!(get_grant, put_grant, delete_grant))
}

/// Body of `PUT /v1/secrets/{name}`: the new version's value.
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct SecretBody {
    /// The value (at most 64 KiB). Never returned, never logged.
    value: String,
}

/// Body of `PUT /v1/modules/{name}/grants/{secret}`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct GrantBody {
    /// The file's name under `/modules/<module>/secrets/` (default: the
    /// secret's name).
    #[serde(default)]
    file: Option<String>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
struct SecretList {
    secrets: Vec<SecretView>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
struct GrantList {
    grants: Vec<GrantView>,
}

/// Every secret's metadata (never a value).
#[utoipa::path(get, path = "/v1/secrets",
    responses((status = 200, description = "Every secret", body = SecretList)))]
async fn list_secrets(State(config): State<Arc<Config>>) -> Result<Json<SecretList>, Problem> {
    Ok(Json(SecretList {
        secrets: config.secrets().await?,
    }))
}

/// A secret's metadata: its versions, who wrote them, its grants. Never its value.
#[utoipa::path(get, path = "/v1/secrets/{name}",
    params(
        ("name" = String, Path, description = "The secret's name: 1 to 63 of a-z 0-9 . _ -"),
        ("If-None-Match" = Option<String>, Header, nullable = false, description = "The ETag you hold: 304 while it is current"),
    ),
    responses((status = 200, description = "The secret's metadata", body = SecretView, headers(("ETag" = String, description = "`\"<version>\"`"))),
        NotModified, NotFound))]
async fn get_secret(
    State(config): State<Arc<Config>>,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Result<Response, Problem> {
    let Some(secret) = config.secret(&name).await? else {
        return Err(Error::NotFound(format!(
            "no secret `{}`",
            name.chars().take(80).collect::<String>()
        ))
        .into());
    };
    Ok(etag::conditional_get(&headers, secret.version, &secret))
}

/// Write a new version of a secret (creating it): encrypted at rest, then
/// sealed to and declared on exactly the nodes that run a module granted it.
/// Replacing needs `If-Match` with the version read.
#[utoipa::path(put, path = "/v1/secrets/{name}",
    params(
        ("name" = String, Path, description = "The secret's name: 1 to 63 of a-z 0-9 . _ -"),
        ("If-Match" = Option<String>, Header, nullable = false, description = IF_MATCH),
        ("If-None-Match" = Option<String>, Header, nullable = false, description = "`*`: only create"),
    ),
    request_body = SecretBody,
    responses(
        (status = 200, description = "A new version", body = SecretView, headers(("ETag" = String, description = "`\"<version>\"`"))),
        (status = 201, description = "Created", body = SecretView, headers(("ETag" = String, description = "`\"<version>\"`"))),
        BodyErrors, PreconditionFailed, PreconditionRequired, Unavailable))]
async fn put_secret(
    State(config): State<Arc<Config>>,
    Path(name): Path<String>,
    audit: Audit,
    headers: HeaderMap,
    ApiJson(body): ApiJson<SecretBody>,
) -> Result<Response, Problem> {
    let pre = Preconditions::from_headers(&headers)?;
    let (secret, created) = config.put_secret(&name, &body.value, &pre, &audit).await?;
    Ok(etag::with_etag(
        created_status(created),
        secret.version,
        secret,
    ))
}

/// Delete a secret, its versions and its grants: its files leave every node.
#[utoipa::path(delete, path = "/v1/secrets/{name}",
    params(
        ("name" = String, Path, description = "The secret's name"),
        ("If-Match" = Option<String>, Header, nullable = false, description = "Delete only at one of these quoted versions"),
    ),
    responses((status = 204, description = "Deleted"), BadRequest, NotFound, PreconditionFailed))]
async fn delete_secret(
    State(config): State<Arc<Config>>,
    Path(name): Path<String>,
    audit: Audit,
    headers: HeaderMap,
) -> Result<StatusCode, Problem> {
    let pre = Preconditions::from_headers(&headers)?;
    config.delete_secret(&name, &pre, &audit).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Rotate the secrets master key (admin): a new key becomes current, every
/// data key is re-wrapped under it, the old key leaves the keyring file.
/// Values and what nodes hold do not change; the controller keeps serving.
#[utoipa::path(post, path = "/v1/secrets/master-key/rotate",
    responses((status = 200, description = "Rotated", body = RotationReport), Unavailable))]
async fn rotate(
    State(config): State<Arc<Config>>,
    audit: Audit,
) -> Result<Json<RotationReport>, Problem> {
    Ok(Json(config.rotate_master_key(&audit).await?))
}

/// The secrets granted to a module.
#[utoipa::path(get, path = "/v1/modules/{name}/grants",
    params(("name" = String, Path, description = "The module's name")),
    responses((status = 200, description = "The module's grants", body = GrantList)))]
async fn list_grants(
    State(config): State<Arc<Config>>,
    Path(name): Path<String>,
) -> Result<Json<GrantList>, Problem> {
    Ok(Json(GrantList {
        grants: config.grants(&name, None).await?,
    }))
}

fn no_grant(module: &str, secret: &str) -> Problem {
    Error::NotFound(format!(
        "no grant of `{}` to module `{}`",
        secret.chars().take(80).collect::<String>(),
        module.chars().take(80).collect::<String>()
    ))
    .into()
}

/// One grant.
#[utoipa::path(get, path = "/v1/modules/{name}/grants/{secret}",
    params(
        ("name" = String, Path, description = "The module's name"),
        ("secret" = String, Path, description = "The secret's name"),
        ("If-None-Match" = Option<String>, Header, nullable = false, description = "The ETag you hold: 304 while it is current"),
    ),
    responses((status = 200, description = "The grant", body = GrantView, headers(("ETag" = String, description = "`\"<revision>\"`"))),
        NotModified, NotFound))]
async fn get_grant(
    State(config): State<Arc<Config>>,
    Path((module, secret)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Response, Problem> {
    let Some(grant) = config
        .grants(&module, Some(&secret))
        .await?
        .into_iter()
        .next()
    else {
        return Err(no_grant(&module, &secret));
    };
    Ok(etag::conditional_get(&headers, grant.revision, &grant))
}

/// Grant a secret to a module: every node that runs it receives the value,
/// sealed to the node, as `/modules/<module>/secrets/<file>` (mode 0600).
#[utoipa::path(put, path = "/v1/modules/{name}/grants/{secret}",
    params(
        ("name" = String, Path, description = "The module's name"),
        ("secret" = String, Path, description = "The secret's name"),
        ("If-Match" = Option<String>, Header, nullable = false, description = IF_MATCH),
        ("If-None-Match" = Option<String>, Header, nullable = false, description = "`*`: only create"),
    ),
    request_body = GrantBody,
    responses(
        (status = 200, description = "Replaced", body = GrantView, headers(("ETag" = String, description = "`\"<revision>\"`"))),
        (status = 201, description = "Granted", body = GrantView, headers(("ETag" = String, description = "`\"<revision>\"`"))),
        BodyErrors, Conflict, NotFound, PreconditionFailed, PreconditionRequired))]
async fn put_grant(
    State(config): State<Arc<Config>>,
    Path((module, secret)): Path<(String, String)>,
    audit: Audit,
    headers: HeaderMap,
    ApiJson(body): ApiJson<GrantBody>,
) -> Result<Response, Problem> {
    let pre = Preconditions::from_headers(&headers)?;
    let (grant, created) = config
        .put_grant(&module, &secret, body.file.as_deref(), &pre, &audit)
        .await?;
    Ok(etag::with_etag(
        created_status(created),
        grant.revision,
        grant,
    ))
}

/// Revoke a grant: the secret's file leaves the module's nodes.
#[utoipa::path(delete, path = "/v1/modules/{name}/grants/{secret}",
    params(
        ("name" = String, Path, description = "The module's name"),
        ("secret" = String, Path, description = "The secret's name"),
        ("If-Match" = Option<String>, Header, nullable = false, description = "Delete only at one of these quoted revisions"),
    ),
    responses((status = 204, description = "Revoked"), BadRequest, NotFound, PreconditionFailed))]
async fn delete_grant(
    State(config): State<Arc<Config>>,
    Path((module, secret)): Path<(String, String)>,
    audit: Audit,
    headers: HeaderMap,
) -> Result<StatusCode, Problem> {
    let pre = Preconditions::from_headers(&headers)?;
    config.delete_grant(&module, &secret, &pre, &audit).await?;
    Ok(StatusCode::NO_CONTENT)
}
