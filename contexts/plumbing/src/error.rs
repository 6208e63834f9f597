//! A context's error, said once: each context's error enum implements
//! [`ContextError`] with only what is particular to it (the problem an API
//! client is answered with, and which of its failures may pass), and plumbing
//! derives the rest: `From<E> for` [`Problem`] (so a route's `?` answers with
//! it) and `From<E> for` [`HandlerError`] (so a handler's `?` is classified,
//! requeued or dead-lettered).

use crate::HandlerError;
use crate::api::Problem;

/// What a context's error says of itself; see the [module](self).
///
/// Both methods have defaults, so an error overrides only where it differs:
/// a server-side failure (500) for the API, and for a handler the class of
/// the database error it wraps, if it wraps one, else permanent.
pub trait ContextError: std::error::Error + Sized + 'static {
    /// The problem+json answer to a request that failed with this error. The
    /// default is a server-side failure: 500, the error logged, the client
    /// told to see the controller's log ([`Problem::internal`]).
    fn problem(self) -> Problem {
        Problem::internal(self)
    }

    /// What the controller does with a report or event whose handler failed
    /// with this error: requeue it (transient) or dead-letter it with this
    /// text as the reason (permanent). The default: an error whose direct
    /// cause (`source()`) is a database error has that error's class
    /// ([`HandlerError::of_database`]: a refused value is permanent, a lost
    /// connection transient); any other error is permanent, the message being
    /// wrong and staying wrong. An error that can pass otherwise (an external
    /// service's) overrides this, and falls back on [`classify`].
    fn handler_error(self) -> HandlerError {
        classify(self)
    }
}

/// The default class of a handler's failure ([`ContextError::handler_error`]),
/// for an override to fall back on.
pub fn classify(e: impl std::error::Error + 'static) -> HandlerError {
    match e.source().and_then(|s| s.downcast_ref::<sqlx::Error>()) {
        Some(db) => HandlerError::of_database(db),
        None => HandlerError::Permanent(e.to_string()),
    }
}

impl<E: ContextError> From<E> for Problem {
    fn from(e: E) -> Self {
        e.problem()
    }
}

impl<E: ContextError> From<E> for HandlerError {
    fn from(e: E) -> Self {
        e.handler_error()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;

    #[derive(Debug, thiserror::Error)]
    enum Error {
        #[error("database: {0}")]
        Database(#[from] sqlx::Error),
        #[error(transparent)]
        Section(#[from] crate::section::SectionError),
        #[error("{0}")]
        NotFound(String),
    }

    impl ContextError for Error {
        fn problem(self) -> Problem {
            match self {
                Error::NotFound(what) => Problem::not_found(what),
                other => Problem::internal(other),
            }
        }
    }

    #[test]
    fn a_wrapped_database_error_keeps_its_class_and_the_rest_is_permanent() {
        let lost = HandlerError::from(Error::Database(sqlx::Error::PoolTimedOut));
        assert!(lost.is_transient(), "{lost}");
        let via_section = HandlerError::from(Error::Section(
            crate::section::SectionError::Database(sqlx::Error::PoolTimedOut),
        ));
        assert!(via_section.is_transient(), "{via_section}");
        let corrupt = HandlerError::from(Error::Section(crate::section::SectionError::Items(
            "x".to_owned(),
        )));
        assert!(!corrupt.is_transient());
        assert_eq!(corrupt.to_string(), "section items do not serialize: x");
        let missing = HandlerError::from(Error::NotFound("no node `a`".to_owned()));
        assert_eq!(missing.to_string(), "no node `a`");
        assert!(!missing.is_transient());
    }

    #[test]
    fn the_problem_is_the_errors_own_or_a_server_failure() {
        let p = Problem::from(Error::NotFound("no node `a`".to_owned()));
        assert_eq!(
            (p.status, p.detail.as_str()),
            (StatusCode::NOT_FOUND, "no node `a`")
        );
        let p = Problem::from(Error::Database(sqlx::Error::PoolTimedOut));
        assert_eq!(p.status, StatusCode::INTERNAL_SERVER_ERROR);
    }
}
