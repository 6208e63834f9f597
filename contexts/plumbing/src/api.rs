//! problem+json (RFC 9457) errors for the HTTP API: every 4xx names what is wrong
//! and, where a field is at fault, which field.

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::StatusCode;
use axum::http::header::CONTENT_TYPE;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// What an operator's API token allows, from least to most: read (`viewer`),
/// change the fleet (`operator`), manage tokens, revoke nodes and read the audit
/// log (`admin`). Ordered: a role allows everything a lesser one does.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    serde::Deserialize,
    utoipa::ToSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Viewer,
    Operator,
    Admin,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Viewer => "viewer",
            Role::Operator => "operator",
            Role::Admin => "admin",
        }
    }

    pub fn parse(s: &str) -> Option<Role> {
        match s {
            "viewer" => Some(Role::Viewer),
            "operator" => Some(Role::Operator),
            "admin" => Some(Role::Admin),
            _ => None,
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The authenticated operator of a request. The controller's auth layer puts
/// it in the request's [`Audit`](crate::audit::Audit), which a mutating handler
/// takes (`audit.principal()`). Holds no secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    /// The API token's id.
    pub id: uuid::Uuid,
    /// The API token's name, e.g. `bootstrap-admin`.
    pub name: String,
    pub role: Role,
}

/// An error answer (RFC 9457, `application/problem+json`).
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Problem {
    #[serde(skip)]
    pub status: StatusCode,
    /// Always `about:blank`: the status says what kind of problem it is.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The status's reason phrase, e.g. `Unprocessable Entity`.
    pub title: String,
    /// The HTTP status code.
    #[serde(rename = "status")]
    pub status_code: u16,
    /// What is wrong, for a person.
    pub detail: String,
    /// The field (body path, path or query parameter, header) at fault, if one is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
}

impl Problem {
    pub fn new(status: StatusCode, detail: impl Into<String>) -> Self {
        Problem {
            status,
            kind: "about:blank",
            title: status.canonical_reason().unwrap_or("error").to_owned(),
            status_code: status.as_u16(),
            detail: detail.into(),
            field: None,
        }
    }

    pub fn field(status: StatusCode, field: impl Into<String>, detail: impl Into<String>) -> Self {
        Problem {
            field: Some(field.into()),
            ..Problem::new(status, detail)
        }
    }

    pub fn not_found(what: impl Into<String>) -> Self {
        Problem::new(StatusCode::NOT_FOUND, what)
    }

    pub fn unprocessable(field: impl Into<String>, detail: impl Into<String>) -> Self {
        Problem::field(StatusCode::UNPROCESSABLE_ENTITY, field, detail)
    }

    pub fn unauthorized(detail: impl Into<String>) -> Self {
        Problem::new(StatusCode::UNAUTHORIZED, detail)
    }

    pub fn forbidden(detail: impl Into<String>) -> Self {
        Problem::new(StatusCode::FORBIDDEN, detail)
    }

    /// A server-side failure: the detail is logged, the client sees a generic text.
    pub fn internal(error: impl std::fmt::Display) -> Self {
        tracing::error!(error = %error, "request failed");
        Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal error; see the controller's log",
        )
    }
}

impl From<mesh_protocol::DecodeError> for Problem {
    fn from(e: mesh_protocol::DecodeError) -> Self {
        match &e {
            mesh_protocol::DecodeError::Invalid { field, reason } => {
                Problem::unprocessable(field.clone(), reason.clone())
            }
            _ => Problem::new(StatusCode::BAD_REQUEST, e.to_string()),
        }
    }
}

/// The field and the reason of a value that does not decode, for a context's
/// `Invalid { field, reason }` error: the field the error names, or `body`.
pub fn field_and_reason(e: mesh_protocol::DecodeError) -> (String, String) {
    match e {
        mesh_protocol::DecodeError::Invalid { field, reason } => (field, reason),
        other => ("body".to_owned(), other.to_string()),
    }
}

impl From<sqlx::Error> for Problem {
    fn from(e: sqlx::Error) -> Self {
        Problem::internal(e)
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let body = serde_json::to_vec(&self).unwrap_or_default();
        (
            self.status,
            [(CONTENT_TYPE, "application/problem+json")],
            body,
        )
            .into_response()
    }
}

/// The status of a write that creates or replaces: 201 when it created, else
/// 200.
pub fn created_status(created: bool) -> StatusCode {
    if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    }
}

/// A write's answer: [`created_status`] with `body` as JSON.
pub fn created<T>(created: bool, body: T) -> (StatusCode, axum::Json<T>) {
    (created_status(created), axum::Json(body))
}

/// Like `axum::Json`, but every rejection is a [`Problem`]. The content type is
/// not checked: `curl -d` without a header still works.
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = Problem;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = Bytes::from_request(req, state)
            .await
            .map_err(|e| Problem::new(e.status(), e.body_text()))?;
        parse(&bytes).map(ApiJson)
    }
}

/// Like `axum::extract::Query`, but every rejection is a 400 [`Problem`] that
/// names the parameter at fault (`field`): one that does not parse, is
/// missing, or is not one the route takes (route parameter structs deny
/// unknown fields).
pub struct ApiQuery<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parse_query(parts.uri.query().unwrap_or_default()).map(ApiQuery)
    }
}

/// A query string (`a=1&b=x`, percent-encoded) read into `T`; see [`ApiQuery`].
pub fn parse_query<T: DeserializeOwned>(query: &str) -> Result<T, Problem> {
    let de = serde_urlencoded::Deserializer::new(form_urlencoded::parse(query.as_bytes()));
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let error = e.into_inner();
        let field = match field_of(&path, &error.to_string()) {
            f if f == "body" => "query".to_owned(),
            f => f,
        };
        Problem::field(
            StatusCode::BAD_REQUEST,
            field,
            format!("the query string: {error}"),
        )
    })
}

fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, Problem> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value: T = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        reject(path, e.into_inner())
    })?;
    de.end().map_err(|e| reject(".".to_owned(), e))?;
    Ok(value)
}

fn reject(path: String, error: serde_json::Error) -> Problem {
    match error.classify() {
        serde_json::error::Category::Data => {
            Problem::unprocessable(field_of(&path, &error.to_string()), error.to_string())
        }
        _ => Problem::new(
            StatusCode::BAD_REQUEST,
            format!("the body is not JSON: {error}"),
        ),
    }
}

/// The field a data error is about: the path serde reached, completed with the
/// name in a "missing field `x`" / "unknown field `x`" message.
fn field_of(path: &str, message: &str) -> String {
    let named = ["missing field `", "unknown field `"]
        .iter()
        .find_map(|p| message.strip_prefix(p))
        .and_then(|rest| rest.split('`').next());
    match (path, named) {
        (".", Some(name)) => name.to_owned(),
        (".", None) => "body".to_owned(),
        (path, Some(name)) if !path.ends_with(name) => format!("{path}.{name}"),
        (path, _) => path.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Body {
        name: String,
        inner: Option<std::collections::BTreeMap<String, String>>,
    }

    #[test]
    fn fields_are_named() {
        let p = parse::<Body>(b"{").unwrap_err();
        assert_eq!(p.status, StatusCode::BAD_REQUEST);
        let p = parse::<Body>(b"{}").unwrap_err();
        assert_eq!(p.field.as_deref(), Some("name"));
        let p = parse::<Body>(br#"{"name": "x", "bogus": 1}"#).unwrap_err();
        assert_eq!(p.field.as_deref(), Some("bogus"), "{p:?}");
        let p = parse::<Body>(br#"{"name": 3}"#).unwrap_err();
        assert_eq!(p.field.as_deref(), Some("name"));
        let p = parse::<Body>(br#"{"name": "x", "inner": {"a": 1}}"#).unwrap_err();
        assert_eq!(p.field.as_deref(), Some("inner.a"));
        let p = parse::<Body>(br#"{"name": "x"} trailing"#).unwrap_err();
        assert_eq!(p.status, StatusCode::BAD_REQUEST);
        assert!(parse::<Body>(br#"{"name": "x"}"#).is_ok());
    }
}
