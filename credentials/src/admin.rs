//! `admin-credentials.toml`: what creates and drops databases, roles, vhosts and
//! broker users. Never given to the controller.

use std::path::{Path, PathBuf};

use mesh_protocol::Secret;
use serde::{Deserialize, Serialize};

use crate::CredentialsError;
use crate::file::{check_url, expose, from_toml, read_required, read_text, to_toml};

/// `admin-credentials.toml` (mode 0600), written by `mesh-bundle up`, read by
/// `mesh-bundle node-add` and by the test kit (which provisions each test's
/// environment with it).
///
/// ```toml
/// postgres_url = "postgres://mesh_admin:…@127.0.0.1:5432/postgres"
/// rabbitmq_api = "http://127.0.0.1:15672"
/// rabbitmq_user = "mesh-admin"
/// rabbitmq_password = "…"
/// amqp_url = "amqp://mesh-admin:…@127.0.0.1:5672"
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminCredentials {
    /// A role with CREATEDB CREATEROLE, on the `postgres` database.
    #[serde(serialize_with = "expose")]
    pub postgres_url: Secret<String>,
    /// Base URL of the RabbitMQ management HTTP API.
    pub rabbitmq_api: String,
    /// A RabbitMQ user with the administrator tag.
    pub rabbitmq_user: String,
    #[serde(serialize_with = "expose")]
    pub rabbitmq_password: Secret<String>,
    /// AMQP URL of the admin user, without a vhost part.
    #[serde(serialize_with = "expose")]
    pub amqp_url: Secret<String>,
}

impl AdminCredentials {
    /// The file's name inside the etc directory ([`crate::etc_dir`]).
    pub const FILE: &str = "admin-credentials.toml";
    /// Environment variable naming the file (tests, `bundle/test`).
    pub const ENV: &str = "MESH_ADMIN_CREDENTIALS";

    /// `$MESH_ADMIN_CREDENTIALS`, else `<etc_dir>/admin-credentials.toml`.
    pub fn default_path() -> PathBuf {
        match std::env::var_os(Self::ENV) {
            Some(p) if !p.is_empty() => PathBuf::from(p),
            _ => crate::etc_dir().join(Self::FILE),
        }
    }

    /// Reads and checks the file at `path`; a missing file is an error.
    pub fn load(path: &Path) -> Result<AdminCredentials, CredentialsError> {
        Self::parse(&read_required(path)?, path)
    }

    /// Like [`AdminCredentials::load`]; `Ok(None)` when the file does not exist.
    pub fn load_if_exists(path: &Path) -> Result<Option<AdminCredentials>, CredentialsError> {
        read_text(path)?
            .map(|text| Self::parse(&text, path))
            .transpose()
    }

    /// Decodes and checks the file's text; `path` names the file in errors.
    pub fn parse(text: &str, path: &Path) -> Result<AdminCredentials, CredentialsError> {
        let c: AdminCredentials = from_toml(text, path)?;
        check_url(
            path,
            "postgres_url",
            c.postgres_url.expose(),
            &["postgres", "postgresql"],
        )?;
        check_url(path, "rabbitmq_api", &c.rabbitmq_api, &["http", "https"])?;
        check_url(path, "amqp_url", c.amqp_url.expose(), &["amqp", "amqps"])?;
        if c.rabbitmq_user.is_empty() {
            return Err(CredentialsError::invalid(path, "rabbitmq_user", "is empty"));
        }
        Ok(c)
    }

    /// Writes the file atomically with mode 0600 (see [`crate::write_secret_file`]);
    /// `false` when it already held exactly this. Refuses what it could not read back.
    pub fn write(&self, path: &Path) -> Result<bool, CredentialsError> {
        let text = to_toml(self, path)?;
        Self::parse(&text, path)?;
        crate::write_secret_file(path, &text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> AdminCredentials {
        AdminCredentials {
            postgres_url: Secret::new(
                "postgres://mesh_admin:s3cret@127.0.0.1:5432/postgres".into(),
            ),
            rabbitmq_api: "http://127.0.0.1:15672".into(),
            rabbitmq_user: "mesh-admin".into(),
            rabbitmq_password: Secret::new("s3cret".into()),
            amqp_url: Secret::new("amqp://mesh-admin:s3cret@127.0.0.1:5672".into()),
        }
    }

    #[test]
    fn round_trip_and_secrets_never_print() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(AdminCredentials::FILE);
        let a = sample();
        assert!(a.write(&path).unwrap());
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains("rabbitmq_password = \"s3cret\"\n"), "{text}");
        assert_eq!(AdminCredentials::load(&path).unwrap(), a);
        assert!(!format!("{a:?}").contains("s3cret"));
        assert_eq!(
            AdminCredentials::load_if_exists(&dir.path().join("absent.toml")).unwrap(),
            None
        );
        let err = AdminCredentials::load(&dir.path().join("absent.toml")).unwrap_err();
        assert!(err.to_string().contains("absent.toml"), "{err}");
    }

    #[test]
    fn errors_name_the_field() {
        let path = Path::new("/etc/mesh/admin-credentials.toml");
        let good = "postgres_url = \"postgres://a:s3cret@h/postgres\"\nrabbitmq_api = \"http://h:15672\"\nrabbitmq_user = \"a\"\nrabbitmq_password = \"s3cret\"\namqp_url = \"amqp://a:s3cret@h\"\n";
        assert!(AdminCredentials::parse(good, path).is_ok());
        for (text, field) in [
            (good.replace("amqp://", "http://"), "`amqp_url`"),
            (good.replace("postgres://", "mysql://"), "`postgres_url`"),
            (
                good.replace("rabbitmq_user = \"a\"\n", ""),
                "`rabbitmq_user`",
            ),
            (
                good.replace("rabbitmq_password = \"s3cret\"", "rabbitmq_password = 5"),
                "`rabbitmq_password`",
            ),
        ] {
            let err = AdminCredentials::parse(&text, path)
                .unwrap_err()
                .to_string();
            assert!(err.contains(field), "`{err}` lacks {field}");
            assert!(err.contains("admin-credentials.toml"), "{err}");
            assert!(!err.contains("s3cret"), "{err}");
        }
    }
}
