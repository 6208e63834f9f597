//! Secrets at rest: envelope encryption with AES-256-GCM. Each secret has its
//! own random 32-byte data key; each version of its value is encrypted under
//! that data key (AAD: the secret's name and version, so a ciphertext cannot
//! be moved to another secret or version), and the data key is wrapped under
//! a master key of the keyring (AAD: the secret's name). Rotating the master
//! key re-wraps data keys; values are never re-encrypted.
//!
//! Stored forms are `nonce (12 bytes) || ciphertext+tag`. Nothing here logs
//! or formats a key or a value.

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::{Aes256Gcm, Key, Nonce};

/// Why a stored secret does not open (a wrong or missing master key, a
/// corrupted row). Never carries key material or plaintext.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct CryptError(pub String);

const NONCE: usize = 12;

fn seal(key: &[u8; 32], aad: &[u8], plaintext: &[u8]) -> Result<Vec<u8>, CryptError> {
    let cipher = Aes256Gcm::new(&Key::<Aes256Gcm>::from(*key));
    let nonce_bytes: [u8; NONCE] = rand::random();
    let nonce = Nonce::from(nonce_bytes);
    let ct = cipher
        .encrypt(
            &nonce,
            Payload {
                msg: plaintext,
                aad,
            },
        )
        .map_err(|_| CryptError("encryption failed".into()))?;
    let mut out = Vec::with_capacity(NONCE + ct.len());
    out.extend_from_slice(&nonce_bytes);
    out.extend_from_slice(&ct);
    Ok(out)
}

fn open(key: &[u8; 32], aad: &[u8], stored: &[u8], what: &str) -> Result<Vec<u8>, CryptError> {
    if stored.len() < NONCE + 16 {
        return Err(CryptError(format!("{what}: stored form too short")));
    }
    let (nonce_bytes, ct) = stored.split_at(NONCE);
    let mut n = [0u8; NONCE];
    n.copy_from_slice(nonce_bytes);
    let cipher = Aes256Gcm::new(&Key::<Aes256Gcm>::from(*key));
    cipher
        .decrypt(&Nonce::from(n), Payload { msg: ct, aad })
        .map_err(|_| CryptError(format!("{what}: does not decrypt (wrong key or corrupted)")))
}

fn key_aad(secret: &str) -> Vec<u8> {
    [b"mesh-dk-v1\0".as_slice(), secret.as_bytes()].concat()
}

fn value_aad(secret: &str, version: i64) -> Vec<u8> {
    [
        b"mesh-sv-v1\0".as_slice(),
        secret.as_bytes(),
        b"\0",
        &version.to_be_bytes(),
    ]
    .concat()
}

/// A fresh data key.
pub fn new_data_key() -> [u8; 32] {
    rand::random()
}

/// The data key of `secret` wrapped under `master`.
pub fn wrap_key(
    master: &[u8; 32],
    secret: &str,
    data_key: &[u8; 32],
) -> Result<Vec<u8>, CryptError> {
    seal(master, &key_aad(secret), data_key)
}

/// The data key of `secret`, unwrapped with `master`.
pub fn unwrap_key(master: &[u8; 32], secret: &str, wrapped: &[u8]) -> Result<[u8; 32], CryptError> {
    let raw = open(master, &key_aad(secret), wrapped, "data key")?;
    raw.try_into()
        .map_err(|_| CryptError("data key: not 32 bytes".into()))
}

/// Version `version` of `secret`'s value, encrypted under its data key.
pub fn encrypt_value(
    data_key: &[u8; 32],
    secret: &str,
    version: i64,
    value: &[u8],
) -> Result<Vec<u8>, CryptError> {
    seal(data_key, &value_aad(secret, version), value)
}

/// Version `version` of `secret`'s value.
pub fn decrypt_value(
    data_key: &[u8; 32],
    secret: &str,
    version: i64,
    stored: &[u8],
) -> Result<Vec<u8>, CryptError> {
    open(data_key, &value_aad(secret, version), stored, "value")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_round_trip_and_are_bound_to_name_version_and_key() {
        let master = [7u8; 32];
        let dk = new_data_key();
        let wrapped = wrap_key(&master, "db-password", &dk).unwrap();
        assert_eq!(unwrap_key(&master, "db-password", &wrapped).unwrap(), dk);
        assert!(unwrap_key(&[8u8; 32], "db-password", &wrapped).is_err());
        assert!(unwrap_key(&master, "other", &wrapped).is_err());

        let ct = encrypt_value(&dk, "db-password", 3, b"hunter2-hunter2").unwrap();
        assert!(!ct.windows(7).any(|w| w == b"hunter2"));
        assert_eq!(
            decrypt_value(&dk, "db-password", 3, &ct).unwrap(),
            b"hunter2-hunter2"
        );
        assert!(decrypt_value(&dk, "db-password", 4, &ct).is_err());
        assert!(decrypt_value(&dk, "other", 3, &ct).is_err());
        let mut tampered = ct.clone();
        let last = tampered.len() - 1;
        tampered[last] ^= 1;
        assert!(decrypt_value(&dk, "db-password", 3, &tampered).is_err());
        assert!(decrypt_value(&dk, "db-password", 3, &ct[..10]).is_err());
        // Randomized: the same value twice is two ciphertexts.
        assert_ne!(
            ct,
            encrypt_value(&dk, "db-password", 3, b"hunter2-hunter2").unwrap()
        );
    }
}
