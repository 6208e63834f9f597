//! HTTP routes of the identity context. Errors are problem+json naming the field.
//! Who may call which route is the controller's auth layer's business; every
//! mutating handler takes the [`Audit`] it put in the extensions and writes the
//! entry in the transaction of its change.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use chrono::{DateTime, Utc};
use mesh_plumbing::api::{ApiJson, Problem, Role};
use mesh_plumbing::audit::Audit;
use mesh_protocol::NodeId;
use serde::{Deserialize, Serialize};
use serde_json::json;
use uuid::Uuid;

use crate::{AuditFilter, AuditPage, Error, Identity, JoinRequest, TokenView};

pub(crate) fn routes(identity: Arc<Identity>) -> Router {
    Router::new()
        .route("/v1/join", post(join))
        .route("/v1/nodes/{id}/join-tokens", post(create_join_token))
        .route("/v1/nodes/{id}", delete(revoke_node))
        .route("/v1/tokens", post(create_token).get(list_tokens))
        .route("/v1/tokens/{id}", delete(revoke_token))
        .route("/v1/audit", get(audit))
        .with_state(identity)
}

fn node_id(id: &str) -> Result<NodeId, Problem> {
    NodeId::parse(id).map_err(|e| Problem::unprocessable("id", e.to_string()))
}

fn query<T>(q: Result<Query<T>, QueryRejection>) -> Result<T, Problem> {
    q.map(|Query(t)| t)
        .map_err(|e| Problem::new(StatusCode::BAD_REQUEST, e.body_text()))
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct JoinTokenBody {
    /// Validity in seconds (default 3600).
    ttl_secs: Option<u64>,
}

async fn create_join_token(
    State(identity): State<Arc<Identity>>,
    audit: Audit,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<(StatusCode, Json<serde_json::Value>), Problem> {
    let node = node_id(&id)?;
    // The body is optional: no body means the default validity.
    let body: JoinTokenBody = if body.iter().all(u8::is_ascii_whitespace) {
        JoinTokenBody::default()
    } else {
        serde_json::from_slice(&body)
            .map_err(|e| Problem::unprocessable("ttl_secs", e.to_string()))?
    };
    let created = identity
        .create_join_token(&node, body.ttl_secs.map(Duration::from_secs), &audit)
        .await?;
    Ok((
        StatusCode::CREATED,
        Json(json!({
            "node": created.node,
            "token": created.token.expose(),
            "expires_at": created.expires_at,
        })),
    ))
}

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
        })),
    ))
}

async fn revoke_node(
    State(identity): State<Arc<Identity>>,
    Path(id): Path<String>,
    audit: Audit,
) -> Result<Json<crate::Revoked>, Problem> {
    let node = node_id(&id)?;
    Ok(Json(identity.revoke_node(&node, &audit).await?))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenBody {
    name: String,
    role: Role,
}

#[derive(Serialize)]
struct CreatedToken {
    #[serde(flatten)]
    view: TokenView,
    /// Shown once; only its hash is kept.
    token: String,
}

async fn create_token(
    State(identity): State<Arc<Identity>>,
    audit: Audit,
    ApiJson(body): ApiJson<TokenBody>,
) -> Result<(StatusCode, Json<CreatedToken>), Problem> {
    let created = identity.create_token(&body.name, body.role, &audit).await?;
    Ok((
        StatusCode::CREATED,
        Json(CreatedToken {
            view: created.view,
            token: created.token.expose().clone(),
        }),
    ))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ListParams {
    after: Option<Uuid>,
    limit: Option<i64>,
}

#[derive(Serialize)]
struct TokenList {
    tokens: Vec<TokenView>,
    #[serde(skip_serializing_if = "Option::is_none")]
    next: Option<Uuid>,
}

async fn list_tokens(
    State(identity): State<Arc<Identity>>,
    params: Result<Query<ListParams>, QueryRejection>,
) -> Result<Json<TokenList>, Problem> {
    let params = query(params)?;
    let limit = params.limit.unwrap_or(identity.settings.max_page);
    if limit < 1 {
        return Err(Problem::unprocessable("limit", "must be at least 1"));
    }
    let tokens = identity.tokens(params.after, limit).await?;
    let full =
        i64::try_from(tokens.len()).unwrap_or(i64::MAX) >= limit.min(identity.settings.max_page);
    let next = if full {
        tokens.last().map(|t| t.id)
    } else {
        None
    };
    Ok(Json(TokenList { tokens, next }))
}

async fn revoke_token(
    State(identity): State<Arc<Identity>>,
    Path(id): Path<String>,
    audit: Audit,
) -> Result<Json<TokenView>, Problem> {
    let id = Uuid::parse_str(&id).map_err(|_| {
        Error::NotFound(format!(
            "no token `{}`",
            id.chars().take(40).collect::<String>()
        ))
    })?;
    Ok(Json(identity.revoke_token(id, &audit).await?))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AuditParams {
    principal: Option<String>,
    action: Option<String>,
    target: Option<String>,
    outcome: Option<String>,
    since: Option<DateTime<Utc>>,
    until: Option<DateTime<Utc>>,
    after: Option<i64>,
    limit: Option<i64>,
}

async fn audit(
    State(identity): State<Arc<Identity>>,
    params: Result<Query<AuditParams>, QueryRejection>,
) -> Result<Json<AuditPage>, Problem> {
    let p = query(params)?;
    let filter = AuditFilter {
        principal: p.principal,
        action: p.action,
        target: p.target,
        outcome: p.outcome,
        since: p.since,
        until: p.until,
        after: p.after,
        limit: p.limit,
    };
    Ok(Json(identity.audit(&filter).await?))
}
