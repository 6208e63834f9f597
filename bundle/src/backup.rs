//! Backup and restore of a mesh's controller host (issue 17, decision 0040).
//!
//! `mesh-bundle backup` writes one tar archive, mode 0600:
//!
//! ```text
//! mesh-backup/manifest.json                             versions, names, migrations, sizes, sha256 (clear)
//! mesh-backup/database.dump.sealed                      pg_dump -Fc of every context schema, one snapshot
//! mesh-backup/etc/controller-credentials.toml.sealed    the controller's credentials
//! mesh-backup/etc/controller-signing.key.sealed         the declaration-signing key
//! mesh-backup/etc/secrets-master.toml.sealed            the secrets master keyring
//! mesh-backup/etc/ca.pem.sealed, etc/ca.key.sealed      the mesh CA
//! mesh-backup/etc/admin-token.sealed                    the first admin token (when the host has it)
//! mesh-backup/broker/definitions.json.sealed            vhost, exchanges, queues, bindings, policies,
//!                                                       users (password hashes) and their permissions
//! ```
//!
//! Every file but the manifest is sealed under the operator's recovery key
//! (AES-256-GCM in 64 KiB chunks, each chunk's nonce carrying its index and a
//! last-chunk flag, the file's path and the backup's id as associated data:
//! a chunk cannot be reordered, dropped, truncated or moved to another file or
//! backup). The manifest is authenticated under the same key (a GMAC over its
//! canonical form) and names the key by a one-way id, so a wrong key is told
//! apart from an altered manifest. Nothing in the archive is a secret in clear.
//!
//! The database part is one `pg_dump` under one exported snapshot: a
//! REPEATABLE READ transaction exports it (`pg_export_snapshot()`), reads each
//! schema's applied migrations for the manifest and stays open while pg_dump
//! runs with `--snapshot`, so the archive is one moment of every schema.
//! `mesh-bundle restore` verifies everything before it installs anything, then
//! restores each schema under its own role (`pg_restore --no-owner
//! --role=<role>`), the key files and the broker's definitions.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::{Aes256Gcm, Key, Nonce};
use mesh_credentials::key::{ADMIN_TOKEN_FILE, SIGNING_KEY_FILE};
use mesh_credentials::{
    AdminCredentials, ControllerCredentials, CredentialsError, MASTER_KEYS_FILE, MasterKeys,
};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};
use sqlx::{AssertSqlSafe, Connection, PgConnection};

use crate::CONTEXTS;
use crate::provision::{self, Names, ProvisionError, Rabbit, Secrets, quote_ident};

/// The archive's top directory; nothing else is at its top.
pub const TOP: &str = "mesh-backup";
/// The manifest's name inside [`TOP`].
pub const MANIFEST_FILE: &str = "manifest.json";
/// The manifest format this code writes and reads.
pub const FORMAT: u64 = 1;
/// Plaintext bytes per sealed chunk.
const CHUNK: usize = 64 * 1024;
const TAG: usize = 16;
const MAGIC: &[u8; 8] = b"MESHBAK1";
const PREFIX: usize = 7;
const RECOVERY_KEY_TAG: &str = "mesh-recovery-v1:";

#[derive(Debug, thiserror::Error)]
pub enum BackupError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{what}: {message}")]
    Command { what: String, message: String },
    #[error("recovery key {path}: {reason}")]
    RecoveryKey { path: PathBuf, reason: String },
    #[error("{0} is not a tar archive ({1})")]
    NotTar(PathBuf, String),
    #[error("the archive holds no {TOP}/{MANIFEST_FILE}")]
    ManifestMissing,
    #[error("{TOP}/{MANIFEST_FILE} is not a backup manifest: {0}")]
    ManifestBad(String),
    #[error("{TOP}/{MANIFEST_FILE} has format {0}; this mesh-bundle reads format {FORMAT}")]
    Format(String),
    #[error(
        "wrong recovery key: this backup was sealed under key {archive}, the key given is {given}"
    )]
    WrongKey { archive: String, given: String },
    #[error(
        "{TOP}/{MANIFEST_FILE} is altered: its authentication under the recovery key does not match"
    )]
    ManifestAltered,
    #[error("file `{0}` is in the manifest but missing from the archive")]
    Missing(String),
    #[error("file `{0}` is in the archive but not in the manifest")]
    Extra(String),
    #[error("`{0}` is not a regular file or directory (links are refused)")]
    NotRegular(String),
    #[error("file `{path}` is altered: {what}")]
    Altered { path: String, what: String },
    #[error("file `{0}` does not open with the recovery key (altered after sealing)")]
    DoesNotOpen(String),
    #[error("file `{path}` opened but is not what it should be: {reason}")]
    Content { path: String, reason: String },
    #[error("refusing to restore over mesh data (nothing was installed; --force replaces it): {0}")]
    HoldsData(String),
    #[error("{0}")]
    Source(String),
    #[error("postgresql: {what}: {source}")]
    Postgres { what: String, source: sqlx::Error },
    #[error(transparent)]
    Rabbit(#[from] mesh_broker_admin::Error),
    #[error(transparent)]
    Provision(#[from] ProvisionError),
    #[error(transparent)]
    Credentials(#[from] CredentialsError),
}

type Result<T> = std::result::Result<T, BackupError>;

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> BackupError + '_ {
    move |source| BackupError::Io {
        path: path.to_owned(),
        source,
    }
}

fn pg(what: impl Into<String>) -> impl FnOnce(sqlx::Error) -> BackupError {
    let what = what.into();
    move |source| BackupError::Postgres { what, source }
}

// ---------------------------------------------------------------- the recovery key

/// The operator's recovery key: 32 random bytes. It seals backups and opens
/// them; it is never stored on the controller's host by the mesh.
#[derive(Clone)]
pub struct RecoveryKey([u8; 32]);

impl std::fmt::Debug for RecoveryKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RecoveryKey({})", self.id())
    }
}

impl RecoveryKey {
    pub fn generate() -> RecoveryKey {
        RecoveryKey(rand::random())
    }

    pub fn from_bytes(bytes: [u8; 32]) -> RecoveryKey {
        RecoveryKey(bytes)
    }

    fn derive(&self, purpose: &str) -> [u8; 32] {
        let mut h = Sha256::new();
        h.update(b"mesh-backup-v1\0");
        h.update(purpose.as_bytes());
        h.update(b"\0");
        h.update(self.0);
        h.finalize().into()
    }

    fn sealing_key(&self) -> [u8; 32] {
        self.derive("seal")
    }

    /// A one-way name of the key (16 hex digits), written in the manifest so
    /// that a wrong key is named as such.
    pub fn id(&self) -> String {
        hex::encode(&self.derive("id")[..8])
    }

    /// The key file's text.
    pub fn to_file_text(&self) -> String {
        format!(
            "# mesh recovery key (mesh-bundle recovery-key): seals and opens this mesh's\n\
             # backups. Keep it off the controller's host and apart from the backups;\n\
             # without it no backup can be restored. Key id {}.\n\
             {RECOVERY_KEY_TAG}{}\n",
            self.id(),
            hex::encode(self.0)
        )
    }

    /// Reads a key file; the error names the file, never the key.
    pub fn read(path: &Path) -> Result<RecoveryKey> {
        let text = std::fs::read_to_string(path).map_err(|e| BackupError::RecoveryKey {
            path: path.to_owned(),
            reason: e.to_string(),
        })?;
        Self::parse(&text).map_err(|reason| BackupError::RecoveryKey {
            path: path.to_owned(),
            reason,
        })
    }

    fn parse(text: &str) -> std::result::Result<RecoveryKey, String> {
        let lines: Vec<&str> = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .collect();
        let [line] = lines.as_slice() else {
            return Err(format!(
                "expected one line `{RECOVERY_KEY_TAG}<64 hex digits>`, found {}",
                lines.len()
            ));
        };
        let hexpart = line
            .strip_prefix(RECOVERY_KEY_TAG)
            .ok_or_else(|| format!("the key line does not start with `{RECOVERY_KEY_TAG}`"))?;
        let raw = hex::decode(hexpart).map_err(|_| "the key is not hex".to_string())?;
        let bytes: [u8; 32] = raw
            .try_into()
            .map_err(|_| "the key is not 64 hex digits (32 bytes)".to_string())?;
        Ok(RecoveryKey(bytes))
    }

    /// Writes a new key file, mode 0600; an existing file is never replaced.
    pub fn write_new(&self, path: &Path) -> Result<()> {
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(|e| BackupError::RecoveryKey {
                path: path.to_owned(),
                reason: if e.kind() == std::io::ErrorKind::AlreadyExists {
                    "exists already; a recovery key is never overwritten".into()
                } else {
                    e.to_string()
                },
            })?;
        f.write_all(self.to_file_text().as_bytes())
            .and_then(|()| f.sync_all())
            .map_err(io(path))
    }
}

// ---------------------------------------------------------------- sealing

fn cipher(key: &RecoveryKey) -> Aes256Gcm {
    Aes256Gcm::new(&Key::<Aes256Gcm>::from(key.sealing_key()))
}

fn file_aad(backup_id: &str, path: &str) -> Vec<u8> {
    [
        b"mesh-backup-v1\0file\0".as_slice(),
        backup_id.as_bytes(),
        b"\0",
        path.as_bytes(),
    ]
    .concat()
}

fn chunk_nonce(prefix: &[u8; PREFIX], index: u32, last: bool) -> [u8; 12] {
    let mut n = [0u8; 12];
    n[..PREFIX].copy_from_slice(prefix);
    n[PREFIX..PREFIX + 4].copy_from_slice(&index.to_be_bytes());
    n[11] = u8::from(last);
    n
}

/// Reads `from` to its end, filling `buf` as far as it goes.
fn fill(from: &mut impl Read, buf: &mut Vec<u8>) -> std::io::Result<()> {
    buf.clear();
    let mut taken = from.take(CHUNK as u64);
    taken.read_to_end(buf)?;
    Ok(())
}

/// Seals everything `from` yields into `to`; returns the sealed size.
fn seal_stream(
    key: &RecoveryKey,
    aad: &[u8],
    from: &mut impl Read,
    to: &mut impl Write,
) -> std::io::Result<u64> {
    let c = cipher(key);
    let prefix: [u8; PREFIX] = rand::random();
    to.write_all(MAGIC)?;
    to.write_all(&prefix)?;
    let mut written = (MAGIC.len() + PREFIX) as u64;
    let mut cur = Vec::with_capacity(CHUNK);
    let mut next = Vec::with_capacity(CHUNK);
    fill(from, &mut cur)?;
    let mut index: u32 = 0;
    loop {
        let last = if cur.len() < CHUNK {
            true
        } else {
            fill(from, &mut next)?;
            next.is_empty()
        };
        let ct = c
            .encrypt(
                &Nonce::from(chunk_nonce(&prefix, index, last)),
                Payload { msg: &cur, aad },
            )
            .map_err(|_| std::io::Error::other("encryption failed"))?;
        to.write_all(&ct)?;
        written += ct.len() as u64;
        if last {
            return Ok(written);
        }
        index = index
            .checked_add(1)
            .ok_or_else(|| std::io::Error::other("file too large to seal"))?;
        std::mem::swap(&mut cur, &mut next);
    }
}

/// Opens a sealed file of `len` bytes from `from` into `to`. `Ok(false)` when
/// it does not open (wrong key, altered, truncated, another file's).
fn open_stream(
    key: &RecoveryKey,
    aad: &[u8],
    from: &mut impl Read,
    len: u64,
    to: &mut impl Write,
) -> std::io::Result<bool> {
    let header = (MAGIC.len() + PREFIX) as u64;
    if len < header + TAG as u64 {
        return Ok(false);
    }
    let mut head = [0u8; 15];
    from.read_exact(&mut head)?;
    if &head[..8] != MAGIC {
        return Ok(false);
    }
    let mut prefix = [0u8; PREFIX];
    prefix.copy_from_slice(&head[8..]);
    let c = cipher(key);
    let mut left = len - header;
    let mut index: u32 = 0;
    let mut buf = vec![0u8; CHUNK + TAG];
    while left > 0 {
        let n = left.min((CHUNK + TAG) as u64) as usize;
        let last = left <= (CHUNK + TAG) as u64;
        if n < TAG {
            return Ok(false);
        }
        from.read_exact(&mut buf[..n])?;
        let Ok(pt) = c.decrypt(
            &Nonce::from(chunk_nonce(&prefix, index, last)),
            Payload {
                msg: &buf[..n],
                aad,
            },
        ) else {
            return Ok(false);
        };
        to.write_all(&pt)?;
        left -= n as u64;
        index = match index.checked_add(1) {
            Some(i) => i,
            None => return Ok(false),
        };
    }
    Ok(true)
}

fn manifest_aad(canonical: &[u8]) -> Vec<u8> {
    [b"mesh-backup-v1\0manifest\0".as_slice(), canonical].concat()
}

// ---------------------------------------------------------------- the manifest

/// What a file of the archive is. Each kind has one fixed path.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FileKind {
    Database,
    ControllerCredentials,
    SigningKey,
    MasterKeys,
    CaCertificate,
    CaKey,
    AdminToken,
    BrokerDefinitions,
}

impl FileKind {
    pub const ALL: [FileKind; 8] = [
        FileKind::Database,
        FileKind::ControllerCredentials,
        FileKind::SigningKey,
        FileKind::MasterKeys,
        FileKind::CaCertificate,
        FileKind::CaKey,
        FileKind::AdminToken,
        FileKind::BrokerDefinitions,
    ];

    /// The file's path inside [`TOP`].
    pub fn path(self) -> &'static str {
        match self {
            FileKind::Database => "database.dump.sealed",
            FileKind::ControllerCredentials => "etc/controller-credentials.toml.sealed",
            FileKind::SigningKey => "etc/controller-signing.key.sealed",
            FileKind::MasterKeys => "etc/secrets-master.toml.sealed",
            FileKind::CaCertificate => "etc/ca.pem.sealed",
            FileKind::CaKey => "etc/ca.key.sealed",
            FileKind::AdminToken => "etc/admin-token.sealed",
            FileKind::BrokerDefinitions => "broker/definitions.json.sealed",
        }
    }

    /// Whether a backup without it is incomplete.
    pub fn required(self) -> bool {
        self != FileKind::AdminToken
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileEntry {
    /// Relative to [`TOP`].
    pub path: String,
    pub kind: FileKind,
    /// Bytes of the sealed file.
    pub size: u64,
    /// SHA-256 of the sealed file (64 hex digits).
    pub sha256: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Migration {
    pub version: i64,
    pub name: String,
    pub checksum: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchemaEntry {
    /// The schema (the context's name).
    pub name: String,
    /// The role that owns it and that it is restored as.
    pub role: String,
    /// `<schema>.refinery_schema_history`, read in the snapshot's transaction.
    pub migrations: Vec<Migration>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PostgresPart {
    pub server_version: String,
    pub pg_dump_version: String,
    pub database: String,
    /// The exported snapshot the dump was taken under.
    pub snapshot: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BrokerPart {
    pub rabbitmq_version: String,
    pub vhost: String,
    /// The controller's broker user.
    pub controller_user: String,
    /// The identity context's management user.
    pub identity_user: String,
    /// Every broker user in the definitions (node ids and the two above).
    pub users: Vec<String>,
    pub queues: usize,
    pub exchanges: usize,
    pub policies: usize,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub format: u64,
    /// Random; part of every sealed chunk's associated data.
    pub backup_id: String,
    /// RFC 3339, UTC, when the snapshot was exported.
    pub created_at: String,
    pub mesh_version: String,
    /// [`RecoveryKey::id`] of the key it is sealed under.
    pub recovery_key_id: String,
    pub postgres: PostgresPart,
    pub broker: BrokerPart,
    /// Every context schema, in [`CONTEXTS`] order.
    pub schemas: Vec<SchemaEntry>,
    /// Every file of the archive but the manifest, sorted by path.
    pub files: Vec<FileEntry>,
    /// GMAC (AES-256-GCM of nothing) over the manifest without this field,
    /// under the recovery key: hex of nonce and tag.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
}

impl Manifest {
    fn canonical(&self) -> Vec<u8> {
        let mut m = self.clone();
        m.mac = None;
        serde_json::to_vec(&m).unwrap_or_default()
    }

    fn authenticate(&mut self, key: &RecoveryKey) -> Result<()> {
        self.mac = None;
        let nonce: [u8; 12] = rand::random();
        let tag = cipher(key)
            .encrypt(
                &Nonce::from(nonce),
                Payload {
                    msg: b"",
                    aad: &manifest_aad(&self.canonical()),
                },
            )
            .map_err(|_| BackupError::Source("authenticating the manifest failed".into()))?;
        self.mac = Some(hex::encode([nonce.as_slice(), &tag].concat()));
        Ok(())
    }

    fn check_mac(&self, key: &RecoveryKey) -> Result<()> {
        let raw = self
            .mac
            .as_deref()
            .and_then(|m| hex::decode(m).ok())
            .filter(|r| r.len() == 12 + TAG)
            .ok_or_else(|| {
                BackupError::ManifestBad("field `mac` is missing or malformed".into())
            })?;
        let mut nonce = [0u8; 12];
        nonce.copy_from_slice(&raw[..12]);
        cipher(key)
            .decrypt(
                &Nonce::from(nonce),
                Payload {
                    msg: &raw[12..],
                    aad: &manifest_aad(&self.canonical()),
                },
            )
            .map(|_| ())
            .map_err(|_| BackupError::ManifestAltered)
    }

    /// Parses the manifest's text: the format first, then every field
    /// (unknown fields refused), then the structure (each kind at its path
    /// once, the required ones present, every context schema once).
    pub fn parse(text: &str) -> Result<Manifest> {
        let v: Value =
            serde_json::from_str(text).map_err(|e| BackupError::ManifestBad(e.to_string()))?;
        match v.get("format") {
            Some(Value::Number(n)) if n.as_u64() == Some(FORMAT) => {}
            Some(other) => return Err(BackupError::Format(other.to_string())),
            None => return Err(BackupError::ManifestBad("missing field `format`".into())),
        }
        let m: Manifest =
            serde_json::from_value(v).map_err(|e| BackupError::ManifestBad(e.to_string()))?;
        let mut kinds = BTreeSet::new();
        let mut paths = BTreeSet::new();
        for f in &m.files {
            if f.path != f.kind.path() {
                return Err(BackupError::ManifestBad(format!(
                    "file `{}` is listed as {:?}, whose path is `{}`",
                    f.path,
                    f.kind,
                    f.kind.path()
                )));
            }
            if !kinds.insert(f.kind) || !paths.insert(f.path.clone()) {
                return Err(BackupError::ManifestBad(format!(
                    "file `{}` is listed twice",
                    f.path
                )));
            }
            if f.sha256.len() != 64 || !f.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(BackupError::ManifestBad(format!(
                    "file `{}`: sha256 is not 64 hex digits",
                    f.path
                )));
            }
        }
        for k in FileKind::ALL {
            if k.required() && !kinds.contains(&k) {
                return Err(BackupError::ManifestBad(format!(
                    "no {:?} file (`{}`) is listed",
                    k,
                    k.path()
                )));
            }
        }
        let names: Vec<&str> = m.schemas.iter().map(|s| s.name.as_str()).collect();
        if names != CONTEXTS {
            return Err(BackupError::ManifestBad(format!(
                "schemas are {names:?}, not every context's {CONTEXTS:?}"
            )));
        }
        m.names()?;
        Ok(m)
    }

    /// The environment's names the archive was taken from (restored as is).
    pub fn names(&self) -> Result<Names> {
        let first = self
            .schemas
            .first()
            .ok_or_else(|| BackupError::ManifestBad("no schema".into()))?;
        let prefix = first
            .role
            .strip_suffix(&format!("_{}", first.name))
            .ok_or_else(|| {
                BackupError::ManifestBad(format!(
                    "role `{}` of schema {} is not `<prefix>_{}`",
                    first.role, first.name, first.name
                ))
            })?
            .to_owned();
        for s in &self.schemas {
            if s.role != format!("{prefix}_{}", s.name) {
                return Err(BackupError::ManifestBad(format!(
                    "role `{}` of schema {} is not `{prefix}_{}`",
                    s.role, s.name, s.name
                )));
            }
        }
        let ok = |s: &str| {
            !s.is_empty()
                && s.len() <= 63
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-'))
        };
        for (field, value) in [
            ("postgres.database", self.postgres.database.as_str()),
            ("role prefix", prefix.as_str()),
            ("broker.vhost", self.broker.vhost.as_str()),
            (
                "broker.controller_user",
                self.broker.controller_user.as_str(),
            ),
            ("broker.identity_user", self.broker.identity_user.as_str()),
        ] {
            if !ok(value) {
                return Err(BackupError::ManifestBad(format!(
                    "{field} `{value}` is not 1 to 63 of A-Z a-z 0-9 _ -"
                )));
            }
        }
        Ok(Names {
            database: self.postgres.database.clone(),
            role_prefix: prefix,
            vhost: self.broker.vhost.clone(),
            controller_user: self.broker.controller_user.clone(),
            identity_user: self.broker.identity_user.clone(),
        })
    }

    /// The manifest's JSON: the header fields on the first line, then one line
    /// per file (as `mesh-bundle pack` writes its own).
    pub fn to_json(&self) -> String {
        let mut head = serde_json::to_value(self).unwrap_or(Value::Null);
        let files = head
            .as_object_mut()
            .and_then(|o| o.remove("files"))
            .unwrap_or(Value::Array(vec![]));
        let mut text = serde_json::to_string(&head).unwrap_or_default();
        text.pop(); // the closing brace
        text.push_str(",\n\"files\": [\n");
        let lines: Vec<String> = files
            .as_array()
            .map(|a| a.iter().map(|f| f.to_string()).collect())
            .unwrap_or_default();
        text.push_str(&lines.join(",\n"));
        text.push_str("\n]}\n");
        text
    }
}

pub fn sha256_file(path: &Path) -> Result<(String, u64)> {
    let mut f = std::fs::File::open(path).map_err(io(path))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    let mut n = 0u64;
    loop {
        let k = f.read(&mut buf).map_err(io(path))?;
        if k == 0 {
            break;
        }
        h.update(&buf[..k]);
        n += k as u64;
    }
    Ok((hex::encode(h.finalize()), n))
}

// ---------------------------------------------------------------- helpers

/// A private (0700) temporary directory.
fn private_dir(prefix: &str) -> Result<tempfile::TempDir> {
    use std::os::unix::fs::PermissionsExt;
    let d = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir()
        .map_err(io(Path::new("temporary directory")))?;
    std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o700))
        .map_err(io(d.path()))?;
    Ok(d)
}

fn create_private(path: &Path) -> Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(io(path))
}

fn run(what: &str, cmd: &mut Command) -> Result<String> {
    let out = cmd.output().map_err(|e| BackupError::Command {
        what: what.to_owned(),
        message: e.to_string(),
    })?;
    if !out.status.success() {
        return Err(BackupError::Command {
            what: what.to_owned(),
            message: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A PostgreSQL tool (`pg_dump`, `pg_restore`) from `bin` or PATH.
fn pg_tool(bin: Option<&Path>, name: &str) -> PathBuf {
    match bin {
        Some(b) => b.join(name),
        None => PathBuf::from(name),
    }
}

/// A libpq connection URL without its password, and the password (for
/// PGPASSWORD: never on a command line).
fn libpq_target(url: &str) -> Result<(String, Option<String>)> {
    let mut u = url::Url::parse(url)
        .map_err(|e| BackupError::Source(format!("a database URL does not parse: {e}")))?;
    let password = u
        .password()
        .and_then(|p| urlencoding::decode(p).ok())
        .map(|p| p.into_owned());
    let _ = u.set_password(None);
    Ok((u.to_string(), password))
}

fn pg_command(program: PathBuf, url: &str) -> Result<(Command, String)> {
    let (target, password) = libpq_target(url)?;
    let mut cmd = Command::new(program);
    cmd.env_remove("PGPASSWORD")
        .env_remove("PGSERVICE")
        .env("PGCONNECT_TIMEOUT", "30")
        .stdin(Stdio::null());
    if let Some(p) = password {
        cmd.env("PGPASSWORD", p);
    }
    Ok((cmd, target))
}

fn url_user(url: &str) -> Option<String> {
    let u = url::Url::parse(url).ok()?;
    urlencoding::decode(u.username())
        .ok()
        .map(|s| s.into_owned())
}

fn url_path(url: &str) -> Option<String> {
    let u = url::Url::parse(url).ok()?;
    let p = u.path().trim_start_matches('/');
    urlencoding::decode(p).ok().map(|s| s.into_owned())
}

/// The broker's definitions that belong to `vhost`: the vhost, its queues,
/// exchanges, bindings, policies and parameters, and every user with a
/// permission there (or named in `also`) with its password hash, tags and
/// permissions, but none of `exclude` (the host's own administrator).
pub fn mesh_definitions(
    all: &Value,
    vhost: &str,
    also: &BTreeSet<String>,
    exclude: &BTreeSet<String>,
) -> Value {
    let list = |k: &str| -> Vec<Value> {
        all.get(k)
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default()
    };
    let on_vhost = |v: &Value| v.get("vhost").and_then(Value::as_str) == Some(vhost);
    let user_of = |v: &Value| v.get("user").and_then(Value::as_str).map(str::to_owned);
    let mut users: BTreeSet<String> = also.clone();
    for k in ["permissions", "topic_permissions"] {
        for p in list(k).iter().filter(|p| on_vhost(p)) {
            if let Some(u) = user_of(p) {
                users.insert(u);
            }
        }
    }
    users.retain(|u| !exclude.contains(u));
    let keep_user = |p: &Value| on_vhost(p) && user_of(p).is_some_and(|u| users.contains(&u));
    let mut out = serde_json::Map::new();
    for k in ["rabbit_version", "rabbitmq_version"] {
        if let Some(v) = all.get(k) {
            out.insert(k.into(), v.clone());
        }
    }
    out.insert(
        "users".into(),
        Value::Array(
            list("users")
                .into_iter()
                .filter(|u| {
                    u.get("name")
                        .and_then(Value::as_str)
                        .is_some_and(|n| users.contains(n))
                })
                .collect(),
        ),
    );
    out.insert(
        "vhosts".into(),
        Value::Array(
            list("vhosts")
                .into_iter()
                .filter(|v| v.get("name").and_then(Value::as_str) == Some(vhost))
                .collect(),
        ),
    );
    for k in ["permissions", "topic_permissions"] {
        out.insert(
            k.into(),
            Value::Array(list(k).into_iter().filter(|p| keep_user(p)).collect()),
        );
    }
    for k in ["parameters", "policies", "queues", "exchanges", "bindings"] {
        out.insert(
            k.into(),
            Value::Array(list(k).into_iter().filter(|v| on_vhost(v)).collect()),
        );
    }
    Value::Object(out)
}

fn names_in(defs: &Value, key: &str) -> Vec<String> {
    defs.get(key)
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|v| v.get("name").and_then(Value::as_str).map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

fn count(defs: &Value, key: &str) -> usize {
    defs.get(key).and_then(Value::as_array).map_or(0, Vec::len)
}

// ---------------------------------------------------------------- writing an archive

/// What goes into an archive: each file's plaintext source.
enum Part {
    Bytes(Vec<u8>),
    /// Sealed elsewhere already (the database dump, streamed), at this path.
    Sealed(PathBuf),
}

/// Seals `parts` into `stage/mesh-backup/`, writes the authenticated
/// manifest, and tars the whole into `out` (mode 0600, written to a temporary
/// name beside it, then renamed).
fn assemble(
    out: &Path,
    stage: &Path,
    key: &RecoveryKey,
    mut manifest: Manifest,
    parts: Vec<(FileKind, Part)>,
) -> Result<Manifest> {
    let top = stage.join(TOP);
    std::fs::create_dir_all(top.join("etc")).map_err(io(&top))?;
    std::fs::create_dir_all(top.join("broker")).map_err(io(&top))?;
    manifest.files.clear();
    for (kind, part) in parts {
        let path = top.join(kind.path());
        match part {
            Part::Bytes(b) => {
                let mut f = create_private(&path)?;
                seal_stream(
                    key,
                    &file_aad(&manifest.backup_id, kind.path()),
                    &mut b.as_slice(),
                    &mut f,
                )
                .map_err(io(&path))?;
                f.sync_all().map_err(io(&path))?;
            }
            Part::Sealed(p) => {
                if p != path {
                    std::fs::rename(&p, &path).map_err(io(&p))?;
                }
            }
        }
        let (sha256, size) = sha256_file(&path)?;
        manifest.files.push(FileEntry {
            path: kind.path().to_owned(),
            kind,
            size,
            sha256,
        });
    }
    manifest.files.sort_by(|a, b| a.path.cmp(&b.path));
    manifest.authenticate(key)?;
    let mpath = top.join(MANIFEST_FILE);
    std::fs::write(&mpath, manifest.to_json()).map_err(io(&mpath))?;

    let dir = match out.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        out.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "backup".into()),
        std::process::id()
    ));
    let _ = std::fs::remove_file(&tmp);
    let file = create_private(&tmp)?;
    let status = Command::new("tar")
        .arg("-C")
        .arg(stage)
        .args([
            "--sort=name",
            "--owner=0",
            "--group=0",
            "--numeric-owner",
            "-cf",
            "-",
            TOP,
        ])
        .stdout(file)
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| BackupError::Command {
            what: "tar".into(),
            message: e.to_string(),
        })?;
    if !status.status.success() {
        let _ = std::fs::remove_file(&tmp);
        return Err(BackupError::Command {
            what: "tar".into(),
            message: String::from_utf8_lossy(&status.stderr).trim().to_owned(),
        });
    }
    if let Ok(f) = std::fs::File::open(&tmp) {
        let _ = f.sync_all();
    }
    std::fs::rename(&tmp, out).map_err(io(out))?;
    Ok(manifest)
}

// ---------------------------------------------------------------- backup

/// Where a backup reads from.
pub struct BackupSource {
    /// The controller's credentials file (it names the databases, the broker
    /// user, the key files and the CA).
    pub controller_file: PathBuf,
    /// The administrator's credentials (pg_dump runs as the admin role, which
    /// is a member of every context role; the broker's definitions are read
    /// through the management API as the administrator).
    pub admin: AdminCredentials,
    /// The first admin token's file, when the host has it.
    pub admin_token_file: Option<PathBuf>,
    /// Directory of `pg_dump` (default: PATH).
    pub pg_bin: Option<PathBuf>,
}

#[derive(Debug)]
pub struct BackedUp {
    pub manifest: Manifest,
    pub bytes: u64,
    pub manifest_sha256: String,
}

fn read_file(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(io(path))
}

fn required_path(field: &str, p: &Option<PathBuf>) -> Result<PathBuf> {
    p.clone().ok_or_else(|| {
        BackupError::Source(format!(
            "the controller's credentials name no {field}: nothing to back up it from"
        ))
    })
}

/// Writes a backup of the mesh described by `src` to `out`.
pub async fn backup(src: &BackupSource, key: &RecoveryKey, out: &Path) -> Result<BackedUp> {
    let controller_text = read_file(&src.controller_file)?;
    let c = &ControllerCredentials::load(&src.controller_file)?;
    // What to read: every context's schema, each owned by its own role, in
    // one database.
    let mut roles = Vec::new();
    let mut database = None::<String>;
    for ctx in CONTEXTS {
        let url = c.databases.get(ctx).ok_or_else(|| {
            BackupError::Source(format!(
                "the controller's credentials have no database {ctx}"
            ))
        })?;
        let role = url_user(url.expose())
            .filter(|r| !r.is_empty())
            .ok_or_else(|| BackupError::Source(format!("database {ctx}: the URL names no role")))?;
        let db = url_path(url.expose()).unwrap_or_default();
        match &database {
            None => database = Some(db),
            Some(d) if *d == db => {}
            Some(d) => {
                return Err(BackupError::Source(format!(
                    "database {ctx} is `{db}`, the others `{d}`: one database holds every schema"
                )));
            }
        }
        roles.push((ctx, role));
    }
    let database = database.unwrap_or_default();
    let vhost = url_path(c.broker_url.expose()).unwrap_or_default();
    let controller_user = url_user(c.broker_url.expose()).unwrap_or_default();
    let identity_user = c
        .broker_management
        .as_ref()
        .map(|m| m.user.clone())
        .ok_or_else(|| {
            BackupError::Source("the controller's credentials have no broker_management".into())
        })?;

    let sign_path = required_path("signing_key_file", &c.signing_key_file)?;
    let master_path = required_path("master_keys_file", &c.master_keys_file)?;
    let ca_cert_path = required_path("ca_certificate_file", &c.ca_certificate_file)?;
    let ca_key_path = required_path("ca_key_file", &c.ca_key_file)?;
    // Read (and check) the key files before the database is touched.
    mesh_credentials::key::read_signing_key(&sign_path)?;
    MasterKeys::load(&master_path)?;
    mesh_credentials::pki::MeshCa::load(&ca_cert_path, &ca_key_path)
        .map_err(|e| BackupError::Source(format!("the mesh CA: {e}")))?;
    let mut parts = vec![
        (
            FileKind::ControllerCredentials,
            Part::Bytes(controller_text),
        ),
        (FileKind::SigningKey, Part::Bytes(read_file(&sign_path)?)),
        (FileKind::MasterKeys, Part::Bytes(read_file(&master_path)?)),
        (
            FileKind::CaCertificate,
            Part::Bytes(read_file(&ca_cert_path)?),
        ),
        (FileKind::CaKey, Part::Bytes(read_file(&ca_key_path)?)),
    ];
    if let Some(t) = &src.admin_token_file
        && t.exists()
    {
        parts.push((FileKind::AdminToken, Part::Bytes(read_file(t)?)));
    }

    let stage = private_dir("mesh-backup-")?;
    let top = stage.path().join(TOP);
    std::fs::create_dir_all(&top).map_err(io(&top))?;
    let backup_id = uuid_like();

    // The snapshot: exported by a REPEATABLE READ transaction that stays open
    // while pg_dump runs; the migrations are read in it too.
    let admin_url = provision::admin_url_on(&src.admin, &database)?;
    let mut conn = PgConnection::connect(&admin_url).await.map_err(pg(format!(
        "connect as admin to {}",
        provision::redact(&admin_url)
    )))?;
    sqlx::raw_sql("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        .execute(&mut conn)
        .await
        .map_err(pg("BEGIN REPEATABLE READ"))?;
    let snapshot: String = sqlx::query_scalar("SELECT pg_export_snapshot()")
        .fetch_one(&mut conn)
        .await
        .map_err(pg("pg_export_snapshot()"))?;
    let created_at = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    let server_version: String = sqlx::query_scalar("SHOW server_version")
        .fetch_one(&mut conn)
        .await
        .map_err(pg("SHOW server_version"))?;
    let mut schemas = Vec::new();
    for (ctx, role) in &roles {
        let history = format!("{ctx}.refinery_schema_history");
        let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
            .bind(&history)
            .fetch_one(&mut conn)
            .await
            .map_err(pg(format!("to_regclass({history})")))?;
        let migrations = if exists {
            let sql = format!(
                "SELECT version::bigint, name::text, checksum::text FROM {}.refinery_schema_history ORDER BY version",
                quote_ident(ctx)
            );
            sqlx::query_as::<_, (i64, String, String)>(AssertSqlSafe(sql))
                .fetch_all(&mut conn)
                .await
                .map_err(pg(format!("reading {history}")))?
                .into_iter()
                .map(|(version, name, checksum)| Migration {
                    version,
                    name,
                    checksum,
                })
                .collect()
        } else {
            Vec::new()
        };
        schemas.push(SchemaEntry {
            name: ctx.to_string(),
            role: role.clone(),
            migrations,
        });
    }

    // The broker's definitions, read while the snapshot is held.
    let rabbit = Rabbit::new(&src.admin);
    let all: Value = rabbit
        .get("definitions")
        .await?
        .ok_or_else(|| BackupError::Source("GET /api/definitions answered 404".into()))?;
    if !names_in(&all, "vhosts").contains(&vhost) {
        return Err(BackupError::Source(format!(
            "the broker has no vhost `{vhost}` (the controller's broker_url names it)"
        )));
    }
    let defs = mesh_definitions(
        &all,
        &vhost,
        &BTreeSet::from([identity_user.clone(), controller_user.clone()]),
        &BTreeSet::from([src.admin.rabbitmq_user.clone()]),
    );
    let rabbitmq_version = all
        .get("rabbitmq_version")
        .or_else(|| all.get("rabbit_version"))
        .and_then(Value::as_str)
        .unwrap_or("unknown")
        .to_owned();

    // pg_dump: one process, every context schema, the exported snapshot;
    // its output is sealed as it streams (no clear dump on disk).
    let dump_tool = pg_tool(src.pg_bin.as_deref(), "pg_dump");
    let pg_dump_version = run(
        "pg_dump --version",
        Command::new(&dump_tool).arg("--version"),
    )?
    .trim()
    .to_owned();
    let (mut cmd, target) = pg_command(dump_tool, &admin_url)?;
    cmd.args(["--format=custom", "--no-password", "--snapshot", &snapshot]);
    for ctx in CONTEXTS {
        cmd.arg("--schema").arg(quote_ident(ctx));
    }
    cmd.arg("--dbname").arg(&target);
    let dump_path = top.join(FileKind::Database.path());
    let aad = file_aad(&backup_id, FileKind::Database.path());
    let key2 = key.clone();
    let dump_path2 = dump_path.clone();
    let sealed = tokio::task::spawn_blocking(move || -> Result<u64> {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| BackupError::Command {
                what: "pg_dump".into(),
                message: e.to_string(),
            })?;
        let mut stderr = child.stderr.take();
        let err_reader = std::thread::spawn(move || {
            let mut s = String::new();
            if let Some(e) = stderr.as_mut() {
                let _ = e.read_to_string(&mut s);
            }
            s
        });
        let mut file = create_private(&dump_path2)?;
        let mut stdout = child.stdout.take().ok_or_else(|| BackupError::Command {
            what: "pg_dump".into(),
            message: "no stdout".into(),
        })?;
        let sealed = seal_stream(&key2, &aad, &mut stdout, &mut file);
        let status = child.wait().map_err(|e| BackupError::Command {
            what: "pg_dump".into(),
            message: e.to_string(),
        })?;
        let err = err_reader.join().unwrap_or_default();
        if !status.success() {
            return Err(BackupError::Command {
                what: "pg_dump".into(),
                message: err.trim().to_owned(),
            });
        }
        let n = sealed.map_err(io(&dump_path2))?;
        file.sync_all().map_err(io(&dump_path2))?;
        Ok(n)
    })
    .await
    .map_err(|e| BackupError::Source(format!("pg_dump task: {e}")))?;
    // The snapshot is released only now.
    let _ = sqlx::raw_sql("COMMIT").execute(&mut conn).await;
    let _ = conn.close().await;
    sealed?;

    parts.push((FileKind::Database, Part::Sealed(dump_path)));
    let defs_bytes = serde_json::to_vec(&defs).unwrap_or_default();
    let manifest = Manifest {
        format: FORMAT,
        backup_id,
        created_at,
        mesh_version: env!("CARGO_PKG_VERSION").to_owned(),
        recovery_key_id: key.id(),
        postgres: PostgresPart {
            server_version,
            pg_dump_version,
            database,
            snapshot,
        },
        broker: BrokerPart {
            rabbitmq_version,
            vhost,
            controller_user,
            identity_user,
            users: names_in(&defs, "users"),
            queues: count(&defs, "queues"),
            exchanges: count(&defs, "exchanges"),
            policies: count(&defs, "policies"),
        },
        schemas,
        files: Vec::new(),
        mac: None,
    };
    parts.push((FileKind::BrokerDefinitions, Part::Bytes(defs_bytes)));
    let manifest = assemble(out, stage.path(), key, manifest, parts)?;
    let bytes = std::fs::metadata(out).map_err(io(out))?.len();
    let mut h = Sha256::new();
    h.update(manifest.to_json().as_bytes());
    Ok(BackedUp {
        manifest,
        bytes,
        manifest_sha256: hex::encode(h.finalize()),
    })
}

fn uuid_like() -> String {
    let b: [u8; 16] = rand::random();
    let h = hex::encode(b);
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

// ---------------------------------------------------------------- verify

/// An archive verified and opened into a private directory (removed on drop).
pub struct Opened {
    pub manifest: Manifest,
    dir: tempfile::TempDir,
    plain: BTreeMap<FileKind, PathBuf>,
}

impl std::fmt::Debug for Opened {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Opened")
            .field("backup_id", &self.manifest.backup_id)
            .field("dir", &self.dir.path())
            .finish()
    }
}

impl Opened {
    /// The opened (clear) file of `kind`, inside the private directory.
    pub fn file(&self, kind: FileKind) -> Option<&Path> {
        self.plain.get(&kind).map(PathBuf::as_path)
    }

    fn text(&self, kind: FileKind) -> Result<String> {
        let p = self
            .file(kind)
            .ok_or_else(|| BackupError::Missing(format!("{TOP}/{}", kind.path())))?;
        std::fs::read_to_string(p).map_err(io(p))
    }

    /// The archived controller credentials.
    pub fn controller_credentials(&self) -> Result<ControllerCredentials> {
        let text = self.text(FileKind::ControllerCredentials)?;
        Ok(ControllerCredentials::parse(
            &text,
            Path::new(FileKind::ControllerCredentials.path()),
        )?)
    }
}

fn walk(top: &Path, dir: &Path, out: &mut BTreeSet<String>) -> Result<()> {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .map_err(io(dir))?
        .collect::<std::result::Result<_, _>>()
        .map_err(io(dir))?;
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let path = e.path();
        let meta = std::fs::symlink_metadata(&path).map_err(io(&path))?;
        let rel = path
            .strip_prefix(top)
            .unwrap_or(&path)
            .to_string_lossy()
            .into_owned();
        if meta.is_dir() {
            walk(top, &path, out)?;
        } else if meta.is_file() {
            out.insert(rel);
        } else {
            return Err(BackupError::NotRegular(rel));
        }
    }
    Ok(())
}

/// Verifies `archive` with `key` and opens every file into a private
/// directory: the archive is a tar of `mesh-backup/` only; the manifest is
/// well formed, sealed under this key and unaltered; every file it lists is
/// there with its size and sha256 and nothing else is; every sealed file opens
/// and holds what its kind should. The first problem is the error, naming it.
pub fn verify(archive: &Path, key: &RecoveryKey) -> Result<Opened> {
    let meta = std::fs::metadata(archive).map_err(io(archive))?;
    if !meta.is_file() {
        return Err(BackupError::NotTar(
            archive.to_owned(),
            "not a regular file".into(),
        ));
    }
    let dir = private_dir("mesh-restore-")?;
    let extracted = dir.path().join("a");
    std::fs::create_dir(&extracted).map_err(io(&extracted))?;
    let out = Command::new("tar")
        .arg("-xf")
        .arg(archive)
        .arg("-C")
        .arg(&extracted)
        .args(["--no-same-owner", "--no-same-permissions"])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| BackupError::Command {
            what: "tar".into(),
            message: e.to_string(),
        })?;
    if !out.status.success() {
        let msg = String::from_utf8_lossy(&out.stderr);
        let first = msg.lines().next().unwrap_or("tar failed").trim().to_owned();
        return Err(BackupError::NotTar(archive.to_owned(), first));
    }
    let mut found = BTreeSet::new();
    walk(&extracted, &extracted, &mut found)?;
    let prefix = format!("{TOP}/");
    if let Some(stray) = found.iter().find(|p| !p.starts_with(&prefix)) {
        return Err(BackupError::Extra(stray.clone()));
    }
    let top = extracted.join(TOP);
    let mpath = top.join(MANIFEST_FILE);
    if !found.remove(&format!("{TOP}/{MANIFEST_FILE}")) {
        return Err(BackupError::ManifestMissing);
    }
    let text = std::fs::read_to_string(&mpath).map_err(|e| match e.kind() {
        std::io::ErrorKind::InvalidData => BackupError::ManifestBad("not UTF-8".into()),
        _ => BackupError::Io {
            path: mpath.clone(),
            source: e,
        },
    })?;
    let manifest = Manifest::parse(&text)?;
    if manifest.recovery_key_id != key.id() {
        return Err(BackupError::WrongKey {
            archive: manifest.recovery_key_id.clone(),
            given: key.id(),
        });
    }
    manifest.check_mac(key)?;
    let listed: BTreeSet<String> = manifest
        .files
        .iter()
        .map(|f| format!("{TOP}/{}", f.path))
        .collect();
    if let Some(extra) = found.difference(&listed).next() {
        return Err(BackupError::Extra(extra.clone()));
    }
    if let Some(missing) = listed.difference(&found).next() {
        return Err(BackupError::Missing(missing.clone()));
    }
    for f in &manifest.files {
        let p = top.join(&f.path);
        let (sha, size) = sha256_file(&p)?;
        if size != f.size {
            return Err(BackupError::Altered {
                path: format!("{TOP}/{}", f.path),
                what: format!("{size} bytes, the manifest says {}", f.size),
            });
        }
        if sha != f.sha256 {
            return Err(BackupError::Altered {
                path: format!("{TOP}/{}", f.path),
                what: format!("sha256 {sha}, the manifest says {}", f.sha256),
            });
        }
    }
    // Open every file into the private directory, beside the sealed ones.
    let clear = dir.path().join("clear");
    std::fs::create_dir(&clear).map_err(io(&clear))?;
    let mut plain = BTreeMap::new();
    for f in &manifest.files {
        let sealed = top.join(&f.path);
        let name = f.path.trim_end_matches(".sealed").replace('/', "_");
        let to = clear.join(name);
        let mut input = std::fs::File::open(&sealed).map_err(io(&sealed))?;
        let mut output = create_private(&to)?;
        let opened = open_stream(
            key,
            &file_aad(&manifest.backup_id, &f.path),
            &mut input,
            f.size,
            &mut output,
        )
        .map_err(io(&sealed))?;
        if !opened {
            return Err(BackupError::DoesNotOpen(format!("{TOP}/{}", f.path)));
        }
        // The sealed copy is not needed any more.
        let _ = std::fs::remove_file(&sealed);
        plain.insert(f.kind, to);
    }
    let opened = Opened {
        manifest,
        dir,
        plain,
    };
    check_contents(&opened)?;
    Ok(opened)
}

fn content(kind: FileKind, reason: impl std::fmt::Display) -> BackupError {
    BackupError::Content {
        path: format!("{TOP}/{}", kind.path()),
        reason: reason.to_string(),
    }
}

/// Every opened file is what its kind says.
fn check_contents(o: &Opened) -> Result<()> {
    let creds = o
        .controller_credentials()
        .map_err(|e| content(FileKind::ControllerCredentials, e))?;
    for ctx in CONTEXTS {
        if !creds.databases.contains_key(ctx) {
            return Err(content(
                FileKind::ControllerCredentials,
                format!("no database {ctx}"),
            ));
        }
    }
    let path = |k: FileKind| o.file(k).map(Path::to_path_buf).unwrap_or_default();
    mesh_credentials::key::read_signing_key(&path(FileKind::SigningKey))
        .map_err(|_| content(FileKind::SigningKey, "not an Ed25519 key seed"))?;
    MasterKeys::load(&path(FileKind::MasterKeys)).map_err(|e| content(FileKind::MasterKeys, e))?;
    mesh_credentials::pki::MeshCa::load(&path(FileKind::CaCertificate), &path(FileKind::CaKey))
        .map_err(|e| content(FileKind::CaKey, format!("not the mesh CA: {e}")))?;
    if let Some(t) = o.file(FileKind::AdminToken) {
        mesh_credentials::key::read_token(t)
            .map_err(|e| content(FileKind::AdminToken, e))?
            .ok_or_else(|| content(FileKind::AdminToken, "empty"))?;
    }
    let defs: Value = serde_json::from_str(&o.text(FileKind::BrokerDefinitions)?)
        .map_err(|e| content(FileKind::BrokerDefinitions, format!("not JSON: {e}")))?;
    if !names_in(&defs, "vhosts").contains(&o.manifest.broker.vhost) {
        return Err(content(
            FileKind::BrokerDefinitions,
            format!("no vhost `{}`", o.manifest.broker.vhost),
        ));
    }
    let mut head = [0u8; 5];
    let dump = path(FileKind::Database);
    std::fs::File::open(&dump)
        .and_then(|mut f| f.read_exact(&mut head))
        .map_err(|_| content(FileKind::Database, "shorter than a dump's header"))?;
    if &head != b"PGDMP" {
        return Err(content(
            FileKind::Database,
            "not a pg_dump custom-format archive",
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------- restore

pub struct RestoreOptions {
    /// Where the key files and the controller's credentials are written.
    pub etc: PathBuf,
    /// The new host's administrator (its PostgreSQL admin role and broker
    /// administrator); the restored credentials point at its endpoints.
    pub admin: AdminCredentials,
    /// Replace what the target holds (context schemas, the vhost, other keys).
    pub force: bool,
    /// Restore the broker's definitions (off: the broker kept its state).
    pub broker: bool,
    /// Directory of `pg_restore` (default: PATH).
    pub pg_bin: Option<PathBuf>,
}

/// Whether the cluster `admin` reaches holds the database `name`.
async fn database_exists(admin: &AdminCredentials, name: &str) -> Result<bool> {
    let mut conn = provision::connect_admin(admin, "postgres").await?;
    let exists = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
        .bind(name)
        .fetch_one(&mut conn)
        .await
        .map_err(pg("pg_database"))?;
    let _ = conn.close().await;
    Ok(exists)
}

/// What the target holds that a restore would replace; empty when nothing.
pub async fn target_holdings(opened: &Opened, opts: &RestoreOptions) -> Result<Vec<String>> {
    let names = opened.manifest.names()?;
    let mut held = Vec::new();
    if database_exists(&opts.admin, &names.database).await? {
        let mut conn = provision::connect_admin(&opts.admin, &names.database).await?;
        let rows: Vec<(String, i64)> = sqlx::query_as(
            "SELECT n.nspname::text, count(c.oid) FROM pg_namespace n \
             JOIN pg_class c ON c.relnamespace = n.oid AND c.relkind IN ('r', 'p') \
             WHERE n.nspname = ANY($1) GROUP BY 1 ORDER BY 1",
        )
        .bind(CONTEXTS.iter().map(|s| s.to_string()).collect::<Vec<_>>())
        .fetch_all(&mut conn)
        .await
        .map_err(pg("tables of the context schemas"))?;
        let _ = conn.close().await;
        for (schema, n) in rows {
            held.push(format!(
                "database {} schema {schema} has {n} table(s)",
                names.database
            ));
        }
    }
    if opts.broker {
        let rabbit = Rabbit::new(&opts.admin);
        if rabbit.vhost_exists(&names.vhost).await? {
            let queues: Vec<Value> = rabbit
                .get(&format!("queues/{}", mesh_broker_admin::seg(&names.vhost)))
                .await?
                .unwrap_or_default();
            if !queues.is_empty() {
                held.push(format!(
                    "broker vhost {} has {} queue(s)",
                    names.vhost,
                    queues.len()
                ));
            }
        }
    }
    for (kind, file) in [
        (FileKind::SigningKey, SIGNING_KEY_FILE),
        (FileKind::MasterKeys, MASTER_KEYS_FILE),
        (FileKind::CaCertificate, crate::tls::CA_CERT_FILE),
        (FileKind::CaKey, crate::tls::CA_KEY_FILE),
    ] {
        let have = opts.etc.join(file);
        if let (Ok(mine), Some(theirs)) = (std::fs::read(&have), opened.file(kind))
            && std::fs::read(theirs).ok().as_deref() != Some(mine.as_slice())
        {
            held.push(format!(
                "{} exists and is not the archive's",
                have.display()
            ));
        }
    }
    Ok(held)
}

/// One line of what a restore did.
pub type Done = Vec<String>;

/// Installs only the archive's mesh CA into `etc` (bundle/up does this before
/// it issues the broker's certificate, so the broker's certificate is the
/// restored CA's). A different CA already there is refused unless `force`.
pub fn install_ca(opened: &Opened, etc: &Path, force: bool) -> Result<Done> {
    // As a fresh bundle/up makes it (and `restore` below): the directory
    // readable, its secrets 0600. Left to write_secret_file it would be 0700,
    // and the registry bundle/up starts next (its own user) could not read
    // its registry.yml there.
    std::fs::create_dir_all(etc).map_err(io(etc))?;
    let (cert, key) = crate::tls::ca_paths(etc);
    let mut done = Vec::new();
    for (kind, to, mode) in [
        (FileKind::CaKey, &key, 0o600),
        (FileKind::CaCertificate, &cert, 0o644),
    ] {
        let text = opened.text(kind)?;
        if let Ok(have) = std::fs::read_to_string(to)
            && have != text
            && !force
        {
            return Err(BackupError::HoldsData(format!(
                "{} exists and is not the archive's",
                to.display()
            )));
        }
        let changed = mesh_credentials::write_secret_file(to, &text)?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(to, std::fs::Permissions::from_mode(mode)).map_err(io(to))?;
        done.push(format!(
            "{}  {} restored",
            if changed { "changed" } else { "ok     " },
            to.display()
        ));
    }
    Ok(done)
}

/// Installs an opened archive: refuses a target that holds mesh data (unless
/// `force`), writes the key files and the controller's credentials (pointed at
/// this host's endpoints, with the archive's passwords), provisions the
/// database, roles, schemas, vhost and users with them, restores each schema
/// as its own role, and imports the broker's definitions.
pub async fn restore(opened: &Opened, opts: &RestoreOptions) -> Result<Done> {
    let mut done = Vec::new();
    let names = opened.manifest.names()?;
    let held = target_holdings(opened, opts).await?;
    if !held.is_empty() && !opts.force {
        return Err(BackupError::HoldsData(held.join("; ")));
    }
    let archived = opened.controller_credentials()?;
    let secrets = Secrets::from_existing(Some(&archived));

    if opts.force {
        // Replace: the context schemas and the vhost go, provisioning makes
        // them again empty.
        if database_exists(&opts.admin, &names.database).await? {
            let mut conn = provision::connect_admin(&opts.admin, &names.database).await?;
            for ctx in CONTEXTS {
                sqlx::raw_sql(AssertSqlSafe(format!(
                    "DROP SCHEMA IF EXISTS {} CASCADE",
                    quote_ident(ctx)
                )))
                .execute(&mut conn)
                .await
                .map_err(pg(format!("DROP SCHEMA {ctx}")))?;
            }
            let _ = conn.close().await;
            done.push(format!(
                "changed  database {}: context schemas dropped (--force)",
                names.database
            ));
        }
        if opts.broker && Rabbit::new(&opts.admin).delete_vhost(&names.vhost).await? {
            done.push(format!(
                "changed  broker vhost {} deleted (--force)",
                names.vhost
            ));
        }
    }

    // The key files, as they were.
    std::fs::create_dir_all(&opts.etc).map_err(io(&opts.etc))?;
    let (ca_cert, ca_key) = crate::tls::ca_paths(&opts.etc);
    let sign = opts.etc.join(SIGNING_KEY_FILE);
    let master = opts.etc.join(MASTER_KEYS_FILE);
    let mut installs = vec![
        (FileKind::SigningKey, sign.clone()),
        (FileKind::MasterKeys, master.clone()),
        (FileKind::CaKey, ca_key.clone()),
        (FileKind::CaCertificate, ca_cert.clone()),
    ];
    if opened.file(FileKind::AdminToken).is_some() {
        installs.push((FileKind::AdminToken, opts.etc.join(ADMIN_TOKEN_FILE)));
    }
    for (kind, to) in installs {
        let text = opened.text(kind)?;
        let changed = mesh_credentials::write_secret_file(&to, &text)?;
        if kind == FileKind::CaCertificate {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&to, std::fs::Permissions::from_mode(0o644))
                .map_err(io(&to))?;
        }
        done.push(format!(
            "{}  {} restored",
            if changed { "changed" } else { "ok     " },
            to.display()
        ));
    }
    // The controller's credentials: the archive's passwords and token hash,
    // this host's endpoints and files.
    let mut creds = provision::controller_credentials(&opts.admin, &names, &secrets)?;
    creds.signing_key_file = Some(sign);
    creds.master_keys_file = Some(master);
    creds.ca_certificate_file = Some(ca_cert);
    creds.ca_key_file = Some(ca_key);
    creds.bootstrap_admin_token_sha256 = archived.bootstrap_admin_token_sha256.clone();
    creds.advertise_api = archived.advertise_api.clone();
    creds.advertise_broker = archived.advertise_broker.clone();
    let cpath = opts.etc.join(ControllerCredentials::FILE);
    creds.write(&cpath)?;
    done.push(format!("changed  {} written", cpath.display()));

    // Roles (with the archive's passwords), database, empty schemas, vhost,
    // the controller's and identity's broker users.
    let steps = provision::provision(&opts.admin, &names, &secrets).await?;
    done.push(format!(
        "changed  provisioned {} ({} change(s))",
        names.database,
        steps.changed()
    ));

    // Each schema as its own role.
    let dump = opened
        .file(FileKind::Database)
        .ok_or_else(|| BackupError::Missing(format!("{TOP}/{}", FileKind::Database.path())))?;
    let restore_tool = pg_tool(opts.pg_bin.as_deref(), "pg_restore");
    let admin_url = provision::admin_url_on(&opts.admin, &names.database)?;
    for s in &opened.manifest.schemas {
        let listing = run(
            &format!("pg_restore --list --schema {}", s.name),
            Command::new(&restore_tool)
                .args(["--list", "--schema", &s.name])
                .arg(dump),
        )?;
        // The schema itself was made by provisioning, owned by its role.
        let list: String = listing
            .lines()
            .filter(|l| !is_schema_entry(l, &s.name))
            .map(|l| format!("{l}\n"))
            .collect();
        let list_path = opened.dir.path().join(format!("list-{}", s.name));
        std::fs::write(&list_path, list).map_err(io(&list_path))?;
        let (mut cmd, target) = pg_command(restore_tool.clone(), &admin_url)?;
        cmd.args([
            "--no-owner",
            "--no-password",
            "--single-transaction",
            "--exit-on-error",
        ])
        .arg(format!("--role={}", s.role))
        .arg("--use-list")
        .arg(&list_path)
        .arg("--dbname")
        .arg(&target)
        .arg(dump);
        run(
            &format!("pg_restore of schema {} as {}", s.name, s.role),
            &mut cmd,
        )?;
        done.push(format!(
            "changed  schema {} restored as {} ({} migration(s))",
            s.name,
            s.role,
            s.migrations.len()
        ));
    }

    if opts.broker {
        // The broker's messages are not in the archive: a record event the
        // relay had published (sent) but a subscriber had not yet consumed
        // when the snapshot was taken lived only in the lost broker. Every
        // record event still kept is published again; a subscriber that had
        // it drops it (its inbox, kept as long as the outbox), one that had
        // not handles it now. Declarations need none of this: the sections'
        // catch-up re-sends what a node lacks.
        let mut conn = PgConnection::connect(&admin_url)
            .await
            .map_err(pg(format!("connecting to {}", names.database)))?;
        for s in &opened.manifest.schemas {
            let outbox = format!("{}.outbox", s.name);
            let has: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
                .bind(&outbox)
                .fetch_one(&mut conn)
                .await
                .map_err(pg(outbox.clone()))?;
            if !has {
                continue;
            }
            let sql = format!(
                "UPDATE {}.outbox SET sent_at = NULL WHERE exchange = $1 AND sent_at IS NOT NULL",
                s.name
            );
            let again = sqlx::query(AssertSqlSafe(sql))
                .bind(mesh_protocol::topology::RECORD_EXCHANGE)
                .execute(&mut conn)
                .await
                .map_err(pg(format!("{}.outbox", s.name)))?
                .rows_affected();
            if again > 0 {
                done.push(format!(
                    "changed  schema {}: {again} record event(s) to publish again (the broker's copies were not in the backup)",
                    s.name
                ));
            }
        }
        let _ = conn.close().await;
        let defs: Value = serde_json::from_str(&opened.text(FileKind::BrokerDefinitions)?)
            .map_err(|e| content(FileKind::BrokerDefinitions, e))?;
        Rabbit::new(&opts.admin).post("definitions", &defs).await?;
        done.push(format!(
            "changed  broker vhost {}: {} queue(s), {} exchange(s), {} polic(ies), {} user(s) imported",
            names.vhost,
            count(&defs, "queues"),
            count(&defs, "exchanges"),
            count(&defs, "policies"),
            count(&defs, "users"),
        ));
    }
    Ok(done)
}

/// Whether a `pg_restore --list` line is the entry of schema `schema` itself
/// (`<id>; <oid> <oid> SCHEMA - <schema> <owner>`), its comment or its ACL.
fn is_schema_entry(line: &str, schema: &str) -> bool {
    let Some((_, rest)) = line.split_once("; ") else {
        return false;
    };
    let mut words = rest.split_whitespace().skip(2);
    match (words.next(), words.next(), words.next(), words.next()) {
        (Some("SCHEMA"), Some("-"), Some(name), _) => name == schema,
        (Some("COMMENT" | "ACL"), Some("-"), Some("SCHEMA"), Some(name)) => name == schema,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mesh_credentials::{MasterKey, Secret};
    use mesh_protocol::DeclarationSigner;

    const ROLE_PASSWORD: &str = "r0le-password-0123456789abcdef";
    const MASTER: [u8; 32] = [0x5a; 32];

    fn controller() -> ControllerCredentials {
        let mut dbs = BTreeMap::new();
        for ctx in CONTEXTS {
            dbs.insert(
                ctx.to_string(),
                Secret::new(format!(
                    "postgres://mesh_{ctx}:{ROLE_PASSWORD}@127.0.0.1:5432/mesh"
                )),
            );
        }
        let mut c = ControllerCredentials::new(
            Secret::new("amqp://mesh_controller:ctl-pw@127.0.0.1:5672/mesh".into()),
            dbs,
        );
        c.broker_management = Some(mesh_credentials::BrokerManagement {
            url: "http://127.0.0.1:15672".into(),
            user: "mesh_identity".into(),
            password: Secret::new("idpw".into()),
        });
        c
    }

    /// A complete archive (with a stand-in dump) in `dir`: its path.
    fn archive(dir: &Path, key: &RecoveryKey) -> PathBuf {
        let ca = mesh_credentials::pki::MeshCa::generate("test CA").unwrap();
        let cadir = dir.join("ca");
        ca.write(&cadir.join("ca.pem"), &cadir.join("ca.key"))
            .unwrap();
        let master = MasterKeys::new(vec![MasterKey::new("m-1", MASTER)]);
        let mpath = dir.join("master.toml");
        master.write(&mpath).unwrap();
        let signer = DeclarationSigner::from_seed([9; 32]);
        let cpath = dir.join("controller.toml");
        controller().write(&cpath).unwrap();
        let defs = serde_json::json!({
            "users": [{"name": "node-a", "password_hash": "aGFzaA==", "tags": ""}],
            "vhosts": [{"name": "mesh"}],
            "permissions": [], "topic_permissions": [], "parameters": [],
            "policies": [], "queues": [], "exchanges": [], "bindings": []
        });
        let schemas = CONTEXTS
            .iter()
            .map(|c| SchemaEntry {
                name: c.to_string(),
                role: format!("mesh_{c}"),
                migrations: vec![Migration {
                    version: 1,
                    name: "init".into(),
                    checksum: "1".into(),
                }],
            })
            .collect();
        let manifest = Manifest {
            format: FORMAT,
            backup_id: uuid_like(),
            created_at: "2026-12-04T00:00:00.000Z".into(),
            mesh_version: "0.1.0".into(),
            recovery_key_id: key.id(),
            postgres: PostgresPart {
                server_version: "15".into(),
                pg_dump_version: "pg_dump (PostgreSQL) 15".into(),
                database: "mesh".into(),
                snapshot: "00000003-00000002-1".into(),
            },
            broker: BrokerPart {
                rabbitmq_version: "3.10.8".into(),
                vhost: "mesh".into(),
                controller_user: "mesh_controller".into(),
                identity_user: "mesh_identity".into(),
                users: vec!["node-a".into()],
                queues: 0,
                exchanges: 0,
                policies: 0,
            },
            schemas,
            files: vec![],
            mac: None,
        };
        let mut dump = b"PGDMP".to_vec();
        // More than one chunk, not a multiple of it.
        dump.extend((0..200_000u32).map(|i| (i % 251) as u8));
        let parts = vec![
            (FileKind::Database, Part::Bytes(dump)),
            (
                FileKind::ControllerCredentials,
                Part::Bytes(std::fs::read(&cpath).unwrap()),
            ),
            (
                FileKind::SigningKey,
                Part::Bytes(format!("{}\n", signer.to_hex()).into_bytes()),
            ),
            (
                FileKind::MasterKeys,
                Part::Bytes(std::fs::read(&mpath).unwrap()),
            ),
            (
                FileKind::CaCertificate,
                Part::Bytes(std::fs::read(cadir.join("ca.pem")).unwrap()),
            ),
            (
                FileKind::CaKey,
                Part::Bytes(std::fs::read(cadir.join("ca.key")).unwrap()),
            ),
            (
                FileKind::BrokerDefinitions,
                Part::Bytes(serde_json::to_vec(&defs).unwrap()),
            ),
        ];
        let stage = private_dir("mesh-backup-test-").unwrap();
        let out = dir.join("backup.tar");
        assemble(&out, stage.path(), key, manifest, parts).unwrap();
        out
    }

    /// Extracts `archive`, lets `change` alter the tree, tars it again.
    fn altered(archive: &Path, change: impl FnOnce(&Path)) -> PathBuf {
        let dir = archive
            .parent()
            .unwrap()
            .join(format!("x{}", rand::random::<u32>()));
        std::fs::create_dir(&dir).unwrap();
        assert!(
            Command::new("tar")
                .arg("-xf")
                .arg(archive)
                .arg("-C")
                .arg(&dir)
                .status()
                .unwrap()
                .success()
        );
        change(&dir);
        let out = dir.with_extension("tar");
        assert!(
            Command::new("tar")
                .arg("-C")
                .arg(&dir)
                .args(["-cf"])
                .arg(&out)
                .arg(".")
                .status()
                .unwrap()
                .success()
        );
        out
    }

    fn err(archive: &Path, key: &RecoveryKey) -> String {
        verify(archive, key).unwrap_err().to_string()
    }

    /// A temporary folder, a recovery key and an archive made with it there.
    fn made() -> (tempfile::TempDir, RecoveryKey, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let key = RecoveryKey::generate();
        let a = archive(dir.path(), &key);
        (dir, key, a)
    }

    /// `archive` is refused with an error that says `what`.
    fn refused(archive: &Path, key: &RecoveryKey, what: &str) {
        let e = err(archive, key);
        assert!(e.contains(what), "{e}");
    }

    #[test]
    fn a_sealed_stream_round_trips_and_refuses_every_alteration() {
        let key = RecoveryKey::generate();
        for len in [
            0usize,
            1,
            CHUNK - 1,
            CHUNK,
            CHUNK + 1,
            3 * CHUNK,
            3 * CHUNK + 7,
        ] {
            let data: Vec<u8> = (0..len).map(|i| (i * 7 % 256) as u8).collect();
            let mut sealed = Vec::new();
            seal_stream(&key, b"aad", &mut data.as_slice(), &mut sealed).unwrap();
            let open = |bytes: &[u8], aad: &[u8], k: &RecoveryKey| {
                let mut out = Vec::new();
                let ok =
                    open_stream(k, aad, &mut &bytes[..], bytes.len() as u64, &mut out).unwrap();
                ok.then_some(out)
            };
            assert_eq!(
                open(&sealed, b"aad", &key).as_deref(),
                Some(data.as_slice())
            );
            assert!(open(&sealed, b"other", &key).is_none(), "aad binds");
            assert!(open(&sealed, b"aad", &RecoveryKey::generate()).is_none());
            let mut flipped = sealed.clone();
            let at = flipped.len() / 2;
            flipped[at] ^= 1;
            assert!(
                open(&flipped, b"aad", &key).is_none(),
                "len {len}: a flipped bit"
            );
            // Truncated at a chunk boundary: the new last chunk was not sealed as last.
            if len > CHUNK {
                let cut = MAGIC.len() + PREFIX + CHUNK + TAG;
                assert!(open(&sealed[..cut], b"aad", &key).is_none(), "truncated");
            }
        }
    }

    #[test]
    fn a_recovery_key_file_is_0600_never_overwritten_and_read_back() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("recovery.key");
        let key = RecoveryKey::generate();
        key.write_new(&path).unwrap();
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(RecoveryKey::read(&path).unwrap().id(), key.id());
        let e = RecoveryKey::generate()
            .write_new(&path)
            .unwrap_err()
            .to_string();
        assert!(e.contains("never overwritten"), "{e}");
        assert!(!format!("{key:?}").contains(&hex::encode(key.0)));
        std::fs::write(&path, "mesh-recovery-v1:abcd\n").unwrap();
        let e = RecoveryKey::read(&path).unwrap_err().to_string();
        assert!(e.contains("64 hex digits") && !e.contains("abcd"), "{e}");
    }

    #[test]
    fn a_complete_archive_verifies_and_opens() {
        let (_dir, key, a) = made();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&a).unwrap().permissions().mode() & 0o777,
            0o600
        );
        let o = verify(&a, &key).unwrap();
        assert_eq!(o.manifest.names().unwrap(), Names::production());
        assert_eq!(
            o.controller_credentials().unwrap().databases["inventory"].expose(),
            &format!("postgres://mesh_inventory:{ROLE_PASSWORD}@127.0.0.1:5432/mesh")
        );
        let dump = std::fs::read(o.file(FileKind::Database).unwrap()).unwrap();
        assert_eq!(dump.len(), 200_005);
    }

    #[test]
    fn no_secret_is_in_clear_in_the_archive() {
        let (_dir, key, a) = made();
        let bytes = std::fs::read(&a).unwrap();
        let has = |needle: &[u8]| bytes.windows(needle.len()).any(|w| w == needle);
        assert!(has(b"manifest.json"), "the probe reads the archive's bytes");
        for secret in [
            ROLE_PASSWORD.as_bytes(),
            hex::encode(MASTER).as_bytes(),
            DeclarationSigner::from_seed([9; 32]).to_hex().as_bytes(),
            b"PRIVATE KEY",
            b"aGFzaA==",
            b"ctl-pw",
        ] {
            assert!(!has(secret), "{} in clear", String::from_utf8_lossy(secret));
        }
        assert!(!has(hex::encode(key.0).as_bytes()));
    }

    #[test]
    fn an_altered_file_is_refused_naming_it() {
        let (_dir, key, a) = made();
        let b = altered(&a, |d| {
            let p = d.join(TOP).join(FileKind::MasterKeys.path());
            let mut bytes = std::fs::read(&p).unwrap();
            let at = bytes.len() - 3;
            bytes[at] ^= 0x40;
            std::fs::write(&p, bytes).unwrap();
        });
        refused(
            &b,
            &key,
            "file `mesh-backup/etc/secrets-master.toml.sealed` is altered: sha256",
        );
    }

    #[test]
    fn a_file_altered_with_its_manifest_line_does_not_open() {
        let (_dir, key, a) = made();
        // The manifest edited to match the altered file: its MAC fails.
        let b = altered(&a, |d| {
            let p = d.join(TOP).join(FileKind::SigningKey.path());
            let mut bytes = std::fs::read(&p).unwrap();
            let at = bytes.len() - 1;
            bytes[at] ^= 1;
            std::fs::write(&p, &bytes).unwrap();
            let (sha, _) = sha256_file(&p).unwrap();
            let mp = d.join(TOP).join(MANIFEST_FILE);
            let text = std::fs::read_to_string(&mp).unwrap();
            let m = Manifest::parse(&text).unwrap();
            let old = &m
                .files
                .iter()
                .find(|f| f.kind == FileKind::SigningKey)
                .unwrap()
                .sha256;
            std::fs::write(&mp, text.replace(old.as_str(), &sha)).unwrap();
        });
        refused(&b, &key, "is altered: its authentication");
    }

    #[test]
    fn a_wrong_key_is_refused_as_such() {
        let (_dir, key, a) = made();
        let other = RecoveryKey::generate();
        let e = err(&a, &other);
        assert!(e.starts_with("wrong recovery key"), "{e}");
        assert!(e.contains(&key.id()) && e.contains(&other.id()), "{e}");
    }

    #[test]
    fn missing_extra_and_stray_files_are_refused() {
        let (_dir, key, a) = made();
        let b = altered(&a, |d| {
            std::fs::remove_file(d.join(TOP).join(FileKind::CaKey.path())).unwrap();
        });
        assert_eq!(
            err(&b, &key),
            "file `mesh-backup/etc/ca.key.sealed` is in the manifest but missing from the archive"
        );
        let b = altered(&a, |d| {
            std::fs::write(d.join(TOP).join("etc/extra"), "x").unwrap();
        });
        assert_eq!(
            err(&b, &key),
            "file `mesh-backup/etc/extra` is in the archive but not in the manifest"
        );
        let b = altered(&a, |d| {
            std::fs::write(d.join("beside"), "x").unwrap();
        });
        assert_eq!(
            err(&b, &key),
            "file `beside` is in the archive but not in the manifest"
        );
        let b = altered(&a, |d| {
            std::os::unix::fs::symlink("/etc/passwd", d.join(TOP).join("etc/link")).unwrap();
        });
        refused(&b, &key, "is not a regular file");
    }

    #[test]
    fn a_bad_manifest_and_a_non_tar_file_are_refused() {
        let (dir, key, a) = made();
        let edit = |f: &dyn Fn(String) -> String| {
            altered(&a, |d| {
                let p = d.join(TOP).join(MANIFEST_FILE);
                let t = std::fs::read_to_string(&p).unwrap();
                std::fs::write(&p, f(t)).unwrap();
            })
        };
        let e = err(&edit(&|_| "not json".into()), &key);
        assert!(
            e.starts_with("mesh-backup/manifest.json is not a backup manifest"),
            "{e}"
        );
        let e = err(
            &edit(&|t| t.replacen("\"format\":1", "\"format\":2", 1)),
            &key,
        );
        assert!(e.contains("has format 2"), "{e}");
        let e = err(&edit(&|t| t.replacen("{", "{\"surprise\":1,", 1)), &key);
        assert!(e.contains("unknown field `surprise`"), "{e}");
        let e = err(
            &edit(&|t| t.replacen("\"database\":\"mesh\"", "\"database\":\"other\"", 1)),
            &key,
        );
        assert!(e.contains("is altered: its authentication"), "{e}");
        let b = altered(&a, |d| {
            std::fs::remove_file(d.join(TOP).join(MANIFEST_FILE)).unwrap();
        });
        assert_eq!(
            err(&b, &key),
            "the archive holds no mesh-backup/manifest.json"
        );
        let junk = dir.path().join("junk.tar");
        std::fs::write(&junk, vec![7u8; 4096]).unwrap();
        refused(&junk, &key, "is not a tar archive");
    }

    #[test]
    fn definitions_keep_the_vhost_and_its_users_not_the_administrator() {
        let all = serde_json::json!({
            "rabbit_version": "3.10.8",
            "users": [
                {"name": "node-a", "password_hash": "h1"},
                {"name": "mesh_identity", "password_hash": "h2", "tags": "administrator"},
                {"name": "mesh-admin", "password_hash": "h3"},
                {"name": "other", "password_hash": "h4"}
            ],
            "vhosts": [{"name": "mesh"}, {"name": "elsewhere"}],
            "permissions": [
                {"user": "node-a", "vhost": "mesh", "configure": "^$", "write": "^reports$", "read": "^decl\\.node-a$"},
                {"user": "mesh-admin", "vhost": "mesh", "configure": ".*", "write": ".*", "read": ".*"},
                {"user": "other", "vhost": "elsewhere", "configure": ".*", "write": ".*", "read": ".*"}
            ],
            "topic_permissions": [{"user": "node-a", "vhost": "mesh", "exchange": "reports", "write": "^node-a\\.", "read": "^node-a\\."}],
            "queues": [{"name": "decl.node-a", "vhost": "mesh"}, {"name": "q", "vhost": "elsewhere"}],
            "exchanges": [{"name": "reports", "vhost": "mesh"}],
            "bindings": [], "policies": [{"name": "reports", "vhost": "mesh"}], "parameters": []
        });
        let d = mesh_definitions(
            &all,
            "mesh",
            &BTreeSet::from(["mesh_identity".to_string()]),
            &BTreeSet::from(["mesh-admin".to_string()]),
        );
        assert_eq!(names_in(&d, "users"), ["node-a", "mesh_identity"]);
        assert_eq!(names_in(&d, "vhosts"), ["mesh"]);
        assert_eq!(count(&d, "permissions"), 1);
        assert_eq!(count(&d, "topic_permissions"), 1);
        assert_eq!(names_in(&d, "queues"), ["decl.node-a"]);
        assert_eq!(count(&d, "policies"), 1);
    }

    #[test]
    fn schema_entries_of_a_listing_are_recognised() {
        assert!(is_schema_entry(
            "5; 2615 16390 SCHEMA - inventory mesh_inventory",
            "inventory"
        ));
        assert!(!is_schema_entry(
            "5; 2615 16390 SCHEMA - config mesh_config",
            "inventory"
        ));
        assert!(is_schema_entry(
            "9; 0 0 ACL - SCHEMA inventory mesh_inventory",
            "inventory"
        ));
        assert!(!is_schema_entry(
            "215; 1259 16400 TABLE inventory nodes mesh_inventory",
            "inventory"
        ));
        assert!(!is_schema_entry(";  comment line", "inventory"));
    }
}
