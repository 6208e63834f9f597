//! What a node is told: a `Declaration` is one whole `Section` (owned by one
//! context) at a `generation`, with its `Items` (files, units and what the
//! section needs beyond them), never a delta. Decoding validates every item
//! (no relative path, no `..`, modes within `0o7777`, bounded sizes and
//! counts), so an agent applies all of a declaration or nothing.

use std::collections::BTreeSet;
use std::fmt;

use serde::{Deserialize, Deserializer, Serialize};
use sha2::{Digest, Sha256};

use crate::envelope::{Body, UnknownFields, parse_body};
use crate::{DecodeError, MAX_FILE_BYTES, MAX_ITEMS};

/// A part of a node's desired state owned by exactly one context. Each section has
/// its own generation counter; a declaration always carries a whole section.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Section {
    Inventory,
    Config,
    Connectivity,
    Delivery,
    Provisioning,
}

impl Section {
    pub const ALL: [Section; 5] = [
        Section::Inventory,
        Section::Config,
        Section::Connectivity,
        Section::Delivery,
        Section::Provisioning,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Section::Inventory => "inventory",
            Section::Config => "config",
            Section::Connectivity => "connectivity",
            Section::Delivery => "delivery",
            Section::Provisioning => "provisioning",
        }
    }

    pub fn parse(s: &str) -> Option<Section> {
        Section::ALL.into_iter().find(|x| x.as_str() == s)
    }
}

/// A section's name as it may appear on the wire, known or not: 1 to 32 of
/// `[a-z0-9_]`, starting with a letter.
pub fn validate_section_name(field: &str, name: &str) -> Result<(), DecodeError> {
    crate::names::check(field, name, &crate::names::SECTION)
}

impl fmt::Display for Section {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A file mode: permission bits only (at most 0o7777).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(transparent)]
pub struct FileMode(u32);

impl FileMode {
    pub fn new(mode: u32) -> Result<Self, DecodeError> {
        if mode > 0o7777 {
            return Err(DecodeError::invalid(
                "mode",
                format!("{mode:#o} is outside 0o0000..=0o7777"),
            ));
        }
        Ok(FileMode(mode))
    }

    /// Parse an octal string such as `"0644"` or `"644"`.
    pub fn parse_octal(s: &str) -> Result<Self, DecodeError> {
        let digits = s.strip_prefix("0o").unwrap_or(s);
        let mode = u32::from_str_radix(digits, 8)
            .map_err(|_| DecodeError::invalid("mode", format!("`{s}` is not an octal mode")))?;
        FileMode::new(mode)
    }

    pub fn bits(self) -> u32 {
        self.0
    }
}

impl fmt::Display for FileMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:04o}", self.0)
    }
}

impl<'de> Deserialize<'de> for FileMode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        FileMode::new(u32::deserialize(d)?).map_err(serde::de::Error::custom)
    }
}

/// A file a node must have: an absolute, normalized path (applied under the agent's
/// root), its whole content, and its mode.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct FileItem {
    pub path: String,
    pub content: String,
    pub mode: FileMode,
}

/// Check a declared path: absolute, at most 4096 bytes, no empty, `.` or `..`
/// component, no NUL. Returns the path's components.
pub fn validate_path(field: &str, path: &str) -> Result<Vec<String>, DecodeError> {
    let bad = |reason: &str| {
        DecodeError::invalid(
            field,
            format!("`{}`: {reason}", path.chars().take(120).collect::<String>()),
        )
    };
    if path.len() > 4096 {
        return Err(bad("longer than 4096 bytes"));
    }
    if path.contains('\0') {
        return Err(bad("contains NUL"));
    }
    let Some(rest) = path.strip_prefix('/') else {
        return Err(bad("must be absolute"));
    };
    let parts: Vec<&str> = rest.split('/').collect();
    if parts.iter().any(|p| p.is_empty()) {
        return Err(bad("has an empty component or a trailing slash"));
    }
    if parts.iter().any(|p| *p == "." || *p == "..") {
        return Err(bad("must not contain `.` or `..`"));
    }
    Ok(parts.into_iter().map(str::to_owned).collect())
}

impl FileItem {
    pub fn validate(&self, field: &str) -> Result<(), DecodeError> {
        validate_path(&format!("{field}.path"), &self.path)?;
        if self.content.len() > MAX_FILE_BYTES {
            return Err(DecodeError::invalid(
                format!("{field}.content"),
                format!("{} bytes, limit {MAX_FILE_BYTES}", self.content.len()),
            ));
        }
        Ok(())
    }
}

/// A secret file a node must have (the config section): its value sealed to the
/// receiving node's own key ([`crate::sealing`], bound to the node and `path` by
/// [`crate::sealing::secret_aad`]), so only that node reads it. `secret` and
/// `version` name which secret and which of its versions it is, for the
/// operator and for the digest; they are not secret.
#[derive(Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SealedFileItem {
    pub path: String,
    pub mode: FileMode,
    pub secret: String,
    pub version: i64,
    /// Base64 of the HPKE encapsulated key and ciphertext ([`crate::sealing::seal`]).
    pub sealed: String,
}

/// Largest sealed text of one secret, in bytes of base64 (a value of about
/// 72 KiB).
pub const MAX_SEALED_BYTES: usize = 96 * 1024;

impl fmt::Debug for SealedFileItem {
    // Only ciphertext, but a log has no use for it: its length is enough.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SealedFileItem")
            .field("path", &self.path)
            .field("mode", &self.mode)
            .field("secret", &self.secret)
            .field("version", &self.version)
            .field("sealed", &format_args!("<{} bytes>", self.sealed.len()))
            .finish()
    }
}

impl SealedFileItem {
    pub fn validate(&self, field: &str) -> Result<(), DecodeError> {
        validate_path(&format!("{field}.path"), &self.path)?;
        if self.secret.is_empty()
            || self.secret.len() > 255
            || self.secret.chars().any(char::is_control)
        {
            return Err(DecodeError::invalid(
                format!("{field}.secret"),
                "must be 1 to 255 characters without control characters",
            ));
        }
        if self.sealed.len() > MAX_SEALED_BYTES {
            return Err(DecodeError::invalid(
                format!("{field}.sealed"),
                format!("{} bytes, limit {MAX_SEALED_BYTES}", self.sealed.len()),
            ));
        }
        crate::sealing::check_sealed(&self.sealed)
            .map_err(|e| DecodeError::invalid(format!("{field}.sealed"), e.to_string()))?;
        Ok(())
    }
}

/// The items of one section.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeclarationItems {
    #[serde(default)]
    pub files: Vec<FileItem>,
    /// Processes to supervise (the inventory section). Absent when empty, so the
    /// digest of a files-only section is what it always was.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub units: Vec<crate::UnitItem>,
    /// Secret files sealed to the receiving node (the config section). Absent when empty,
    /// so the digest of a section without secrets is what it always was. An agent older
    /// than secrets ignores the field (an unknown field) and writes none of them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<SealedFileItem>,
    /// How often the node must beat and how long the controller waits before
    /// judging it unreachable (the inventory section, when the fleet's budget
    /// stretches the interval past its floor; absent: the agent's own interval).
    /// An agent older than plans ignores it and is judged by its own interval.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heartbeat: Option<HeartbeatPlan>,
    /// The node's WireGuard interface and peers (the connectivity section).
    /// Absent when not declared, so older digests stay; an agent older than
    /// the overlay ignores it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overlay: Option<crate::OverlayPlan>,
    /// The node's nftables ruleset (the connectivity section).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub firewall: Option<crate::FirewallPlan>,
    /// Certificates issued to the node for its CSRs (the connectivity section).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub certificates: Vec<crate::CertificateItem>,
    /// Artifacts the node must hold in its cache, pulled and verified by
    /// digest and signature (the delivery section). An agent older than
    /// artifacts ignores the field.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub artifacts: Vec<crate::ArtifactItem>,
    /// The keys whose signatures make an artifact trusted (the delivery
    /// section; decision 0048): exactly these, in name order, when present
    /// (an empty list trusts no key). Absent from a controller older than
    /// operator-held keys: the agent then trusts the controller's key it
    /// received at enrolment, as before. An agent older than the field
    /// ignores it and keeps trusting only the controller's key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact_keys: Option<Vec<crate::TrustedArtifactKey>>,
    /// Resources of grants the node's provider modules serve (the
    /// provisioning section; decision 0039). An agent older than grants
    /// ignores the field.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub resources: Vec<crate::ResourceItem>,
    /// The mesh's current broker and API endpoints (the inventory section;
    /// decision 0044): the agent keeps them and tries them when its
    /// configured brokers do not answer. Absent when the controller declares
    /// none, so older digests stay; an agent older than endpoints ignores it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoints: Option<crate::Endpoints>,
}

/// The heartbeat interval and grace the controller asks of a node.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct HeartbeatPlan {
    pub interval_ms: u64,
    pub grace_ms: u64,
}

impl HeartbeatPlan {
    pub fn validate(&self, field: &str) -> Result<(), DecodeError> {
        if !crate::HEARTBEAT_INTERVAL_MS.contains(&self.interval_ms) {
            return Err(DecodeError::invalid(
                format!("{field}.interval_ms"),
                format!(
                    "{} is outside {}..={}",
                    self.interval_ms,
                    crate::HEARTBEAT_INTERVAL_MS.start(),
                    crate::HEARTBEAT_INTERVAL_MS.end()
                ),
            ));
        }
        if self.grace_ms < self.interval_ms {
            return Err(DecodeError::invalid(
                format!("{field}.grace_ms"),
                format!(
                    "{} is shorter than the interval ({})",
                    self.grace_ms, self.interval_ms
                ),
            ));
        }
        Ok(())
    }
}

impl DeclarationItems {
    pub fn validate(&self) -> Result<(), DecodeError> {
        if self.files.len() > MAX_ITEMS {
            return Err(DecodeError::invalid(
                "body.items.files",
                format!("more than {MAX_ITEMS} files"),
            ));
        }
        if self.units.len() > MAX_ITEMS {
            return Err(DecodeError::invalid(
                "body.items.units",
                format!("more than {MAX_ITEMS} units"),
            ));
        }
        if self.secrets.len() > MAX_ITEMS {
            return Err(DecodeError::invalid(
                "body.items.secrets",
                format!("more than {MAX_ITEMS} secrets"),
            ));
        }
        if let Some(plan) = &self.heartbeat {
            plan.validate("body.items.heartbeat")?;
        }
        if let Some(plan) = &self.overlay {
            plan.validate("body.items.overlay")?;
        }
        if let Some(plan) = &self.firewall {
            plan.validate("body.items.firewall")?;
        }
        if let Some(endpoints) = &self.endpoints {
            endpoints.validate("body.items.endpoints")?;
        }
        if self.certificates.len() > crate::MAX_CERTIFICATES {
            return Err(DecodeError::invalid(
                "body.items.certificates",
                format!("more than {} certificates", crate::MAX_CERTIFICATES),
            ));
        }
        if self.artifacts.len() > crate::MAX_ARTIFACTS {
            return Err(DecodeError::invalid(
                "body.items.artifacts",
                format!("more than {} artifacts", crate::MAX_ARTIFACTS),
            ));
        }
        let mut digests = BTreeSet::new();
        for (i, a) in self.artifacts.iter().enumerate() {
            let field = format!("body.items.artifacts[{i}]");
            a.validate(&field)?;
            if !digests.insert(a.digest.as_str()) {
                return Err(DecodeError::invalid(
                    format!("{field}.digest"),
                    format!("`{}` is declared twice", a.digest),
                ));
            }
        }
        if let Some(keys) = &self.artifact_keys {
            if keys.len() > crate::MAX_ARTIFACT_KEYS {
                return Err(DecodeError::invalid(
                    "body.items.artifact_keys",
                    format!("more than {} keys", crate::MAX_ARTIFACT_KEYS),
                ));
            }
            let mut seen = BTreeSet::new();
            for (i, k) in keys.iter().enumerate() {
                let field = format!("body.items.artifact_keys[{i}]");
                let key = k.validate(&field)?;
                if !seen.insert(key.to_hex()) {
                    return Err(DecodeError::invalid(
                        format!("{field}.key"),
                        "declared twice",
                    ));
                }
            }
        }
        if self.resources.len() > crate::MAX_RESOURCES {
            return Err(DecodeError::invalid(
                "body.items.resources",
                format!("more than {} resources", crate::MAX_RESOURCES),
            ));
        }
        let mut grants = BTreeSet::new();
        for (i, r) in self.resources.iter().enumerate() {
            let field = format!("body.items.resources[{i}]");
            r.validate(&field)?;
            if !grants.insert(r.grant) {
                return Err(DecodeError::invalid(
                    format!("{field}.grant"),
                    format!("`{}` is declared twice", r.grant),
                ));
            }
        }
        let mut certs = BTreeSet::new();
        for (i, c) in self.certificates.iter().enumerate() {
            let field = format!("body.items.certificates[{i}]");
            c.validate(&field)?;
            if !certs.insert(c.name.as_str()) {
                return Err(DecodeError::invalid(
                    format!("{field}.name"),
                    format!("`{}` is declared twice", c.name),
                ));
            }
        }
        let mut names = BTreeSet::new();
        for (i, u) in self.units.iter().enumerate() {
            let field = format!("body.items.units[{i}]");
            u.validate(&field)?;
            if !names.insert(u.name.as_str()) {
                return Err(DecodeError::invalid(
                    format!("{field}.name"),
                    format!("`{}` is declared twice", u.name),
                ));
            }
        }
        let mut seen = BTreeSet::new();
        for (i, f) in self.files.iter().enumerate() {
            let field = format!("body.items.files[{i}]");
            f.validate(&field)?;
            if !seen.insert(f.path.as_str()) {
                return Err(DecodeError::invalid(
                    format!("{field}.path"),
                    format!("`{}` is declared twice", f.path),
                ));
            }
        }
        for (i, f) in self.secrets.iter().enumerate() {
            let field = format!("body.items.secrets[{i}]");
            f.validate(&field)?;
            if !seen.insert(f.path.as_str()) {
                return Err(DecodeError::invalid(
                    format!("{field}.path"),
                    format!("`{}` is declared twice", f.path),
                ));
            }
        }
        Ok(())
    }
}

/// The digest of a set of items: hex SHA-256 of their canonical JSON (files and
/// secrets sorted by path, units by name). Equal items give equal digests, whatever order they were built in.
pub fn digest_items(items: &DeclarationItems) -> String {
    let mut sorted = items.clone();
    sorted.files.sort_by(|a, b| a.path.cmp(&b.path));
    sorted.units.sort_by(|a, b| a.name.cmp(&b.name));
    sorted.secrets.sort_by(|a, b| a.path.cmp(&b.path));
    sorted.certificates.sort_by(|a, b| a.name.cmp(&b.name));
    sorted.artifacts.sort_by(|a, b| a.digest.cmp(&b.digest));
    sorted.resources.sort_by_key(|r| r.grant);
    if let Some(keys) = &mut sorted.artifact_keys {
        keys.sort_by(|a, b| a.name.cmp(&b.name).then_with(|| a.key.cmp(&b.key)));
    }
    let bytes = serde_json::to_vec(&sorted).unwrap_or_default();
    hex::encode(Sha256::digest(&bytes))
}

/// What a node is told: the whole of one section at one generation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Declaration {
    pub section: Section,
    /// Monotonic per node and section, starting at 1.
    pub generation: u64,
    pub items: DeclarationItems,
}

impl Declaration {
    pub const KIND: &'static str = "declaration";

    pub fn validate(&self) -> Result<(), DecodeError> {
        if self.generation == 0 {
            return Err(DecodeError::invalid(
                "body.generation",
                "generations start at 1",
            ));
        }
        self.items.validate()
    }
}

impl Body for Declaration {
    fn kind(&self) -> &'static str {
        Declaration::KIND
    }

    fn to_value(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or(serde_json::Value::Null)
    }

    fn from_parts(
        kind: &str,
        body: serde_json::Value,
        unknown: &mut UnknownFields,
    ) -> Result<Self, DecodeError> {
        if kind != Declaration::KIND {
            return Err(DecodeError::UnknownKind(kind.chars().take(64).collect()));
        }
        // A section this version does not know (a newer controller's) is not a
        // malformed declaration: the agent reports it unsupported.
        if let Some(name) = body.get("section").and_then(serde_json::Value::as_str)
            && Section::parse(name).is_none()
        {
            validate_section_name("body.section", name)?;
            return Err(DecodeError::UnsupportedSection {
                section: name.to_owned(),
                generation: body.get("generation").and_then(serde_json::Value::as_u64),
            });
        }
        let d: Declaration = parse_body(kind, body, unknown)?;
        d.validate()?;
        Ok(d)
    }
}
