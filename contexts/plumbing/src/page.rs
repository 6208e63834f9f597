//! The one convention of every list route that answers a page at a time:
//! `limit` (how many at most: absent, the route's default; under 1 or over
//! the route's maximum, a 422 naming `limit`, or for a route whose maximum is
//! a setting, cut to it) and `after` (the previous page's `next`: the key of
//! its last item, opaque to the client; one the route cannot read is a 422
//! naming `after`). The answer's `next` is the last item's key when the page
//! is full ([`next`]), absent on the last page.
//!
//! [`ListQuery`] extracts both with the route's filters: every other
//! parameter, read like [`ApiQuery`](crate::api::ApiQuery) (one that does not
//! parse or is not known is a 400 naming it). A route's OpenAPI `params` list
//! [`Page`] beside its filters' struct.

use std::fmt::Display;

use axum::extract::FromRequestParts;
use axum::http::StatusCode;
use axum::http::request::Parts;
use serde::de::DeserializeOwned;

use crate::api::{Problem, parse_query};

/// The page a list route is asked for; see the [module](self).
#[derive(Debug, Default, Clone, PartialEq, Eq, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct Page {
    /// The previous page's `next`: items after it, in the list's order.
    pub after: Option<String>,
    /// At most this many (the route's description gives its default and
    /// maximum).
    #[param(minimum = 1)]
    pub limit: Option<i64>,
}

impl Page {
    /// How many to answer: `limit`, or `default` without one; one under 1 or
    /// over `max` is a 422 naming `limit`.
    pub fn limit(&self, default: i64, max: i64) -> Result<i64, Problem> {
        let limit = self.limit.unwrap_or(default);
        if (1..=max).contains(&limit) {
            Ok(limit)
        } else {
            Err(Problem::unprocessable(
                "limit",
                format!("must be 1 to {max}"),
            ))
        }
    }

    /// Like [`Page::limit`] for a route whose maximum is a setting the client
    /// does not know: one over `max` is cut to it, one under 1 is a 422.
    pub fn limit_capped(&self, default: i64, max: i64) -> Result<i64, Problem> {
        match self.limit.unwrap_or(default) {
            limit if limit < 1 => Err(Problem::unprocessable("limit", "must be at least 1")),
            limit => Ok(limit.min(max.max(1))),
        }
    }

    /// `after` read by the route's `parse` (its key: a name, an id); what
    /// `parse` refuses is a 422 naming `after`, with `parse`'s reason.
    pub fn after<K, E: Display>(
        &self,
        parse: impl FnOnce(&str) -> Result<K, E>,
    ) -> Result<Option<K>, Problem> {
        self.after
            .as_deref()
            .map(|a| parse(a).map_err(|e| Problem::unprocessable("after", e.to_string())))
            .transpose()
    }
}

impl Page {
    /// `after` as the id (a UUID) of the previous page's last item.
    pub fn after_id(&self) -> Result<Option<uuid::Uuid>, Problem> {
        self.after(|a| {
            uuid::Uuid::parse_str(a).map_err(|_| format!("`{}` is not an id (a UUID)", cut(a)))
        })
    }
}

/// The `next` of a page of `items` asked with `limit`: the key of the last
/// item when the page is full (there may be more), none on the last page.
pub fn next<T, K>(items: &[T], limit: i64, key: impl FnOnce(&T) -> K) -> Option<K> {
    if i64::try_from(items.len()).unwrap_or(i64::MAX) >= limit {
        items.last().map(key)
    } else {
        None
    }
}

/// A list route's query: its [`Page`] and its filters `F` (every other
/// parameter; `()`-like routes without filters use [`NoFilters`]).
pub struct ListQuery<F>(pub Page, pub F);

/// The filters of a list route that has none: any parameter but `limit` and
/// `after` is a 400 naming it.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoFilters {}

impl<F: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for ListQuery<F> {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        let (page, rest) = split(parts.uri.query().unwrap_or_default())?;
        Ok(ListQuery(page, parse_query(&rest)?))
    }
}

/// The page's parameters out of a query string, and the rest of it, encoded
/// again for the filters.
fn split(query: &str) -> Result<(Page, String), Problem> {
    let mut page = Page::default();
    let mut rest = form_urlencoded::Serializer::new(String::new());
    for (name, value) in form_urlencoded::parse(query.as_bytes()) {
        let twice = match &*name {
            "after" => page.after.replace(value.into_owned()).is_some(),
            "limit" => {
                let limit = value.parse().map_err(|_| {
                    Problem::field(
                        StatusCode::BAD_REQUEST,
                        "limit",
                        format!("the query string: `{}` is not a whole number", cut(&value)),
                    )
                })?;
                page.limit.replace(limit).is_some()
            }
            _ => {
                rest.append_pair(&name, &value);
                false
            }
        };
        if twice {
            return Err(Problem::field(
                StatusCode::BAD_REQUEST,
                name.into_owned(),
                "the query string: given twice",
            ));
        }
    }
    Ok((page, rest.finish()))
}

fn cut(s: &str) -> String {
    s.chars().take(40).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize, PartialEq)]
    #[serde(deny_unknown_fields)]
    struct Filters {
        node: Option<String>,
    }

    fn list(query: &str) -> Result<(Page, Filters), Problem> {
        let (page, rest) = split(query)?;
        Ok((page, parse_query(&rest)?))
    }

    #[test]
    fn the_page_and_the_filters_are_read_apart() {
        let (page, filters) = list("node=a%20b&limit=2&after=x%2Fy").unwrap();
        assert_eq!(page.limit, Some(2));
        assert_eq!(page.after.as_deref(), Some("x/y"));
        assert_eq!(filters.node.as_deref(), Some("a b"));
        let (page, filters) = list("").unwrap();
        assert_eq!((page, filters), (Page::default(), Filters { node: None }));
    }

    #[test]
    fn a_parameter_that_cannot_be_read_is_a_400_naming_it() {
        for (query, field) in [
            ("limit=ten", "limit"),
            ("limit=1&limit=2", "limit"),
            ("after=a&after=b", "after"),
            ("colour=red", "colour"),
        ] {
            let p = list(query).unwrap_err();
            assert_eq!(p.status, StatusCode::BAD_REQUEST, "{query}");
            assert_eq!(p.field.as_deref(), Some(field), "{query}: {p:?}");
        }
    }

    #[test]
    fn limits_and_keys_out_of_range_are_422_naming_them() {
        let page = |limit| Page {
            limit,
            after: Some("x".to_owned()),
        };
        assert_eq!(page(None).limit(100, 500).unwrap(), 100);
        assert_eq!(page(Some(500)).limit(100, 500).unwrap(), 500);
        for limit in [0, -1, 501] {
            let p = page(Some(limit)).limit(100, 500).unwrap_err();
            assert_eq!(p.status, StatusCode::UNPROCESSABLE_ENTITY);
            assert_eq!(p.field.as_deref(), Some("limit"));
        }
        assert_eq!(page(Some(5000)).limit_capped(1000, 1000).unwrap(), 1000);
        assert!(page(Some(0)).limit_capped(1000, 1000).is_err());
        let p = page(None).after(|a| a.parse::<u32>()).unwrap_err();
        assert_eq!(p.field.as_deref(), Some("after"));
        assert_eq!(Page::default().after(|a| a.parse::<u32>()).unwrap(), None);
    }

    #[test]
    fn next_is_the_last_key_of_a_full_page() {
        assert_eq!(next(&[1, 2], 2, |x| *x), Some(2));
        assert_eq!(next(&[1], 2, |x| *x), None);
        assert_eq!(next::<i32, i32>(&[], 2, |x| *x), None);
    }
}
