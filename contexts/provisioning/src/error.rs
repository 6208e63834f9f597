use axum::response::{IntoResponse, Response};
use mesh_plumbing::HandlerError;
use mesh_plumbing::api::Problem;
use mesh_protocol::DecodeError;
use thiserror::Error;

/// What can go wrong in the provisioning context. None of it ever carries a
/// credential.
#[derive(Debug, Error)]
pub enum Error {
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    #[error("invalid field `{field}`: {reason}")]
    Invalid { field: String, reason: String },
    #[error("{0}")]
    NotFound(String),
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
            Error::Corrupt { .. } => "corrupt",
            Error::Section(_) => "section",
        }
    }

    pub(crate) fn corrupt(what: impl Into<String>, reason: impl std::fmt::Display) -> Error {
        Error::Corrupt {
            what: what.into(),
            reason: reason.to_string(),
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
            other => HandlerError::Permanent(other.to_string()),
        }
    }
}

impl From<Error> for Problem {
    fn from(e: Error) -> Self {
        match e {
            Error::Invalid { field, reason } => Problem::unprocessable(field, reason),
            Error::NotFound(what) => Problem::not_found(what),
            other => Problem::internal(other),
        }
    }
}

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        Problem::from(self).into_response()
    }
}
