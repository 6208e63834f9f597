//! Optimistic concurrency for every resource an operator writes (modules,
//! files, settings, labels, grants, secrets): the resource's ETag is
//! `"<revision>"`; a write that replaces an existing resource says which
//! revision it replaces (`If-Match`), else 428; a stale one gets 412.
//! `If-Match: *` replaces whatever is there; `If-None-Match: *` only creates.
//! A `GET` whose `If-None-Match` names the current revision is answered 304.

use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use crate::api::Problem;

/// A precondition header: `*`, or the revisions it lists (weak tags compare too).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Precondition {
    Any,
    Revisions(Vec<i64>),
}

impl Precondition {
    /// Whether the precondition holds for a resource at `revision`.
    pub fn holds(&self, revision: i64) -> bool {
        match self {
            Precondition::Any => true,
            Precondition::Revisions(r) => r.contains(&revision),
        }
    }
}

/// The ETag of a resource at `revision`: `"<revision>"`.
pub fn etag(revision: i64) -> HeaderValue {
    HeaderValue::from_str(&format!("\"{revision}\"")).unwrap_or(HeaderValue::from_static("\"0\""))
}

/// Read header `name` (`If-Match` or `If-None-Match`); `None` when absent, 400
/// naming the header when it is neither `*` nor quoted revisions.
pub fn precondition(
    headers: &HeaderMap,
    name: HeaderName,
) -> Result<Option<Precondition>, Problem> {
    let Some(value) = headers.get(&name) else {
        return Ok(None);
    };
    let bad = || {
        Problem::field(
            StatusCode::BAD_REQUEST,
            name.as_str(),
            "expected `*` or quoted revisions such as `\"3\"`",
        )
    };
    let text = value.to_str().map_err(|_| bad())?.trim();
    if text == "*" {
        return Ok(Some(Precondition::Any));
    }
    let mut revisions = Vec::new();
    for tag in text.split(',') {
        let tag = tag.trim();
        let tag = tag.strip_prefix("W/").unwrap_or(tag);
        let inner = tag
            .strip_prefix('"')
            .and_then(|t| t.strip_suffix('"'))
            .ok_or_else(bad)?;
        revisions.push(inner.parse::<i64>().map_err(|_| bad())?);
    }
    Ok(Some(Precondition::Revisions(revisions)))
}

/// `If-Match` and `If-None-Match` of a request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Preconditions {
    pub if_match: Option<Precondition>,
    pub if_none_match: Option<Precondition>,
}

impl Preconditions {
    /// Both headers of `headers` (400 naming the one that cannot be read).
    pub fn from_headers(headers: &HeaderMap) -> Result<Preconditions, Problem> {
        Ok(Preconditions {
            if_match: precondition(headers, header::IF_MATCH)?,
            if_none_match: precondition(headers, header::IF_NONE_MATCH)?,
        })
    }

    /// Whether a write may go ahead on a resource at `current` (`None`: it
    /// does not exist). `what` names the resource in the error, e.g.
    /// ``file `motd` ``.
    pub fn check_write(&self, current: Option<i64>, what: &str) -> Result<(), PreconditionError> {
        check_write(
            current,
            self.if_match.as_ref(),
            self.if_none_match.as_ref(),
            what,
        )
    }

    /// Whether a delete may go ahead on a resource at `revision`: `If-Match`
    /// is checked when given.
    pub fn check_delete(&self, revision: i64, what: &str) -> Result<(), PreconditionError> {
        match &self.if_match {
            Some(p) if !p.holds(revision) => Err(PreconditionError::Failed(format!(
                "{what} is at revision {revision}: re-read it"
            ))),
            _ => Ok(()),
        }
    }
}

/// Why a write's precondition does not hold.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PreconditionError {
    /// 428: the resource exists and the write did not say which revision it replaces.
    #[error("{0}")]
    Required(String),
    /// 412: the revision named is not the current one.
    #[error("{0}")]
    Failed(String),
}

impl From<PreconditionError> for Problem {
    fn from(e: PreconditionError) -> Self {
        match e {
            PreconditionError::Required(detail) => {
                Problem::new(StatusCode::PRECONDITION_REQUIRED, detail)
            }
            PreconditionError::Failed(detail) => {
                Problem::new(StatusCode::PRECONDITION_FAILED, detail)
            }
        }
    }
}

/// Whether a create-or-replace may go ahead on a resource at `current`
/// (`None`: it does not exist): creating needs nothing (or `If-None-Match: *`),
/// replacing needs an `If-Match` that holds.
pub fn check_write(
    current: Option<i64>,
    if_match: Option<&Precondition>,
    if_none_match: Option<&Precondition>,
    what: &str,
) -> Result<(), PreconditionError> {
    match (current, if_match, if_none_match) {
        (None, Some(_), _) => Err(PreconditionError::Failed(format!(
            "If-Match given, but there is no {what}"
        ))),
        (None, None, _) => Ok(()),
        (Some(rev), _, Some(_)) => Err(PreconditionError::Failed(format!(
            "If-None-Match given, but {what} exists (revision {rev})"
        ))),
        (Some(rev), None, None) => Err(PreconditionError::Required(format!(
            "{what} exists (revision {rev}): say which revision you replace with \
             If-Match: \"{rev}\" (or If-Match: * to replace whatever is there)"
        ))),
        (Some(rev), Some(p), None) if p.holds(rev) => Ok(()),
        (Some(rev), Some(_), None) => Err(PreconditionError::Failed(format!(
            "{what} is at revision {rev}: re-read it and apply your change again"
        ))),
    }
}

/// True when `If-None-Match` is `*` or lists `revision`: the client's copy is
/// current and a `GET` answers 304.
pub fn not_modified(headers: &HeaderMap, revision: i64) -> bool {
    matches!(precondition(headers, header::IF_NONE_MATCH), Ok(Some(p)) if p.holds(revision))
}

/// A 304 answer carrying the current ETag.
pub fn not_modified_response(revision: i64) -> Response {
    (StatusCode::NOT_MODIFIED, [(header::ETAG, etag(revision))]).into_response()
}

/// A JSON answer carrying the ETag of `revision`.
pub fn with_etag(status: StatusCode, revision: i64, body: impl serde::Serialize) -> Response {
    (status, [(header::ETAG, etag(revision))], axum::Json(body)).into_response()
}

/// The answer of a `GET` of a resource at `revision`: 304 when the request's
/// `If-None-Match` names it (an unreadable `If-None-Match` matches nothing),
/// else 200 with `body` and the ETag.
pub fn conditional_get(
    headers: &HeaderMap,
    revision: i64,
    body: impl serde::Serialize,
) -> Response {
    if not_modified(headers, revision) {
        not_modified_response(revision)
    } else {
        with_etag(StatusCode::OK, revision, body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(name: HeaderName, value: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(name, HeaderValue::from_str(value).unwrap());
        h
    }

    #[test]
    fn reads_star_and_lists_of_revisions() {
        let h = headers(header::IF_MATCH, "W/\"3\", \"5\"");
        assert_eq!(
            precondition(&h, header::IF_MATCH).unwrap(),
            Some(Precondition::Revisions(vec![3, 5]))
        );
        let h = headers(header::IF_MATCH, "*");
        assert_eq!(
            precondition(&h, header::IF_MATCH).unwrap(),
            Some(Precondition::Any)
        );
        let h = headers(header::IF_MATCH, "3");
        assert!(precondition(&h, header::IF_MATCH).is_err());
        assert_eq!(
            precondition(&HeaderMap::new(), header::IF_MATCH).unwrap(),
            None
        );
    }

    #[test]
    fn writes_need_the_current_revision_to_replace() {
        let two = Precondition::Revisions(vec![2]);
        assert_eq!(check_write(None, None, None, "x"), Ok(()));
        assert_eq!(
            check_write(None, None, Some(&Precondition::Any), "x"),
            Ok(())
        );
        assert!(matches!(
            check_write(None, Some(&two), None, "x"),
            Err(PreconditionError::Failed(_))
        ));
        assert!(matches!(
            check_write(Some(2), None, None, "x"),
            Err(PreconditionError::Required(_))
        ));
        assert_eq!(check_write(Some(2), Some(&two), None, "x"), Ok(()));
        assert_eq!(
            check_write(Some(2), Some(&Precondition::Any), None, "x"),
            Ok(())
        );
        assert!(matches!(
            check_write(Some(3), Some(&two), None, "x"),
            Err(PreconditionError::Failed(_))
        ));
        assert!(matches!(
            check_write(Some(2), None, Some(&Precondition::Any), "x"),
            Err(PreconditionError::Failed(_))
        ));
    }

    #[test]
    fn get_is_not_modified_only_for_the_current_revision() {
        assert!(not_modified(&headers(header::IF_NONE_MATCH, "\"4\""), 4));
        assert!(!not_modified(&headers(header::IF_NONE_MATCH, "\"3\""), 4));
        assert!(!not_modified(&HeaderMap::new(), 4));
    }
}
