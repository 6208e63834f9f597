//! The envelope every message travels in (`id`, a UUID v7; `kind`; `node`;
//! `seq`; `sent_at`; `body`) and the one decode of it: `Envelope::decode`
//! (and `decode_noting`) with a size limit, the protocol versions a receiver speaks
//! (`ProtocolRange`), and the fields of a body this version does not know,
//! skipped and kept for the receiver to count (`UnknownFields`).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::{DecodeError, NodeId};

/// The version of the envelope and of every body in it: what this build writes.
/// A receiver refuses an envelope of a version it does not speak
/// ([`ProtocolRange::THIS`]). Within a version, bodies only grow: a receiver
/// ignores (and counts) fields it does not know; a breaking change needs a new
/// version (docs/protocol.md, Compatibility).
pub const PROTOCOL_VERSION: u16 = 1;

/// The envelope versions a party speaks, oldest to newest. A hello carries the
/// agent's; an agent that sends none is read as speaking v1 only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ProtocolRange {
    pub min: u16,
    pub max: u16,
}

impl ProtocolRange {
    /// The range this build speaks (controller and agent alike).
    pub const THIS: ProtocolRange = ProtocolRange {
        min: PROTOCOL_VERSION,
        max: PROTOCOL_VERSION,
    };

    /// What a hello without a range means: an agent older than ranges, v1 only.
    pub const V1: ProtocolRange = ProtocolRange { min: 1, max: 1 };

    pub fn contains(self, v: u16) -> bool {
        self.min <= v && v <= self.max
    }

    /// The newest version both ranges hold, if any.
    pub fn common(self, other: ProtocolRange) -> Option<u16> {
        let v = self.max.min(other.max);
        (v >= self.min.max(other.min)).then_some(v)
    }

    pub(crate) fn validate(self, field: &str) -> Result<(), DecodeError> {
        if self.min == 0 || self.min > self.max {
            return Err(DecodeError::invalid(
                field,
                format!(
                    "min {} and max {} must satisfy 1 <= min <= max",
                    self.min, self.max
                ),
            ));
        }
        Ok(())
    }
}

impl std::fmt::Display for ProtocolRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "v{}..v{}", self.min, self.max)
    }
}

/// Fields a decoder skipped because this version does not know them (a newer
/// sender may add optional fields within a version). `count` is all of them;
/// `paths` keeps the first [`UnknownFields::MAX_PATHS`] (e.g. `body.extra`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UnknownFields {
    pub count: usize,
    pub paths: Vec<String>,
}

impl UnknownFields {
    pub const MAX_PATHS: usize = 16;

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    fn note(&mut self, prefix: &str, path: &serde_ignored::Path<'_>) {
        self.count += 1;
        if self.paths.len() < Self::MAX_PATHS {
            let path = path.to_string();
            let full = match (prefix.is_empty(), path.as_str()) {
                (true, _) => path,
                (false, "" | "?") => prefix.to_owned(),
                (false, p) => format!("{prefix}.{p}"),
            };
            self.paths.push(full.chars().take(128).collect());
        }
    }
}

/// Parse JSON bytes as `T`, noting (not refusing) the fields `T` does not know.
pub(crate) fn from_slice_noting<T: serde::de::DeserializeOwned>(
    bytes: &[u8],
    unknown: &mut UnknownFields,
) -> Result<T, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = serde_ignored::deserialize(&mut de, |path| unknown.note("", &path))?;
    de.end()?;
    Ok(value)
}

/// Read a JSON value as `T`, noting the fields `T` does not know under `prefix`.
pub(crate) fn from_value_noting<T: serde::de::DeserializeOwned>(
    value: serde_json::Value,
    unknown: &mut UnknownFields,
    prefix: &str,
) -> Result<T, serde_json::Error> {
    serde_ignored::deserialize(value, |path| unknown.note(prefix, &path))
}

/// The envelope as it is on the wire, body not yet interpreted.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RawEnvelope {
    /// Protocol version, [`PROTOCOL_VERSION`].
    pub v: u16,
    /// Message id, a UUID v7; also the AMQP `message_id` and the inbox key.
    pub id: Uuid,
    /// What the body is; also the AMQP `type`.
    pub kind: String,
    /// The node the message is from (reports) or for (declarations).
    pub node: NodeId,
    /// Per-node monotonic sequence number of reports; the generation for declarations.
    pub seq: u64,
    pub sent_at: DateTime<Utc>,
    pub body: serde_json::Value,
}

/// A body that can travel in an envelope: it knows its kind and how to read itself
/// back from a kind and a JSON value.
pub trait Body: Sized {
    fn kind(&self) -> &'static str;
    fn to_value(&self) -> serde_json::Value;
    /// Read the body of `kind`, noting the fields this version does not know.
    fn from_parts(
        kind: &str,
        body: serde_json::Value,
        unknown: &mut UnknownFields,
    ) -> Result<Self, DecodeError>;
}

/// A decoded, validated message.
#[derive(Debug, Clone, PartialEq)]
pub struct Envelope<B> {
    pub id: Uuid,
    pub node: NodeId,
    pub seq: u64,
    pub sent_at: DateTime<Utc>,
    pub body: B,
}

impl<B: Body> Envelope<B> {
    /// A new envelope with a fresh UUID v7 and the current time.
    pub fn new(node: NodeId, seq: u64, body: B) -> Self {
        Envelope {
            id: Uuid::now_v7(),
            node,
            seq,
            sent_at: Utc::now(),
            body,
        }
    }

    pub fn kind(&self) -> &'static str {
        self.body.kind()
    }

    pub fn encode(&self) -> Vec<u8> {
        let raw = RawEnvelope {
            v: PROTOCOL_VERSION,
            id: self.id,
            kind: self.body.kind().to_owned(),
            node: self.node.clone(),
            seq: self.seq,
            sent_at: self.sent_at,
            body: self.body.to_value(),
        };
        // Serializing plain data structures to JSON cannot fail.
        serde_json::to_vec(&raw).unwrap_or_default()
    }

    /// Decode and validate `bytes`, refusing anything larger than `limit`.
    /// Fields this version does not know are ignored.
    pub fn decode(bytes: &[u8], limit: usize) -> Result<Self, DecodeError> {
        Self::decode_noting(bytes, limit).map(|(env, _)| env)
    }

    /// [`Envelope::decode`], also returning the fields it ignored, so that the
    /// receiver can count them.
    pub fn decode_noting(bytes: &[u8], limit: usize) -> Result<(Self, UnknownFields), DecodeError> {
        if bytes.len() > limit {
            return Err(DecodeError::TooLarge {
                size: bytes.len(),
                limit,
            });
        }
        let mut unknown = UnknownFields::default();
        let raw: RawEnvelope = from_slice_noting(bytes, &mut unknown)?;
        if !ProtocolRange::THIS.contains(raw.v) {
            return Err(DecodeError::UnsupportedVersion(raw.v));
        }
        let body = B::from_parts(&raw.kind, raw.body, &mut unknown)?;
        let env = Envelope {
            id: raw.id,
            node: raw.node,
            seq: raw.seq,
            sent_at: raw.sent_at,
            body,
        };
        Ok((env, unknown))
    }
}

/// Parse a JSON value into a typed body, naming the kind in the error and
/// noting the fields this version does not know.
pub(crate) fn parse_body<T: serde::de::DeserializeOwned>(
    kind: &str,
    value: serde_json::Value,
    unknown: &mut UnknownFields,
) -> Result<T, DecodeError> {
    from_value_noting(value, unknown, "body")
        .map_err(|e| DecodeError::invalid("body", format!("{kind}: {e}")))
}
