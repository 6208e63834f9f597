//! The credential files the bundle writes and the controller, agents and tests read.
//! Formats are the contract in the team plan: change them together with their readers.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Default directory of the credential files; `MESH_ETC` overrides it.
pub const DEFAULT_ETC: &str = "/etc/mesh";
/// File name of the admin credentials inside the etc directory.
pub const ADMIN_FILE: &str = "admin-credentials.toml";
/// File name of the controller credentials inside the etc directory.
pub const CONTROLLER_FILE: &str = "controller-credentials.toml";
/// Environment variable naming the admin credentials file (tests, bundle).
pub const ADMIN_ENV: &str = "MESH_ADMIN_CREDENTIALS";
/// File name of the controller's declaration-signing key (Ed25519 seed, hex, 0600).
pub const SIGNING_KEY_FILE: &str = "controller-signing.key";
/// File name of the first admin API token (0600), written once by `bundle/up`.
pub const ADMIN_TOKEN_FILE: &str = "admin-token";

#[derive(Debug, thiserror::Error)]
pub enum CredentialsError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not valid: {source}")]
    Parse {
        path: PathBuf,
        source: toml::de::Error,
    },
    #[error("cannot encode credentials: {0}")]
    Encode(#[from] toml::ser::Error),
}

/// What the controller needs: its broker URL (vhost included), one database URL
/// per context (each as that context's own role), the file of its declaration
/// signing key, the hash of the first admin token, and the management API
/// account the identity context creates and deletes node users with.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ControllerCredentials {
    pub broker_url: String,
    /// Path of the controller's Ed25519 signing key (hex seed, mode 0600).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signing_key_file: Option<String>,
    /// SHA-256 (hex) of the first admin API token; the controller creates the
    /// operator `bootstrap-admin` with it at start if no token has that hash.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap_admin_token_sha256: Option<String>,
    /// The management API account node users are created with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub broker_management: Option<BrokerManagement>,
    pub databases: BTreeMap<String, String>,
}

/// A RabbitMQ management API account (administrator tag, no vhost permissions).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BrokerManagement {
    /// Base URL of the management API, e.g. `http://127.0.0.1:15672`.
    pub url: String,
    pub user: String,
    pub password: String,
}

/// What the bundle and the tests use to create and drop databases, roles, vhosts and
/// users. Never given to the controller.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminCredentials {
    /// A role with CREATEDB CREATEROLE, on the `postgres` database.
    pub postgres_url: String,
    /// Base URL of the RabbitMQ management HTTP API.
    pub rabbitmq_api: String,
    /// A RabbitMQ user with the administrator tag.
    pub rabbitmq_user: String,
    pub rabbitmq_password: String,
    /// AMQP URL of the admin user, without a vhost part.
    pub amqp_url: String,
}

impl AdminCredentials {
    /// This machine's defaults when no admin credentials file exists: the local
    /// `postgres` superuser over TCP and RabbitMQ's `guest` user (loopback only).
    pub fn local_defaults() -> AdminCredentials {
        AdminCredentials {
            postgres_url: "postgres://postgres@127.0.0.1:5432/postgres".into(),
            rabbitmq_api: "http://127.0.0.1:15672".into(),
            rabbitmq_user: "guest".into(),
            rabbitmq_password: "guest".into(),
            amqp_url: "amqp://guest:guest@127.0.0.1:5672".into(),
        }
    }

    /// The admin credentials file: `$MESH_ADMIN_CREDENTIALS`, else
    /// `$MESH_ETC/admin-credentials.toml`, else `/etc/mesh/admin-credentials.toml`.
    pub fn default_path() -> PathBuf {
        match std::env::var_os(ADMIN_ENV) {
            Some(p) if !p.is_empty() => PathBuf::from(p),
            _ => etc_dir().join(ADMIN_FILE),
        }
    }

    /// Reads [`AdminCredentials::default_path`]; falls back to
    /// [`AdminCredentials::local_defaults`] when that file does not exist.
    pub fn load_or_local_defaults() -> Result<AdminCredentials, CredentialsError> {
        let path = Self::default_path();
        match read_toml(&path)? {
            Some(c) => Ok(c),
            None => Ok(Self::local_defaults()),
        }
    }
}

/// The directory of the credential files: `$MESH_ETC` or `/etc/mesh`.
pub fn etc_dir() -> PathBuf {
    match std::env::var_os("MESH_ETC") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => PathBuf::from(DEFAULT_ETC),
    }
}

/// Reads a TOML file; `Ok(None)` when it does not exist.
pub fn read_toml<T: serde::de::DeserializeOwned>(
    path: &Path,
) -> Result<Option<T>, CredentialsError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(CredentialsError::Read {
                path: path.into(),
                source,
            });
        }
    };
    toml::from_str(&text)
        .map(Some)
        .map_err(|source| CredentialsError::Parse {
            path: path.into(),
            source,
        })
}

/// Encodes `value` as TOML.
pub fn to_toml<T: Serialize>(value: &T) -> Result<String, CredentialsError> {
    Ok(toml::to_string(value)?)
}

/// Writes `contents` to `path` atomically with mode 0600 (temp file in the same
/// directory, fsync, rename), creating the directory with mode 0700 if missing.
/// Returns `false` without writing when the file already holds exactly `contents`
/// (and has mode 0600).
pub fn write_secret_file(path: &Path, contents: &str) -> Result<bool, CredentialsError> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
    let werr = |p: &Path, source| CredentialsError::Write {
        path: p.into(),
        source,
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if !dir.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(|e| werr(&dir, e))?;
    }
    if let Ok(existing) = std::fs::read_to_string(path) {
        let mode = std::fs::metadata(path)
            .map(|m| m.permissions().mode() & 0o777)
            .unwrap_or(0);
        if existing == contents && mode == 0o600 {
            return Ok(false);
        }
    }
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "credentials".into());
    let tmp = dir.join(format!(
        ".{file_name}.{}.tmp",
        hex::encode(rand::random::<[u8; 4]>())
    ));
    let result = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(contents.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        if let Ok(d) = std::fs::File::open(&dir) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(werr(path, e));
    }
    Ok(true)
}

/// The password inside a `scheme://user:password@host/...` URL, percent-decoded.
pub fn password_of(url: &str) -> Option<String> {
    let u = url::Url::parse(url).ok()?;
    let p = u.password()?;
    urlencoding::decode(p).ok().map(|s| s.into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controller_toml_shape() {
        let mut databases = BTreeMap::new();
        databases.insert(
            "inventory".to_string(),
            "postgres://mesh_inventory:pw@127.0.0.1:5432/mesh".to_string(),
        );
        let mut c = ControllerCredentials {
            broker_url: "amqp://mesh-controller:pw@127.0.0.1:5672/mesh".into(),
            signing_key_file: None,
            bootstrap_admin_token_sha256: None,
            broker_management: None,
            databases,
        };
        let text = to_toml(&c).unwrap();
        assert!(
            text.starts_with("broker_url = \"amqp://mesh-controller:pw@127.0.0.1:5672/mesh\"\n")
        );
        assert!(text.contains(
            "[databases]\ninventory = \"postgres://mesh_inventory:pw@127.0.0.1:5432/mesh\"\n"
        ));
        let back: ControllerCredentials = toml::from_str(&text).unwrap();
        assert_eq!(back, c);
        assert_eq!(password_of(&c.broker_url).as_deref(), Some("pw"));
        c.signing_key_file = Some("/etc/mesh/controller-signing.key".into());
        c.broker_management = Some(BrokerManagement {
            url: "http://127.0.0.1:15672".into(),
            user: "mesh_identity".into(),
            password: "pw2".into(),
        });
        let text = to_toml(&c).unwrap();
        assert!(text.contains("[broker_management]"), "{text}");
        let back: ControllerCredentials = toml::from_str(&text).unwrap();
        assert_eq!(back, c);
    }

    #[test]
    fn secret_file_is_0600_and_idempotent() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/x.toml");
        assert!(write_secret_file(&path, "a = 1\n").unwrap());
        assert!(!write_secret_file(&path, "a = 1\n").unwrap());
        assert!(write_secret_file(&path, "a = 2\n").unwrap());
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let dmode = std::fs::metadata(path.parent().unwrap())
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(dmode, 0o700);
    }
}
