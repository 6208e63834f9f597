//! The key and token files: one secret each, as text, mode 0600.
//!
//! - an Ed25519 key file holds the 32-byte seed as 64 hex digits and a newline:
//!   the controller's declaration-signing key ([`SIGNING_KEY_FILE`], written by
//!   `mesh-bundle up` and the test kit, read by the controller and
//!   `mesh-bundle node-add`) and a node's own key ([`NODE_KEY_FILE`], written
//!   by `mesh-agent join`);
//! - a node's X25519 key that secrets are sealed to ([`SEAL_KEY_FILE`]): its
//!   32-byte seed as 64 hex digits and a newline, written by `mesh-agent join`
//!   (and by `mesh-agent run` when missing), read by `mesh-agent run`;
//! - the first admin API token ([`ADMIN_TOKEN_FILE`]): the token and a newline,
//!   written once by `mesh-bundle up`, read by operators (`cat`).

use std::path::Path;

use mesh_protocol::sealing::SealSecretKey;
use mesh_protocol::{DeclarationSigner, Secret};

use crate::CredentialsError;
use crate::file::{read_required, read_text};

/// The controller's declaration-signing key, inside the etc directory.
pub const SIGNING_KEY_FILE: &str = "controller-signing.key";
/// A node's own key pair's seed, inside the agent's state directory.
pub const NODE_KEY_FILE: &str = "node.key";
/// A node's seal key's seed (secrets are sealed to its public key), inside the
/// agent's state directory.
pub const SEAL_KEY_FILE: &str = "seal.key";
/// The first admin API token, inside the etc directory.
pub const ADMIN_TOKEN_FILE: &str = "admin-token";

/// Reads the Ed25519 key file at `path`; a missing file is an error.
pub fn read_signing_key(path: &Path) -> Result<DeclarationSigner, CredentialsError> {
    parse_key(&read_required(path)?, path)
}

/// Like [`read_signing_key`]; `Ok(None)` when the file does not exist.
pub fn read_signing_key_if_exists(
    path: &Path,
) -> Result<Option<DeclarationSigner>, CredentialsError> {
    read_text(path)?
        .map(|text| parse_key(&text, path))
        .transpose()
}

fn parse_key(text: &str, path: &Path) -> Result<DeclarationSigner, CredentialsError> {
    DeclarationSigner::from_hex(text).map_err(|_| CredentialsError::Malformed {
        path: path.to_owned(),
        message: "not an Ed25519 key seed (64 hex digits)".into(),
    })
}

/// Writes the key file atomically with mode 0600; `false` when it already held
/// exactly this key.
pub fn write_signing_key(path: &Path, key: &DeclarationSigner) -> Result<bool, CredentialsError> {
    crate::write_secret_file(path, &format!("{}\n", key.to_hex()))
}

/// Reads the seal key file at `path`; `Ok(None)` when the file does not exist.
pub fn read_seal_key_if_exists(path: &Path) -> Result<Option<SealSecretKey>, CredentialsError> {
    read_text(path)?
        .map(|text| {
            SealSecretKey::from_hex(&text).map_err(|_| CredentialsError::Malformed {
                path: path.to_owned(),
                message: "not an X25519 key seed (64 hex digits)".into(),
            })
        })
        .transpose()
}

/// Writes the seal key file atomically with mode 0600; `false` when it already
/// held exactly this key.
pub fn write_seal_key(path: &Path, key: &SealSecretKey) -> Result<bool, CredentialsError> {
    crate::write_secret_file(path, &format!("{}\n", key.to_hex()))
}

/// Reads the token file at `path`; `Ok(None)` when it does not exist or is empty.
pub fn read_token(path: &Path) -> Result<Option<Secret<String>>, CredentialsError> {
    Ok(read_text(path)?
        .map(|t| t.trim().to_owned())
        .filter(|t| !t.is_empty())
        .map(Secret::new))
}

/// Writes the token file atomically with mode 0600; `false` when it already held
/// exactly this token.
pub fn write_token(path: &Path, token: &Secret<String>) -> Result<bool, CredentialsError> {
    crate::write_secret_file(path, &format!("{}\n", token.expose()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_tokens_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(SIGNING_KEY_FILE);
        assert!(read_signing_key_if_exists(&path).unwrap().is_none());
        assert!(read_signing_key(&path).is_err());
        let key = DeclarationSigner::from_seed([7; 32]);
        assert!(write_signing_key(&path, &key).unwrap());
        assert!(!write_signing_key(&path, &key).unwrap());
        assert_eq!(
            read_signing_key(&path).unwrap().public_key_hex(),
            key.public_key_hex()
        );
        std::fs::write(&path, "0123 not a key").unwrap();
        let err = read_signing_key(&path).unwrap_err().to_string();
        assert!(err.contains(SIGNING_KEY_FILE), "{err}");
        assert!(!err.contains("0123"), "{err}");

        let seal = dir.path().join(SEAL_KEY_FILE);
        assert!(read_seal_key_if_exists(&seal).unwrap().is_none());
        let key = SealSecretKey::from_seed([8; 32]);
        assert!(write_seal_key(&seal, &key).unwrap());
        assert!(!write_seal_key(&seal, &key).unwrap());
        assert_eq!(
            read_seal_key_if_exists(&seal).unwrap().unwrap().public(),
            key.public()
        );
        std::fs::write(&seal, "0808 not a key").unwrap();
        let err = read_seal_key_if_exists(&seal).unwrap_err().to_string();
        assert!(
            err.contains(SEAL_KEY_FILE) && !err.contains("0808"),
            "{err}"
        );

        let token = dir.path().join(ADMIN_TOKEN_FILE);
        assert!(read_token(&token).unwrap().is_none());
        std::fs::write(&token, "\n").unwrap();
        assert!(read_token(&token).unwrap().is_none());
        assert!(write_token(&token, &Secret::new("mesh_at_x".into())).unwrap());
        assert_eq!(read_token(&token).unwrap().unwrap().expose(), "mesh_at_x");
    }
}
