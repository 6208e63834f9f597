//! A unit's recent output, fetched through the agent (decision 0033).
//!
//! The controller asks with a [`LogsRequest`] on the node's own declaration
//! queue (signed like a declaration, with a short AMQP expiration so it never
//! piles up there); the agent answers with a `logs` report ([`Logs`]) naming
//! the request's envelope id. The agent reads only the log files of its own
//! units of the module, under its state directory: nothing in a request is
//! ever used as a path. Output is not stored anywhere on the way.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::envelope::{Body, UnknownFields, parse_body};
use crate::{DecodeError, validate_module_name, validate_unit_name};

/// Most lines a request may ask for, per stream of each unit.
pub const MAX_LOG_LINES: u32 = 1000;
/// Longest line an answer carries, in bytes; a longer one is cut into pieces
/// of at most this size.
pub const MAX_LOG_LINE_BYTES: usize = 4096;
/// Most units one answer covers, and most positions one request carries.
pub const MAX_LOG_UNITS: usize = 64;
/// Bytes of output (escaped as JSON) one answer carries at most, all units and
/// streams together, so that the report stays under
/// [`crate::MAX_REPORT_BYTES`] with room for its envelope and positions.
pub const MAX_LOG_ANSWER_BYTES: usize = 48 * 1024;

/// One of a unit's two streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogStream {
    Stdout,
    Stderr,
}

impl LogStream {
    pub const ALL: [LogStream; 2] = [LogStream::Stdout, LogStream::Stderr];

    pub fn as_str(self) -> &'static str {
        match self {
            LogStream::Stdout => "stdout",
            LogStream::Stderr => "stderr",
        }
    }
}

/// Where a reader of one stream of one unit stopped: the file (its inode)
/// and the offset in it, and a check of the bytes just before the offset, so
/// that a file replaced by another with the same inode is not mistaken for
/// it. `file` 0: nothing was written yet (read from the oldest file kept).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LogPosition {
    pub unit: String,
    pub stream: LogStream,
    pub file: u64,
    pub offset: u64,
    #[serde(default)]
    pub check: u64,
}

/// Controller → node: the recent output of the node's units of `module`.
/// Its envelope's `id` is the request's id, which the answer names; its
/// `seq` is 0.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogsRequest {
    pub module: String,
    /// Without a position for a stream: its last `tail` lines; with one: at
    /// most `tail` lines after it. 1 to [`MAX_LOG_LINES`].
    pub tail: u32,
    /// Where the previous answer stopped, per unit and stream.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub after: Vec<LogPosition>,
}

impl LogsRequest {
    /// The envelope kind (the AMQP `type`) of a logs request on `decl.<node>`.
    pub const KIND: &'static str = "logs_request";

    pub fn validate(&self) -> Result<(), DecodeError> {
        validate_module_name("body.module", &self.module)?;
        if self.tail == 0 || self.tail > MAX_LOG_LINES {
            return Err(DecodeError::invalid(
                "body.tail",
                format!("{} is outside 1..={MAX_LOG_LINES}", self.tail),
            ));
        }
        if self.after.len() > 2 * MAX_LOG_UNITS {
            return Err(DecodeError::invalid(
                "body.after",
                format!("more than {} positions", 2 * MAX_LOG_UNITS),
            ));
        }
        for (i, p) in self.after.iter().enumerate() {
            validate_unit_name(&format!("body.after[{i}].unit"), &p.unit)?;
        }
        Ok(())
    }
}

impl Body for LogsRequest {
    fn kind(&self) -> &'static str {
        LogsRequest::KIND
    }

    fn to_value(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or(serde_json::Value::Null)
    }

    fn from_parts(
        kind: &str,
        body: serde_json::Value,
        unknown: &mut UnknownFields,
    ) -> Result<Self, DecodeError> {
        if kind != LogsRequest::KIND {
            return Err(DecodeError::UnknownKind(kind.chars().take(64).collect()));
        }
        let r: LogsRequest = parse_body(kind, body, unknown)?;
        r.validate()?;
        Ok(r)
    }
}

/// What one stream of one unit gave.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamLogs {
    pub stream: LogStream,
    /// Whole lines, oldest first, without their newline; bytes that are not
    /// UTF-8 are replaced (U+FFFD).
    #[serde(default)]
    pub lines: Vec<String>,
    /// Where to continue from.
    pub position: LogPosition,
    /// Output was lost between the position asked and the first line: its
    /// file was rotated away (or replaced) before it was read.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub gap: bool,
    /// More output follows `position` than this answer carries: ask again.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub more: bool,
}

/// One unit's output.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnitLogs {
    pub unit: String,
    pub streams: Vec<StreamLogs>,
}

/// Node → controller (report kind `logs`): the answer to the request whose
/// envelope id is `request`. Transient, sent once, never buffered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Logs {
    pub request: Uuid,
    pub module: String,
    #[serde(default)]
    pub units: Vec<UnitLogs>,
    /// Why nothing could be read (the node runs no unit of the module, the
    /// request was invalid), in words.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Logs {
    pub(crate) fn validate(&self) -> Result<(), DecodeError> {
        validate_module_name("body.module", &self.module)?;
        if self.units.len() > MAX_LOG_UNITS {
            return Err(DecodeError::invalid(
                "body.units",
                format!("more than {MAX_LOG_UNITS} units"),
            ));
        }
        for (i, u) in self.units.iter().enumerate() {
            validate_unit_name(&format!("body.units[{i}].unit"), &u.unit)?;
            if u.streams.len() > LogStream::ALL.len() {
                return Err(DecodeError::invalid(
                    format!("body.units[{i}].streams"),
                    "more than two streams",
                ));
            }
            for (j, s) in u.streams.iter().enumerate() {
                if s.lines.len() > MAX_LOG_LINES as usize {
                    return Err(DecodeError::invalid(
                        format!("body.units[{i}].streams[{j}].lines"),
                        format!("more than {MAX_LOG_LINES} lines"),
                    ));
                }
                if s.position.unit != u.unit || s.position.stream != s.stream {
                    return Err(DecodeError::invalid(
                        format!("body.units[{i}].streams[{j}].position"),
                        "names another unit or stream",
                    ));
                }
            }
        }
        if let Some(e) = &self.error
            && e.chars().count() > 2000
        {
            return Err(DecodeError::invalid(
                "body.error",
                "longer than 2000 characters",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Envelope, NodeId};

    #[test]
    fn a_request_round_trips_and_is_checked() {
        let node = NodeId::parse("node-a").unwrap();
        let req = LogsRequest {
            module: "web".into(),
            tail: 10,
            after: vec![LogPosition {
                unit: "web-0".into(),
                stream: LogStream::Stderr,
                file: 42,
                offset: 7,
                check: 9,
            }],
        };
        let env = Envelope::new(node.clone(), 0, req.clone());
        let back = Envelope::<LogsRequest>::decode(&env.encode(), 1 << 20).unwrap();
        assert_eq!(back.body, req);
        for bad in [
            LogsRequest {
                tail: 0,
                ..req.clone()
            },
            LogsRequest {
                tail: MAX_LOG_LINES + 1,
                ..req.clone()
            },
            LogsRequest {
                module: "../etc".into(),
                ..req.clone()
            },
        ] {
            let env = Envelope::new(node.clone(), 0, bad);
            assert!(Envelope::<LogsRequest>::decode(&env.encode(), 1 << 20).is_err());
        }
        // A declaration is not a logs request, nor the other way round.
        let err = Envelope::<crate::Declaration>::decode(&env.encode(), 1 << 20).unwrap_err();
        assert_eq!(err.metric_label(), "unknown_kind");
    }
}
