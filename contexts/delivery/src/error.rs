use axum::http::StatusCode;
use mesh_plumbing::api::Problem;
use mesh_plumbing::{ContextError, HandlerError};
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
    pub(crate) fn invalid(field: &str, reason: impl Into<String>) -> Self {
        Error::Invalid {
            field: field.to_owned(),
            reason: reason.into(),
        }
    }
}

impl From<DecodeError> for Error {
    fn from(e: DecodeError) -> Self {
        let (field, reason) = mesh_plumbing::api::field_and_reason(e);
        Error::Invalid { field, reason }
    }
}

/// Plumbing derives `From<Error>` for `Problem` and for `HandlerError` from this.
impl ContextError for Error {
    fn problem(self) -> Problem {
        match self {
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

    /// The artifact store's failures may pass; the rest as plumbing says.
    fn handler_error(self) -> HandlerError {
        match self {
            Error::Store(e) => HandlerError::Transient(e),
            other => mesh_plumbing::error::classify(other),
        }
    }
}
