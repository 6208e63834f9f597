use axum::http::StatusCode;
use mesh_plumbing::api::Problem;
use mesh_plumbing::{ContextError, HandlerError};
use thiserror::Error;

use crate::BrokerError;

/// What can go wrong in the identity context. Messages never hold a token, a
/// password or a key.
#[derive(Debug, Error)]
pub enum Error {
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    #[error("invalid field `{field}`: {reason}")]
    Invalid { field: String, reason: String },
    #[error("{0}")]
    NotFound(String),
    /// A join token that is not known: 401.
    #[error("the join token is not known")]
    UnknownJoinToken,
    /// A join token that is known but may not be used (used, expired, another
    /// node's): 403 with the reason.
    #[error("{0}")]
    JoinRefused(String),
    #[error("{0}")]
    Conflict(String),
    #[error("the broker: {0}")]
    Broker(#[from] BrokerError),
    #[error("stored data is unreadable: {0}")]
    Corrupt(String),
    /// An ID token not exchanged (`POST /v1/tokens/exchange`): 401 with why.
    #[error("{0}")]
    ExchangeRefused(String),
    /// A trusted issuer whose keys could not be fetched: 503.
    #[error("{0}")]
    IssuerUnavailable(String),
}

impl Error {
    pub fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::Invalid {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

/// Plumbing derives `From<Error>` for `Problem` and for `HandlerError` from this.
impl ContextError for Error {
    fn problem(self) -> Problem {
        match self {
            Error::Invalid { field, reason } => Problem::unprocessable(field, reason),
            Error::NotFound(what) => Problem::not_found(what),
            Error::UnknownJoinToken => Problem::unauthorized(self.to_string()),
            Error::JoinRefused(why) => Problem::forbidden(why),
            Error::Conflict(why) => Problem::new(StatusCode::CONFLICT, why),
            Error::ExchangeRefused(why) => {
                tracing::info!(reason = %why, "refused an ID token exchange");
                Problem::unauthorized(why)
            }
            Error::IssuerUnavailable(why) => {
                tracing::warn!(reason = %why, "an OIDC issuer's keys could not be fetched");
                Problem::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("{why}; nothing was exchanged: try again"),
                )
            }
            Error::Broker(b) => {
                tracing::error!(error = %b, "broker account operation failed");
                Problem::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the broker's management API failed while managing the node's account; the change was not recorded (the broker may hold part of it) and is safe to repeat: try again",
                )
            }
            other => Problem::internal(other),
        }
    }

    /// The broker's failures may pass; the rest as plumbing says.
    fn handler_error(self) -> HandlerError {
        match self {
            Error::Broker(b) => HandlerError::Transient(b.to_string()),
            other => mesh_plumbing::error::classify(other),
        }
    }
}
