//! What a node states: the `Report` kinds (`ReportKind::ALL`: hello with its
//! facts, heartbeat with its applied generations, applied with a section's
//! outcome, units, certificates, health, logs, resources), the bodies this
//! module defines (hello, heartbeat, applied), decoded by kind through the
//! envelope (`Body`).
//! A node states only about itself: the controller takes its identity from
//! the broker's `user_id`, never from a body.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize};

use crate::envelope::{Body, UnknownFields, parse_body};
use crate::{DecodeError, Labels, ProtocolRange, Section, validate_labels};

/// Newest generation a node has applied, per section.
pub type AppliedGenerations = BTreeMap<Section, u64>;

/// Read applied generations, skipping (and so noting as unknown fields) the
/// sections this version does not know: a newer agent may have applied one.
fn lenient_generations<'de, D: Deserializer<'de>>(d: D) -> Result<AppliedGenerations, D::Error> {
    struct Visitor;
    impl<'de> serde::de::Visitor<'de> for Visitor {
        type Value = AppliedGenerations;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a map of section to generation")
        }

        fn visit_map<A: serde::de::MapAccess<'de>>(
            self,
            mut map: A,
        ) -> Result<Self::Value, A::Error> {
            let mut out = AppliedGenerations::new();
            while let Some(key) = map.next_key::<String>()? {
                match Section::parse(&key) {
                    Some(section) => {
                        out.insert(section, map.next_value()?);
                    }
                    None => {
                        map.next_value::<serde::de::IgnoredAny>()?;
                    }
                }
            }
            Ok(out)
        }
    }
    d.deserialize_map(Visitor)
}

/// The kinds of report a node sends. The controller's router matches on this
/// exhaustively: a new kind does not compile until it is routed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ReportKind {
    Hello,
    Heartbeat,
    Applied,
    Units,
    Certificates,
    Health,
    /// The answer to a logs request (decision 0033): transient, consumed by
    /// the controller's memory, never by a context.
    Logs,
    /// What a provider's agent found of its grants' resources (decision 0039).
    Resources,
}

impl ReportKind {
    pub const ALL: [ReportKind; 8] = [
        ReportKind::Hello,
        ReportKind::Heartbeat,
        ReportKind::Applied,
        ReportKind::Units,
        ReportKind::Certificates,
        ReportKind::Health,
        ReportKind::Logs,
        ReportKind::Resources,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ReportKind::Hello => "hello",
            ReportKind::Heartbeat => "heartbeat",
            ReportKind::Applied => "applied",
            ReportKind::Units => "units",
            ReportKind::Certificates => "certificates",
            ReportKind::Health => "health",
            ReportKind::Logs => "logs",
            ReportKind::Resources => "resources",
        }
    }

    pub fn parse(s: &str) -> Result<Self, DecodeError> {
        ReportKind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| DecodeError::UnknownKind(s.chars().take(64).collect()))
    }
}

/// What a node states about itself.
#[derive(Debug, Clone, PartialEq)]
pub enum Report {
    Hello(Hello),
    Heartbeat(Heartbeat),
    Applied(Applied),
    Units(crate::Units),
    Certificates(crate::Certificates),
    Health(crate::Health),
    Logs(crate::Logs),
    Resources(crate::Resources),
}

impl Report {
    pub fn report_kind(&self) -> ReportKind {
        match self {
            Report::Hello(_) => ReportKind::Hello,
            Report::Heartbeat(_) => ReportKind::Heartbeat,
            Report::Applied(_) => ReportKind::Applied,
            Report::Units(_) => ReportKind::Units,
            Report::Certificates(_) => ReportKind::Certificates,
            Report::Health(_) => ReportKind::Health,
            Report::Logs(_) => ReportKind::Logs,
            Report::Resources(_) => ReportKind::Resources,
        }
    }
}

impl Body for Report {
    fn kind(&self) -> &'static str {
        self.report_kind().as_str()
    }

    fn to_value(&self) -> serde_json::Value {
        let v = match self {
            Report::Hello(b) => serde_json::to_value(b),
            Report::Heartbeat(b) => serde_json::to_value(b),
            Report::Applied(b) => serde_json::to_value(b),
            Report::Units(b) => serde_json::to_value(b),
            Report::Certificates(b) => serde_json::to_value(b),
            Report::Health(b) => serde_json::to_value(b),
            Report::Logs(b) => serde_json::to_value(b),
            Report::Resources(b) => serde_json::to_value(b),
        };
        v.unwrap_or(serde_json::Value::Null)
    }

    fn from_parts(
        kind: &str,
        body: serde_json::Value,
        unknown: &mut UnknownFields,
    ) -> Result<Self, DecodeError> {
        let report = match ReportKind::parse(kind)? {
            ReportKind::Hello => Report::Hello(parse_body(kind, body, unknown)?),
            ReportKind::Heartbeat => Report::Heartbeat(parse_body(kind, body, unknown)?),
            ReportKind::Applied => Report::Applied(parse_body(kind, body, unknown)?),
            ReportKind::Units => Report::Units(parse_body(kind, body, unknown)?),
            ReportKind::Certificates => Report::Certificates(parse_body(kind, body, unknown)?),
            ReportKind::Health => Report::Health(parse_body(kind, body, unknown)?),
            ReportKind::Logs => Report::Logs(parse_body(kind, body, unknown)?),
            ReportKind::Resources => Report::Resources(parse_body(kind, body, unknown)?),
        };
        report.validate()?;
        Ok(report)
    }
}

impl Report {
    fn validate(&self) -> Result<(), DecodeError> {
        match self {
            Report::Hello(h) => h.validate(),
            Report::Heartbeat(h) => h.validate(),
            Report::Applied(a) => a.validate(),
            Report::Units(u) => {
                if u.units.len() > crate::MAX_ITEMS {
                    return Err(DecodeError::invalid("body.units", "too many units"));
                }
                for (i, s) in u.units.iter().enumerate() {
                    if s.reason.as_ref().is_some_and(|r| r.chars().count() > 64) {
                        return Err(DecodeError::invalid(
                            format!("body.units[{i}].reason"),
                            "longer than 64 characters",
                        ));
                    }
                }
                Ok(())
            }
            Report::Certificates(c) => c.validate(),
            Report::Health(h) => h.validate(),
            Report::Logs(l) => l.validate(),
            Report::Resources(r) => r.validate(),
        }
    }
}

/// Sent on every (re)connect: the node's facts, and what it has applied, so the
/// controller can re-send any section the node is behind on. The hello is the
/// handshake: every version sends it in a v1 envelope, so any controller can
/// read who the agent is and which versions it speaks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hello {
    pub hostname: String,
    pub arch: String,
    pub cpus: u32,
    pub memory_bytes: u64,
    /// Labels the node's own configuration gives it; operator labels override these.
    pub labels: Labels,
    pub agent_version: String,
    /// The node's public key, once it has enrolled (identity issue).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub public_key: Option<String>,
    /// The node's X25519 public key (64 hex digits) that secrets are sealed to
    /// ([`crate::sealing`]); absent: an agent older than sealed secrets, to
    /// which no secret can be declared.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seal_key: Option<String>,
    /// The node's WireGuard public key and endpoint (connectivity); absent: an
    /// agent older than the overlay, or one configured without it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overlay: Option<crate::OverlayFacts>,
    #[serde(deserialize_with = "lenient_generations")]
    pub applied: AppliedGenerations,
    /// The envelope versions the agent speaks; absent (an agent older than
    /// ranges): v1 only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol: Option<ProtocolRange>,
    /// The broker outage the agent lived through before this (re)connect:
    /// how long, and what it buffered and dropped meanwhile. Absent: none
    /// (the first connect of a run), or an agent older than outages.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outage: Option<crate::Outage>,
    /// The agent's metrics listener (`metrics_listen`, `ip:port`), which
    /// inventory hands Prometheus as the node's scrape target (an
    /// unspecified address, `0.0.0.0`, on the node's advertised address).
    /// Absent: metrics are not served, or an agent older than discovery.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics: Option<Box<str>>,
}

impl Hello {
    /// The envelope versions the agent speaks.
    pub fn protocol(&self) -> ProtocolRange {
        self.protocol.unwrap_or(ProtocolRange::V1)
    }

    /// Why a controller speaking `ours` cannot talk to this agent; none if it can.
    pub fn refusal(&self, ours: ProtocolRange) -> Option<String> {
        let theirs = self.protocol();
        ours.common(theirs).is_none().then(|| {
            format!(
                "protocol mismatch: agent {} speaks {theirs}, this controller speaks {ours}; \
                 nothing is declared to the node until one of them is upgraded",
                self.agent_version
            )
        })
    }

    fn validate(&self) -> Result<(), DecodeError> {
        if let Some(range) = self.protocol {
            range.validate("body.protocol")?;
        }
        if let Some(key) = &self.seal_key {
            crate::sealing::SealPublicKey::from_hex(key)
                .map_err(|e| DecodeError::invalid("body.seal_key", e.to_string()))?;
        }
        if let Some(metrics) = &self.metrics
            && metrics.parse::<std::net::SocketAddr>().is_err()
        {
            return Err(DecodeError::invalid(
                "body.metrics",
                "must be an ip:port (the agent's metrics listener)",
            ));
        }
        if let Some(overlay) = &self.overlay {
            overlay.validate("body.overlay")?;
        }
        for (field, value, max) in [
            ("body.hostname", &self.hostname, 255),
            ("body.arch", &self.arch, 64),
            ("body.agent_version", &self.agent_version, 64),
        ] {
            if value.is_empty() || value.len() > max || value.chars().any(char::is_control) {
                return Err(DecodeError::invalid(
                    field,
                    format!("must be 1 to {max} characters without control characters"),
                ));
            }
        }
        validate_labels("body.labels", &self.labels)
    }
}

/// Sent on an interval: liveness only. Published transient and without waiting
/// for a confirm (the next one follows; decision 0023). It carries the node's
/// applied generations, the digest of what it applied (one number per section,
/// smaller than any hash of them), so the controller can tell a node in step
/// from one that needs its durable path, and the interval it beats at.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Heartbeat {
    #[serde(deserialize_with = "lenient_generations")]
    pub applied: AppliedGenerations,
    /// The interval the agent beats at now, in milliseconds. Absent: an agent
    /// older than heartbeat plans, which beats at its configured interval.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interval_ms: Option<u64>,
}

/// Shortest and longest heartbeat interval a heartbeat may name, in ms.
pub const HEARTBEAT_INTERVAL_MS: std::ops::RangeInclusive<u64> = 10..=3_600_000;

impl Heartbeat {
    /// A heartbeat of an agent that does not say its interval.
    pub fn new(applied: AppliedGenerations) -> Self {
        Heartbeat {
            applied,
            interval_ms: None,
        }
    }

    fn validate(&self) -> Result<(), DecodeError> {
        match self.interval_ms {
            Some(ms) if !HEARTBEAT_INTERVAL_MS.contains(&ms) => Err(DecodeError::invalid(
                "body.interval_ms",
                format!(
                    "{ms} is outside {}..={}",
                    HEARTBEAT_INTERVAL_MS.start(),
                    HEARTBEAT_INTERVAL_MS.end()
                ),
            )),
            _ => Ok(()),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Every item applied; the generation is now the node's applied generation.
    Applied,
    /// Some items failed; the generation is not recorded as applied.
    Failed,
    /// The declaration could not be read or validated; nothing on disk changed.
    Rejected,
    /// The declaration is for a section this agent does not know (a newer
    /// controller); nothing changed. `unsupported_section` names it.
    Unsupported,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Applied => "applied",
            Outcome::Failed => "failed",
            Outcome::Rejected => "rejected",
            Outcome::Unsupported => "unsupported",
        }
    }
}

/// The outcome of one item of a declaration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ItemOutcome {
    /// The item's path (files) or name (units).
    pub item: String,
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Sent after a declaration was handled, whatever the outcome.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Applied {
    /// Absent only when a rejected declaration could not be read far enough to
    /// know, or its section is unsupported (see `unsupported_section`).
    pub section: Option<Section>,
    pub generation: Option<u64>,
    pub outcome: Outcome,
    #[serde(default)]
    pub items: Vec<ItemOutcome>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Outcome `unsupported`: the section as declared, which this agent does
    /// not know (so `section` cannot name it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unsupported_section: Option<String>,
}

/// Longest error text a receiver keeps from an applied report, in characters.
pub const MAX_ERROR_CHARS: usize = 4000;

impl Applied {
    /// The report's error in words for an operator: its `error`, else its failed
    /// items (`item: error; …`), at most [`MAX_ERROR_CHARS`]; none if all went well.
    pub fn error_text(&self) -> Option<String> {
        let text = match &self.error {
            Some(e) => e.clone(),
            None => {
                let failed: Vec<String> = self
                    .items
                    .iter()
                    .filter(|i| !i.ok)
                    .map(|i| format!("{}: {}", i.item, i.error.as_deref().unwrap_or("failed")))
                    .collect();
                if failed.is_empty() {
                    return None;
                }
                failed.join("; ")
            }
        };
        Some(text.chars().take(MAX_ERROR_CHARS).collect())
    }

    /// The section's name: the known `section`, else the unsupported one.
    pub fn section_name(&self) -> Option<&str> {
        self.section
            .map(Section::as_str)
            .or(self.unsupported_section.as_deref())
    }

    fn validate(&self) -> Result<(), DecodeError> {
        match self.outcome {
            Outcome::Rejected => {}
            Outcome::Unsupported => match &self.unsupported_section {
                Some(name) => {
                    crate::declaration::validate_section_name("body.unsupported_section", name)?
                }
                None => {
                    return Err(DecodeError::invalid(
                        "body.unsupported_section",
                        "required when the outcome is unsupported",
                    ));
                }
            },
            Outcome::Applied | Outcome::Failed => {
                if self.section.is_none() || self.generation.is_none() {
                    return Err(DecodeError::invalid(
                        "body.section",
                        "section and generation are required unless the outcome is rejected or unsupported",
                    ));
                }
            }
        }
        if self.items.len() > crate::MAX_ITEMS {
            return Err(DecodeError::invalid("body.items", "too many items"));
        }
        Ok(())
    }
}
