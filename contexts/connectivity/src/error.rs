use mesh_plumbing::ContextError;
use mesh_plumbing::api::Problem;
use mesh_protocol::DecodeError;
use thiserror::Error;

/// What can go wrong in the connectivity context.
#[derive(Debug, Error)]
pub enum Error {
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    #[error("invalid field `{field}`: {reason}")]
    Invalid { field: String, reason: String },
    /// A stored value that does not read back (a bug or a manual edit).
    #[error("stored data is unreadable ({what}): {reason}")]
    Corrupt { what: String, reason: String },
    #[error(transparent)]
    Section(#[from] mesh_plumbing::section::SectionError),
    /// The mesh CA failed to sign (never carries key material).
    #[error("the mesh CA: {0}")]
    Ca(#[from] mesh_credentials::pki::PkiError),
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
            other => Problem::internal(other),
        }
    }
}
