//! `<state_dir>/credentials.toml`: who this node is and how it reaches the broker.
//! Written at enrolment (`mesh-agent join`, or `mesh-bundle node-add`), mode
//! 0600; read once at start. Its one definition — fields `node`, `broker_url`,
//! `controller_key`, the checks, the errors naming the file and the field — is
//! [`mesh_credentials::AgentCredentials`], which its writers use too.

pub use mesh_credentials::{AgentCredentials as Credentials, CredentialsError};
pub use mesh_protocol::{NodeId, PublicKey, Secret, redact_url};

/// The file name inside the state directory.
pub const CREDENTIALS_FILE: &str = Credentials::FILE;

pub use mesh_credentials::key::SEAL_KEY_FILE;
use mesh_protocol::sealing::SealSecretKey;

/// The node's seal key (`<state_dir>/seal.key`), made (fresh, mode 0600) when
/// it is missing: a node enrolled before sealed secrets, or by `mesh-bundle
/// node-add` or the test kit, has none. `true` when it was made now. The
/// private key never leaves the node; its public key is stated in every hello.
pub fn load_or_create_seal_key(
    state_dir: &std::path::Path,
) -> Result<(SealSecretKey, bool), CredentialsError> {
    let path = state_dir.join(SEAL_KEY_FILE);
    if let Some(key) = mesh_credentials::key::read_seal_key_if_exists(&path)? {
        return Ok((key, false));
    }
    let key = SealSecretKey::from_seed(rand::random());
    mesh_credentials::key::write_seal_key(&path, &key)?;
    Ok((key, true))
}
