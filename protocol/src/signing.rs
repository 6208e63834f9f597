//! Declaration signatures: the controller signs the exact bytes of every
//! declaration it publishes with its Ed25519 key; an agent verifies them against
//! the controller's public key it received at enrolment and applies nothing that
//! fails. Something with write access to the broker but without the controller's
//! key cannot command a node.
//!
//! Keys and signatures travel hex encoded: a key is 32 bytes (64 hex digits), a
//! signature 64 bytes (128 hex digits). This module is pure: the caller brings the
//! randomness (a fresh 32-byte seed) and does the file I/O.

use std::fmt;

use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};

/// Why a signature or key was refused. Never contains key material.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    #[error("the message carries no signature header")]
    Missing,
    #[error("the signature is not 128 hex digits")]
    MalformedSignature,
    #[error("the key is not 64 hex digits of a valid Ed25519 public key")]
    MalformedKey,
    #[error("the signature does not verify against the controller's key")]
    Mismatch,
}

/// The controller's private signing key. Debug and Display print `[redacted]`.
#[derive(Clone)]
pub struct DeclarationSigner(SigningKey);

impl DeclarationSigner {
    /// The key whose seed is `seed` (32 bytes: from a CSPRNG, or read back from
    /// the key file).
    pub fn from_seed(seed: [u8; 32]) -> Self {
        DeclarationSigner(SigningKey::from_bytes(&seed))
    }

    /// Read a key file's text: the seed as 64 hex digits (surrounding whitespace
    /// ignored).
    pub fn from_hex(text: &str) -> Result<Self, SignatureError> {
        let bytes = hex::decode(text.trim()).map_err(|_| SignatureError::MalformedKey)?;
        let seed: [u8; 32] = bytes.try_into().map_err(|_| SignatureError::MalformedKey)?;
        Ok(Self::from_seed(seed))
    }

    /// The seed as 64 hex digits, for writing the key file.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0.to_bytes())
    }

    /// The public key, 64 hex digits: what agents verify against.
    pub fn public_key_hex(&self) -> String {
        hex::encode(self.0.verifying_key().to_bytes())
    }

    /// Sign `payload` (the exact bytes published); 128 hex digits.
    pub fn sign_hex(&self, payload: &[u8]) -> String {
        hex::encode(self.0.sign(payload).to_bytes())
    }
}

impl fmt::Debug for DeclarationSigner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("DeclarationSigner([redacted])")
    }
}

/// A public key agents (and identity, for node keys) hold.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PublicKey(VerifyingKey);

impl PublicKey {
    /// Parse 64 hex digits; refuses anything that is not a valid Ed25519 point
    /// (and weak keys).
    pub fn from_hex(text: &str) -> Result<Self, SignatureError> {
        let bytes = hex::decode(text.trim()).map_err(|_| SignatureError::MalformedKey)?;
        let bytes: [u8; 32] = bytes.try_into().map_err(|_| SignatureError::MalformedKey)?;
        let key = VerifyingKey::from_bytes(&bytes).map_err(|_| SignatureError::MalformedKey)?;
        if key.is_weak() {
            return Err(SignatureError::MalformedKey);
        }
        Ok(PublicKey(key))
    }

    pub fn to_hex(&self) -> String {
        hex::encode(self.0.to_bytes())
    }

    /// Verify a hex signature over `payload` (strict: no malleable signatures).
    pub fn verify_hex(
        &self,
        payload: &[u8],
        signature: Option<&str>,
    ) -> Result<(), SignatureError> {
        let signature = signature.ok_or(SignatureError::Missing)?;
        let bytes = hex::decode(signature).map_err(|_| SignatureError::MalformedSignature)?;
        let bytes: [u8; 64] = bytes
            .try_into()
            .map_err(|_| SignatureError::MalformedSignature)?;
        let sig = Signature::from_bytes(&bytes);
        self.0
            .verify_strict(payload, &sig)
            .map_err(|_| SignatureError::Mismatch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sign_and_verify() {
        let signer = DeclarationSigner::from_seed([7; 32]);
        let key = PublicKey::from_hex(&signer.public_key_hex()).unwrap();
        let sig = signer.sign_hex(b"payload");
        assert_eq!(sig.len(), 128);
        assert!(key.verify_hex(b"payload", Some(&sig)).is_ok());
        assert_eq!(
            key.verify_hex(b"payloaD", Some(&sig)),
            Err(SignatureError::Mismatch)
        );
        assert_eq!(
            key.verify_hex(b"payload", None),
            Err(SignatureError::Missing)
        );
        assert_eq!(
            key.verify_hex(b"payload", Some("zz")),
            Err(SignatureError::MalformedSignature)
        );
        let other = DeclarationSigner::from_seed([8; 32]);
        assert_eq!(
            key.verify_hex(b"payload", Some(&other.sign_hex(b"payload"))),
            Err(SignatureError::Mismatch)
        );
        let back = DeclarationSigner::from_hex(&format!("{}\n", signer.to_hex())).unwrap();
        assert_eq!(back.public_key_hex(), signer.public_key_hex());
        assert!(!format!("{signer:?}").contains(&signer.to_hex()));
        assert!(PublicKey::from_hex("00").is_err());
        assert!(PublicKey::from_hex(&"00".repeat(32)).is_err(), "weak key");
    }
}
