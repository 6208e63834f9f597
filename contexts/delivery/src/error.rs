use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use mesh_plumbing::HandlerError;
use mesh_plumbing::api::Problem;
use mesh_protocol::DecodeError;
use thiserror::Error;

use crate::receipts::ReceiptError;

/// What can go wrong in the delivery context.
#[derive(Debug, Error)]
pub enum Error {
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    #[error("invalid field `{field}`: {reason}")]
    Invalid { field: String, reason: String },
    #[error("{0} not found")]
    NotFound(String),
    /// A request the current state refuses (a freeze, a rollout in progress,
    /// a decision already made).
    #[error("{0}")]
    Conflict(String),
    #[error("the artifact store: {0}")]
    Store(String),
    #[error("the artifact is larger than {limit} bytes")]
    TooLarge { limit: usize },
    #[error("receipt log: {0}")]
    Receipt(#[from] ReceiptError),
    /// A stored value that does not read back (a bug or a manual edit).
    #[error("stored data is unreadable ({what}): {reason}")]
    Corrupt { what: String, reason: String },
    #[error(transparent)]
    Section(#[from] mesh_plumbing::section::SectionError),
}

impl Error {
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Database(_) => "database",
            Error::Invalid { .. } => "invalid",
            Error::NotFound(_) => "not_found",
            Error::Conflict(_) => "conflict",
            Error::Store(_) => "store",
            Error::TooLarge { .. } => "too_large",
            Error::Receipt(_) => "receipt",
            Error::Corrupt { .. } => "corrupt",
            Error::Section(_) => "section",
        }
    }

    pub(crate) fn invalid(field: &str, reason: impl Into<String>) -> Self {
        Error::Invalid {
            field: field.to_owned(),
            reason: reason.into(),
        }
    }
}

impl From<DecodeError> for Error {
    fn from(e: DecodeError) -> Self {
        match e {
            DecodeError::Invalid { field, reason } => Error::Invalid { field, reason },
            other => Error::Invalid {
                field: "body".to_owned(),
                reason: other.to_string(),
            },
        }
    }
}

impl From<Error> for HandlerError {
    fn from(e: Error) -> Self {
        match e {
            Error::Database(db) => HandlerError::from(db),
            Error::Section(e) => HandlerError::from(e),
            Error::Store(e) => HandlerError::Transient(e),
            other => HandlerError::Permanent(other.to_string()),
        }
    }
}

impl From<Error> for Problem {
    fn from(e: Error) -> Self {
        match e {
            Error::Invalid { field, reason } => Problem::unprocessable(field, reason),
            Error::NotFound(what) => Problem::not_found(format!("{what} not found")),
            Error::Conflict(detail) => Problem::new(StatusCode::CONFLICT, detail),
            Error::TooLarge { limit } => Problem::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the artifact is larger than {limit} bytes (artifact_max_bytes)"),
            ),
            Error::Store(detail) => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("the artifact registry: {detail}"),
            ),
            other => Problem::internal(other),
        }
    }
}

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        Problem::from(self).into_response()
    }
}
