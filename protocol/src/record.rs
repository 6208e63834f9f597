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
        match (self.context.as_str(), self.event.as_str()) {
            ("inventory", "node.joined") => Ok(RecordKind::NodeJoined(self.body()?)),
            ("inventory", "node.updated") => Ok(RecordKind::NodeUpdated(self.body()?)),
            ("identity", "node.enrolled") => Ok(RecordKind::NodeEnrolled(self.body()?)),
            ("identity", "node.revoked") => Ok(RecordKind::NodeRevoked(self.body()?)),
            _ => Err(DecodeError::UnknownKind(self.routing_key())),
        }
    }

    /// The body read as `T`, naming the event in the error.
    fn body<T: serde::de::DeserializeOwned>(&self) -> Result<T, DecodeError> {
        serde_json::from_value(self.body.clone()).map_err(|e| {
            DecodeError::invalid("body", format!("{}.{}: {e}", self.context, self.event))
        })
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
    NodeEnrolled(NodeIdentityChanged),
    NodeRevoked(NodeIdentityChanged),
}

/// Event name (after the context) of an operator action's audit entry: every
/// context that served an operator's mutation writes `<context>.operator.audit`
/// to its outbox; identity subscribes to `*.operator.audit` and appends it.
pub const AUDIT_EVENT: &str = "operator.audit";

/// Body of `<context>.operator.audit`: who did what to what, and how it ended.
/// Never carries a token or any other secret.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuditEntry {
    /// The operator token's id (UUID) and name, e.g. `ci-deployer`.
    pub principal_id: Uuid,
    pub principal: String,
    /// The role the token holds: `admin`, `operator` or `viewer`.
    pub role: String,
    /// The route acted on: method and route pattern, e.g. `PUT /v1/files/{name}`.
    pub action: String,
    /// The concrete path, e.g. `/v1/files/motd`.
    pub target: String,
    /// The request's id (also its `x-request-id` response header).
    pub request_id: Uuid,
    pub at: DateTime<Utc>,
    /// `ok` (2xx), `denied` (403: the role was not enough) or `failed` (any other).
    pub outcome: String,
    /// The HTTP status: 200 for every `ok` entry (it commits with the change,
    /// before the response exists), the status the request ended with otherwise.
    pub status: u16,
}

impl AuditEntry {
    /// The audit entry an event carries, if it is a `*.operator.audit` event.
    pub fn from_event(event: &RecordEvent) -> Option<Result<AuditEntry, DecodeError>> {
        (event.event == AUDIT_EVENT).then(|| {
            serde_json::from_value(event.body.clone())
                .map_err(|e| DecodeError::invalid("body", format!("{}: {e}", event.routing_key())))
        })
    }
}

/// Body of `identity.node.enrolled` (a node joined with a join token, or
/// re-joined under a new key) and `identity.node.revoked`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeIdentityChanged {
    pub node: NodeId,
    /// The node's Ed25519 public key (hex); absent on revocation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub public_key: Option<String>,
    pub at: DateTime<Utc>,
}
