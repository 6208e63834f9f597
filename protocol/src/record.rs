use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::{DecodeError, Labels, MAX_EVENT_BYTES, NodeId, PROTOCOL_VERSION};

/// A domain event on the record: how one context tells the others what happened,
/// without any of them reading another's tables. Routing key `<context>.<event>`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecordEvent {
    pub v: u16,
    /// Event id, UUID v7; the receiving context's inbox key.
    pub id: Uuid,
    /// The context that wrote the event.
    pub context: String,
    /// The event's name within that context, e.g. `node.joined`.
    pub event: String,
    pub sent_at: DateTime<Utc>,
    pub body: serde_json::Value,
}

impl RecordEvent {
    pub fn new<T: Serialize>(context: &str, event: &str, body: &T) -> Self {
        RecordEvent {
            v: PROTOCOL_VERSION,
            id: Uuid::now_v7(),
            context: context.to_owned(),
            event: event.to_owned(),
            sent_at: Utc::now(),
            body: serde_json::to_value(body).unwrap_or(serde_json::Value::Null),
        }
    }

    pub fn routing_key(&self) -> String {
        format!("{}.{}", self.context, self.event)
    }

    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        if bytes.len() > MAX_EVENT_BYTES {
            return Err(DecodeError::TooLarge {
                size: bytes.len(),
                limit: MAX_EVENT_BYTES,
            });
        }
        let e: RecordEvent = serde_json::from_slice(bytes)?;
        if e.v != PROTOCOL_VERSION {
            return Err(DecodeError::UnsupportedVersion(e.v));
        }
        Ok(e)
    }

    /// The typed form of the events this crate knows.
    pub fn kind(&self) -> Result<RecordKind, DecodeError> {
        let parse = |v: &serde_json::Value| -> Result<NodeLabelsChanged, DecodeError> {
            serde_json::from_value(v.clone()).map_err(|e| {
                DecodeError::invalid("body", format!("{}.{}: {e}", self.context, self.event))
            })
        };
        match (self.context.as_str(), self.event.as_str()) {
            ("inventory", "node.joined") => Ok(RecordKind::NodeJoined(parse(&self.body)?)),
            ("inventory", "node.updated") => Ok(RecordKind::NodeUpdated(parse(&self.body)?)),
            _ => Err(DecodeError::UnknownKind(self.routing_key())),
        }
    }
}

/// Body of `inventory.node.joined` and `inventory.node.updated`: a node's
/// effective labels. `version` grows with every change to the node, so a receiver
/// ignores an older event that arrives after a newer one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeLabelsChanged {
    pub node: NodeId,
    pub labels: Labels,
    pub version: i64,
}

/// The record events contexts subscribe to, typed.
#[derive(Debug, Clone, PartialEq)]
pub enum RecordKind {
    NodeJoined(NodeLabelsChanged),
    NodeUpdated(NodeLabelsChanged),
}
