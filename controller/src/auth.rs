//! Who may call what: bearer API tokens (identity's), the role every route
//! needs, and the audit entry of every operator mutation.
//!
//! The policy is one table, [`required`]: the route (method and pattern, as axum
//! matched it) → [`Access`]. `/healthz`, `/metrics` and the OpenAPI document
//! `/v1/openapi.json` (it describes routes, it shows no data) are open;
//! `POST /v1/join` is authenticated by its join token and `POST
//! /v1/tokens/exchange` by its OIDC ID token (identity checks both); tokens,
//! OIDC trusts, node revocation and the audit log need `admin`; a module's unit output
//! (`GET /v1/modules/{name}/logs`) needs `operator`; any other read needs
//! `viewer` and any other change `operator`. A missing or unknown token is 401, a role too
//! small is 403, both problem+json. The dashboard's static files
//! (dashboard.rs) are outside every guarded router: they hold no data, and
//! the page sends the operator's token with each `/v1` call it makes.
//!
//! Audit (docs/decisions/0018): the layer puts a [`mesh_plumbing::audit::Audit`]
//! in an authenticated request; the mutating handler writes its `ok` entry into
//! the context's outbox in the transaction of the change itself. A read whose
//! answer may be sensitive ([`is_audited_read`]: a unit's output) gets its
//! entry, whatever its outcome, from the layer after the response. The layer only
//! writes, through plumbing, the entries no handler's transaction carries: a
//! 403 (`denied`) and a failed mutation (`failed`, with its status), after the
//! response. A 401 has no principal and is not in the audit log: it is logged
//! and counted (`mesh_controller_api_unauthenticated_total`). A mutation that answered 2xx
//! without an entry in its transaction is a bug: it is logged, counted
//! (`mesh_controller_api_mutations_unaudited_total`) and its entry written afterwards.

use std::sync::Arc;

use axum::extract::{MatchedPath, Request, State};
use axum::http::header::{AUTHORIZATION, WWW_AUTHENTICATE};
use axum::http::{HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use mesh_identity::{Authenticated, Identity};
use mesh_plumbing::OutboxSignal;
use mesh_plumbing::api::{Problem, Role};
use mesh_plumbing::audit::{self, Audit};
use sqlx::PgPool;
use uuid::Uuid;

use crate::metrics::Metrics;

/// For tests of crash safety only: when `MESH_FAILPOINT_EXIT_AFTER_API_COMMIT`
/// names a route's action (`PUT /v1/files/{name}`) or is `*`, the process exits
/// (code 87) right after such a mutation committed, before its response is
/// sent, as a crash at that moment would.
pub const API_FAILPOINT_ENV: &str = "MESH_FAILPOINT_EXIT_AFTER_API_COMMIT";

/// Exit code of the API failpoint.
pub const API_FAILPOINT_EXIT: i32 = 87;

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
        // Authenticated by the OIDC ID token it carries (identity checks it).
        (&Method::POST, Some("/v1/tokens/exchange")) => Access::Open,
        (
            _,
            Some(
                "/v1/tokens"
                | "/v1/tokens/{id}"
                | "/v1/tokens/{id}/rotate"
                | "/v1/audit"
                | "/v1/trust"
                | "/v1/trust/{name}",
            ),
        ) => Access::Role(Role::Admin),
        (_, Some("/v1/secrets/master-key/rotate")) => Access::Role(Role::Admin),
        // Which keys make a node run code (decision 0048).
        (_, Some("/v1/signing-keys" | "/v1/signing-keys/{name}")) => Access::Role(Role::Admin),
        (&Method::DELETE, Some("/v1/nodes/{id}")) => Access::Role(Role::Admin),
        // Undoing a revocation is an admin's decision (decision 0050).
        (&Method::POST, Some("/v1/nodes/{id}/readmit")) => Access::Role(Role::Admin),
        // A unit's output may hold anything it prints (decision 0033).
        (&Method::GET, Some(LOGS_ROUTE)) => Access::Role(Role::Operator),
        (&Method::GET | &Method::HEAD, _) => Access::Role(Role::Viewer),
        _ => Access::Role(Role::Operator),
    }
}

fn is_mutation(method: &Method) -> bool {
    !matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
}

/// The route of a module's unit output (`crate::logs`).
pub const LOGS_ROUTE: &str = "/v1/modules/{name}/logs";

/// Reads that are audited like mutations, whatever their outcome: what they
/// show may be sensitive (a unit's output). Their entry is written after the
/// response (nothing changed, so no transaction carries it).
pub fn is_audited_read(method: &Method, route: Option<&str>) -> bool {
    *method == Method::GET && route == Some(LOGS_ROUTE)
}

/// The state of the auth layer of one context's routes.
#[derive(Clone)]
pub struct Guard {
    pub identity: Arc<Identity>,
    /// The context whose routes these are: audit events go to its outbox.
    pub context: &'static str,
    pub pool: PgPool,
    pub signal: OutboxSignal,
    pub metrics: Metrics,
    /// [`API_FAILPOINT_ENV`], read once at startup.
    pub failpoint: Option<Arc<str>>,
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
    // The id access.rs set (a trusted incoming one, or one it made); a new one
    // only outside those layers.
    let request_id = crate::access::request_id(&req).unwrap_or_else(Uuid::now_v7);
    let method = req.method().clone();
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|m| m.as_str().to_owned());
    let target = req.uri().path().to_owned();
    match required(&method, route.as_deref()) {
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
    }
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
        guard.metrics.unauthenticated.inc();
        tracing::info!(%method, target, %request_id, "refused: no API token");
        return unauthorized("this route needs an API token: `Authorization: Bearer <token>`");
    };
    let principal = match guard.identity.authenticate(token).await {
        Ok(Authenticated::Principal(p)) => p,
        Ok(Authenticated::Unknown) => {
            guard.metrics.unauthenticated.inc();
            tracing::info!(%method, target, %request_id, "refused an unknown or revoked API token");
            return unauthorized("the API token is not known or was revoked");
        }
        Ok(Authenticated::Expired { name, at }) => {
            guard.metrics.unauthenticated.inc();
            tracing::info!(%method, target, %request_id, token = %name, expired_at = %at, "refused an expired API token");
            return unauthorized(&format!(
                "the API token `{name}` expired at {}: ask an admin for a new one (`meshctl token create`, or `meshctl token rotate <id>`)",
                at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
            ));
        }
        Err(e) => return Problem::internal(e).into_response(),
    };
    let action = format!("{method} {}", route.unwrap_or(target));
    let audit = Audit::new(principal, action, target, request_id);
    let principal = audit.principal();
    if principal.role < needed {
        tracing::info!(principal = %principal.name, role = %principal.role, action = audit.action(), "refused: role too small");
        let refusal = Problem::forbidden(format!(
            "`{}` needs the {needed} role; token `{}` has {}",
            audit.action(),
            principal.name,
            principal.role
        ))
        .into_response();
        if is_mutation(method) || is_audited_read(method, route) {
            after(guard, &audit, StatusCode::FORBIDDEN).await;
        }
        return refusal;
    }
    req.extensions_mut().insert(audit.clone());
    let response = next.run(req).await;
    if is_audited_read(method, route) {
        after(guard, &audit, response.status()).await;
    } else if is_mutation(method) {
        let status = response.status();
        if status.is_success()
            && guard
                .failpoint
                .as_deref()
                .is_some_and(|f| f == "*" || f == audit.action())
        {
            tracing::warn!(
                action = audit.action(),
                "failpoint: exiting after the API commit, before the response"
            );
            std::process::exit(API_FAILPOINT_EXIT);
        }
        if status.is_success() && audit.recorded() {
            // The entry committed with the change; wake the relay for it.
            guard.signal.notify();
        } else if status.is_success() {
            guard
                .metrics
                .mutations_unaudited
                .get_or_create(&Metrics::context(guard.context))
                .inc();
            tracing::error!(
                context = guard.context,
                %request_id,
                principal = %audit.principal().name,
                action = audit.action(),
                "MUTATION WITHOUT AUDIT ENTRY: the handler wrote none in its transaction; writing it now"
            );
            after(guard, &audit, status).await;
        } else {
            after(guard, &audit, status).await;
        }
    }
    response
}

/// Write the entry of a request whose entry no handler's transaction carries
/// (403, a failed mutation) to the serving context's outbox, through plumbing.
/// A failure is logged loudly and counted; the response stands.
async fn after(guard: &Guard, audit: &Audit, status: StatusCode) {
    match audit::record_outcome(&guard.pool, guard.context, audit, status).await {
        Ok(()) => guard.signal.notify(),
        Err(e) => {
            guard
                .metrics
                .audit_lost
                .get_or_create(&Metrics::context(guard.context))
                .inc();
            tracing::error!(
                context = guard.context,
                request_id = %audit.request_id(),
                principal = %audit.principal().name,
                action = audit.action(),
                %status,
                error = %e,
                "AUDIT ENTRY LOST: could not write it to the outbox"
            );
        }
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
            (Method::POST, "/v1/tokens/exchange", Open),
            (Method::GET, "/v1/trust", R(Role::Admin)),
            (Method::GET, "/v1/trust/{name}", R(Role::Admin)),
            (Method::PUT, "/v1/trust/{name}", R(Role::Admin)),
            (Method::DELETE, "/v1/trust/{name}", R(Role::Admin)),
            (Method::GET, "/v1/nodes", R(Role::Viewer)),
            (Method::GET, "/v1/nodes/{id}", R(Role::Viewer)),
            (Method::GET, "/v1/nodes/{id}/labels", R(Role::Viewer)),
            (Method::PUT, "/v1/nodes/{id}/labels", R(Role::Operator)),
            (Method::PUT, "/v1/files/{name}", R(Role::Operator)),
            (Method::DELETE, "/v1/files/{name}", R(Role::Operator)),
            (
                Method::POST,
                "/v1/nodes/{id}/join-tokens",
                R(Role::Operator),
            ),
            (Method::DELETE, "/v1/nodes/{id}", R(Role::Admin)),
            (Method::POST, "/v1/nodes/{id}/readmit", R(Role::Admin)),
            (Method::GET, "/v1/tokens", R(Role::Admin)),
            (Method::POST, "/v1/tokens", R(Role::Admin)),
            (Method::DELETE, "/v1/tokens/{id}", R(Role::Admin)),
            (Method::POST, "/v1/tokens/{id}/rotate", R(Role::Admin)),
            (Method::GET, "/v1/audit", R(Role::Admin)),
            (Method::GET, "/v1/signing-keys", R(Role::Admin)),
            (Method::POST, "/v1/signing-keys", R(Role::Admin)),
            (Method::DELETE, "/v1/signing-keys/{name}", R(Role::Admin)),
            (
                Method::POST,
                "/v1/artifacts/{digest}/signatures",
                R(Role::Operator),
            ),
            (Method::GET, "/v1/overlay", R(Role::Viewer)),
            (Method::GET, "/v1/prometheus/targets", R(Role::Viewer)),
            (Method::GET, "/v1/certificates", R(Role::Viewer)),
            (Method::GET, "/v1/grants", R(Role::Viewer)),
            (Method::GET, "/v1/grants/{id}", R(Role::Viewer)),
            (Method::GET, "/v1/events", R(Role::Viewer)),
            (Method::GET, "/v1/modules/{name}/logs", R(Role::Operator)),
            (Method::GET, "/v1/modules/{name}", R(Role::Viewer)),
            (
                Method::POST,
                "/v1/secrets/master-key/rotate",
                R(Role::Admin),
            ),
        ];
        for (m, p, want) in cases {
            assert_eq!(required(&m, Some(p)), want, "{m} {p}");
        }
        assert_eq!(required(&Method::GET, None), R(Role::Viewer));
        assert_eq!(required(&Method::POST, None), R(Role::Operator));
    }
}
