//! `controller-credentials.toml`: everything the controller connects with.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use mesh_protocol::Secret;
use serde::{Deserialize, Serialize};

use crate::CredentialsError;
use crate::file::{check_url, expose, expose_map, from_toml, read_required, read_text, to_toml};

/// `controller-credentials.toml` (mode 0600), written by `mesh-bundle up` (and
/// the test kit) and read by the controller: its broker URL (vhost included),
/// one database URL per context (each as that context's own role), the file of
/// its declaration-signing key, the hash of the first admin API token, and the
/// management API account the identity context manages node users with.
///
/// ```toml
/// broker_url = "amqp://mesh_controller:…@127.0.0.1:5672/mesh"
/// signing_key_file = "/etc/mesh/controller-signing.key"
/// master_keys_file = "/etc/mesh/secrets-master.toml"
/// bootstrap_admin_token_sha256 = "…64 hex digits…"
/// ca_certificate_file = "/etc/mesh/ca.pem"
/// ca_key_file = "/etc/mesh/ca.key"
/// advertise_api = "https://192.0.2.2:7443"
/// advertise_broker = "192.0.2.2:5671"
///
/// [broker_management]
/// url = "http://127.0.0.1:15672"
/// user = "mesh_identity"
/// password = "…"
///
/// [databases]
/// inventory = "postgres://mesh_inventory:…@127.0.0.1:5432/mesh"
/// # … one per context
/// ```
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ControllerCredentials {
    /// `amqp://<controller user>:<password>@host:port/<vhost>`.
    #[serde(serialize_with = "expose")]
    pub broker_url: Secret<String>,
    /// Path of the controller's Ed25519 signing key (hex seed, mode 0600; see
    /// [`crate::key`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signing_key_file: Option<PathBuf>,
    /// Path of the secrets master keyring ([`crate::MasterKeys`], mode 0600):
    /// it wraps the data key of every secret the config context keeps. Without
    /// it the controller runs, and refuses to store or deliver secrets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub master_keys_file: Option<PathBuf>,
    /// SHA-256 (hex) of the first admin API token; the controller creates the
    /// operator `bootstrap-admin` with it at start if no token has that hash.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap_admin_token_sha256: Option<String>,
    /// The management API account node users are created with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub broker_management: Option<BrokerManagement>,
    /// The mesh CA's certificate (PEM, mode 0644): what every node pins at its
    /// join and verifies the broker and the API against. Written once by
    /// `mesh-bundle up`. Without it (an older file) the controller serves no
    /// HTTPS and hands nodes no CA.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_certificate_file: Option<PathBuf>,
    /// The mesh CA's private key (PEM, mode 0600, owned by root: the
    /// controller's user). Only the controller's process reads it: it issues
    /// the API's certificate from it and signs nodes' certificates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_key_file: Option<PathBuf>,
    /// The API's URL nodes and operators reach from other machines,
    /// `https://<address>:<port>` (bundle/up: this host's primary IPv4, or
    /// `MESH_ADVERTISE`). The controller's own settings may override it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub advertise_api: Option<String>,
    /// The broker's AMQPS endpoint nodes are handed, `<address>:<port>`
    /// (bundle/up: the same address, port 5671). The controller's own settings
    /// may override it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub advertise_broker: Option<String>,
    /// Context name → `postgres://<role>:<password>@host:port/<database>`.
    #[serde(serialize_with = "expose_map")]
    pub databases: BTreeMap<String, Secret<String>>,
    /// Where it was read from (for errors); [`ControllerCredentials::FILE`] when
    /// it was made in memory.
    #[serde(skip)]
    path: PathBuf,
}

/// A RabbitMQ management API account (administrator tag, no vhost permissions).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BrokerManagement {
    /// Base URL of the management API, e.g. `http://127.0.0.1:15672`.
    pub url: String,
    pub user: String,
    #[serde(serialize_with = "expose")]
    pub password: Secret<String>,
}

/// Equal content; where each was read from does not count.
impl PartialEq for ControllerCredentials {
    fn eq(&self, other: &Self) -> bool {
        self.broker_url == other.broker_url
            && self.signing_key_file == other.signing_key_file
            && self.master_keys_file == other.master_keys_file
            && self.bootstrap_admin_token_sha256 == other.bootstrap_admin_token_sha256
            && self.broker_management == other.broker_management
            && self.ca_certificate_file == other.ca_certificate_file
            && self.ca_key_file == other.ca_key_file
            && self.advertise_api == other.advertise_api
            && self.advertise_broker == other.advertise_broker
            && self.databases == other.databases
    }
}

impl Eq for ControllerCredentials {}

impl ControllerCredentials {
    /// The file's name inside the etc directory ([`crate::etc_dir`]).
    pub const FILE: &str = "controller-credentials.toml";

    /// Credentials with the broker URL and the databases; the optional fields
    /// empty.
    pub fn new(
        broker_url: Secret<String>,
        databases: BTreeMap<String, Secret<String>>,
    ) -> ControllerCredentials {
        ControllerCredentials {
            broker_url,
            signing_key_file: None,
            master_keys_file: None,
            bootstrap_admin_token_sha256: None,
            broker_management: None,
            ca_certificate_file: None,
            ca_key_file: None,
            advertise_api: None,
            advertise_broker: None,
            databases,
            path: PathBuf::from(Self::FILE),
        }
    }

    /// Reads and checks the file at `path`; a missing file is an error.
    pub fn load(path: &Path) -> Result<ControllerCredentials, CredentialsError> {
        Self::parse(&read_required(path)?, path)
    }

    /// Like [`ControllerCredentials::load`]; `Ok(None)` when the file does not exist.
    pub fn load_if_exists(path: &Path) -> Result<Option<ControllerCredentials>, CredentialsError> {
        read_text(path)?
            .map(|text| Self::parse(&text, path))
            .transpose()
    }

    /// Decodes and checks the file's text; `path` names the file in errors.
    pub fn parse(text: &str, path: &Path) -> Result<ControllerCredentials, CredentialsError> {
        let mut c: ControllerCredentials = from_toml(text, path)?;
        c.path = path.to_owned();
        c.check()?;
        Ok(c)
    }

    /// Writes the file atomically with mode 0600 (see [`crate::write_secret_file`]);
    /// `false` when it already held exactly this. Refuses what it could not read back.
    pub fn write(&self, path: &Path) -> Result<bool, CredentialsError> {
        let text = to_toml(self, path)?;
        Self::parse(&text, path)?;
        crate::write_secret_file(path, &text)
    }

    /// The file these credentials were read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn check(&self) -> Result<(), CredentialsError> {
        let path = &self.path;
        check_url(
            path,
            "broker_url",
            self.broker_url.expose(),
            &["amqp", "amqps"],
        )?;
        for (context, url) in &self.databases {
            check_url(
                path,
                &format!("databases.{context}"),
                url.expose(),
                &["postgres", "postgresql"],
            )?;
        }
        if let Some(m) = &self.broker_management {
            check_url(path, "broker_management.url", &m.url, &["http", "https"])?;
        }
        if self.ca_certificate_file.is_some() != self.ca_key_file.is_some() {
            return Err(CredentialsError::invalid(
                path,
                if self.ca_key_file.is_some() {
                    "ca_certificate_file"
                } else {
                    "ca_key_file"
                },
                "the CA needs both ca_certificate_file and ca_key_file (run bundle/up again)",
            ));
        }
        if let Some(api) = &self.advertise_api {
            crate::advertise::check_api_url(api)
                .map_err(|reason| CredentialsError::invalid(path, "advertise_api", reason))?;
        }
        if let Some(broker) = &self.advertise_broker {
            mesh_protocol::parse_host_port(broker)
                .map_err(|reason| CredentialsError::invalid(path, "advertise_broker", reason))?;
        }
        if let Some(hash) = &self.bootstrap_admin_token_sha256
            && (hash.len() != 64 || !hash.bytes().all(|b| b.is_ascii_hexdigit()))
        {
            return Err(CredentialsError::invalid(
                path,
                "bootstrap_admin_token_sha256",
                "must be 64 hex digits (a SHA-256)",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> ControllerCredentials {
        let mut databases = BTreeMap::new();
        databases.insert(
            "inventory".to_string(),
            Secret::new("postgres://mesh_inventory:pw@127.0.0.1:5432/mesh".to_string()),
        );
        ControllerCredentials::new(
            Secret::new("amqp://mesh-controller:pw@127.0.0.1:5672/mesh".into()),
            databases,
        )
    }

    #[test]
    fn toml_shape_and_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(ControllerCredentials::FILE);
        let mut c = sample();
        assert!(c.write(&path).unwrap());
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            text.starts_with("broker_url = \"amqp://mesh-controller:pw@127.0.0.1:5672/mesh\"\n"),
            "{text}"
        );
        assert!(text.contains(
            "[databases]\ninventory = \"postgres://mesh_inventory:pw@127.0.0.1:5432/mesh\"\n"
        ));
        let back = ControllerCredentials::load(&path).unwrap();
        assert_eq!(back, c);
        assert_eq!(back.path(), path);

        c.signing_key_file = Some("/etc/mesh/controller-signing.key".into());
        c.bootstrap_admin_token_sha256 = Some("ab".repeat(32));
        c.broker_management = Some(BrokerManagement {
            url: "http://127.0.0.1:15672".into(),
            user: "mesh_identity".into(),
            password: Secret::new("pw2".into()),
        });
        assert!(c.write(&path).unwrap());
        assert!(!c.write(&path).unwrap(), "unchanged: not rewritten");
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains("[broker_management]"), "{text}");
        assert_eq!(ControllerCredentials::load(&path).unwrap(), c);

        // The CA and the advertised endpoints (a file without them still reads:
        // above).
        c.ca_certificate_file = Some("/etc/mesh/ca.pem".into());
        c.ca_key_file = Some("/etc/mesh/ca.key".into());
        c.advertise_api = Some("https://192.0.2.2:7443".into());
        c.advertise_broker = Some("192.0.2.2:5671".into());
        assert!(c.write(&path).unwrap());
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            text.contains("ca_certificate_file = \"/etc/mesh/ca.pem\"\nca_key_file = \"/etc/mesh/ca.key\"\nadvertise_api = \"https://192.0.2.2:7443\"\nadvertise_broker = \"192.0.2.2:5671\"\n"),
            "{text}"
        );
        assert_eq!(ControllerCredentials::load(&path).unwrap(), c);
    }

    #[test]
    fn ca_and_advertise_fields_are_checked() {
        let path = Path::new("/etc/mesh/controller-credentials.toml");
        let base = "broker_url = \"amqp://c:hunter2@h/mesh\"\n";
        let db = "[databases]\ninventory = \"postgres://i:hunter2@h/m\"\n";
        for (extra, field) in [
            (
                "ca_certificate_file = \"/etc/mesh/ca.pem\"\n",
                "`ca_key_file`",
            ),
            (
                "ca_key_file = \"/etc/mesh/ca.key\"\n",
                "`ca_certificate_file`",
            ),
            (
                "advertise_api = \"http://192.0.2.2:7443\"\n",
                "`advertise_api`",
            ),
            (
                "advertise_api = \"https://192.0.2.2:7443/v1\"\n",
                "`advertise_api`",
            ),
            ("advertise_broker = \"192.0.2.2\"\n", "`advertise_broker`"),
            (
                "advertise_broker = \"amqps://192.0.2.2:5671\"\n",
                "`advertise_broker`",
            ),
        ] {
            let err = ControllerCredentials::parse(&format!("{base}{extra}{db}"), path)
                .unwrap_err()
                .to_string();
            assert!(err.contains(field), "{extra:?}: `{err}` lacks {field}");
            assert!(!err.contains("hunter2"), "{err}");
        }
    }

    #[test]
    fn secrets_never_print() {
        let mut c = sample();
        c.broker_management = Some(BrokerManagement {
            url: "http://127.0.0.1:15672".into(),
            user: "mesh_identity".into(),
            password: Secret::new("pw2".into()),
        });
        let debug = format!("{c:?}");
        assert!(!debug.contains("pw"), "{debug}");
    }

    #[test]
    fn errors_name_the_file_and_the_field_and_never_a_secret() {
        let path = Path::new("/etc/mesh/controller-credentials.toml");
        let ok_db = "[databases]\ninventory = \"postgres://i:hunter2@h/m\"\n";
        for (text, names) in [
            (ok_db.to_string(), "`broker_url`"),
            (
                format!("broker_url = \"http://c:hunter2@h/mesh\"\n{ok_db}"),
                "`broker_url`",
            ),
            (
                format!("broker_url = \"amqp://c:hunter2@h/mesh\"\nbogus = 1\n{ok_db}"),
                "`bogus`",
            ),
            (
                "broker_url = \"amqp://c:hunter2@h/mesh\"\n[databases]\nconfig = \"amqp://c:hunter2@h/m\"\n"
                    .to_string(),
                "`databases.config`",
            ),
            (
                format!("broker_url = \"amqp://c:hunter2@h/mesh\"\nbootstrap_admin_token_sha256 = \"x\"\n{ok_db}"),
                "`bootstrap_admin_token_sha256`",
            ),
            (
                "broker_url = \"amqp://c:hunter2@h/mesh\"\ndatabases = \"postgres://i:hunter2@h/m\"\n"
                    .to_string(),
                "`databases`",
            ),
            ("broker_url = \"amqp://c:hunter2@h/mesh\" junk".to_string(), "line 1"),
        ] {
            let err = ControllerCredentials::parse(&text, path)
                .unwrap_err()
                .to_string();
            assert!(err.contains(names), "{text:?}: `{err}` lacks {names}");
            assert!(err.contains("controller-credentials.toml"), "{err}");
            assert!(!err.contains("hunter2"), "{err}");
        }
    }
}
