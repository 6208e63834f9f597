//! The wire vocabulary of the mesh: what a host agent states (reports), what it is
//! told (declarations), what contexts tell each other (record events), and the
//! names of the exchanges and queues they travel through.
//!
//! This crate is pure: no I/O, no broker, no database. It is the one parse point
//! for everything that crosses the wire. Decoding is strict about what it knows
//! and tolerant of what a newer sender may add: an unknown kind, a missing field,
//! an oversized message, an unsupported version or an invalid value is a typed
//! [`DecodeError`], never a panic and never a silently defaulted value; a field
//! this version does not know is ignored and reported ([`UnknownFields`]), so
//! the receiver counts it (docs/protocol.md, Compatibility).
//!
//! docs/protocol.md is the contract this crate implements.
//!
//! Where things are: `envelope.rs` (the envelope and its one decode, with a
//! size limit, the protocol versions, the unknown fields a decode skipped),
//! `report.rs` (hello, heartbeat, applied), `declaration.rs` (section,
//! generation, items), `unit.rs` (unit items), `record.rs` ([`RecordEvent`]
//! and its closed, typed [`RecordKind`]: every event any context writes,
//! audit entries included), `module.rs` (the bodies of `inventory.module.*`),
//! `connectivity.rs` (hello's overlay facts, the `certificates` report, the
//! overlay, firewall and certificate items, module ports), `node.rs`
//! ([`NodeId`], labels), `endpoints.rs` (the inventory section's endpoints,
//! the one `<host>:<port>` check; decision 0044), `logs.rs` (the logs request
//! a controller sends on a node's declaration queue and the `logs` report
//! that answers it; decision 0033), `provisioning.rs` (`requires` /
//! `provides`, the provisioning section's resources, the `resources` report;
//! decision 0039), [`topology`] (names and bounds of every exchange and
//! queue, the signature header, a node's broker permissions), [`signing`]
//! (Ed25519 declaration signatures), [`sealing`] (secrets sealed to the
//! receiving node with HPKE), `secret.rs` ([`Secret`], token hashing) and
//! `error.rs` ([`DecodeError`]). Callers bring randomness.
//! `tests/compat/v1/` is the corpus of every message this version writes;
//! every later version must still decode it (decision 0020).

mod artifact;
mod connectivity;
mod declaration;
mod endpoints;
mod envelope;
mod error;
mod health;
mod logs;
mod module;
mod names;
mod node;
mod provisioning;
mod record;
mod report;
pub mod sealing;
mod secret;
pub mod signing;
pub mod topology;
mod unit;

pub use artifact::{
    ARTIFACT_MEDIA_TYPE, ARTIFACT_REPOSITORY, ArtifactDigest, ArtifactItem, ArtifactSignature,
    ArtifactSignatureError, MAX_ARTIFACT_KEYS, MAX_ARTIFACT_SIGNATURES, MAX_ARTIFACTS,
    MAX_TARGET_REVISIONS, ModuleTargets, NodeTarget, RevisionUnit, SIGNATURE_MEDIA_TYPE,
    TrustedArtifactKey, signature_payload,
};
pub use connectivity::{
    CertificateItem, CertificateRequest, Certificates, FirewallPlan, HeldCertificate,
    MAX_CERTIFICATES, MAX_PEERS, MAX_PEM_BYTES, MAX_PORTS, MAX_RULESET_BYTES, ModulePort,
    NODE_CERTIFICATE, OverlayFacts, OverlayPeer, OverlayPlan, PortProtocol,
    validate_certificate_name, validate_cidr, validate_dns_name, validate_endpoint, validate_ports,
    validate_wireguard_key,
};
pub use declaration::{
    Declaration, DeclarationItems, FileItem, FileMode, HeartbeatPlan, MAX_SEALED_BYTES,
    SealedFileItem, Section, digest_items, validate_path, validate_section_name,
};
pub use endpoints::{
    Endpoints, MAX_ENDPOINT_BYTES, MAX_ENDPOINTS, check_api_endpoint, format_host_port,
    parse_host_port,
};
pub use envelope::Body;
pub use envelope::{Envelope, PROTOCOL_VERSION, ProtocolRange, RawEnvelope, UnknownFields};
pub use error::DecodeError;
pub use health::{
    AlertChanged, CertificateIssued, ExecCheck, FleetCondition, FleetConditions, Health,
    HealthState, HttpCheck, MAX_CONDITIONS, MAX_PROBE_DETAIL, MAX_PROBE_RESULTS, MAX_PROBES,
    ModuleHealth, Outage, Probe, ProbeCheck, ProbeResult, ProbeState, ReplicaHealth, Severity,
    TcpCheck, validate_probes,
};
pub use logs::{
    LogPosition, LogStream, Logs, LogsRequest, MAX_LOG_ANSWER_BYTES, MAX_LOG_LINE_BYTES,
    MAX_LOG_LINES, MAX_LOG_UNITS, StreamLogs, UnitLogs,
};
pub use module::{
    MAX_SETTINGS_FILES, ModuleColumns, ModuleEvent, ModulePlacement, ModuleRemoved, SettingsFile,
    SettingsFormat, validate_file_name, validate_module_name, validate_settings_file_name,
    validate_settings_files,
};
pub use node::{
    Labels, NODE_LABEL, NodeId, RESERVED_LABEL_PREFIX, parse_selector, validate_labels,
};
pub use provisioning::{
    AdminAccess, AdminServer, CREDENTIAL_NOT_YET_DELIVERED, CREDENTIAL_VERSION_KEY, CredentialFile,
    CredentialsIssued, CredentialsWithdrawn, MAX_REASON_CHARS, MAX_REQUIREMENTS, MAX_RESOURCES,
    Provides, Requirement, ResourceItem, ResourceKind, ResourceState, ResourceStatus,
    ResourceStatusState, Resources, is_garage_key_id, validate_requirement_name,
    validate_resource_name, validate_resources,
};
pub use record::{
    AUDIT_EVENT, AuditEntry, LivenessState, NodeIdentityChanged, NodeLabelsChanged, NodeLiveness,
    RECORD_EVENTS, RecordEvent, RecordKind,
};
pub use report::{
    Applied, AppliedGenerations, HEARTBEAT_INTERVAL_MS, Heartbeat, Hello, ItemOutcome,
    MAX_ERROR_CHARS, Outcome, Report, ReportKind,
};
pub use secret::{Secret, new_token, redact_url, token_sha256_hex};
pub use signing::{DeclarationSigner, PublicKey, SignatureError};
pub use unit::{
    DesiredState, MIN_CPU_MILLIS, MIN_MEMORY_BYTES, MIN_PIDS, MODULE_UID_MAX, MODULE_UID_MIN,
    REASON_OOM_KILLED, RestartPolicy, UnitItem, UnitLimits, UnitState, UnitStatus, UnitUser, Units,
    validate_unit_name,
};

/// Largest report (hello, heartbeat, applied) the controller accepts, in bytes of
/// encoded JSON. A hello with a few hundred labels fits with room to spare.
pub const MAX_REPORT_BYTES: usize = 64 * 1024;

/// Largest declaration an agent accepts, in bytes of encoded JSON. A declaration is
/// a whole section; files larger than this belong in an artifact (delivery context).
pub const MAX_DECLARATION_BYTES: usize = 1024 * 1024;

/// Largest single file content inside a declaration, in bytes.
pub const MAX_FILE_BYTES: usize = 256 * 1024;

/// Largest number of items of one kind in one declaration.
pub const MAX_ITEMS: usize = 1024;

/// Largest record event, in bytes of encoded JSON.
pub const MAX_EVENT_BYTES: usize = 256 * 1024;
