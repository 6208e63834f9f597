//! Every API request's id, access log line and metrics.
//!
//! The request id: an incoming `x-request-id` that is a UUID is kept (so a
//! client, or a proxy in front of the API, can follow its request); anything
//! else is not trusted: a new UUID v7 is made and the client's value appears
//! in the access log only, as `client_request_id`, escaped and truncated. The
//! id is on the request (header and extension) before the auth layer runs, so
//! the audit entry carries it, and it is on every response (`x-request-id`):
//! access log line, audit entry and response header agree.
//!
//! The access log is tower-http's `TraceLayer`: a span `request` (method,
//! route, request id) around the request, and one event per response, target
//! `mesh_controller::access`, with `method`, `route` (the pattern axum
//! matched, `unmatched` when none), `status`, `latency_ms` (to the response's
//! head: a stream such as `/v1/events` is logged when it starts), `request_id`
//! and, when the client sent an id that was not trusted, `client_request_id`.
//! The same response counts in `mesh_controller_http_requests_total` and
//! `mesh_controller_http_request_duration_seconds`, by route pattern, never by
//! raw path, so their cardinality stays bounded.
//!
//! [`layered`] puts the layers in this order, outermost first: the id's check,
//! tower-http's `SetRequestId` (makes the id when none is trusted),
//! `PropagateRequestId` (the response header), `TraceLayer`, then
//! `annotate`, innermost, which hands the route and id to the access log
//! through the response's extensions. They wrap every route (axum applies a
//! router's layers after routing, so the matched route is known) and the
//! fallbacks, outside each context's auth layer: the log sees the final
//! status, 401 and 403 included.

use std::time::Duration;

use axum::Router;
use axum::extract::{MatchedPath, Request};
use axum::http::{HeaderName, HeaderValue, Method, Response};
use axum::middleware::Next;
use tower_http::request_id::{
    MakeRequestId, PropagateRequestIdLayer, RequestId, SetRequestIdLayer,
};
use tower_http::trace::{MakeSpan, OnResponse, TraceLayer};
use tracing::Span;
use uuid::Uuid;

use crate::metrics::Metrics;

/// Request and response header carrying the request's id (also in its audit
/// entry and its access log line).
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// The route label of a request no route matched.
pub const UNMATCHED: &str = "unmatched";

/// Longest share of an untrusted client request id the access log keeps
/// (before escaping).
pub const CLIENT_ID_MAX: usize = 64;

/// An `x-request-id` the client sent that was not a UUID, escaped and truncated.
#[derive(Debug, Clone)]
pub struct ClientRequestId(pub String);

/// What the access log needs of the request, carried on the response.
#[derive(Debug, Clone)]
struct AccessInfo {
    method: &'static str,
    route: Option<String>,
    request_id: Option<String>,
    client_request_id: Option<String>,
}

/// The request id of `req`, as [`layered`] set it: `None` outside those layers.
pub fn request_id<B>(req: &axum::http::Request<B>) -> Option<Uuid> {
    req.headers()
        .get(REQUEST_ID_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|s| Uuid::parse_str(s).ok())
}

/// A trusted incoming id: exactly one `x-request-id`, a UUID (any version).
fn trusted(req: &Request) -> Result<Option<Uuid>, String> {
    let mut values = req.headers().get_all(REQUEST_ID_HEADER).iter();
    let Some(first) = values.next() else {
        return Ok(None);
    };
    let parsed = first
        .to_str()
        .ok()
        .and_then(|s| Uuid::parse_str(s.trim()).ok());
    match (parsed, values.next()) {
        (Some(id), None) => Ok(Some(id)),
        _ => Err(escaped(first.as_bytes())),
    }
}

/// `bytes` as printable ASCII (`\"`, `\\`, `\xNN` for the rest), at most
/// [`CLIENT_ID_MAX`] bytes of it, `…` when cut.
fn escaped(bytes: &[u8]) -> String {
    let mut out: String = bytes
        .iter()
        .take(CLIENT_ID_MAX)
        .flat_map(|b| std::ascii::escape_default(*b))
        .map(char::from)
        .collect();
    if bytes.len() > CLIENT_ID_MAX {
        out.push('…');
    }
    out
}

/// Outermost: keep a valid incoming id (normalised to its hyphenated lower
/// case form); drop any other, remembering it as [`ClientRequestId`].
async fn check_id(mut req: Request, next: Next) -> axum::response::Response {
    match trusted(&req) {
        Ok(Some(id)) => {
            if let Ok(v) = HeaderValue::from_str(&id.to_string()) {
                req.headers_mut().insert(REQUEST_ID_HEADER, v);
            }
        }
        Ok(None) => {}
        Err(client) => {
            req.headers_mut().remove(REQUEST_ID_HEADER);
            req.extensions_mut().insert(ClientRequestId(client));
        }
    }
    next.run(req).await
}

/// Makes the id of a request that brought none (or none trusted): a UUID v7.
#[derive(Clone, Copy, Default)]
struct MakeUuidV7;

impl MakeRequestId for MakeUuidV7 {
    fn make_request_id<B>(&mut self, _request: &axum::http::Request<B>) -> Option<RequestId> {
        HeaderValue::from_str(&Uuid::now_v7().to_string())
            .ok()
            .map(RequestId::new)
    }
}

/// Innermost: carry the method, the route, the id and the client's untrusted
/// id to the access log on the response.
async fn annotate(req: Request, next: Next) -> axum::response::Response {
    let info = AccessInfo {
        method: method_label(req.method()),
        route: req
            .extensions()
            .get::<MatchedPath>()
            .map(|m| m.as_str().to_owned()),
        request_id: request_id(&req).map(|id| id.to_string()),
        client_request_id: req
            .extensions()
            .get::<ClientRequestId>()
            .map(|c| c.0.clone()),
    };
    let mut response = next.run(req).await;
    response.extensions_mut().insert(info);
    response
}

/// A method as a label: the standard ones by name, any other `OTHER`, so a
/// client cannot grow the metrics' label sets.
fn method_label(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET",
        Method::HEAD => "HEAD",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::PATCH => "PATCH",
        Method::OPTIONS => "OPTIONS",
        Method::TRACE => "TRACE",
        Method::CONNECT => "CONNECT",
        _ => "OTHER",
    }
}

/// The span of one request: method, route pattern and request id.
#[derive(Clone, Copy)]
struct RequestSpan;

impl<B> MakeSpan<B> for RequestSpan {
    fn make_span(&mut self, req: &axum::http::Request<B>) -> Span {
        let route = req
            .extensions()
            .get::<MatchedPath>()
            .map_or(UNMATCHED, |m| m.as_str());
        let id = request_id(req).map(|id| id.to_string()).unwrap_or_default();
        tracing::info_span!(
            "request",
            method = method_label(req.method()),
            route,
            request_id = %id,
        )
    }
}

/// The access log line and the request metrics, once the response's head is
/// known (what they need of the request comes from [`annotate`]).
#[derive(Clone)]
struct AccessLog {
    metrics: Metrics,
}

impl<B> OnResponse<B> for AccessLog {
    fn on_response(self, response: &Response<B>, latency: Duration, _span: &Span) {
        let info = response.extensions().get::<AccessInfo>();
        let route = info.and_then(|i| i.route.as_deref()).unwrap_or(UNMATCHED);
        let method = info.map_or("OTHER", |i| i.method);
        let status = response.status().as_u16();
        self.metrics.http_request(route, method, status, latency);
        tracing::info!(
            target: "mesh_controller::access",
            method,
            route,
            status,
            latency_ms = latency.as_secs_f64() * 1000.0,
            request_id = info.and_then(|i| i.request_id.as_deref()).unwrap_or(""),
            client_request_id = info.and_then(|i| i.client_request_id.as_deref()),
            "request"
        );
    }
}

/// `router` with the request id, access log and request metrics layers (see
/// the module's documentation for their order). Call it after every route
/// and fallback is added: axum's layers wrap only what is already there.
pub fn layered(router: Router, metrics: Metrics) -> Router {
    let header = HeaderName::from_static(REQUEST_ID_HEADER);
    let trace = TraceLayer::new_for_http()
        .make_span_with(RequestSpan)
        .on_request(())
        .on_response(AccessLog { metrics })
        .on_body_chunk(())
        .on_eos(())
        .on_failure(());
    // Each `layer` wraps what is there: innermost first.
    router
        .layer(axum::middleware::from_fn(annotate))
        .layer(trace)
        .layer(PropagateRequestIdLayer::new(header.clone()))
        .layer(SetRequestIdLayer::new(header, MakeUuidV7))
        .layer(axum::middleware::from_fn(check_id))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_untrusted_id_is_escaped_and_cut() {
        assert_eq!(escaped(b"abc\"\\\n"), "abc\\\"\\\\\\n");
        let long = vec![b'x'; 100];
        let shown = escaped(&long);
        assert_eq!(shown.chars().count(), CLIENT_ID_MAX + 1);
        assert!(shown.ends_with('…'));
        assert_eq!(escaped(&[0xff]), "\\xff");
    }

    #[test]
    fn methods_are_a_closed_set() {
        assert_eq!(method_label(&Method::GET), "GET");
        let odd = Method::from_bytes(b"BREW").unwrap_or(Method::GET);
        assert_eq!(method_label(&odd), "OTHER");
    }
}
