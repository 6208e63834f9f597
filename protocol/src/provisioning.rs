//! Resource grants between modules (decision 0039): what a module requires
//! and what a provider module provides (module spec, carried by
//! `inventory.module.placed`), what the provisioning section tells a
//! provider's node to create ([`ResourceItem`]), what the provider's agent
//! states back (the `resources` report: [`Resources`]), and what provisioning
//! tells config on the record ([`CredentialsIssued`], [`CredentialsWithdrawn`]).
//!
//! A credential never travels in clear: to the consumer's and provider's
//! nodes it goes as a config secret sealed to each node; on the record it is
//! encrypted under the secrets master key ([`CredentialsIssued`]); in a
//! declaration only the path of the config secret file is named.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::{DecodeError, validate_module_name, validate_path};

/// The kinds of resource a module may require.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub enum ResourceKind {
    /// A database and a login role with rights on it alone, in a PostgreSQL
    /// the provider module runs.
    #[serde(rename = "postgres.database")]
    PostgresDatabase,
    /// A virtual host and a user with permissions on it alone, in a RabbitMQ
    /// the provider module runs.
    #[serde(rename = "amqp.vhost")]
    AmqpVhost,
    /// A bucket and an access key allowed on it alone, in an S3 server
    /// (Garage) the provider module runs.
    #[serde(rename = "s3.bucket")]
    S3Bucket,
}

impl ResourceKind {
    pub const ALL: [ResourceKind; 3] = [
        ResourceKind::PostgresDatabase,
        ResourceKind::AmqpVhost,
        ResourceKind::S3Bucket,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ResourceKind::PostgresDatabase => "postgres.database",
            ResourceKind::AmqpVhost => "amqp.vhost",
            ResourceKind::S3Bucket => "s3.bucket",
        }
    }

    pub fn parse(s: &str) -> Option<ResourceKind> {
        ResourceKind::ALL.into_iter().find(|k| k.as_str() == s)
    }

    /// The options a requirement of this kind may carry. Their values are
    /// the provider's to judge: a value its server refuses fails the grant
    /// with the server's reason.
    pub fn options(self) -> &'static [&'static str] {
        match self {
            // CREATE DATABASE … ENCODING; ALTER ROLE … CONNECTION LIMIT.
            ResourceKind::PostgresDatabase => &["encoding", "connection_limit"],
            // rabbitmqctl set_vhost_limits max-queues / max-connections.
            ResourceKind::AmqpVhost => &["max_queues", "max_connections"],
            // garage bucket set-quotas --max-size.
            ResourceKind::S3Bucket => &["max_size"],
        }
    }

    /// The password key of this kind's credential file (the agent reads it;
    /// the consumer's process uses the whole file).
    pub fn password_key(self) -> &'static str {
        match self {
            ResourceKind::PostgresDatabase => "PGPASSWORD",
            ResourceKind::AmqpVhost => "AMQP_PASSWORD",
            ResourceKind::S3Bucket => "AWS_SECRET_ACCESS_KEY",
        }
    }
}

impl fmt::Display for ResourceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Most requirements, and most provided kinds, of one module.
pub const MAX_REQUIREMENTS: usize = 32;
/// Most resources one provisioning section or `resources` report holds.
pub const MAX_RESOURCES: usize = 1024;
/// Longest reason a `resources` report carries, in characters.
pub const MAX_REASON_CHARS: usize = 2000;
/// Key of the credential file that holds the credential's version.
pub const CREDENTIAL_VERSION_KEY: &str = "MESH_CREDENTIAL_VERSION";
/// What a `waiting` reason of a `resources` report ends with when the only
/// thing missing is the credential file of the declared version (config
/// delivers it a moment after each issue): a normal, brief wait, which the
/// controller does not raise as a condition. The agent writes it, the
/// provisioning context reads it: one definition for both.
pub const CREDENTIAL_NOT_YET_DELIVERED: &str = "not yet delivered";

/// Requirement names: 1 to 32 of `[a-z0-9-]`, starting with a letter.
pub fn validate_requirement_name(field: &str, name: &str) -> Result<(), DecodeError> {
    crate::names::check(field, name, &crate::names::REQUIREMENT)
}

/// What a module asks for (`requires` of its spec).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Requirement {
    pub kind: ResourceKind,
    /// Unique within the module; the credential file is
    /// `/modules/<module>/secrets/grant-<name>.env`.
    pub name: String,
    /// Options of the kind ([`ResourceKind::options`]), as strings.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub options: BTreeMap<String, String>,
    /// The provider module; absent: the one module that provides the kind
    /// (none or several: the grant waits, saying why).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    /// On revocation, delete the data at once instead of keeping it for the
    /// retention.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub delete: bool,
}

/// The server a provider's agent administers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum AdminServer {
    Postgres,
    Rabbitmq,
    Garage,
}

/// How a provider's agent reaches the server's administrative interface on
/// its own node. None of it is a password: administration is local.
/// - `postgres`: `psql -h <socket_dir> -p <port> -U <user>` over the
///   server's Unix socket, with peer or trust authentication for the local
///   administrator (`user` default `postgres`);
/// - `rabbitmq`: `rabbitmqctl -n <node>` with `HOME=<home>` (the Erlang
///   cookie in `<home>/.erlang.cookie`);
/// - `garage`: `garage -c <config>` (its RPC secret is in that file).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AdminAccess {
    pub server: AdminServer,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub socket_dir: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub home: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<String>,
}

impl AdminAccess {
    pub fn kind(&self) -> ResourceKind {
        match self.server {
            AdminServer::Postgres => ResourceKind::PostgresDatabase,
            AdminServer::Rabbitmq => ResourceKind::AmqpVhost,
            AdminServer::Garage => ResourceKind::S3Bucket,
        }
    }

    /// The PostgreSQL administrator's role (default `postgres`).
    pub fn postgres_user(&self) -> &str {
        self.user.as_deref().unwrap_or("postgres")
    }

    pub fn validate(&self, field: &str) -> Result<(), DecodeError> {
        let word = |f: &str, v: &str| {
            if v.is_empty() || v.len() > 255 || v.chars().any(|c| c.is_control() || c == ' ') {
                Err(DecodeError::invalid(
                    format!("{field}.{f}"),
                    "must be 1 to 255 characters without spaces or control characters",
                ))
            } else {
                Ok(())
            }
        };
        let need = |f: &str, v: &Option<String>| -> Result<String, DecodeError> {
            v.clone().ok_or_else(|| {
                DecodeError::invalid(
                    format!("{field}.{f}"),
                    format!("a {:?} server needs it", self.server).to_lowercase(),
                )
            })
        };
        let none = |f: &str, v: &Option<String>| {
            if v.is_some() {
                Err(DecodeError::invalid(
                    format!("{field}.{f}"),
                    format!("not a field of a {:?} server", self.server).to_lowercase(),
                ))
            } else {
                Ok(())
            }
        };
        match self.server {
            AdminServer::Postgres => {
                validate_path(
                    &format!("{field}.socket_dir"),
                    &need("socket_dir", &self.socket_dir)?,
                )?;
                if let Some(u) = &self.user {
                    word("user", u)?;
                }
                none("node", &self.node)?;
                none("home", &self.home)?;
                none("config", &self.config)
            }
            AdminServer::Rabbitmq => {
                word("node", &need("node", &self.node)?)?;
                validate_path(&format!("{field}.home"), &need("home", &self.home)?)?;
                none("socket_dir", &self.socket_dir)?;
                none("user", &self.user)?;
                none("config", &self.config)
            }
            AdminServer::Garage => {
                validate_path(&format!("{field}.config"), &need("config", &self.config)?)?;
                none("socket_dir", &self.socket_dir)?;
                none("user", &self.user)?;
                none("node", &self.node)?;
                none("home", &self.home)
            }
        }
    }
}

/// What a provider module offers (`provides` of its spec).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Provides {
    pub kind: ResourceKind,
    /// Where consumers reach the server: a host name or address. A provider
    /// that may move must name something that follows it (a DNS name).
    pub host: String,
    pub port: u16,
    pub admin: AdminAccess,
}

impl Provides {
    pub fn validate(&self, field: &str) -> Result<(), DecodeError> {
        crate::validate_dns_name(&format!("{field}.host"), &self.host)
            .or_else(|_| {
                self.host
                    .parse::<std::net::IpAddr>()
                    .map(|_| ())
                    .map_err(|_| ())
            })
            .map_err(|_| {
                DecodeError::invalid(
                    format!("{field}.host"),
                    format!(
                        "`{}` is neither a DNS name nor an IP address",
                        self.host.chars().take(80).collect::<String>()
                    ),
                )
            })?;
        check_server(field, self.kind, self.port, &self.admin)
    }
}

/// A server's port, and an `admin` that administers a server of `kind`.
fn check_server(
    field: &str,
    kind: ResourceKind,
    port: u16,
    admin: &AdminAccess,
) -> Result<(), DecodeError> {
    if port == 0 {
        return Err(DecodeError::invalid(
            format!("{field}.port"),
            "must be 1 to 65535",
        ));
    }
    if admin.kind() != kind {
        return Err(DecodeError::invalid(
            format!("{field}.admin"),
            format!("does not administer a {kind} server"),
        ));
    }
    admin.validate(&format!("{field}.admin"))
}

/// Options of `kind` only ([`ResourceKind::options`]), each value 1 to 255
/// characters without control characters.
fn check_options(
    field: &str,
    kind: ResourceKind,
    options: &BTreeMap<String, String>,
) -> Result<(), DecodeError> {
    for (k, v) in options {
        let at = format!("{field}.options.{}", k.chars().take(64).collect::<String>());
        if !kind.options().contains(&k.as_str()) {
            return Err(DecodeError::invalid(
                at,
                format!(
                    "not an option of {kind} (known: {})",
                    kind.options().join(", ")
                ),
            ));
        }
        if v.is_empty() || v.len() > 255 || v.chars().any(char::is_control) {
            return Err(DecodeError::invalid(
                at,
                "must be 1 to 255 characters without control characters",
            ));
        }
    }
    Ok(())
}

/// Check a module's `requires` and `provides` (bounds, names, options,
/// provider names, one provided entry per kind).
pub fn validate_resources(
    requires: &[Requirement],
    provides: &[Provides],
) -> Result<(), DecodeError> {
    if requires.len() > MAX_REQUIREMENTS {
        return Err(DecodeError::invalid(
            "requires",
            format!("at most {MAX_REQUIREMENTS}"),
        ));
    }
    if provides.len() > MAX_REQUIREMENTS {
        return Err(DecodeError::invalid(
            "provides",
            format!("at most {MAX_REQUIREMENTS}"),
        ));
    }
    let mut names = std::collections::BTreeSet::new();
    for (i, r) in requires.iter().enumerate() {
        let field = format!("requires[{i}]");
        validate_requirement_name(&format!("{field}.name"), &r.name)?;
        if !names.insert(r.name.as_str()) {
            return Err(DecodeError::invalid(
                format!("{field}.name"),
                format!("`{}` is required twice", r.name),
            ));
        }
        check_options(&field, r.kind, &r.options)?;
        if let Some(p) = &r.provider {
            validate_module_name(&format!("{field}.provider"), p)?;
        }
    }
    let mut kinds = std::collections::BTreeSet::new();
    for (i, p) in provides.iter().enumerate() {
        let field = format!("provides[{i}]");
        p.validate(&field)?;
        if !kinds.insert(p.kind) {
            return Err(DecodeError::invalid(
                format!("{field}.kind"),
                format!("{} is provided twice", p.kind),
            ));
        }
    }
    Ok(())
}

/// What the provider's node must make of a grant's resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResourceState {
    /// The resource exists and the grant's user logs in with the credential
    /// of `credential_version`.
    Present,
    /// The user can no longer log in (role `NOLOGIN`, broker user deleted,
    /// key deleted); the data is kept.
    Revoked,
    /// The user and the data are gone.
    Deleted,
}

/// One grant's resource, in the provisioning section of a provider's node.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ResourceItem {
    pub grant: Uuid,
    pub kind: ResourceKind,
    /// The database, vhost or bucket on the server.
    pub name: String,
    /// The login role, broker user or access key id the credential is for.
    pub user: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub options: BTreeMap<String, String>,
    pub state: ResourceState,
    /// The server's port on this node.
    pub port: u16,
    pub admin: AdminAccess,
    /// Where config delivers the grant's credential file on this node (a
    /// declared path, under the agent's root): the agent reads the password
    /// from it. Present exactly when `state` is `present`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credential: Option<String>,
    /// The credential's version the user must have; the file says which it
    /// holds ([`CREDENTIAL_VERSION_KEY`]): an older file means waiting.
    #[serde(default)]
    pub credential_version: i64,
}

/// The names a provider's server is asked to use: 1 to 63 of `[a-z0-9-]`
/// (the bucket rules; safe unquoted in rabbitmqctl and quoted in SQL), or a
/// Garage key id (`GK` and 24 hex digits).
pub fn validate_resource_name(field: &str, name: &str) -> Result<(), DecodeError> {
    crate::names::check(field, name, &crate::names::RESOURCE)
}

/// A Garage access key id: `GK` and 24 lowercase hex digits.
pub fn is_garage_key_id(s: &str) -> bool {
    s.len() == 26
        && s.starts_with("GK")
        && s[2..]
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

impl ResourceItem {
    pub fn validate(&self, field: &str) -> Result<(), DecodeError> {
        validate_resource_name(&format!("{field}.name"), &self.name)?;
        if self.kind == ResourceKind::S3Bucket {
            if !is_garage_key_id(&self.user) {
                return Err(DecodeError::invalid(
                    format!("{field}.user"),
                    "an s3 key id is GK and 24 hex digits",
                ));
            }
        } else {
            validate_resource_name(&format!("{field}.user"), &self.user)?;
        }
        check_options(field, self.kind, &self.options)?;
        check_server(field, self.kind, self.port, &self.admin)?;
        match (&self.credential, self.state) {
            (Some(p), ResourceState::Present) => {
                validate_path(&format!("{field}.credential"), p)?;
            }
            (None, ResourceState::Present) => {
                return Err(DecodeError::invalid(
                    format!("{field}.credential"),
                    "a present resource names its credential file",
                ));
            }
            (Some(_), _) => {
                return Err(DecodeError::invalid(
                    format!("{field}.credential"),
                    "only a present resource names a credential file",
                ));
            }
            (None, _) => {}
        }
        Ok(())
    }
}

/// What a provider's agent found of one grant's resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResourceStatusState {
    /// Exists, and the user logs in with `credential_version`.
    Ready,
    /// Not yet: the server is not answering, or the credential file of the
    /// declared version has not arrived. The agent tries again.
    Waiting,
    /// The server refused (`reason` in its words). Tried again only when the
    /// declaration changes.
    Failed,
    /// The user can no longer log in; the data is kept.
    Revoked,
    /// The user and the data are gone.
    Deleted,
}

impl ResourceStatusState {
    pub fn as_str(self) -> &'static str {
        match self {
            ResourceStatusState::Ready => "ready",
            ResourceStatusState::Waiting => "waiting",
            ResourceStatusState::Failed => "failed",
            ResourceStatusState::Revoked => "revoked",
            ResourceStatusState::Deleted => "deleted",
        }
    }
}

/// One grant's resource as the provider's agent found it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResourceStatus {
    pub grant: Uuid,
    pub state: ResourceStatusState,
    /// The credential version the user has (ready).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credential_version: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The resource was ready at `credential_version`, then found missing and
    /// created again: the controller rotates the credential.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub recreated: bool,
}

/// Body of the `resources` report: every resource of the node's
/// provisioning section, whole; sent when any changes (and on each
/// reconnect). `generation` is the provisioning section it answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resources {
    pub generation: u64,
    pub resources: Vec<ResourceStatus>,
}

impl Resources {
    pub(crate) fn validate(&self) -> Result<(), DecodeError> {
        if self.resources.len() > MAX_RESOURCES {
            return Err(DecodeError::invalid(
                "body.resources",
                format!("at most {MAX_RESOURCES}"),
            ));
        }
        for (i, r) in self.resources.iter().enumerate() {
            if r.reason
                .as_ref()
                .is_some_and(|s| s.chars().count() > MAX_REASON_CHARS)
            {
                return Err(DecodeError::invalid(
                    format!("body.resources[{i}].reason"),
                    format!("longer than {MAX_REASON_CHARS} characters"),
                ));
            }
        }
        Ok(())
    }
}

/// A module that receives a grant's credential file, and the file's name
/// under `/modules/<module>/secrets/`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CredentialFile {
    pub module: String,
    pub file: String,
}

/// Body of `provisioning.credentials.issued`: a grant's credential file
/// (its consumer's and its provider's copies) for config to keep as the
/// secret `secret` and deliver. The value is config's at-rest form under the
/// secrets master key `key_id`: `wrapped_key` is the data key wrapped for
/// `secret`, `ciphertext` the file under that data key for (`secret`,
/// `version`); both base64. Never in clear on the record.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CredentialsIssued {
    pub grant: Uuid,
    pub secret: String,
    pub version: i64,
    pub files: Vec<CredentialFile>,
    pub key_id: String,
    pub wrapped_key: String,
    pub ciphertext: String,
}

impl fmt::Debug for CredentialsIssued {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CredentialsIssued")
            .field("grant", &self.grant)
            .field("secret", &self.secret)
            .field("version", &self.version)
            .field("files", &self.files)
            .field("key_id", &self.key_id)
            .field(
                "ciphertext",
                &format_args!("<{} bytes>", self.ciphertext.len()),
            )
            .finish()
    }
}

fn validate_secret_name(field: &str, s: &str) -> Result<(), DecodeError> {
    let ok = (1..=63).contains(&s.len())
        && s.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'_' || b == b'-'
        });
    if ok {
        Ok(())
    } else {
        Err(DecodeError::invalid(
            field,
            "must be 1 to 63 of a-z 0-9 . _ -",
        ))
    }
}

impl CredentialsIssued {
    pub(crate) fn validate(&self) -> Result<(), DecodeError> {
        validate_secret_name("body.secret", &self.secret)?;
        if self.files.is_empty() || self.files.len() > 2 {
            return Err(DecodeError::invalid("body.files", "one or two files"));
        }
        for (i, f) in self.files.iter().enumerate() {
            validate_module_name(&format!("body.files[{i}].module"), &f.module)?;
            crate::validate_file_name(&format!("body.files[{i}].file"), &f.file)?;
        }
        if self.ciphertext.len() > crate::MAX_SEALED_BYTES {
            return Err(DecodeError::invalid("body.ciphertext", "too long"));
        }
        Ok(())
    }
}

/// Body of `provisioning.credentials.withdrawn`: config deletes the secret
/// (and so its files, from every node).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CredentialsWithdrawn {
    pub grant: Uuid,
    pub secret: String,
}

impl CredentialsWithdrawn {
    pub(crate) fn validate(&self) -> Result<(), DecodeError> {
        validate_secret_name("body.secret", &self.secret)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn provides() -> Provides {
        Provides {
            kind: ResourceKind::PostgresDatabase,
            host: "10.0.0.2".into(),
            port: 5433,
            admin: AdminAccess {
                server: AdminServer::Postgres,
                socket_dir: Some("/run/pg".into()),
                user: None,
                node: None,
                home: None,
                config: None,
            },
        }
    }

    #[test]
    fn kinds_round_trip() {
        for k in ResourceKind::ALL {
            let s = serde_json::to_string(&k).unwrap();
            assert_eq!(s, format!("\"{}\"", k.as_str()));
            assert_eq!(ResourceKind::parse(k.as_str()), Some(k));
        }
    }

    #[test]
    fn spec_parts_are_checked_naming_the_field() {
        let r = |name: &str, opts: &[(&str, &str)]| Requirement {
            kind: ResourceKind::PostgresDatabase,
            name: name.into(),
            options: opts
                .iter()
                .map(|(k, v)| ((*k).into(), (*v).into()))
                .collect(),
            provider: None,
            delete: false,
        };
        assert!(validate_resources(&[r("main", &[("encoding", "UTF8")])], &[provides()]).is_ok());
        let e = validate_resources(&[r("main", &[("bogus", "1")])], &[]).unwrap_err();
        assert!(e.to_string().contains("requires[0].options.bogus"), "{e}");
        let e = validate_resources(&[r("main", &[]), r("main", &[])], &[]).unwrap_err();
        assert!(e.to_string().contains("requires[1].name"), "{e}");
        let e = validate_resources(&[r("Main", &[])], &[]).unwrap_err();
        assert!(e.to_string().contains("requires[0].name"), "{e}");
        let mut p = provides();
        p.kind = ResourceKind::AmqpVhost;
        let e = validate_resources(&[], &[p]).unwrap_err();
        assert!(e.to_string().contains("provides[0].admin"), "{e}");
        let e = validate_resources(&[], &[provides(), provides()]).unwrap_err();
        assert!(e.to_string().contains("provides[1].kind"), "{e}");
    }

    #[test]
    fn admin_access_is_tagged_by_server() {
        let p: Provides = serde_json::from_value(serde_json::json!({
            "kind": "amqp.vhost", "host": "broker.example", "port": 5673,
            "admin": {"server": "rabbitmq", "node": "prov@localhost", "home": "/var/lib/prov"}
        }))
        .unwrap();
        assert!(p.validate("provides[0]").is_ok());
        let bad = serde_json::from_value::<Provides>(serde_json::json!({
            "kind": "amqp.vhost", "host": "h", "port": 1,
            "admin": {"server": "mysql", "node": "n"}
        }));
        assert!(bad.is_err());
        let p: Provides = serde_json::from_value(serde_json::json!({
            "kind": "amqp.vhost", "host": "h", "port": 1,
            "admin": {"server": "rabbitmq", "node": "n", "home": "/h", "config": "/c"}
        }))
        .unwrap();
        let e = p.validate("provides[0]").unwrap_err();
        assert!(e.to_string().contains("provides[0].admin.config"), "{e}");
    }

    #[test]
    fn a_resource_item_names_its_credential_only_when_present() {
        let mut item = ResourceItem {
            grant: Uuid::nil(),
            kind: ResourceKind::PostgresDatabase,
            name: "app-main".into(),
            user: "app-main".into(),
            options: BTreeMap::new(),
            state: ResourceState::Present,
            port: 5433,
            admin: provides().admin,
            credential: Some("/modules/pg/secrets/grant-x.env".into()),
            credential_version: 1,
        };
        assert!(item.validate("r").is_ok());
        item.state = ResourceState::Revoked;
        assert!(item.validate("r").is_err());
        item.credential = None;
        assert!(item.validate("r").is_ok());
        item.kind = ResourceKind::S3Bucket;
        item.admin = AdminAccess {
            server: AdminServer::Garage,
            config: Some("/etc/garage.toml".into()),
            socket_dir: None,
            user: None,
            node: None,
            home: None,
        };
        assert!(item.validate("r").is_err(), "an s3 user is a key id");
        item.user = "GK0123456789abcdef01234567".into();
        assert!(item.validate("r").is_ok());
    }

    #[test]
    fn issued_credentials_do_not_debug_their_ciphertext() {
        let c = CredentialsIssued {
            grant: Uuid::nil(),
            secret: "grant-x".into(),
            version: 1,
            files: vec![],
            key_id: "k1".into(),
            wrapped_key: "AAAA".into(),
            ciphertext: "c2VjcmV0".into(),
        };
        let s = format!("{c:?}");
        assert!(!s.contains("c2VjcmV0") && !s.contains("AAAA"), "{s}");
    }
}
