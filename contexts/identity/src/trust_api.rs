//! HTTP routes of OIDC trust (decision 0049): `GET /v1/trust`,
//! `GET|PUT|DELETE /v1/trust/{name}` (admin, audited in the change's
//! transaction) and `POST /v1/tokens/exchange` (authenticated by the ID token
//! it carries, like `POST /v1/join` by its join token).

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use mesh_plumbing::api::{ApiJson, Problem, Role};
use mesh_plumbing::audit::Audit;
use mesh_plumbing::openapi::{BodyErrors, NotFound, Unauthorized, Unavailable, Unprocessable};
use serde::{Deserialize, Serialize};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use uuid::Uuid;

use crate::{Identity, TokenView, TrustSpec, TrustView};

pub(crate) fn routes() -> OpenApiRouter<Arc<Identity>> {
    OpenApiRouter::new()
        .routes(routes!(list_trusts))
        .routes(routes!(get_trust, put_trust, delete_trust))
        .routes(routes!(exchange))
}

/// Body of `PUT /v1/trust/{name}`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct TrustBody {
    /// The issuer's URL, exactly as its tokens' `iss` says (`https://`;
    /// `http://` only on a loopback address). Its keys are found through
    /// `<issuer>/.well-known/openid-configuration`.
    issuer: String,
    /// What an ID token's `aud` must hold.
    audience: String,
    /// What its `sub` must match; `*` matches any run of characters. Must
    /// name something: `*` alone is refused.
    subject: String,
    /// The role of the tokens given.
    role: Role,
    /// Their lifetime in seconds: 60 to 3600 (the default).
    #[schema(minimum = 60, maximum = 3600)]
    ttl_secs: Option<u64>,
}

#[derive(Serialize, utoipa::ToSchema)]
struct TrustList {
    trusts: Vec<TrustView>,
}

/// List the OIDC trusts.
#[utoipa::path(
    get,
    path = "/v1/trust",
    responses((status = 200, description = "Every trust", body = TrustList))
)]
async fn list_trusts(State(identity): State<Arc<Identity>>) -> Result<Json<TrustList>, Problem> {
    Ok(Json(TrustList {
        trusts: identity.trusts().await?,
    }))
}

/// One OIDC trust.
#[utoipa::path(
    get,
    path = "/v1/trust/{name}",
    params(("name" = String, Path, description = "The trust's name")),
    responses((status = 200, description = "The trust", body = TrustView), NotFound)
)]
async fn get_trust(
    State(identity): State<Arc<Identity>>,
    Path(name): Path<String>,
) -> Result<Json<TrustView>, Problem> {
    Ok(Json(identity.trust(&name).await?))
}

/// Create or replace an OIDC trust: ID tokens of `issuer` for `audience`
/// whose subject matches `subject` are exchanged for tokens of `role`. A
/// changed trust revokes the tokens it gave.
#[utoipa::path(
    put,
    path = "/v1/trust/{name}",
    params(("name" = String, Path, description = "The trust's name")),
    request_body = TrustBody,
    responses(
        (status = 201, description = "Created", body = TrustView),
        (status = 200, description = "Replaced", body = TrustView),
        BodyErrors,
    )
)]
async fn put_trust(
    State(identity): State<Arc<Identity>>,
    Path(name): Path<String>,
    audit: Audit,
    ApiJson(body): ApiJson<TrustBody>,
) -> Result<(StatusCode, Json<TrustView>), Problem> {
    let spec = TrustSpec {
        issuer: body.issuer,
        audience: body.audience,
        subject: body.subject,
        role: body.role,
        ttl: body.ttl_secs.map(Duration::from_secs),
    };
    let (view, created) = identity.put_trust(&name, &spec, &audit).await?;
    Ok(mesh_plumbing::api::created(created, view))
}

/// Delete an OIDC trust and revoke the tokens it gave.
#[utoipa::path(
    delete,
    path = "/v1/trust/{name}",
    params(("name" = String, Path, description = "The trust's name")),
    responses((status = 200, description = "Deleted", body = TrustView), NotFound)
)]
async fn delete_trust(
    State(identity): State<Arc<Identity>>,
    Path(name): Path<String>,
    audit: Audit,
) -> Result<Json<TrustView>, Problem> {
    Ok(Json(identity.delete_trust(&name, &audit).await?))
}

/// Body of `POST /v1/tokens/exchange`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct ExchangeBody {
    /// The trust to exchange under.
    trust: String,
    /// The OIDC ID token (a JWS, RS256 or ES256).
    id_token: String,
}

#[derive(Serialize, utoipa::ToSchema)]
struct ExchangedToken {
    #[serde(flatten)]
    view: TokenView,
    /// Shown once; only its hash is kept.
    token: String,
}

/// Exchange an OIDC ID token for a short-lived API token of the trust's role
/// (an hour at most). Authenticated by the ID token itself; every refusal is
/// 401 naming why.
#[utoipa::path(
    post,
    path = "/v1/tokens/exchange",
    request_body = ExchangeBody,
    responses(
        (status = 201, description = "The token; its secret is shown once", body = ExchangedToken),
        BodyErrors,
        Unauthorized,
        Unavailable,
        Unprocessable,
    )
)]
async fn exchange(
    State(identity): State<Arc<Identity>>,
    headers: HeaderMap,
    ApiJson(body): ApiJson<ExchangeBody>,
) -> Response {
    // The request's id as the controller's access layer set it.
    let request_id = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|s| Uuid::parse_str(s).ok())
        .unwrap_or_else(Uuid::now_v7);
    match identity
        .exchange(
            &body.trust,
            &body.id_token,
            request_id,
            "/v1/tokens/exchange",
        )
        .await
    {
        Ok(done) => (
            StatusCode::CREATED,
            Json(ExchangedToken {
                view: done.token.view,
                token: done.token.token.expose().clone(),
            }),
        )
            .into_response(),
        Err(e) => {
            let mut r = Problem::from(e).into_response();
            if r.status() == StatusCode::UNAUTHORIZED {
                r.headers_mut().insert(
                    axum::http::header::WWW_AUTHENTICATE,
                    axum::http::HeaderValue::from_static("Bearer error=\"invalid_token\""),
                );
            }
            r
        }
    }
}
