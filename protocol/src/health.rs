//! Health: the probes a unit declares, the `health` report an agent sends of
//! their results, what an agent says of a broker outage it lived through
//! (hello's `outage`), and the record events observability and the contexts
//! it learns from write (module health, alerts, fleet conditions, certificates).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::{DecodeError, NodeId, validate_module_name, validate_unit_name};

/// Most probes one unit may declare.
pub const MAX_PROBES: usize = 8;
/// Most probe results one `health` report may carry.
pub const MAX_PROBE_RESULTS: usize = 4096;
/// Longest probe detail (why it failed) kept, in characters.
pub const MAX_PROBE_DETAIL: usize = 512;

/// `GET http://<host>:<port><path>` answers `expect_status`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct HttpCheck {
    /// Default `127.0.0.1`.
    #[serde(default = "loopback")]
    pub host: String,
    pub port: u16,
    /// Default `/`.
    #[serde(default = "root_path")]
    pub path: String,
    /// Default 200.
    #[serde(default = "ok_status")]
    pub expect_status: u16,
}

/// A TCP connection to `<host>:<port>` is accepted.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TcpCheck {
    /// Default `127.0.0.1`.
    #[serde(default = "loopback")]
    pub host: String,
    pub port: u16,
}

/// `command args…` exits 0 within the timeout.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ExecCheck {
    pub command: String,
    #[serde(default)]
    pub args: Vec<String>,
}

/// What a probe checks: exactly one of its `http`, `tcp`, `exec`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeCheck<'a> {
    Http(&'a HttpCheck),
    Tcp(&'a TcpCheck),
    Exec(&'a ExecCheck),
}

fn loopback() -> String {
    "127.0.0.1".into()
}
fn root_path() -> String {
    "/".into()
}
fn ok_status() -> u16 {
    200
}
fn one() -> u32 {
    1
}
fn three() -> u32 {
    3
}
fn ten() -> u32 {
    10
}
fn two() -> u32 {
    2
}

/// A probe a unit declares: what to check, how often, and how many results in
/// a row turn it healthy or unhealthy (as Kubernetes' probes count them).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Probe {
    /// Unique within the unit: `[a-z0-9-_.]`, 1 to 63 characters.
    pub name: String,
    /// Exactly one of `http`, `tcp` and `exec` (as Kubernetes' `httpGet`,
    /// `tcpSocket` and `exec`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<HttpCheck>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp: Option<TcpCheck>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exec: Option<ExecCheck>,
    /// Seconds between two checks. Default 10, 1 to 3600.
    #[serde(default = "ten")]
    pub interval_secs: u32,
    /// Seconds a check may take before it counts as a failure. Default 2,
    /// at least 1 and at most the interval.
    #[serde(default = "two")]
    pub timeout_secs: u32,
    /// Successes in a row that turn the probe healthy. Default 1.
    #[serde(default = "one")]
    pub success_threshold: u32,
    /// Failures in a row that turn the probe unhealthy. Default 3.
    #[serde(default = "three")]
    pub failure_threshold: u32,
    /// Seconds after the unit started before the first check. Default 0.
    #[serde(default)]
    pub initial_delay_secs: u32,
}

impl Probe {
    pub fn validate(&self, field: &str) -> Result<(), DecodeError> {
        validate_unit_name(&format!("{field}.name"), &self.name)?;
        let bad = |f: &str, reason: &str| DecodeError::invalid(format!("{field}.{f}"), reason);
        if !(1..=3600).contains(&self.interval_secs) {
            return Err(bad("interval_secs", "must be 1 to 3600"));
        }
        if self.timeout_secs == 0 || self.timeout_secs > self.interval_secs {
            return Err(bad(
                "timeout_secs",
                "must be at least 1 and at most interval_secs",
            ));
        }
        if !(1..=100).contains(&self.success_threshold) {
            return Err(bad("success_threshold", "must be 1 to 100"));
        }
        if !(1..=100).contains(&self.failure_threshold) {
            return Err(bad("failure_threshold", "must be 1 to 100"));
        }
        if self.initial_delay_secs > 86_400 {
            return Err(bad("initial_delay_secs", "must be at most 86400"));
        }
        let Some(check) = self.check() else {
            return Err(DecodeError::invalid(
                field,
                "exactly one of `http`, `tcp` and `exec` is required",
            ));
        };
        match check {
            ProbeCheck::Http(HttpCheck {
                host,
                port,
                path,
                expect_status,
            }) => {
                validate_host(&format!("{field}.host"), host)?;
                if *port == 0 {
                    return Err(bad("port", "must be 1 to 65535"));
                }
                if !path.starts_with('/')
                    || path.len() > 1024
                    || path.bytes().any(|b| b.is_ascii_control() || b == b' ')
                {
                    return Err(bad(
                        "path",
                        "must start with / and hold at most 1024 characters without spaces or control characters",
                    ));
                }
                if !(100..=599).contains(expect_status) {
                    return Err(bad("expect_status", "must be an HTTP status, 100 to 599"));
                }
            }
            ProbeCheck::Tcp(TcpCheck { host, port }) => {
                validate_host(&format!("{field}.host"), host)?;
                if *port == 0 {
                    return Err(bad("port", "must be 1 to 65535"));
                }
            }
            ProbeCheck::Exec(ExecCheck { command, args }) => {
                if command.is_empty() || command.len() > 4096 || command.contains('\0') {
                    return Err(bad("command", "must be 1 to 4096 bytes without NUL"));
                }
                if args.len() > 64 || args.iter().any(|a| a.len() > 4096 || a.contains('\0')) {
                    return Err(bad(
                        "args",
                        "at most 64 arguments of at most 4096 bytes, without NUL",
                    ));
                }
            }
        }
        Ok(())
    }

    /// What the probe checks; none unless exactly one check is given.
    pub fn check(&self) -> Option<ProbeCheck<'_>> {
        match (&self.http, &self.tcp, &self.exec) {
            (Some(h), None, None) => Some(ProbeCheck::Http(h)),
            (None, Some(t), None) => Some(ProbeCheck::Tcp(t)),
            (None, None, Some(e)) => Some(ProbeCheck::Exec(e)),
            _ => None,
        }
    }

    /// The probe's kind: `http`, `tcp` or `exec` (`invalid` without exactly one).
    pub fn kind(&self) -> &'static str {
        match self.check() {
            Some(ProbeCheck::Http(_)) => "http",
            Some(ProbeCheck::Tcp(_)) => "tcp",
            Some(ProbeCheck::Exec(_)) => "exec",
            None => "invalid",
        }
    }
}

/// Validate a unit's probes: at most [`MAX_PROBES`], names unique.
pub fn validate_probes(field: &str, probes: &[Probe]) -> Result<(), DecodeError> {
    if probes.len() > MAX_PROBES {
        return Err(DecodeError::invalid(
            field,
            format!("at most {MAX_PROBES} probes"),
        ));
    }
    for (i, p) in probes.iter().enumerate() {
        p.validate(&format!("{field}[{i}]"))?;
        if probes[..i].iter().any(|q| q.name == p.name) {
            return Err(DecodeError::invalid(
                format!("{field}[{i}].name"),
                format!("`{}` is named twice", p.name),
            ));
        }
    }
    Ok(())
}

/// A probe's host: an IP address or a DNS name, at most 253 characters.
fn validate_host(field: &str, host: &str) -> Result<(), DecodeError> {
    let ok = !host.is_empty()
        && host.len() <= 253
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b':' | b'_'));
    if ok {
        Ok(())
    } else {
        Err(DecodeError::invalid(
            field,
            "must be an IP address or a DNS name of at most 253 characters",
        ))
    }
}

/// A probe's current verdict on its node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum ProbeState {
    /// Not decided yet (initial delay, or fewer results than a threshold).
    Unknown,
    Healthy,
    Unhealthy,
}

impl ProbeState {
    pub fn as_str(self) -> &'static str {
        match self {
            ProbeState::Unknown => "unknown",
            ProbeState::Healthy => "healthy",
            ProbeState::Unhealthy => "unhealthy",
        }
    }
}

/// One probe's result as its agent states it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProbeResult {
    /// The unit the probe belongs to.
    pub unit: String,
    pub module: String,
    pub probe: String,
    pub state: ProbeState,
    /// When `state` last changed on the node.
    pub since: DateTime<Utc>,
    /// When the probe last ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checked_at: Option<DateTime<Utc>>,
    /// Failures in a row (0 after a success).
    #[serde(default)]
    pub failures: u32,
    /// The last check's outcome in words: `HTTP 503`, `connection refused`, …
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// Body of the `health` report: the result of every probe of every unit the
/// node runs, whole, never a delta. Sent when a probe's state changes and, as
/// a summary (`summary: true`), on an interval.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Health {
    pub probes: Vec<ProbeResult>,
    /// A periodic summary, not a change.
    #[serde(default)]
    pub summary: bool,
}

impl Health {
    pub(crate) fn validate(&self) -> Result<(), DecodeError> {
        if self.probes.len() > MAX_PROBE_RESULTS {
            return Err(DecodeError::invalid(
                "body.probes",
                format!("at most {MAX_PROBE_RESULTS} results"),
            ));
        }
        for (i, p) in self.probes.iter().enumerate() {
            let at = format!("body.probes[{i}]");
            validate_unit_name(&format!("{at}.unit"), &p.unit)?;
            validate_unit_name(&format!("{at}.module"), &p.module)?;
            validate_unit_name(&format!("{at}.probe"), &p.probe)?;
            if p.detail
                .as_ref()
                .is_some_and(|d| d.chars().count() > MAX_PROBE_DETAIL)
            {
                return Err(DecodeError::invalid(
                    format!("{at}.detail"),
                    format!("at most {MAX_PROBE_DETAIL} characters"),
                ));
            }
        }
        Ok(())
    }
}

/// What an agent lived through while it could not reach the broker, stated
/// in the first hello after it reached it again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Outage {
    /// When the agent lost the broker (its clock).
    pub since: DateTime<Utc>,
    /// How long it could not reach it, in seconds.
    pub seconds: u64,
    /// Reports it kept in its buffer meanwhile (sent after this hello).
    pub buffered: u64,
    /// Reports it had to drop (buffer full, or a heartbeat that cannot wait).
    pub dropped: u64,
}

// ---------------------------------------------------------------- record bodies

/// Health of a replica, a module or a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum HealthState {
    /// Nothing decided yet: no result, or the node is not heard.
    Unknown,
    /// Every probe (or, without probes, the unit) is well.
    Healthy,
    /// A replica: a probe failed or the unit is not running.
    Unhealthy,
    /// A module or node: some replicas unhealthy, some healthy.
    Degraded,
    /// A module: no replica healthy.
    Down,
}

impl HealthState {
    pub fn as_str(self) -> &'static str {
        match self {
            HealthState::Unknown => "unknown",
            HealthState::Healthy => "healthy",
            HealthState::Unhealthy => "unhealthy",
            HealthState::Degraded => "degraded",
            HealthState::Down => "down",
        }
    }
}

/// One replica's health in a [`ModuleHealth`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaHealth {
    pub node: NodeId,
    pub unit: String,
    pub health: HealthState,
    /// Why it is not healthy, in words: the probe results or unit state that
    /// decided it (`probe `ready`: HTTP 503`). Absent when healthy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// Body of `observability.module.health`: a module's health changed (its own
/// or one replica's). `version` grows with every event of the module; a
/// receiver (delivery's rollout gate) keeps the newest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModuleHealth {
    pub module: String,
    pub version: i64,
    pub health: HealthState,
    pub replicas: Vec<ReplicaHealth>,
    pub at: DateTime<Utc>,
}

impl ModuleHealth {
    pub(crate) fn validate(&self) -> Result<(), DecodeError> {
        validate_module_name("body.module", &self.module)?;
        for (i, r) in self.replicas.iter().enumerate() {
            validate_unit_name(&format!("body.replicas[{i}].unit"), &r.unit)?;
            if r.reason
                .as_ref()
                .is_some_and(|x| x.chars().count() > 4 * MAX_PROBE_DETAIL)
            {
                return Err(DecodeError::invalid(
                    format!("body.replicas[{i}].reason"),
                    format!("at most {} characters", 4 * MAX_PROBE_DETAIL),
                ));
            }
        }
        Ok(())
    }
}

/// An alert's severity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    Info,
    Warning,
    Critical,
}

impl Severity {
    pub fn as_str(self) -> &'static str {
        match self {
            Severity::Info => "info",
            Severity::Warning => "warning",
            Severity::Critical => "critical",
        }
    }
}

/// Body of `observability.alert.raised` and `observability.alert.resolved`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AlertChanged {
    pub id: Uuid,
    pub kind: String,
    pub severity: Severity,
    /// What the alert is about: `node/<id>`, `module/<name>`, `queue/<name>`, `controller`.
    pub subject: String,
    pub message: String,
    pub since: DateTime<Utc>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resolved_at: Option<DateTime<Utc>>,
}

/// One condition of the fleet that inventory's reconcile found (a module it
/// cannot place in full, a pinned module on an unreachable node, re-placement
/// paused). observability turns each into an alert.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct FleetCondition {
    /// Stable while the condition holds, e.g. `unplaced:web`.
    pub key: String,
    /// `placement_unsatisfied`, `pinned_unreachable` or `replacement_paused`.
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<NodeId>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub module: Option<String>,
    /// Whether the module is stateful (a pinned module on an unreachable node).
    #[serde(default)]
    pub stateful: bool,
    pub message: String,
}

/// Most conditions one `inventory.fleet.conditions` event carries.
pub const MAX_CONDITIONS: usize = 10_000;

/// Body of `inventory.fleet.conditions`: every condition inventory's last
/// reconcile found, whole (a condition absent is over). Written when the set
/// changes; `version` grows with each, a receiver keeps the newest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FleetConditions {
    pub version: i64,
    pub conditions: Vec<FleetCondition>,
}

impl FleetConditions {
    pub(crate) fn validate(&self) -> Result<(), DecodeError> {
        if self.conditions.len() > MAX_CONDITIONS {
            return Err(DecodeError::invalid(
                "body.conditions",
                format!("at most {MAX_CONDITIONS}"),
            ));
        }
        for (i, c) in self.conditions.iter().enumerate() {
            if c.key.is_empty() || c.key.len() > 256 {
                return Err(DecodeError::invalid(
                    format!("body.conditions[{i}].key"),
                    "must be 1 to 256 characters",
                ));
            }
            if let Some(m) = &c.module {
                validate_module_name(&format!("body.conditions[{i}].module"), m)?;
            }
        }
        Ok(())
    }
}

/// Body of `connectivity.certificate.issued`: the mesh CA signed a
/// certificate for a node (its own, or one of its modules').
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CertificateIssued {
    pub node: NodeId,
    /// `node` or the module's name.
    pub name: String,
    pub serial: String,
    pub not_after: DateTime<Utc>,
}

impl CertificateIssued {
    pub(crate) fn validate(&self) -> Result<(), DecodeError> {
        crate::validate_certificate_name("body.name", &self.name)?;
        if self.serial.is_empty() || self.serial.len() > 128 {
            return Err(DecodeError::invalid(
                "body.serial",
                "must be 1 to 128 characters",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_probe_takes_its_defaults_and_names_a_bad_field() {
        let p: Probe =
            serde_json::from_str(r#"{"name":"ready","http":{"port":8080,"path":"/healthz"}}"#)
                .unwrap();
        assert_eq!(p.interval_secs, 10);
        assert_eq!(p.failure_threshold, 3);
        assert_eq!(
            p.check(),
            Some(ProbeCheck::Http(&HttpCheck {
                host: "127.0.0.1".into(),
                port: 8080,
                path: "/healthz".into(),
                expect_status: 200
            }))
        );
        let mut neither = p.clone();
        neither.http = None;
        match neither.validate("probes[0]").unwrap_err() {
            DecodeError::Invalid { field, .. } => assert_eq!(field, "probes[0]"),
            other => panic!("{other}"),
        }
        p.validate("probes[0]").unwrap();
        let mut bad = p.clone();
        bad.timeout_secs = 20;
        match bad.validate("probes[0]").unwrap_err() {
            DecodeError::Invalid { field, .. } => assert_eq!(field, "probes[0].timeout_secs"),
            other => panic!("{other}"),
        }
        let twice = vec![p.clone(), p];
        match validate_probes("probes", &twice).unwrap_err() {
            DecodeError::Invalid { field, .. } => assert_eq!(field, "probes[1].name"),
            other => panic!("{other}"),
        }
    }
}
