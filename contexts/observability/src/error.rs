use axum::http::StatusCode;
use mesh_plumbing::ContextError;
use mesh_plumbing::api::Problem;
use thiserror::Error;

/// What can go wrong in the observability context.
#[derive(Debug, Error)]
pub enum Error {
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    /// A request's field (a query parameter or header) that does not parse.
    #[error("invalid field `{field}`: {reason}")]
    Invalid { field: String, reason: String },
    /// The position resumed from was pruned: events after it are lost.
    #[error(
        "position {asked} is older than the oldest kept (events through {through} were pruned): re-list the state you follow (GET /v1/nodes, /v1/modules, ...) and open the stream again without Last-Event-ID"
    )]
    Gone { asked: i64, through: i64 },
    /// Every stream slot is taken.
    #[error("{0} event streams are open, the most this controller serves; retry later")]
    TooManyStreams(usize),
    #[error("stored data is unreadable ({what}): {reason}")]
    Corrupt { what: String, reason: String },
}

/// Plumbing derives `From<Error>` for `Problem` and for `HandlerError` from this.
impl ContextError for Error {
    fn problem(self) -> Problem {
        match &self {
            Error::Invalid { field, reason } => {
                Problem::field(StatusCode::BAD_REQUEST, field.clone(), reason.clone())
            }
            Error::Gone { .. } => {
                Problem::field(StatusCode::GONE, "Last-Event-ID", self.to_string())
            }
            Error::TooManyStreams(_) => {
                Problem::new(StatusCode::SERVICE_UNAVAILABLE, self.to_string())
            }
            _ => Problem::internal(self),
        }
    }
}
