use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::{DecodeError, NodeId};

/// The version of the envelope and of every body in it. A receiver refuses any other.
pub const PROTOCOL_VERSION: u16 = 1;

/// The envelope as it is on the wire, body not yet interpreted.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
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
    fn from_parts(kind: &str, body: serde_json::Value) -> Result<Self, DecodeError>;
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
    pub fn decode(bytes: &[u8], limit: usize) -> Result<Self, DecodeError> {
        if bytes.len() > limit {
            return Err(DecodeError::TooLarge {
                size: bytes.len(),
                limit,
            });
        }
        let raw: RawEnvelope = serde_json::from_slice(bytes)?;
        if raw.v != PROTOCOL_VERSION {
            return Err(DecodeError::UnsupportedVersion(raw.v));
        }
        let body = B::from_parts(&raw.kind, raw.body)?;
        Ok(Envelope {
            id: raw.id,
            node: raw.node,
            seq: raw.seq,
            sent_at: raw.sent_at,
            body,
        })
    }
}

/// Parse a JSON value into a typed body, naming the kind in the error.
pub(crate) fn parse_body<T: serde::de::DeserializeOwned>(
    kind: &str,
    value: serde_json::Value,
) -> Result<T, DecodeError> {
    serde_json::from_value(value).map_err(|e| DecodeError::invalid("body", format!("{kind}: {e}")))
}
