//! problem+json (RFC 9457) errors for the HTTP API: every 4xx names what is wrong
//! and, where a field is at fault, which field.

use axum::http::StatusCode;
use axum::http::header::CONTENT_TYPE;
use axum::response::{IntoResponse, Response};
use serde::Serialize;

#[derive(Debug, Clone, Serialize)]
pub struct Problem {
    #[serde(skip)]
    pub status: StatusCode,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub title: String,
    #[serde(rename = "status")]
    pub status_code: u16,
    pub detail: String,
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
