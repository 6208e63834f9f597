use axum::http::StatusCode;
use mesh_plumbing::ContextError;
use mesh_plumbing::api::Problem;
use mesh_plumbing::etag::PreconditionError;
use mesh_protocol::DecodeError;
use thiserror::Error;

/// What can go wrong in the inventory context.
#[derive(Debug, Error)]
pub enum Error {
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    #[error("no node `{0}`")]
    NodeNotFound(String),
    #[error("invalid field `{field}`: {reason}")]
    Invalid { field: String, reason: String },
    /// A stored value that does not read back (a bug or a manual edit).
    #[error("stored data of node `{node}` is unreadable: {reason}")]
    Corrupt { node: String, reason: String },
    #[error(transparent)]
    Section(#[from] mesh_plumbing::section::SectionError),
    /// Something other than a node that the request names does not exist.
    #[error("{0}")]
    NotFound(String),
    /// A write whose If-Match / If-None-Match does not hold.
    #[error("{0}")]
    PreconditionFailed(String),
    /// A replace that did not say which revision it replaces.
    #[error("{0}")]
    PreconditionRequired(String),

    /// A write the resource's state forbids (a revoked node).
    #[error("{0}")]
    Conflict(String),
}

/// What [`mesh_plumbing::etag::check_write`] judged: 428 or 412.
impl From<PreconditionError> for Error {
    fn from(e: PreconditionError) -> Self {
        match e {
            PreconditionError::Required(detail) => Error::PreconditionRequired(detail),
            PreconditionError::Failed(detail) => Error::PreconditionFailed(detail),
        }
    }
}

impl From<DecodeError> for Error {
    fn from(e: DecodeError) -> Self {
        let (field, reason) = mesh_plumbing::api::field_and_reason(e);
        Error::Invalid { field, reason }
    }
}

/// The problem+json each error answers (domain methods return [`enum@Error`];
/// only the routes speak HTTP). Plumbing derives `From<Error>` for `Problem`
/// and for `HandlerError` from this.
impl ContextError for Error {
    fn problem(self) -> Problem {
        match self {
            Error::NodeNotFound(id) => Problem::not_found(format!("no node `{id}`")),
            Error::Invalid { field, reason } => Problem::unprocessable(field, reason),
            Error::NotFound(detail) => Problem::not_found(detail),
            Error::PreconditionFailed(detail) => {
                Problem::new(StatusCode::PRECONDITION_FAILED, detail)
            }
            Error::PreconditionRequired(detail) => {
                Problem::new(StatusCode::PRECONDITION_REQUIRED, detail)
            }
            Error::Conflict(detail) => Problem::new(StatusCode::CONFLICT, detail),
            other => Problem::internal(other),
        }
    }
}
