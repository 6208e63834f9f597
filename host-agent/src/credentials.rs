//! `<state_dir>/credentials.toml`: who this node is and how it reaches the broker.
//! Written at enrolment (`mesh-agent join`, or `mesh-bundle node-add`), mode
//! 0600; read once at start. Its one definition — fields `node`, `broker_url`,
//! `controller_key`, the checks, the errors naming the file and the field — is
//! [`mesh_credentials::AgentCredentials`], which its writers use too.

pub use mesh_credentials::{AgentCredentials as Credentials, CredentialsError};
pub use mesh_protocol::{NodeId, PublicKey, Secret, redact_url};

/// The file name inside the state directory.
pub const CREDENTIALS_FILE: &str = Credentials::FILE;
