//! The credential files of a mesh, each defined once: its struct, its format,
//! how it is read (errors name the file and the field, never a secret) and how
//! it is written (atomically, mode 0600). A file's writer and its reader use the
//! same definition, so they cannot drift apart.
//!
//! | file | definition | written by | read by |
//! |---|---|---|---|
//! | `/etc/mesh/admin-credentials.toml` | [`AdminCredentials`] | `mesh-bundle up` | `mesh-bundle node-add`, the test kit |
//! | `/etc/mesh/controller-credentials.toml` | [`ControllerCredentials`] | `mesh-bundle up`, the test kit | the controller; `mesh-bundle up` (keeps its passwords) |
//! | `/etc/mesh/controller-signing.key` | [`key`] | `mesh-bundle up`, the test kit | the controller, `mesh-bundle node-add` |
//! | `/etc/mesh/admin-token` | [`key::read_token`], [`key::write_token`] | `mesh-bundle up` | `mesh-bundle up`; the operator (`cat`) |
//! | `<state>/credentials.toml` | [`AgentCredentials`] | `mesh-agent join`, `mesh-bundle node-add`, the test kit | `mesh-agent run`, the e2e harness |
//! | `<state>/node.key` | [`key`] | `mesh-agent join` | (tests) |
//! | `/etc/mesh/ca.pem`, `/etc/mesh/ca.key` | the mesh CA (`pki`) | `mesh-bundle up` (once) | the controller (the key: only it); the CA certificate also goes to every node at its join |
//! | `/etc/mesh/secrets-master.toml` | [`MasterKeys`] | `mesh-bundle up`, the test kit; the controller when it rotates the master key | the controller (config's secrets) |
//!
//! Secrets are [`Secret`]s: their `Debug` and `Display` print `[redacted]`, and
//! they are exposed only where they are written to their file or handed to the
//! library that needs them.
//!
//! The host agent depends on this crate, so it depends on nothing but
//! `mesh-protocol`, serde, toml and URL parsing: no database driver, no broker
//! client, no runtime (docs/decisions/0022-credential-files-in-their-own-crate.md).

mod admin;
pub mod advertise;
mod agent;
mod controller;
pub mod crypt;
mod file;
pub mod key;
mod master;
pub mod pki;

use std::path::PathBuf;

pub use admin::AdminCredentials;
pub use agent::AgentCredentials;
pub use controller::{BrokerManagement, ControllerCredentials};
pub use file::{password_of, write_secret_file};
pub use master::{MASTER_KEYS_FILE, MasterKey, MasterKeys};
pub use mesh_protocol::Secret;

/// Default directory of the controller host's credential files.
pub const DEFAULT_ETC: &str = "/etc/mesh";
/// Environment variable overriding [`DEFAULT_ETC`].
pub const ETC_ENV: &str = "MESH_ETC";

/// The directory of the controller host's credential files: `$MESH_ETC`, else
/// `/etc/mesh`.
pub fn etc_dir() -> PathBuf {
    match std::env::var_os(ETC_ENV) {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => PathBuf::from(DEFAULT_ETC),
    }
}

/// Why a credential file could not be read or written. Names the file, and the
/// field where one is at fault; never contains a secret.
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
    /// Not the file's format (not TOML, a missing or unknown field, a value of
    /// the wrong type). The message is the parser's, with quoted values removed.
    #[error("{path}: {message}")]
    Malformed { path: PathBuf, message: String },
    /// A field is present but its value is not usable.
    #[error("{path}: field `{field}`: {reason}")]
    Invalid {
        path: PathBuf,
        field: String,
        reason: String,
    },
}

impl CredentialsError {
    pub(crate) fn invalid(
        path: &std::path::Path,
        field: impl Into<String>,
        reason: impl Into<String>,
    ) -> CredentialsError {
        CredentialsError::Invalid {
            path: path.to_owned(),
            field: field.into(),
            reason: reason.into(),
        }
    }

    /// The file at fault.
    pub fn path(&self) -> &std::path::Path {
        match self {
            CredentialsError::Read { path, .. }
            | CredentialsError::Write { path, .. }
            | CredentialsError::Malformed { path, .. }
            | CredentialsError::Invalid { path, .. } => path,
        }
    }
}
