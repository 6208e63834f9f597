//! `<state_dir>/credentials.toml`: who this node is and how it reaches the broker.
//! Written at enrolment (`mesh-agent join`, or `mesh-bundle node-add`), mode
//! 0600; read once at start. Fields: `node`, `broker_url`, `controller_key`.

use std::path::{Path, PathBuf};

use lapin::uri::AMQPUri;
pub use mesh_protocol::{NodeId, PublicKey, Secret, redact_url};
use serde::Deserialize;

/// The file name inside the state directory.
pub const CREDENTIALS_FILE: &str = "credentials.toml";

/// Why the credentials could not be used. Names the file and the field.
#[derive(Debug, thiserror::Error)]
pub enum CredentialsError {
    #[error("cannot read credentials file {path}: {error}")]
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("credentials file {path}: {message}")]
    Malformed { path: PathBuf, message: String },
    #[error("credentials file {path}: field `{field}`: {reason}")]
    Invalid {
        path: PathBuf,
        field: &'static str,
        reason: String,
    },
}

/// The node's identity and broker URL.
#[derive(Debug, Clone)]
pub struct Credentials {
    /// This node's id, which is also its broker user.
    pub node: NodeId,
    /// `amqp://<node>:<password>@host:port/<vhost>`; the password makes the whole
    /// URL a secret. Log [`Credentials::redacted_url`] instead.
    pub broker_url: Secret<String>,
    /// The controller's declaration-signing public key, received at enrolment:
    /// a declaration whose signature does not verify against it is not applied.
    pub controller_key: PublicKey,
}

#[derive(Deserialize)]
struct RawCredentials {
    node: Option<String>,
    broker_url: Option<String>,
    controller_key: Option<String>,
}

impl Credentials {
    /// Read `<state_dir>/credentials.toml`.
    pub fn load(state_dir: &Path) -> Result<Credentials, CredentialsError> {
        let path = state_dir.join(CREDENTIALS_FILE);
        let text = std::fs::read_to_string(&path).map_err(|error| CredentialsError::Read {
            path: path.clone(),
            error,
        })?;
        Credentials::parse(&text, &path)
    }

    /// Parse the file's text; `path` is only used in error messages. Errors never
    /// contain the password: the URL is not echoed back.
    pub fn parse(text: &str, path: &Path) -> Result<Credentials, CredentialsError> {
        let raw: RawCredentials =
            toml::from_str(text).map_err(|e| CredentialsError::Malformed {
                path: path.to_owned(),
                // toml's message quotes the offending line, which may hold the password.
                message: e.message().to_owned(),
            })?;
        let invalid = |field, reason: String| CredentialsError::Invalid {
            path: path.to_owned(),
            field,
            reason,
        };
        let node = raw.node.ok_or_else(|| invalid("node", "missing".into()))?;
        let node = NodeId::parse(&node).map_err(|e| invalid("node", e.to_string()))?;
        let url = raw
            .broker_url
            .ok_or_else(|| invalid("broker_url", "missing".into()))?;
        let uri: AMQPUri = url
            .parse()
            .map_err(|_| invalid("broker_url", "not an amqp:// or amqps:// URL".into()))?;
        if uri.authority.userinfo.username != node.as_str() {
            return Err(invalid(
                "broker_url",
                format!(
                    "its user must be the node id `{node}` (the broker checks the user_id of every report against it)"
                ),
            ));
        }
        let key = raw.controller_key.ok_or_else(|| {
            invalid(
                "controller_key",
                "missing (enrol with `mesh-agent join`, or `mesh-bundle node-add` again)".into(),
            )
        })?;
        let controller_key =
            PublicKey::from_hex(&key).map_err(|e| invalid("controller_key", e.to_string()))?;
        Ok(Credentials {
            node,
            broker_url: Secret::new(url),
            controller_key,
        })
    }

    /// The broker URL with the password replaced by `[redacted]`, for logs.
    pub fn redacted_url(&self) -> String {
        redact_url(self.broker_url.expose())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A valid public key.
    fn key() -> String {
        mesh_protocol::DeclarationSigner::from_seed([1; 32]).public_key_hex()
    }

    #[test]
    fn key_is_required() {
        let err = parse("node = \"node-a\"\nbroker_url = \"amqp://node-a:pw@h/v\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("controller_key"), "{err}");
    }

    fn parse(text: &str) -> Result<Credentials, CredentialsError> {
        Credentials::parse(text, Path::new("/s/credentials.toml"))
    }

    #[test]
    fn good_file() {
        let c =
            parse(&format!("node = \"node-a\"\nbroker_url = \"amqp://node-a:s3cret@127.0.0.1:5672/mesh\"\ncontroller_key = \"{}\"\n", key()))
                .unwrap();
        assert_eq!(c.node.as_str(), "node-a");
        assert_eq!(
            c.redacted_url(),
            "amqp://node-a:[redacted]@127.0.0.1:5672/mesh"
        );
        let debug = format!("{c:?}");
        assert!(!debug.contains("s3cret"), "{debug}");
        assert!(debug.contains("[redacted]"));
    }

    #[test]
    fn errors_name_file_and_field() {
        for (text, field) in [
            ("broker_url = \"amqp://a:b@h/v\"", "`node`"),
            ("node = \"node-a\"", "`broker_url`"),
            (
                "node = \"Node_A\"\nbroker_url = \"amqp://a:b@h/v\"",
                "`node`",
            ),
            (
                "node = \"node-a\"\nbroker_url = \"http://x\"",
                "`broker_url`",
            ),
            (
                "node = \"node-a\"\nbroker_url = \"amqp://node-b:pw@h/v\"",
                "`broker_url`",
            ),
            ("node = ", "credentials.toml"),
        ] {
            let err = parse(text).unwrap_err().to_string();
            assert!(err.contains(field), "{text:?}: `{err}` lacks {field}");
            assert!(err.contains("/s/credentials.toml"), "{err}");
            assert!(!err.contains("pw@"), "{err}");
        }
    }

    #[test]
    fn malformed_file_does_not_echo_password() {
        let err = parse("node = \"node-a\"\nbroker_url = \"amqp://node-a:hunter2@h/v\" junk")
            .unwrap_err()
            .to_string();
        assert!(!err.contains("hunter2"), "{err}");
    }

    #[test]
    fn redaction() {
        assert_eq!(
            redact_url("amqp://u:p@h:1/v?x=1"),
            "amqp://u:[redacted]@h:1/v?x=1"
        );
        assert_eq!(redact_url("amqp://h:1/v"), "amqp://h:1/v");
        assert_eq!(redact_url("amqp://u@h"), "amqp://u:[redacted]@h");
        assert_eq!(redact_url("junk"), "[unparseable url]");
    }
}
