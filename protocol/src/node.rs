//! A node's name (`NodeId`: a DNS label, also its broker user and the suffix
//! of its declaration queue) and labels (`Labels`, with their validation;
//! keys under `mesh.io/` are the controller's own).

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Deserializer, Serialize};

use crate::DecodeError;

/// A node's name: its broker user, the first part of its report routing keys, and
/// the suffix of its declaration queue. 1 to 63 characters of `[a-z0-9-]`, starting
/// and ending with a letter or digit (a DNS label), so it never contains the `.`
/// that separates routing-key words.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(transparent)]
pub struct NodeId(String);

impl NodeId {
    pub fn parse(s: &str) -> Result<Self, DecodeError> {
        let bad =
            |reason: &str| DecodeError::invalid("node", format!("`{}`: {reason}", truncate(s)));
        if s.is_empty() || s.len() > 63 {
            return Err(bad("must be 1 to 63 characters"));
        }
        if !s
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        {
            return Err(bad("may contain only a-z, 0-9 and -"));
        }
        if s.starts_with('-') || s.ends_with('-') {
            return Err(bad("must start and end with a letter or digit"));
        }
        Ok(NodeId(s.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

fn truncate(s: &str) -> String {
    s.chars().take(80).collect()
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NodeId({})", self.0)
    }
}

impl<'de> Deserialize<'de> for NodeId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        NodeId::parse(&s).map_err(serde::de::Error::custom)
    }
}

impl std::str::FromStr for NodeId {
    type Err = DecodeError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        NodeId::parse(s)
    }
}

/// Labels of a node: key → value. Keys are 1..=63 of `[a-z0-9._/-]`, values at most
/// 255 characters without control characters; at most 64 labels.
pub type Labels = BTreeMap<String, String>;

pub const MAX_LABELS: usize = 64;

/// Label keys under this prefix are reserved for facts the controller
/// verifies itself: neither a node (in its hello) nor an operator (API, join
/// token) can set one (issue 29; docs/security.md).
pub const RESERVED_LABEL_PREFIX: &str = "mesh.io/";

/// The label every node has, read-only: its id, as the broker proved it
/// (`mesh.io/node=web-1`), so a selector can name one node.
pub const NODE_LABEL: &str = "mesh.io/node";

pub fn validate_labels(field: &str, labels: &Labels) -> Result<(), DecodeError> {
    if labels.len() > MAX_LABELS {
        return Err(DecodeError::invalid(
            field,
            format!("at most {MAX_LABELS} labels"),
        ));
    }
    for (k, v) in labels {
        let key_ok = !k.is_empty()
            && k.len() <= 63
            && k.bytes().all(|b| {
                b.is_ascii_lowercase()
                    || b.is_ascii_digit()
                    || matches!(b, b'-' | b'.' | b'_' | b'/')
            });
        if !key_ok {
            return Err(DecodeError::invalid(
                format!("{field}.{}", truncate(k)),
                "label keys are 1 to 63 characters of a-z 0-9 . _ / -",
            ));
        }
        if v.len() > 255 || v.chars().any(char::is_control) {
            return Err(DecodeError::invalid(
                format!("{field}.{k}"),
                "label values are at most 255 characters, no control characters",
            ));
        }
    }
    Ok(())
}

/// Parses a label selector as a query parameter writes it: `key=value` pairs
/// joined by commas (`role=web,zone=eu`); a node matches when every pair is
/// among its labels. Keys and values follow [`validate_labels`]; an empty
/// selector, a pair without `=`, or a key given twice is an error naming
/// `field`.
pub fn parse_selector(field: &str, text: &str) -> Result<Labels, DecodeError> {
    if text.trim().is_empty() {
        return Err(DecodeError::invalid(
            field,
            "empty: give key=value pairs joined by commas, e.g. role=web,zone=eu",
        ));
    }
    let mut labels = Labels::new();
    for pair in text.split(',') {
        let Some((k, v)) = pair.split_once('=') else {
            return Err(DecodeError::invalid(
                field,
                format!("`{}` is not key=value", truncate(pair)),
            ));
        };
        if labels.insert(k.to_owned(), v.to_owned()).is_some() {
            return Err(DecodeError::invalid(
                field,
                format!("key `{}` is given twice", truncate(k)),
            ));
        }
    }
    // The problem names the parameter itself; the reason names the key.
    validate_labels(field, &labels).map_err(|e| match e {
        DecodeError::Invalid { field: at, reason } => DecodeError::invalid(
            field,
            format!(
                "{}: {reason}",
                at.strip_prefix(&format!("{field}.")).unwrap_or(&at)
            ),
        ),
        other => other,
    })?;
    Ok(labels)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_ids() {
        assert!(NodeId::parse("node-1").is_ok());
        for bad in ["", "-a", "a-", "A", "a.b", "a_b", &"x".repeat(64)] {
            assert!(NodeId::parse(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn labels() {
        let mut l = Labels::new();
        l.insert("role".into(), "web".into());
        assert!(validate_labels("labels", &l).is_ok());
        l.insert("Bad Key".into(), "x".into());
        let err = validate_labels("labels", &l).unwrap_err();
        assert!(err.to_string().contains("labels.Bad Key"), "{err}");
    }

    #[test]
    fn selectors() {
        let s = parse_selector("selector", "role=web,zone=eu").unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!(s["role"], "web");
        assert_eq!(s["zone"], "eu");
        assert_eq!(parse_selector("selector", "role=").unwrap()["role"], "");
        assert_eq!(parse_selector("selector", "a=b=c").unwrap()["a"], "b=c");
        for bad in ["", " ", "role", "role=web,", "=web", "Role=web", "a=1,a=2"] {
            let err = parse_selector("selector", bad).unwrap_err();
            assert!(err.to_string().contains("selector"), "{bad}: {err}");
        }
    }
}
