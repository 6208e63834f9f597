use mesh_plumbing::ContextError;
use mesh_plumbing::api::Problem;
use mesh_protocol::DecodeError;
use thiserror::Error;

/// What can go wrong in the config context.
#[derive(Debug, Error)]
pub enum Error {
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    #[error("no file `{0}`")]
    FileNotFound(String),
    #[error("invalid field `{field}`: {reason}")]
    Invalid { field: String, reason: String },
    /// The change would give a node a section the agent cannot accept.
    #[error(
        "invalid field `{field}`: the config section of node `{node}` would be too large: {reason}"
    )]
    SectionTooLarge {
        field: String,
        node: String,
        reason: String,
    },
    /// A stored value that does not read back (a bug or a manual edit).
    #[error("stored data is unreadable ({what}): {reason}")]
    Corrupt { what: String, reason: String },
    #[error(transparent)]
    Section(#[from] mesh_plumbing::section::SectionError),
    #[error("{0}")]
    NotFound(String),
    #[error(transparent)]
    Precondition(#[from] mesh_plumbing::etag::PreconditionError),
    /// The controller was started without a secrets master keyring.
    #[error(
        "no secrets master keyring: the controller's credentials name no `master_keys_file` \
         (run bundle/up again, then restart the controller)"
    )]
    NoMasterKey,
    /// The keyring file cannot be read or written, or a key it should hold is
    /// not there. Never carries key material.
    #[error("secrets master keyring: {0}")]
    Keyring(String),
    /// The request conflicts with what is stored.
    #[error("{0}")]
    Conflict(String),
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
            Error::FileNotFound(name) => Problem::not_found(format!("no file `{name}`")),
            Error::Invalid { field, reason } => Problem::unprocessable(field, reason),
            Error::SectionTooLarge {
                field,
                node,
                reason,
            } => Problem::unprocessable(
                field,
                format!("the config section of node `{node}` would be too large: {reason}"),
            ),
            Error::NotFound(detail) => Problem::not_found(detail),
            Error::Precondition(e) => Problem::from(e),
            Error::Conflict(detail) => Problem::new(axum::http::StatusCode::CONFLICT, detail),
            e @ Error::NoMasterKey => {
                Problem::new(axum::http::StatusCode::SERVICE_UNAVAILABLE, e.to_string())
            }
            other => Problem::internal(other),
        }
    }
}
