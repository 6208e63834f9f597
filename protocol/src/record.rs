//! Record events: how one context tells the others what happened, without any
//! of them reading another's tables. Routing key `<context>.<event>`.
//!
//! The set of events is closed: [`RecordKind`] names every one, with its typed
//! body, and [`RecordEvent::decode`] is the one place they are read. An event
//! this version does not know is a [`DecodeError::UnknownKind`] (the controller
//! dead-letters it with reason `unknown_kind`).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::envelope::{UnknownFields, from_slice_noting, from_value_noting};
use crate::{
    DecodeError, Labels, MAX_EVENT_BYTES, ModulePlacement, ModuleRemoved, NodeId, PROTOCOL_VERSION,
};

/// Event name (after the context) of an operator action's audit entry: every
/// context that served an operator's mutation writes `<context>.operator.audit`
/// to its outbox; identity subscribes to `*.operator.audit` and appends it.
pub const AUDIT_EVENT: &str = "operator.audit";

/// Every record event of this version, as `<context>.<event>` (`*` for any
/// context). The compatibility corpus (tests/compat/v1/) holds one of each.
pub const RECORD_EVENTS: [&str; 19] = [
    "inventory.node.joined",
    "inventory.node.updated",
    "inventory.node.unreachable",
    "inventory.node.alive",
    "inventory.module.placed",
    "inventory.module.removed",
    "inventory.fleet.conditions",
    "identity.node.enrolled",
    "identity.node.revoked",
    "identity.node.readmitted",
    "connectivity.certificate.issued",
    "observability.module.health",
    "observability.alert.raised",
    "observability.alert.resolved",
    "delivery.module.targets",
    "provisioning.credentials.issued",
    "provisioning.credentials.withdrawn",
    "provisioning.grants.conditions",
    "*.operator.audit",
];

/// The record event as it is on the wire, body not yet interpreted.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct RawRecordEvent {
    v: u16,
    id: Uuid,
    context: String,
    event: String,
    sent_at: DateTime<Utc>,
    body: serde_json::Value,
}

/// A decoded, typed record event.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordEvent {
    /// Event id, UUID v7; the receiving context's inbox key.
    pub id: Uuid,
    pub sent_at: DateTime<Utc>,
    /// What happened, with its body.
    pub kind: RecordKind,
}

/// Every record event there is, typed. A new event does not compile until it
/// has a name here, a body type and a corpus file.
#[derive(Debug, Clone, PartialEq)]
pub enum RecordKind {
    /// `inventory.node.joined`: a node's first hello.
    NodeJoined(NodeLabelsChanged),
    /// `inventory.node.updated`: a node's effective labels changed.
    NodeUpdated(NodeLabelsChanged),
    /// `inventory.node.unreachable`: the sweeper judged a node silent.
    NodeUnreachable(NodeLiveness),
    /// `inventory.node.alive`: a node judged unreachable was heard again.
    NodeAlive(NodeLiveness),
    /// `inventory.module.placed`: the nodes a module has assignments on, or its settings files, changed
    ModulePlaced(ModulePlacement),
    /// `inventory.module.removed`: a module was deleted
    ModuleRemoved(ModuleRemoved),
    /// `inventory.fleet.conditions`: the conditions the reconcile found changed.
    FleetConditions(crate::FleetConditions),
    /// `identity.node.enrolled`: a node joined (or re-joined under a new key).
    NodeEnrolled(NodeIdentityChanged),
    /// `identity.node.revoked`: a node was revoked.
    NodeRevoked(NodeIdentityChanged),
    /// `identity.node.readmitted`: an admin re-admitted a revoked node
    /// (`POST /v1/nodes/{id}/readmit`, decision 0050): it may be given
    /// credentials again (a join token, `mesh-bundle node-add`) and its
    /// reports count again. It is not enrolled by this: it has no broker
    /// user until it joins (or is added) again.
    NodeReadmitted(NodeIdentityChanged),
    /// `connectivity.certificate.issued`: the mesh CA signed a certificate.
    CertificateIssued(crate::CertificateIssued),
    /// `observability.module.health`: a module's or a replica's health changed.
    ModuleHealth(crate::ModuleHealth),
    /// `observability.alert.raised`: an alert opened.
    AlertRaised(crate::AlertChanged),
    /// `observability.alert.resolved`: an alert closed.
    AlertResolved(crate::AlertChanged),
    /// `delivery.module.targets`: the revision each node's replicas of a module run.
    ModuleTargets(crate::ModuleTargets),
    /// `provisioning.credentials.issued`: a grant's credential file for config
    /// to keep and deliver, encrypted under the secrets master key.
    CredentialsIssued(crate::CredentialsIssued),
    /// `provisioning.credentials.withdrawn`: a grant's credential file is
    /// withdrawn from every node.
    CredentialsWithdrawn(crate::CredentialsWithdrawn),
    /// `provisioning.grants.conditions`: grants that wait or failed, whole
    /// (observability turns each into an alert).
    GrantConditions(crate::FleetConditions),
    /// `<context>.operator.audit`: an operator's mutation served by `context`.
    OperatorAudit { context: String, entry: AuditEntry },
}

impl RecordKind {
    /// The context that writes this event.
    pub fn context(&self) -> &str {
        match self {
            RecordKind::NodeJoined(_)
            | RecordKind::NodeUpdated(_)
            | RecordKind::NodeUnreachable(_)
            | RecordKind::NodeAlive(_)
            | RecordKind::ModulePlaced(_)
            | RecordKind::ModuleRemoved(_)
            | RecordKind::FleetConditions(_) => "inventory",
            RecordKind::NodeEnrolled(_)
            | RecordKind::NodeRevoked(_)
            | RecordKind::NodeReadmitted(_) => "identity",
            RecordKind::CertificateIssued(_) => "connectivity",
            RecordKind::ModuleHealth(_)
            | RecordKind::AlertRaised(_)
            | RecordKind::AlertResolved(_) => "observability",
            RecordKind::ModuleTargets(_) => "delivery",
            RecordKind::CredentialsIssued(_)
            | RecordKind::CredentialsWithdrawn(_)
            | RecordKind::GrantConditions(_) => "provisioning",
            RecordKind::OperatorAudit { context, .. } => context,
        }
    }

    /// The event's name within its context, e.g. `node.joined`.
    pub fn event(&self) -> &'static str {
        match self {
            RecordKind::NodeJoined(_) => "node.joined",
            RecordKind::NodeUpdated(_) => "node.updated",
            RecordKind::NodeUnreachable(_) => "node.unreachable",
            RecordKind::NodeAlive(_) => "node.alive",
            RecordKind::ModulePlaced(_) => "module.placed",
            RecordKind::ModuleRemoved(_) => "module.removed",
            RecordKind::FleetConditions(_) => "fleet.conditions",
            RecordKind::CertificateIssued(_) => "certificate.issued",
            RecordKind::ModuleHealth(_) => "module.health",
            RecordKind::AlertRaised(_) => "alert.raised",
            RecordKind::AlertResolved(_) => "alert.resolved",
            RecordKind::ModuleTargets(_) => "module.targets",
            RecordKind::CredentialsIssued(_) => "credentials.issued",
            RecordKind::CredentialsWithdrawn(_) => "credentials.withdrawn",
            RecordKind::GrantConditions(_) => "grants.conditions",
            RecordKind::NodeEnrolled(_) => "node.enrolled",
            RecordKind::NodeRevoked(_) => "node.revoked",
            RecordKind::NodeReadmitted(_) => "node.readmitted",
            RecordKind::OperatorAudit { .. } => AUDIT_EVENT,
        }
    }

    fn body(&self) -> serde_json::Value {
        let v = match self {
            RecordKind::NodeJoined(b) | RecordKind::NodeUpdated(b) => serde_json::to_value(b),
            RecordKind::NodeUnreachable(b) | RecordKind::NodeAlive(b) => serde_json::to_value(b),
            RecordKind::ModulePlaced(b) => serde_json::to_value(b),
            RecordKind::ModuleRemoved(b) => serde_json::to_value(b),
            RecordKind::FleetConditions(b) => serde_json::to_value(b),
            RecordKind::CertificateIssued(b) => serde_json::to_value(b),
            RecordKind::ModuleHealth(b) => serde_json::to_value(b),
            RecordKind::ModuleTargets(b) => serde_json::to_value(b),
            RecordKind::CredentialsIssued(b) => serde_json::to_value(b),
            RecordKind::CredentialsWithdrawn(b) => serde_json::to_value(b),
            RecordKind::GrantConditions(b) => serde_json::to_value(b),
            RecordKind::AlertRaised(b) | RecordKind::AlertResolved(b) => serde_json::to_value(b),
            RecordKind::NodeEnrolled(b)
            | RecordKind::NodeRevoked(b)
            | RecordKind::NodeReadmitted(b) => serde_json::to_value(b),
            RecordKind::OperatorAudit { entry, .. } => serde_json::to_value(entry),
        };
        // Serializing plain data structures to JSON cannot fail.
        v.unwrap_or(serde_json::Value::Null)
    }

    /// Read `body` as the event `<context>.<event>`; unknown fields are noted.
    fn parse(
        context: &str,
        event: &str,
        body: serde_json::Value,
        unknown: &mut UnknownFields,
    ) -> Result<RecordKind, DecodeError> {
        let key = format!("{context}.{event}");
        fn parse<T: serde::de::DeserializeOwned>(
            key: &str,
            body: serde_json::Value,
            unknown: &mut UnknownFields,
        ) -> Result<T, DecodeError> {
            from_value_noting(body, unknown, "body")
                .map_err(|e| DecodeError::invalid("body", format!("{key}: {e}")))
        }
        let kind = match (context, event) {
            ("inventory", "node.joined") => RecordKind::NodeJoined(parse(&key, body, unknown)?),
            ("inventory", "node.updated") => RecordKind::NodeUpdated(parse(&key, body, unknown)?),
            ("inventory", "node.unreachable") => {
                RecordKind::NodeUnreachable(parse(&key, body, unknown)?)
            }
            ("inventory", "node.alive") => RecordKind::NodeAlive(parse(&key, body, unknown)?),
            ("inventory", "module.placed") => RecordKind::ModulePlaced(parse(&key, body, unknown)?),
            ("inventory", "module.removed") => {
                RecordKind::ModuleRemoved(parse(&key, body, unknown)?)
            }
            ("inventory", "fleet.conditions") => {
                RecordKind::FleetConditions(parse(&key, body, unknown)?)
            }
            ("connectivity", "certificate.issued") => {
                RecordKind::CertificateIssued(parse(&key, body, unknown)?)
            }
            ("observability", "module.health") => {
                RecordKind::ModuleHealth(parse(&key, body, unknown)?)
            }
            ("observability", "alert.raised") => {
                RecordKind::AlertRaised(parse(&key, body, unknown)?)
            }
            ("observability", "alert.resolved") => {
                RecordKind::AlertResolved(parse(&key, body, unknown)?)
            }
            ("delivery", "module.targets") => {
                RecordKind::ModuleTargets(parse(&key, body, unknown)?)
            }
            ("provisioning", "credentials.issued") => {
                RecordKind::CredentialsIssued(parse(&key, body, unknown)?)
            }
            ("provisioning", "credentials.withdrawn") => {
                RecordKind::CredentialsWithdrawn(parse(&key, body, unknown)?)
            }
            ("provisioning", "grants.conditions") => {
                RecordKind::GrantConditions(parse(&key, body, unknown)?)
            }
            ("identity", "node.enrolled") => RecordKind::NodeEnrolled(parse(&key, body, unknown)?),
            ("identity", "node.revoked") => RecordKind::NodeRevoked(parse(&key, body, unknown)?),
            ("identity", "node.readmitted") => {
                RecordKind::NodeReadmitted(parse(&key, body, unknown)?)
            }
            (context, AUDIT_EVENT) => {
                validate_context(context)?;
                RecordKind::OperatorAudit {
                    context: context.to_owned(),
                    entry: parse(&key, body, unknown)?,
                }
            }
            _ => {
                return Err(DecodeError::UnknownKind(key.chars().take(128).collect()));
            }
        };
        kind.validate()?;
        Ok(kind)
    }

    fn validate(&self) -> Result<(), DecodeError> {
        let state = |body: &NodeLiveness, expected: LivenessState| {
            if body.state == expected {
                Ok(())
            } else {
                Err(DecodeError::invalid(
                    "body.state",
                    format!("`{}` in a {} event", body.state.as_str(), self.event()),
                ))
            }
        };
        match self {
            RecordKind::NodeUnreachable(b) => state(b, LivenessState::Unreachable),
            RecordKind::NodeAlive(b) => state(b, LivenessState::Alive),
            RecordKind::ModulePlaced(b) => b.validate(),
            RecordKind::ModuleRemoved(b) => b.validate(),
            RecordKind::FleetConditions(b) => b.validate(),
            RecordKind::CertificateIssued(b) => b.validate(),
            RecordKind::ModuleHealth(b) => b.validate(),
            RecordKind::ModuleTargets(b) => b.validate(),
            RecordKind::CredentialsIssued(b) => b.validate(),
            RecordKind::CredentialsWithdrawn(b) => b.validate(),
            RecordKind::GrantConditions(b) => b.validate(),
            RecordKind::AlertRaised(b) if b.resolved_at.is_some() => Err(DecodeError::invalid(
                "body.resolved_at",
                "a raised alert is not resolved",
            )),
            RecordKind::AlertResolved(b) if b.resolved_at.is_none() => Err(DecodeError::invalid(
                "body.resolved_at",
                "required when an alert is resolved",
            )),
            _ => Ok(()),
        }
    }
}

/// A context's name as it appears in routing keys: 1 to 32 of `[a-z0-9_]`,
/// starting with a letter.
fn validate_context(context: &str) -> Result<(), DecodeError> {
    let ok = !context.is_empty()
        && context.len() <= 32
        && context
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_lowercase())
        && context
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(DecodeError::invalid(
            "context",
            format!(
                "`{}`: 1 to 32 characters of a-z 0-9 _ starting with a letter",
                context.chars().take(64).collect::<String>()
            ),
        ))
    }
}

impl RecordEvent {
    /// A new event with a fresh UUID v7 and the current time.
    pub fn new(kind: RecordKind) -> Self {
        RecordEvent {
            id: Uuid::now_v7(),
            sent_at: Utc::now(),
            kind,
        }
    }

    /// The context that wrote the event.
    pub fn context(&self) -> &str {
        self.kind.context()
    }

    /// The event's name within that context, e.g. `node.joined`.
    pub fn event(&self) -> &'static str {
        self.kind.event()
    }

    pub fn routing_key(&self) -> String {
        format!("{}.{}", self.context(), self.event())
    }

    pub fn encode(&self) -> Vec<u8> {
        let raw = RawRecordEvent {
            v: PROTOCOL_VERSION,
            id: self.id,
            context: self.context().to_owned(),
            event: self.event().to_owned(),
            sent_at: self.sent_at,
            body: self.kind.body(),
        };
        serde_json::to_vec(&raw).unwrap_or_default()
    }

    /// Decode and validate an event; fields this version does not know are ignored.
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        Self::decode_noting(bytes).map(|(e, _)| e)
    }

    /// [`RecordEvent::decode`], also returning the fields it ignored.
    pub fn decode_noting(bytes: &[u8]) -> Result<(Self, UnknownFields), DecodeError> {
        if bytes.len() > MAX_EVENT_BYTES {
            return Err(DecodeError::TooLarge {
                size: bytes.len(),
                limit: MAX_EVENT_BYTES,
            });
        }
        let mut unknown = UnknownFields::default();
        let raw: RawRecordEvent = from_slice_noting(bytes, &mut unknown)?;
        if raw.v != PROTOCOL_VERSION {
            return Err(DecodeError::UnsupportedVersion(raw.v));
        }
        let kind = RecordKind::parse(&raw.context, &raw.event, raw.body, &mut unknown)?;
        let event = RecordEvent {
            id: raw.id,
            sent_at: raw.sent_at,
            kind,
        };
        Ok((event, unknown))
    }
}

/// Body of `inventory.node.joined` and `inventory.node.updated`: a node's
/// effective labels. `version` grows with every change to the node, so a receiver
/// ignores an older event that arrives after a newer one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeLabelsChanged {
    pub node: NodeId,
    pub labels: Labels,
    pub version: i64,
}

/// A node's liveness as the controller judges it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LivenessState {
    Alive,
    Unreachable,
}

impl LivenessState {
    pub fn as_str(self) -> &'static str {
        match self {
            LivenessState::Alive => "alive",
            LivenessState::Unreachable => "unreachable",
        }
    }
}

/// Body of `inventory.node.unreachable` and `inventory.node.alive`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeLiveness {
    pub node: NodeId,
    /// `unreachable` or `alive`, as the event's name says.
    pub state: LivenessState,
    /// When the controller judged it (unreachable) or heard it again (alive).
    pub at: DateTime<Utc>,
    /// When the controller last heard from the node before this transition.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_heard: Option<DateTime<Utc>>,
}

impl NodeLiveness {
    /// The event this body belongs to.
    pub fn into_kind(self) -> RecordKind {
        match self.state {
            LivenessState::Alive => RecordKind::NodeAlive(self),
            LivenessState::Unreachable => RecordKind::NodeUnreachable(self),
        }
    }
}

/// Body of `<context>.operator.audit`: who did what to what, and how it ended.
/// Never carries a token or any other secret.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
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
    /// What the route alone does not say and an auditor must see, in words:
    /// e.g. that a module written runs as root (decision 0051). Absent for
    /// most entries (and from an older controller).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// Body of `identity.node.enrolled` (a node joined with a join token, or
/// re-joined under a new key), `identity.node.revoked` and
/// `identity.node.readmitted`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeIdentityChanged {
    pub node: NodeId,
    /// The node's Ed25519 public key (hex); absent on revocation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub public_key: Option<String>,
    pub at: DateTime<Utc>,
    /// The labels the operator bound to the join token the node enrolled
    /// with (`meshctl node add --label`): inventory makes them the node's
    /// operator labels. Absent on revocation and for a token without labels
    /// (and from an older controller: unknown fields are ignored).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<Labels>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node() -> NodeId {
        NodeId::parse("node-a").unwrap()
    }

    #[test]
    fn every_kind_round_trips_under_its_name() {
        let at = Utc::now();
        let kinds = [
            RecordKind::NodeJoined(NodeLabelsChanged {
                node: node(),
                labels: Labels::new(),
                version: 1,
            }),
            NodeLiveness {
                node: node(),
                state: LivenessState::Unreachable,
                at,
                last_heard: Some(at),
            }
            .into_kind(),
            RecordKind::NodeRevoked(NodeIdentityChanged {
                node: node(),
                public_key: None,
                at,
                labels: None,
            }),
            RecordKind::NodeReadmitted(NodeIdentityChanged {
                node: node(),
                public_key: None,
                at,
                labels: None,
            }),
            RecordKind::ModulePlaced(ModulePlacement {
                module: "web".into(),
                version: 3,
                nodes: vec![node()],
                settings_files: vec![crate::SettingsFile {
                    name: "app.env".into(),
                    format: crate::SettingsFormat::Env,
                }],
                ports: Vec::new(),
                requires: Vec::new(),
                provides: Vec::new(),
            }),
            RecordKind::ModuleRemoved(ModuleRemoved {
                module: "web".into(),
                version: 4,
            }),
        ];
        for kind in kinds {
            let event = RecordEvent::new(kind);
            let back = RecordEvent::decode(&event.encode()).unwrap();
            assert_eq!(back, event);
            assert!(
                RECORD_EVENTS.contains(&event.routing_key().as_str()),
                "{}",
                event.routing_key()
            );
        }
    }

    #[test]
    fn liveness_state_must_match_the_event() {
        let bytes = br#"{"v":1,"id":"01890000-0000-7000-8000-000000000000","context":"inventory","event":"node.alive","sent_at":"2024-01-01T00:00:00Z","body":{"node":"node-a","state":"unreachable","at":"2024-01-01T00:00:00Z"}}"#;
        let err = RecordEvent::decode(bytes).unwrap_err();
        assert_eq!(err.metric_label(), "invalid", "{err}");
    }

    #[test]
    fn a_placement_with_a_bad_settings_file_is_invalid_naming_the_field() {
        let bytes = br#"{"v":1,"id":"01890000-0000-7000-8000-000000000000","context":"inventory","event":"module.placed","sent_at":"2024-01-01T00:00:00Z","body":{"module":"web","version":1,"nodes":["node-a"],"settings_files":[{"name":"../etc/passwd","format":"env"}]}}"#;
        match RecordEvent::decode(bytes).unwrap_err() {
            DecodeError::Invalid { field, .. } => assert_eq!(field, "body.settings_files[0].name"),
            other => panic!("{other}"),
        }
        let bytes = br#"{"v":1,"id":"01890000-0000-7000-8000-000000000000","context":"inventory","event":"module.placed","sent_at":"2024-01-01T00:00:00Z","body":{"module":"web","version":1,"nodes":["node-b","node-a"],"settings_files":[]}}"#;
        match RecordEvent::decode(bytes).unwrap_err() {
            DecodeError::Invalid { field, .. } => assert_eq!(field, "body.nodes"),
            other => panic!("{other}"),
        }
    }

    #[test]
    fn unknown_events_are_unknown_kind() {
        let bytes = br#"{"v":1,"id":"01890000-0000-7000-8000-000000000000","context":"inventory","event":"node.exploded","sent_at":"2024-01-01T00:00:00Z","body":{}}"#;
        let err = RecordEvent::decode(bytes).unwrap_err();
        assert_eq!(
            err,
            DecodeError::UnknownKind("inventory.node.exploded".into())
        );
    }
}
