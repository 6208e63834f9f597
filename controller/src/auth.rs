//! Who may call what: bearer API tokens (identity's), the role every route
//! needs, and the audit event every operator mutation leaves.
//!
//! The policy is one table, [`required`]: the route (method and pattern, as axum
//! matched it) → [`Access`]. `/healthz`, `/metrics` and the OpenAPI document
//! `/v1/openapi.json` (it describes routes, it shows no data) are open;
//! `POST /v1/join` is authenticated by its join token (identity checks it); tokens, node
//! revocation and the audit log need `admin`; any other read needs `viewer` and
//! any other change `operator`. A missing or unknown token is 401, a role too
//! small is 403, both problem+json.
//!
//! The layer is applied to each context's routes with that context's name: after
//! an authenticated mutation (or a 403) it writes a `<context>.operator.audit`
//! event to that context's outbox, which the relay publishes to the record and
//! identity appends to its audit log (docs/decisions/0007).

use std::sync::Arc;

use axum::extract::{MatchedPath, Request, State};
use axum::http::header::{AUTHORIZATION, WWW_AUTHENTICATE};
use axum::http::{HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use chrono::Utc;
use mesh_identity::Identity;
use mesh_plumbing::OutboxSignal;
use mesh_plumbing::api::{Principal, Problem, Role};
use mesh_protocol::{AUDIT_EVENT, AuditEntry, RecordEvent};
use sqlx::PgPool;
use uuid::Uuid;

/// Response header carrying the request's id (also in its audit entry).
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// What a route needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// No token: health, metrics, and the join (its join token is checked by identity).
    Open,
    /// A bearer token with at least this role.
    Role(Role),
}

/// The role every route needs: `method` and the route pattern axum matched
/// (`None` for no route, which answers 404).
pub fn required(method: &Method, route: Option<&str>) -> Access {
    match (method, route) {
        (_, Some("/healthz" | "/metrics" | "/v1/openapi.json")) => Access::Open,
        (&Method::POST, Some("/v1/join")) => Access::Open,
        (_, Some("/v1/tokens" | "/v1/tokens/{id}" | "/v1/audit")) => Access::Role(Role::Admin),
        (&Method::DELETE, Some("/v1/nodes/{id}")) => Access::Role(Role::Admin),
        (&Method::GET | &Method::HEAD, _) => Access::Role(Role::Viewer),
        _ => Access::Role(Role::Operator),
    }
}

fn is_mutation(method: &Method) -> bool {
    !matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
}

/// The state of the auth layer of one context's routes.
#[derive(Clone)]
pub struct Guard {
    pub identity: Arc<Identity>,
    /// The context whose routes these are: audit events go to its outbox.
    pub context: &'static str,
    pub pool: PgPool,
    pub signal: OutboxSignal,
}

fn bearer(req: &Request) -> Option<&str> {
    let value = req.headers().get(AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

fn unauthorized(detail: &str) -> Response {
    let mut r = Problem::unauthorized(detail).into_response();
    r.headers_mut()
        .insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    r
}

/// The middleware: authenticate, authorize, run, audit.
pub async fn guard(State(guard): State<Guard>, req: Request, next: Next) -> Response {
    let request_id = Uuid::now_v7();
    let method = req.method().clone();
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|m| m.as_str().to_owned());
    let target = req.uri().path().to_owned();
    let mut response = match required(&method, route.as_deref()) {
        Access::Open => next.run(req).await,
        Access::Role(needed) => {
            authorized(
                &guard,
                req,
                next,
                needed,
                &method,
                route.as_deref(),
                &target,
                request_id,
            )
            .await
        }
    };
    if let Ok(v) = HeaderValue::from_str(&request_id.to_string()) {
        response.headers_mut().insert(REQUEST_ID_HEADER, v);
    }
    response
}

#[allow(clippy::too_many_arguments)]
async fn authorized(
    guard: &Guard,
    mut req: Request,
    next: Next,
    needed: Role,
    method: &Method,
    route: Option<&str>,
    target: &str,
    request_id: Uuid,
) -> Response {
    let Some(token) = bearer(&req) else {
        return unauthorized("this route needs an API token: `Authorization: Bearer <token>`");
    };
    let principal = match guard.identity.authenticate(token).await {
        Ok(Some(p)) => p,
        Ok(None) => {
            tracing::info!(%method, target, "refused an unknown or revoked API token");
            return unauthorized("the API token is not known or was revoked");
        }
        Err(e) => return Problem::internal(e).into_response(),
    };
    let action = format!("{method} {}", route.unwrap_or(target));
    if principal.role < needed {
        tracing::info!(principal = %principal.name, role = %principal.role, %action, "refused: role too small");
        if is_mutation(method) {
            audit(
                guard,
                &principal,
                &action,
                target,
                request_id,
                StatusCode::FORBIDDEN,
            )
            .await;
        }
        return Problem::forbidden(format!(
            "`{action}` needs the {needed} role; token `{}` has {}",
            principal.name, principal.role
        ))
        .into_response();
    }
    req.extensions_mut().insert(principal.clone());
    let response = next.run(req).await;
    if is_mutation(method) {
        audit(
            guard,
            &principal,
            &action,
            target,
            request_id,
            response.status(),
        )
        .await;
    }
    response
}

/// Write the audit event of one operator action to the serving context's
/// outbox. A failure is logged (loudly) and does not undo the action.
async fn audit(
    guard: &Guard,
    principal: &Principal,
    action: &str,
    target: &str,
    request_id: Uuid,
    status: StatusCode,
) {
    let outcome = if status.is_success() {
        "ok"
    } else if status == StatusCode::FORBIDDEN {
        "denied"
    } else {
        "failed"
    };
    let entry = AuditEntry {
        principal_id: principal.id,
        principal: principal.name.clone(),
        role: principal.role.as_str().to_owned(),
        action: action.to_owned(),
        target: target.chars().take(1024).collect(),
        request_id,
        at: Utc::now(),
        outcome: outcome.to_owned(),
        status: status.as_u16(),
    };
    let event = RecordEvent::new(guard.context, AUDIT_EVENT, &entry);
    let written = async {
        let mut tx = guard.pool.begin().await?;
        mesh_plumbing::outbox::record(&mut tx, guard.context, &event).await?;
        tx.commit().await
    }
    .await;
    match written {
        Ok(()) => guard.signal.notify(),
        Err(e) => tracing::error!(
            context = guard.context,
            %request_id,
            principal = %principal.name,
            action,
            error = %e,
            "AUDIT EVENT LOST: could not write it to the outbox"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_route_declares_its_role() {
        use Access::{Open, Role as R};
        let cases = [
            (Method::GET, "/healthz", Open),
            (Method::GET, "/metrics", Open),
            (Method::GET, "/v1/openapi.json", Open),
            (Method::POST, "/v1/join", Open),
            (Method::GET, "/v1/nodes", R(Role::Viewer)),
            (Method::GET, "/v1/nodes/{id}", R(Role::Viewer)),
            (Method::PUT, "/v1/nodes/{id}/labels", R(Role::Operator)),
            (Method::PUT, "/v1/files/{name}", R(Role::Operator)),
            (Method::DELETE, "/v1/files/{name}", R(Role::Operator)),
            (
                Method::POST,
                "/v1/nodes/{id}/join-tokens",
                R(Role::Operator),
            ),
            (Method::DELETE, "/v1/nodes/{id}", R(Role::Admin)),
            (Method::GET, "/v1/tokens", R(Role::Admin)),
            (Method::POST, "/v1/tokens", R(Role::Admin)),
            (Method::DELETE, "/v1/tokens/{id}", R(Role::Admin)),
            (Method::GET, "/v1/audit", R(Role::Admin)),
        ];
        for (m, p, want) in cases {
            assert_eq!(required(&m, Some(p)), want, "{m} {p}");
        }
        assert_eq!(required(&Method::GET, None), R(Role::Viewer));
        assert_eq!(required(&Method::POST, None), R(Role::Operator));
    }
}
