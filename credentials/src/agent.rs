//! `<state_dir>/credentials.toml`: who this node is and how it reaches the broker.

use std::path::{Path, PathBuf};

use mesh_protocol::{NodeId, PublicKey, Secret, redact_url};
use serde::{Deserialize, Serialize};

use crate::CredentialsError;
use crate::file::{check_url, from_toml, read_required, read_text, to_toml};

/// The agent's `<state_dir>/credentials.toml` (mode 0600): its node id, its
/// broker URL (the node's own broker user and password), the controller's
/// declaration-signing public key, and — for a node joined over the network —
/// the mesh CA's certificate it pinned at its join and the API's URL. Written at
/// enrolment (`mesh-agent join`, or `mesh-bundle node-add`, or the test kit),
/// read once when the agent starts.
///
/// ```toml
/// node = "node-a"
/// broker_url = "amqps://node-a:…@192.0.2.2:5671/mesh"
/// controller_key = "…64 hex digits…"
/// api_url = "https://192.0.2.2:7443"
/// ca_certificate = """
/// -----BEGIN CERTIFICATE-----
/// …
/// """
/// ```
///
/// An `amqps://` broker URL needs `ca_certificate`: the agent verifies the
/// broker against it and nothing else (no system roots). A plain `amqp://` URL
/// must name a loopback host (the local mesh, tests): the broker's plain
/// listener is on loopback only.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentCredentials {
    /// This node's id, which is also its broker user.
    pub node: NodeId,
    /// `amqp://<node>:<password>@host:port/<vhost>`; the password makes the whole
    /// URL a secret. Log [`AgentCredentials::redacted_url`] instead.
    pub broker_url: Secret<String>,
    /// The controller's declaration-signing public key, received at enrolment:
    /// a declaration whose signature does not verify against it is not applied.
    pub controller_key: PublicKey,
    /// The mesh CA's certificate (PEM), pinned at the join (its public key's
    /// hash was in the join command): the only trust anchor the agent verifies
    /// the broker and the API with. `None` for a loopback-only node.
    pub ca_certificate: Option<String>,
    /// The API's URL (`https://…`) the node was handed at its join.
    pub api_url: Option<String>,
}

/// The file as TOML has it; every field optional so that a missing one is named
/// with a hint rather than serde's bare "missing field". Unknown fields are
/// ignored: the file may be written by a newer `mesh-bundle node-add` than the
/// agent that reads it.
#[derive(Deserialize)]
struct RawFile {
    node: Option<String>,
    broker_url: Option<String>,
    controller_key: Option<String>,
    api_url: Option<String>,
    ca_certificate: Option<String>,
}

#[derive(Serialize)]
struct FileRef<'a> {
    node: &'a str,
    broker_url: &'a str,
    controller_key: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    api_url: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ca_certificate: Option<&'a str>,
}

impl AgentCredentials {
    /// The file's name inside the agent's state directory.
    pub const FILE: &str = "credentials.toml";

    /// `<state_dir>/credentials.toml`.
    pub fn path_in(state_dir: &Path) -> PathBuf {
        state_dir.join(Self::FILE)
    }

    /// Reads and checks `<state_dir>/credentials.toml`; a missing file is an error.
    pub fn load(state_dir: &Path) -> Result<AgentCredentials, CredentialsError> {
        let path = Self::path_in(state_dir);
        Self::parse(&read_required(&path)?, &path)
    }

    /// Like [`AgentCredentials::load`]; `Ok(None)` when the file does not exist.
    pub fn load_if_exists(state_dir: &Path) -> Result<Option<AgentCredentials>, CredentialsError> {
        let path = Self::path_in(state_dir);
        read_text(&path)?
            .map(|text| Self::parse(&text, &path))
            .transpose()
    }

    /// Decodes and checks the file's text; `path` names the file in errors,
    /// which never contain the password.
    pub fn parse(text: &str, path: &Path) -> Result<AgentCredentials, CredentialsError> {
        let raw: RawFile = from_toml(text, path)?;
        let invalid = |field: &str, reason: String| CredentialsError::invalid(path, field, reason);
        let node = raw.node.ok_or_else(|| invalid("node", "missing".into()))?;
        let node = NodeId::parse(&node).map_err(|e| invalid("node", e.to_string()))?;
        let url = raw
            .broker_url
            .ok_or_else(|| invalid("broker_url", "missing".into()))?;
        let parsed = check_url(path, "broker_url", &url, &["amqp", "amqps"])?;
        if parsed.username() != node.as_str() {
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
        if let Some(pem) = &raw.ca_certificate {
            crate::pki::CertInfo::parse(pem)
                .map_err(|e| invalid("ca_certificate", e.to_string()))?;
        }
        let host = parsed.host_str().unwrap_or_default();
        match parsed.scheme() {
            "amqps" if raw.ca_certificate.is_none() => {
                return Err(invalid(
                    "broker_url",
                    "an amqps:// broker needs `ca_certificate` (the mesh CA the broker is verified against; join again)".into(),
                ));
            }
            "amqp" if !crate::advertise::is_loopback_host(host) => {
                return Err(invalid(
                    "broker_url",
                    format!(
                        "plain amqp:// is for loopback only, not `{host}`: use the amqps:// endpoint the join hands out"
                    ),
                ));
            }
            _ => {}
        }
        if let Some(api) = &raw.api_url {
            crate::advertise::check_api_url(api).map_err(|reason| invalid("api_url", reason))?;
        }
        Ok(AgentCredentials {
            node,
            broker_url: Secret::new(url),
            controller_key,
            ca_certificate: raw.ca_certificate,
            api_url: raw.api_url,
        })
    }

    /// Writes `<state_dir>/credentials.toml` atomically with mode 0600 (see
    /// [`crate::write_secret_file`]); `false` when it already held exactly this.
    /// Refuses what the agent could not read back (a broker user that is not the
    /// node, a URL that is not AMQP).
    pub fn write(&self, state_dir: &Path) -> Result<bool, CredentialsError> {
        let path = Self::path_in(state_dir);
        let key = self.controller_key.to_hex();
        let text = to_toml(
            &FileRef {
                node: self.node.as_str(),
                broker_url: self.broker_url.expose(),
                controller_key: &key,
                api_url: self.api_url.as_deref(),
                ca_certificate: self.ca_certificate.as_deref(),
            },
            &path,
        )?;
        Self::parse(&text, &path)?;
        crate::write_secret_file(&path, &text)
    }

    /// The broker password (percent-decoded).
    pub fn password(&self) -> Option<Secret<String>> {
        crate::password_of(self.broker_url.expose()).map(Secret::new)
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

    fn parse(text: &str) -> Result<AgentCredentials, CredentialsError> {
        AgentCredentials::parse(text, Path::new("/s/credentials.toml"))
    }

    #[test]
    fn key_is_required() {
        let err = parse("node = \"node-a\"\nbroker_url = \"amqp://node-a:pw@h/v\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("controller_key"), "{err}");
    }

    #[test]
    fn good_file() {
        let c = parse(&format!(
            "node = \"node-a\"\nbroker_url = \"amqp://node-a:s3cret@127.0.0.1:5672/mesh\"\ncontroller_key = \"{}\"\n",
            key()
        ))
        .unwrap();
        assert_eq!(c.node.as_str(), "node-a");
        assert_eq!(
            c.redacted_url(),
            "amqp://node-a:[redacted]@127.0.0.1:5672/mesh"
        );
        assert_eq!(c.password().unwrap().expose(), "s3cret");
        let debug = format!("{c:?}");
        assert!(!debug.contains("s3cret"), "{debug}");
        assert!(debug.contains("[redacted]"));
    }

    #[test]
    fn written_by_the_writer_read_by_the_reader() {
        let dir = tempfile::tempdir().unwrap();
        let c = AgentCredentials {
            node: NodeId::parse("node-a").unwrap(),
            broker_url: Secret::new("amqp://node-a:s3cret@127.0.0.1:5672/mesh".into()),
            controller_key: PublicKey::from_hex(&key()).unwrap(),
            ca_certificate: None,
            api_url: None,
        };
        assert!(c.write(dir.path()).unwrap());
        assert!(!c.write(dir.path()).unwrap());
        assert_eq!(AgentCredentials::load(dir.path()).unwrap(), c);
        assert_eq!(
            std::fs::read_to_string(dir.path().join("credentials.toml")).unwrap(),
            format!(
                "node = \"node-a\"\nbroker_url = \"amqp://node-a:s3cret@127.0.0.1:5672/mesh\"\ncontroller_key = \"{}\"\n",
                key()
            )
        );
        // The writer refuses what the reader would refuse, and writes nothing.
        let other = tempfile::tempdir().unwrap();
        let bad = AgentCredentials {
            broker_url: Secret::new("amqp://node-b:s3cret@127.0.0.1:5672/mesh".into()),
            ..c
        };
        let err = bad.write(other.path()).unwrap_err().to_string();
        assert!(err.contains("`broker_url`"), "{err}");
        assert!(!other.path().join("credentials.toml").exists());
        assert_eq!(
            AgentCredentials::load_if_exists(other.path()).unwrap(),
            None
        );
    }

    #[test]
    fn amqps_needs_the_ca_and_plain_amqp_needs_loopback() {
        let ca = crate::pki::MeshCa::generate("test mesh CA").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let c = AgentCredentials {
            node: NodeId::parse("node-a").unwrap(),
            broker_url: Secret::new("amqps://node-a:s3cret@192.0.2.2:5671/mesh".into()),
            controller_key: PublicKey::from_hex(&key()).unwrap(),
            ca_certificate: Some(ca.certificate_pem().to_owned()),
            api_url: Some("https://192.0.2.2:7443".into()),
        };
        assert!(c.write(dir.path()).unwrap());
        assert_eq!(AgentCredentials::load(dir.path()).unwrap(), c);

        let no_ca = AgentCredentials {
            ca_certificate: None,
            ..c.clone()
        };
        let err = no_ca.write(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains("`broker_url`") && err.contains("ca_certificate"),
            "{err}"
        );
        let plain_remote = AgentCredentials {
            broker_url: Secret::new("amqp://node-a:s3cret@192.0.2.2:5672/mesh".into()),
            ..c.clone()
        };
        let err = plain_remote.write(dir.path()).unwrap_err().to_string();
        assert!(err.contains("loopback") && !err.contains("s3cret"), "{err}");
        let bad_ca = AgentCredentials {
            ca_certificate: Some("-----BEGIN CERTIFICATE-----\nxx\n".into()),
            ..c.clone()
        };
        let err = bad_ca.write(dir.path()).unwrap_err().to_string();
        assert!(err.contains("`ca_certificate`"), "{err}");
        let plain_api = AgentCredentials {
            api_url: Some("http://192.0.2.2:7700".into()),
            ..c
        };
        let err = plain_api.write(dir.path()).unwrap_err().to_string();
        assert!(err.contains("`api_url`"), "{err}");
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
        let err = parse("node = \"node-a\"\nbroker_url = [\"amqp://node-a:hunter2@h/v\"]")
            .unwrap_err()
            .to_string();
        assert!(!err.contains("hunter2"), "{err}");
        assert!(err.contains("broker_url"), "{err}");
    }
}
