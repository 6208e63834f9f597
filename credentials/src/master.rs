//! `secrets-master.toml`: the keyring that wraps the data key of every secret
//! the config context keeps (AES-256-GCM). Written by `mesh-bundle up` (one
//! key, made once) and by the controller when it rotates the master key; read
//! by the controller. Mode 0600, readable only by the controller's user.
//!
//! ```toml
//! # The first key is current: new data keys are wrapped under it. The others
//! # still unwrap what was wrapped under them until a rotation re-wraps it.
//! [[keys]]
//! id = "m-20261201T143000Z-3f2a"
//! key = "…64 hex digits…"
//! ```

use std::path::{Path, PathBuf};

use mesh_protocol::Secret;
use serde::{Deserialize, Serialize};

use crate::CredentialsError;
use crate::file::{expose, from_toml, read_required, read_text, to_toml};

/// The keyring's file name inside the etc directory ([`crate::etc_dir`]).
pub const MASTER_KEYS_FILE: &str = "secrets-master.toml";

/// One master key: its id (stored beside every data key it wraps) and 32
/// bytes as 64 hex digits.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MasterKey {
    /// 1 to 64 of `[A-Za-z0-9._-]`.
    pub id: String,
    #[serde(serialize_with = "expose")]
    key: Secret<String>,
}

impl MasterKey {
    /// A key with id `id` and the 32 bytes `key` (from a CSPRNG).
    pub fn new(id: impl Into<String>, key: [u8; 32]) -> MasterKey {
        MasterKey {
            id: id.into(),
            key: Secret::new(hex::encode(key)),
        }
    }

    /// The key's 32 bytes (checked when the file was read or the key made).
    pub fn bytes(&self) -> [u8; 32] {
        let mut out = [0u8; 32];
        if let Ok(raw) = hex::decode(self.key.expose())
            && raw.len() == 32
        {
            out.copy_from_slice(&raw);
        }
        out
    }

    fn check(&self, path: &Path, i: usize) -> Result<(), CredentialsError> {
        let id_ok = !self.id.is_empty()
            && self.id.len() <= 64
            && self
                .id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        if !id_ok {
            return Err(CredentialsError::invalid(
                path,
                format!("keys[{i}].id"),
                "1 to 64 characters of A-Z a-z 0-9 . _ -",
            ));
        }
        match hex::decode(self.key.expose()) {
            Ok(raw) if raw.len() == 32 => Ok(()),
            _ => Err(CredentialsError::invalid(
                path,
                format!("keys[{i}].key"),
                "not 64 hex digits (32 bytes)",
            )),
        }
    }
}

/// The keyring: the current key first, then older ones.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MasterKeys {
    pub keys: Vec<MasterKey>,
    #[serde(skip)]
    path: PathBuf,
}

impl MasterKeys {
    /// A keyring of `keys`, current first (at least one).
    pub fn new(keys: Vec<MasterKey>) -> MasterKeys {
        MasterKeys {
            keys,
            path: PathBuf::from(MASTER_KEYS_FILE),
        }
    }

    /// The key new data keys are wrapped under.
    pub fn current(&self) -> Option<&MasterKey> {
        self.keys.first()
    }

    /// The key with id `id`.
    pub fn get(&self, id: &str) -> Option<&MasterKey> {
        self.keys.iter().find(|k| k.id == id)
    }

    /// Reads and checks the file at `path`; a missing file is an error.
    pub fn load(path: &Path) -> Result<MasterKeys, CredentialsError> {
        Self::parse(&read_required(path)?, path)
    }

    /// Like [`MasterKeys::load`]; `Ok(None)` when the file does not exist.
    pub fn load_if_exists(path: &Path) -> Result<Option<MasterKeys>, CredentialsError> {
        read_text(path)?
            .map(|text| Self::parse(&text, path))
            .transpose()
    }

    /// Decodes and checks the file's text; `path` names the file in errors.
    pub fn parse(text: &str, path: &Path) -> Result<MasterKeys, CredentialsError> {
        let mut keys: MasterKeys = from_toml(text, path)?;
        keys.path = path.to_owned();
        keys.check()?;
        Ok(keys)
    }

    fn check(&self) -> Result<(), CredentialsError> {
        if self.keys.is_empty() {
            return Err(CredentialsError::invalid(
                &self.path,
                "keys",
                "no key: the first key is the current one",
            ));
        }
        for (i, k) in self.keys.iter().enumerate() {
            k.check(&self.path, i)?;
            if self.keys[..i].iter().any(|o| o.id == k.id) {
                return Err(CredentialsError::invalid(
                    &self.path,
                    format!("keys[{i}].id"),
                    "repeats an earlier key's id",
                ));
            }
        }
        Ok(())
    }

    /// Writes the keyring atomically with mode 0600 (refusing what
    /// [`MasterKeys::parse`] would refuse); `false` when the file already held
    /// exactly this.
    pub fn write(&self, path: &Path) -> Result<bool, CredentialsError> {
        let mut checked = self.clone();
        checked.path = path.to_owned();
        checked.check()?;
        crate::write_secret_file(path, &to_toml(&checked, path)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_names_what_is_wrong() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(MASTER_KEYS_FILE);
        assert!(MasterKeys::load_if_exists(&path).unwrap().is_none());
        let ring = MasterKeys::new(vec![
            MasterKey::new("m-2", [2; 32]),
            MasterKey::new("m-1", [1; 32]),
        ]);
        assert!(ring.write(&path).unwrap());
        assert!(!ring.write(&path).unwrap());
        let back = MasterKeys::load(&path).unwrap();
        assert_eq!(back.current().unwrap().id, "m-2");
        assert_eq!(back.get("m-1").unwrap().bytes(), [1; 32]);
        use std::os::unix::fs::PermissionsExt as _;
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert!(!format!("{back:?}").contains(&hex::encode([2u8; 32])));

        let err = MasterKeys::parse("keys = []\n", &path)
            .unwrap_err()
            .to_string();
        assert!(err.contains("keys"), "{err}");
        let err = MasterKeys::parse("[[keys]]\nid = \"a\"\nkey = \"abc\"\n", &path)
            .unwrap_err()
            .to_string();
        assert!(err.contains("keys[0].key") && !err.contains("abc"), "{err}");
        let dup = format!(
            "[[keys]]\nid = \"a\"\nkey = \"{k}\"\n[[keys]]\nid = \"a\"\nkey = \"{k}\"\n",
            k = hex::encode([3u8; 32])
        );
        let err = MasterKeys::parse(&dup, &path).unwrap_err().to_string();
        assert!(err.contains("keys[1].id"), "{err}");
    }
}
