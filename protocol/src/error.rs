//! `DecodeError`: why a message could not be decoded, one variant per cause,
//! each naming what is wrong so the reason can travel in a dead-letter header
//! and be read by an operator, with a short stable label for metrics
//! (`metric_label`).

use thiserror::Error;

/// Why a message could not be decoded. Every variant names what is wrong so that
/// the reason can travel in a dead-letter header and be read by an operator.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum DecodeError {
    #[error("message too large: {size} bytes, limit {limit}")]
    TooLarge { size: usize, limit: usize },
    #[error("malformed JSON: {0}")]
    Malformed(String),
    #[error("unsupported protocol version {0}")]
    UnsupportedVersion(u16),
    #[error("unknown kind `{0}`")]
    UnknownKind(String),
    /// A declaration of a section this version does not know (a newer sender).
    #[error("unsupported section `{section}`")]
    UnsupportedSection {
        section: String,
        generation: Option<u64>,
    },
    #[error("invalid field `{field}`: {reason}")]
    Invalid { field: String, reason: String },
}

impl DecodeError {
    pub(crate) fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        DecodeError::Invalid {
            field: field.into(),
            reason: reason.into(),
        }
    }

    /// The same error with its field under `prefix` (`requires[0].name` in a
    /// record body becomes `body.requires[0].name`).
    pub fn prefixed(self, prefix: &str) -> Self {
        match self {
            DecodeError::Invalid { field, reason } => DecodeError::Invalid {
                field: format!("{prefix}.{field}"),
                reason,
            },
            other => other,
        }
    }

    /// A short, stable label for metrics (`reason` label of the dead-letter counter).
    pub fn metric_label(&self) -> &'static str {
        match self {
            DecodeError::TooLarge { .. } => "too_large",
            DecodeError::Malformed(_) => "malformed",
            DecodeError::UnsupportedVersion(_) => "unsupported_version",
            DecodeError::UnknownKind(_) => "unknown_kind",
            DecodeError::UnsupportedSection { .. } => "unsupported_section",
            DecodeError::Invalid { .. } => "invalid",
        }
    }
}

impl From<serde_json::Error> for DecodeError {
    fn from(e: serde_json::Error) -> Self {
        DecodeError::Malformed(e.to_string())
    }
}
