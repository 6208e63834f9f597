//! `mesh-agent join`: enrol this node with a join token.
//!
//! Generates the node's Ed25519 key pair and its X25519 seal key (secrets are
//! sealed to it) in the state directory (the private keys, mode 0600, never
//! leave the node), sends the public key with the token to
//! `POST <api>/v1/join`, and writes what comes back — the broker URL with the
//! node's own credentials and the controller's declaration-signing key — to
//! `credentials.toml` (mode 0600). The agent then runs with `mesh-agent run`.
//!
//! This is the agent's only HTTP request, and it happens before the agent runs:
//! once running, the agent never asks (it states and is told).

use std::path::{Path, PathBuf};

use mesh_credentials::AgentCredentials;
pub use mesh_credentials::key::NODE_KEY_FILE;
use mesh_protocol::{DeclarationSigner, NodeId, PublicKey, Secret};
use serde::Deserialize;

#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    #[error("state directory {path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error(transparent)]
    Credentials(#[from] mesh_credentials::CredentialsError),
    #[error("cannot reach the API at {api}: {message}")]
    Http { api: String, message: String },
    /// The API refused the join (problem+json detail; never the token).
    #[error("the join was refused ({status}): {detail}")]
    Refused { status: u16, detail: String },
    #[error("the API's answer is not usable: {0}")]
    BadAnswer(String),
}

#[derive(Deserialize)]
struct Answer {
    node: String,
    broker_url: Secret<String>,
    controller_key: String,
}

/// What a successful join wrote.
#[derive(Debug)]
pub struct Joined {
    pub node: NodeId,
    pub credentials: PathBuf,
    pub public_key: String,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> JoinError + '_ {
    move |error| JoinError::Io {
        path: path.to_owned(),
        error,
    }
}

/// Join as `node` with `token` through the API at `api` (`http://host:port`).
pub async fn join(
    api: &str,
    token: &Secret<String>,
    node: &NodeId,
    state_dir: &Path,
) -> Result<Joined, JoinError> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(state_dir)
        .map_err(io(state_dir))?;
    // A fresh key pair for every join: re-enrolment is under a new key.
    let key = DeclarationSigner::from_seed(rand::random());
    mesh_credentials::key::write_signing_key(&state_dir.join(NODE_KEY_FILE), &key)?;
    let public_key = key.public_key_hex();
    // The key secrets are sealed to, beside it: also fresh, also never sent
    // (its public half goes in every hello).
    let seal_key = mesh_protocol::sealing::SealSecretKey::from_seed(rand::random());
    mesh_credentials::key::write_seal_key(
        &state_dir.join(mesh_credentials::key::SEAL_KEY_FILE),
        &seal_key,
    )?;

    let url = format!("{}/v1/join", api.trim_end_matches('/'));
    let http = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(30))
        .build()
        .map_err(|e| JoinError::Http {
            api: api.to_owned(),
            message: e.without_url().to_string(),
        })?;
    let response = http
        .post(&url)
        .json(&serde_json::json!({
            "token": token.expose(),
            "node": node.as_str(),
            "public_key": public_key,
        }))
        .send()
        .await
        .map_err(|e| JoinError::Http {
            api: api.to_owned(),
            message: e.without_url().to_string(),
        })?;
    let status = response.status();
    let body = response.bytes().await.map_err(|e| JoinError::Http {
        api: api.to_owned(),
        message: e.without_url().to_string(),
    })?;
    if !status.is_success() {
        let detail = serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v.get("detail").and_then(|d| d.as_str()).map(str::to_owned))
            .unwrap_or_else(|| String::from_utf8_lossy(&body).chars().take(300).collect());
        return Err(JoinError::Refused {
            status: status.as_u16(),
            detail,
        });
    }
    let answer: Answer = serde_json::from_slice(&body)
        .map_err(|e| JoinError::BadAnswer(format!("not the expected JSON: {e}")))?;
    if answer.node != node.as_str() {
        return Err(JoinError::BadAnswer(format!(
            "it enrolled `{}`, not `{node}`",
            answer.node
        )));
    }
    let controller_key = PublicKey::from_hex(&answer.controller_key)
        .map_err(|e| JoinError::BadAnswer(format!("controller_key: {e}")))?;
    let creds = AgentCredentials {
        node: node.clone(),
        broker_url: answer.broker_url,
        controller_key,
    };
    // The writer checks it reads back before it replaces anything; what the
    // agent could not read (a broker user that is not the node) is the answer's fault.
    creds.write(state_dir).map_err(|e| match e {
        mesh_credentials::CredentialsError::Invalid { field, reason, .. } => {
            JoinError::BadAnswer(format!("{field}: {reason}"))
        }
        other => JoinError::Credentials(other),
    })?;
    Ok(Joined {
        node: node.clone(),
        credentials: AgentCredentials::path_in(state_dir),
        public_key,
    })
}
