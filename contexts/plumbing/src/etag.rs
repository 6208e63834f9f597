//! Optimistic concurrency of the HTTP API: a resource's ETag is
//! `"<revision>"`. A write that replaces what exists must say which revision it
//! replaces (`If-Match`), else 428; a stale one gets 412. `If-Match: *`
//! replaces whatever is there; `If-None-Match: *` only creates. A read
//! answers `If-None-Match` listing the current revision with 304.

use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header::IF_NONE_MATCH};
use thiserror::Error;

use crate::api::Problem;

/// A precondition header: `*`, or the revisions it lists (weak tags compare too).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Precondition {
    Any,
    Revisions(Vec<i64>),
}

impl Precondition {
    /// Whether the precondition names `revision` (or is `*`).
    pub fn matches(&self, revision: i64) -> bool {
        match self {
            Precondition::Any => true,
            Precondition::Revisions(r) => r.contains(&revision),
        }
    }
}

/// A write whose preconditions do not hold.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PreconditionError {
    /// 428: the resource exists and the write did not say which revision it replaces.
    #[error("{0}")]
    Required(String),
    /// 412: `If-Match` or `If-None-Match` does not hold.
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

/// The ETag of `revision`: `"<revision>"`.
pub fn etag(revision: i64) -> HeaderValue {
    HeaderValue::from_str(&format!("\"{revision}\"")).unwrap_or(HeaderValue::from_static("\"0\""))
}

/// Read the precondition header `name` (`If-Match`, `If-None-Match`): none if
/// absent, a 400 naming the header if it is neither `*` nor quoted revisions.
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

/// Whether a read of `revision` may answer 304 Not Modified: `If-None-Match`
/// lists it or is `*`. A header that cannot be read does not match (the
/// full answer is never wrong).
pub fn not_modified(headers: &HeaderMap, revision: i64) -> bool {
    precondition(headers, IF_NONE_MATCH)
        .ok()
        .flatten()
        .is_some_and(|p| p.matches(revision))
}

/// Judge a write of `what` (e.g. ``module `web` ``), whose current revision is
/// `current` (none: it does not exist), under its preconditions:
/// - creating (`current` none) needs no `If-Match`; one given fails (412);
/// - `If-None-Match` fails (412) when it is `*` and `what` exists, or lists
///   the current revision;
/// - replacing needs `If-Match` (else 428, whatever `If-None-Match` says) that
///   is `*` or lists the current revision (else 412).
pub fn check_write(
    current: Option<i64>,
    if_match: Option<&Precondition>,
    if_none_match: Option<&Precondition>,
    what: &str,
) -> Result<(), PreconditionError> {
    let Some(rev) = current else {
        return match if_match {
            Some(_) => Err(PreconditionError::Failed(format!(
                "If-Match given, but there is no {what}"
            ))),
            None => Ok(()),
        };
    };
    if let Some(p) = if_none_match
        && p.matches(rev)
    {
        return Err(PreconditionError::Failed(format!(
            "If-None-Match given, but {what} exists (revision {rev})"
        )));
    }
    match if_match {
        None => Err(PreconditionError::Required(format!(
            "{what} exists (revision {rev}): say which revision you replace with \
             If-Match: \"{rev}\" (or If-Match: * to replace whatever is there)"
        ))),
        Some(p) if p.matches(rev) => Ok(()),
        Some(_) => Err(PreconditionError::Failed(format!(
            "{what} is at revision {rev}: re-read it and apply your change again"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use axum::http::header::IF_MATCH;

    use super::*;

    fn headers(name: HeaderName, value: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(name, HeaderValue::from_str(value).unwrap());
        h
    }

    #[test]
    fn parses_star_and_revisions() {
        let h = headers(IF_MATCH, "*");
        assert_eq!(precondition(&h, IF_MATCH).unwrap(), Some(Precondition::Any));
        let h = headers(IF_MATCH, "\"3\", W/\"4\"");
        assert_eq!(
            precondition(&h, IF_MATCH).unwrap(),
            Some(Precondition::Revisions(vec![3, 4]))
        );
        assert_eq!(precondition(&HeaderMap::new(), IF_MATCH).unwrap(), None);
        let h = headers(IF_MATCH, "3");
        assert_eq!(
            precondition(&h, IF_MATCH).unwrap_err().status,
            StatusCode::BAD_REQUEST
        );
    }

    #[test]
    fn not_modified_when_the_tag_is_current() {
        assert!(not_modified(&headers(IF_NONE_MATCH, "\"2\""), 2));
        assert!(not_modified(&headers(IF_NONE_MATCH, "*"), 2));
        assert!(!not_modified(&headers(IF_NONE_MATCH, "\"1\""), 2));
        assert!(!not_modified(&headers(IF_NONE_MATCH, "nonsense"), 2));
        assert!(!not_modified(&HeaderMap::new(), 2));
    }

    #[test]
    fn writes_need_the_current_revision() {
        let any = Precondition::Any;
        let two = Precondition::Revisions(vec![2]);
        let one = Precondition::Revisions(vec![1]);
        assert_eq!(check_write(None, None, None, "x"), Ok(()));
        assert_eq!(check_write(None, None, Some(&any), "x"), Ok(()));
        assert!(matches!(
            check_write(None, Some(&any), None, "x"),
            Err(PreconditionError::Failed(_))
        ));
        assert!(matches!(
            check_write(Some(2), None, None, "x"),
            Err(PreconditionError::Required(m)) if m.contains("If-Match: \"2\"")
        ));
        assert!(matches!(
            check_write(Some(2), None, Some(&any), "x"),
            Err(PreconditionError::Failed(_))
        ));
        assert!(matches!(
            check_write(Some(2), None, Some(&one), "x"),
            Err(PreconditionError::Required(_))
        ));
        assert_eq!(check_write(Some(2), Some(&any), None, "x"), Ok(()));
        assert_eq!(check_write(Some(2), Some(&two), None, "x"), Ok(()));
        assert!(matches!(
            check_write(Some(2), Some(&one), None, "x"),
            Err(PreconditionError::Failed(_))
        ));
    }
}
