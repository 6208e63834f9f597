use mesh_plumbing::HandlerError;
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

impl Error {
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Database(_) => "database",
            Error::NodeNotFound(_) => "not_found",
            Error::Invalid { .. } => "invalid",
            Error::Corrupt { .. } => "corrupt",
            Error::Section(_) => "section",
            Error::NotFound(_) => "not_found",
            Error::PreconditionFailed(_) => "precondition_failed",
            Error::PreconditionRequired(_) => "precondition_required",

            Error::Conflict(_) => "conflict",
        }
    }
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
