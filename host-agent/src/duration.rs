//! Durations as the agent's settings write them: a number of seconds
//! (integer or float) or a number with a unit (`ms`, `s`, `m`, `h`).
//!
//! A leaf: the config tables of [`crate::config`], [`crate::units`] and
//! [`crate::artifacts`] all read their durations through it, and it knows
//! none of them.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Deserializer};

/// A duration in a config file: a number of seconds (integer or float) or a string
/// with a unit (`ms`, `s`, `m`, `h`).
pub(crate) fn de_duration<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Int(u64),
        Float(f64),
        Str(String),
    }
    match Raw::deserialize(d)? {
        Raw::Int(s) => Ok(Duration::from_secs(s)),
        Raw::Float(f) => Duration::try_from_secs_f64(f).map_err(serde::de::Error::custom),
        Raw::Str(s) => parse_duration(&s).map_err(serde::de::Error::custom),
    }
}

/// Parse `"10"`, `"1.5"`, `"500ms"`, `"10s"`, `"2m"`, `"1h"`.
pub fn parse_duration(s: &str) -> Result<Duration, DurationError> {
    let s = s.trim();
    let (num, scale) = if let Some(n) = s.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = s.strip_suffix('m') {
        (n, 60.0)
    } else if let Some(n) = s.strip_suffix('h') {
        (n, 3600.0)
    } else {
        (s, 1.0)
    };
    let value: f64 = num
        .trim()
        .parse()
        .map_err(|_| DurationError(s.to_owned()))?;
    Duration::try_from_secs_f64(value * scale).map_err(|_| DurationError(s.to_owned()))
}

/// A duration that could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DurationError(String);

impl fmt::Display for DurationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "`{}` is not a duration (use seconds, or a number with ms, s, m or h)",
            self.0
        )
    }
}

impl std::error::Error for DurationError {}
