//! Secrets sealed to the receiving node: a secret value inside a declaration is
//! encrypted to the node's own X25519 public key with HPKE (RFC 9180), so the
//! broker, its administrator, anyone holding the controller's broker credentials
//! and anyone reading the controller's outbox see only ciphertext. Only the node,
//! holding the private key that never leaves it (`seal.key`), opens it.
//!
//! The suite is DHKEM(X25519, HKDF-SHA256), HKDF-SHA256, ChaCha20Poly1305, base
//! mode, single shot, from the `hpke` crate: no cryptography is made here. A
//! sealed text is standard padded base64 of `encapped_key (32 bytes) ||
//! ciphertext` (the ciphertext ends with the 16-byte tag). The associated data
//! ([`secret_aad`]) binds a sealed value to its node and path: a blob copied to
//! another node or another path does not open.
//!
//! Keys travel hex encoded (32 bytes, 64 hex digits). This module is pure: the
//! caller brings the randomness (a fresh 32-byte seed) and does the file I/O.

use std::fmt;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use chacha20::ChaCha20Rng;
use hpke::aead::ChaCha20Poly1305;
use hpke::kdf::HkdfSha256;
use hpke::kem::X25519HkdfSha256;
use hpke::rand_core::SeedableRng;
use hpke::{Deserializable, Kem, OpModeR, OpModeS, Serializable};

type SuiteKem = X25519HkdfSha256;
type KemPublic = <SuiteKem as Kem>::PublicKey;
type KemPrivate = <SuiteKem as Kem>::PrivateKey;
type KemEncapped = <SuiteKem as Kem>::EncappedKey;

/// The HPKE `info` of every seal: names this use, so a key used elsewhere with
/// the same suite never confuses the two.
const INFO: &[u8] = b"mesh sealed secret v1";

/// Bytes of the encapsulated key at the head of a sealed text.
const ENCAPPED_BYTES: usize = 32;

/// Bytes of the AEAD tag at the end of a sealed text.
const TAG_BYTES: usize = 16;

/// Why a key or a sealed text was refused. Never contains key material or
/// plaintext.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SealError {
    #[error("the key is not 64 hex digits of a usable X25519 key")]
    MalformedKey,
    #[error("the sealed text is not base64 of an encapsulated key and a ciphertext")]
    MalformedSealed,
    #[error("the sealed text does not open with this node's key for this node and path")]
    DoesNotOpen,
}

fn key_bytes(text: &str) -> Result<[u8; 32], SealError> {
    let bytes = hex::decode(text.trim()).map_err(|_| SealError::MalformedKey)?;
    bytes.try_into().map_err(|_| SealError::MalformedKey)
}

/// A node's X25519 public key: what secrets are sealed to. Public, so Debug
/// shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct SealPublicKey(KemPublic);

impl SealPublicKey {
    /// Parse 64 hex digits (surrounding whitespace ignored). Refuses a point of
    /// small order (all zeros and the like), to which nothing can be sealed.
    pub fn from_hex(text: &str) -> Result<Self, SealError> {
        let bytes = key_bytes(text)?;
        let key = KemPublic::from_bytes(&bytes).map_err(|_| SealError::MalformedKey)?;
        // A trial encapsulation: hpke refuses a key whose shared secret would be
        // all zeros (a small-order point). The seed is fixed; nothing is sealed.
        SuiteKem::encap_with_rng(&key, None, &mut ChaCha20Rng::from_seed([1; 32]))
            .map_err(|_| SealError::MalformedKey)?;
        Ok(SealPublicKey(key))
    }

    /// 64 hex digits.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0.to_bytes())
    }
}

impl fmt::Debug for SealPublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SealPublicKey({})", self.to_hex())
    }
}

/// A node's X25519 private key (the `seal.key` file holds its seed). Debug
/// prints `SealSecretKey([redacted])`; the hpke key zeroizes on drop.
#[derive(Clone)]
pub struct SealSecretKey {
    seed: [u8; 32],
    secret: KemPrivate,
    public: KemPublic,
}

impl SealSecretKey {
    /// The key derived (RFC 9180 DeriveKeyPair) from `seed`: 32 bytes from a
    /// CSPRNG, or read back from the key file.
    pub fn from_seed(seed: [u8; 32]) -> Self {
        let (secret, public) = SuiteKem::derive_keypair(&seed);
        SealSecretKey {
            seed,
            secret,
            public,
        }
    }

    /// Read a key file's text: the seed as 64 hex digits (surrounding
    /// whitespace ignored).
    pub fn from_hex(text: &str) -> Result<Self, SealError> {
        Ok(Self::from_seed(key_bytes(text)?))
    }

    /// The seed as 64 hex digits, for writing the key file.
    pub fn to_hex(&self) -> String {
        hex::encode(self.seed)
    }

    /// The public key: what the node states in its hello.
    pub fn public(&self) -> SealPublicKey {
        SealPublicKey(self.public.clone())
    }
}

impl fmt::Debug for SealSecretKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SealSecretKey([redacted])")
    }
}

impl Drop for SealSecretKey {
    fn drop(&mut self) {
        // Best effort; the hpke private key zeroizes itself.
        self.seed = [0; 32];
    }
}

/// The associated data that binds a sealed value to the node it is sealed to
/// and the path it is written at: `mesh-secret-v1 NUL <node> NUL <path>`.
pub fn secret_aad(node: &str, path: &str) -> Vec<u8> {
    let mut aad = Vec::with_capacity(16 + node.len() + path.len());
    aad.extend_from_slice(b"mesh-secret-v1\0");
    aad.extend_from_slice(node.as_bytes());
    aad.push(0);
    aad.extend_from_slice(path.as_bytes());
    aad
}

/// Seal `plaintext` to `to`, bound to `aad` (see [`secret_aad`]); returns
/// standard padded base64 of `encapped_key || ciphertext`.
///
/// `ephemeral_seed` must be 32 bytes of fresh randomness from a CSPRNG, never
/// reused: the ephemeral key pair is derived from it (it seeds a ChaCha20 RNG
/// that hpke draws its ephemeral key from). hpke 0.15 takes a `rand_core` 0.10
/// RNG, which rand 0.9's `rand::rng()` / `OsRng` (rand_core 0.9) do not
/// implement, hence the seed. From a crate on rand 0.9:
///
/// ```
/// # use mesh_protocol::sealing::*;
/// # let to = SealSecretKey::from_seed([3; 32]).public();
/// // rand 0.9: `rand::random()` draws from the thread-local CSPRNG (`rand::rng()`,
/// // seeded from the OS); `rand::rngs::OsRng.try_fill_bytes(&mut seed)` works too.
/// let sealed = seal(&to, &secret_aad("node-a", "/etc/app/db.pw"), b"pw", rand::random())?;
/// # Ok::<(), SealError>(())
/// ```
pub fn seal(
    to: &SealPublicKey,
    aad: &[u8],
    plaintext: &[u8],
    ephemeral_seed: [u8; 32],
) -> Result<String, SealError> {
    let mut rng = ChaCha20Rng::from_seed(ephemeral_seed);
    let (encapped, ciphertext) = hpke::single_shot_seal_with_rng::<
        ChaCha20Poly1305,
        HkdfSha256,
        SuiteKem,
    >(&OpModeS::Base, &to.0, INFO, plaintext, aad, &mut rng)
    .map_err(|_| SealError::MalformedKey)?;
    let mut out = Vec::with_capacity(ENCAPPED_BYTES + ciphertext.len());
    out.extend_from_slice(&encapped.to_bytes());
    out.extend_from_slice(&ciphertext);
    Ok(BASE64.encode(out))
}

/// Bytes of the sealed text (base64) of a plaintext of `plaintext_len` bytes.
pub fn sealed_len(plaintext_len: usize) -> usize {
    (ENCAPPED_BYTES + plaintext_len + TAG_BYTES).div_ceil(3) * 4
}

/// Check that `sealed` has the shape of a sealed text (base64, long enough to
/// hold a key and a tag) without opening it.
pub fn check_sealed(sealed: &str) -> Result<(), SealError> {
    split(sealed).map(|_| ())
}

fn split(sealed: &str) -> Result<(KemEncapped, Vec<u8>), SealError> {
    let bytes = BASE64
        .decode(sealed.trim())
        .map_err(|_| SealError::MalformedSealed)?;
    if bytes.len() < ENCAPPED_BYTES + TAG_BYTES {
        return Err(SealError::MalformedSealed);
    }
    let (key, ciphertext) = bytes.split_at(ENCAPPED_BYTES);
    let encapped = KemEncapped::from_bytes(key).map_err(|_| SealError::MalformedSealed)?;
    Ok((encapped, ciphertext.to_vec()))
}

/// Open what [`seal`] sealed to `key`'s public key with the same `aad`.
pub fn open(key: &SealSecretKey, aad: &[u8], sealed: &str) -> Result<Vec<u8>, SealError> {
    let (encapped, ciphertext) = split(sealed)?;
    hpke::single_shot_open::<ChaCha20Poly1305, HkdfSha256, SuiteKem>(
        &OpModeR::Base,
        &key.secret,
        &encapped,
        INFO,
        &ciphertext,
        aad,
    )
    .map_err(|_| SealError::DoesNotOpen)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u8) -> SealSecretKey {
        SealSecretKey::from_seed([n; 32])
    }

    fn seed(n: u8) -> [u8; 32] {
        let mut s = [0u8; 32];
        s[0] = n;
        s[31] = 0xa5;
        s
    }

    const PATH: &str = "/etc/app/db.password";

    #[test]
    fn a_sealed_value_opens_with_the_nodes_key() {
        let k = key(1);
        let aad = secret_aad("node-a", PATH);
        let sealed = seal(&k.public(), &aad, b"hunter2", seed(1)).expect("seal");
        assert_eq!(open(&k, &aad, &sealed).expect("open"), b"hunter2");
        assert_eq!(sealed.len(), sealed_len(7));
        check_sealed(&sealed).expect("shape");
        // An empty value seals too.
        let empty = seal(&k.public(), &aad, b"", seed(2)).expect("seal");
        assert_eq!(open(&k, &aad, &empty).expect("open"), b"");
    }

    #[test]
    fn another_key_does_not_open() {
        let aad = secret_aad("node-a", PATH);
        let sealed = seal(&key(1).public(), &aad, b"hunter2", seed(1)).expect("seal");
        assert_eq!(open(&key(2), &aad, &sealed), Err(SealError::DoesNotOpen));
    }

    #[test]
    fn another_node_or_path_does_not_open() {
        let k = key(1);
        let sealed = seal(
            &k.public(),
            &secret_aad("node-a", PATH),
            b"hunter2",
            seed(1),
        )
        .expect("seal");
        for aad in [
            secret_aad("node-b", PATH),
            secret_aad("node-a", "/etc/app/other"),
            // The separator keeps node and path apart.
            secret_aad("node-a/etc", "/app/db.password"),
            Vec::new(),
        ] {
            assert_eq!(open(&k, &aad, &sealed), Err(SealError::DoesNotOpen));
        }
    }

    #[test]
    fn a_tampered_text_does_not_open() {
        let k = key(1);
        let aad = secret_aad("node-a", PATH);
        let sealed = seal(&k.public(), &aad, b"hunter2", seed(1)).expect("seal");
        let bytes = BASE64.decode(&sealed).expect("base64");
        for at in [0, ENCAPPED_BYTES, bytes.len() - 1] {
            let mut t = bytes.clone();
            t[at] ^= 1;
            assert_eq!(
                open(&k, &aad, &BASE64.encode(&t)),
                Err(SealError::DoesNotOpen),
                "byte {at}"
            );
        }
        let short = BASE64.encode(&bytes[..ENCAPPED_BYTES + TAG_BYTES - 1]);
        assert_eq!(open(&k, &aad, &short), Err(SealError::MalformedSealed));
        assert_eq!(
            open(&k, &aad, "not base64!"),
            Err(SealError::MalformedSealed)
        );
    }

    #[test]
    fn the_sealed_text_shows_nothing_of_the_plaintext() {
        let k = key(1);
        let plaintext = b"correct horse battery staple";
        let sealed = seal(&k.public(), b"", plaintext, seed(1)).expect("seal");
        let bytes = BASE64.decode(&sealed).expect("base64");
        assert!(!sealed.contains("correct horse"));
        assert!(
            !bytes
                .windows(8)
                .any(|w| plaintext.windows(8).any(|p| p == w))
        );
    }

    #[test]
    fn two_seals_of_one_value_differ() {
        let k = key(1);
        let a = seal(&k.public(), b"", b"same", seed(1)).expect("seal");
        let b = seal(&k.public(), b"", b"same", seed(2)).expect("seal");
        assert_ne!(a, b);
        assert_eq!(open(&k, b"", &a), open(&k, b"", &b));
    }

    #[test]
    fn keys_round_trip_through_hex_and_secrets_do_not_print() {
        let k = key(9);
        let again = SealSecretKey::from_hex(&format!(" {}\n", k.to_hex())).expect("hex");
        assert_eq!(again.public(), k.public());
        assert_eq!(format!("{k:?}"), "SealSecretKey([redacted])");
        let public = k.public();
        assert_eq!(
            SealPublicKey::from_hex(&public.to_hex()).expect("hex"),
            public
        );
        assert!(format!("{public:?}").contains(&public.to_hex()));
        assert_ne!(public.to_hex(), k.to_hex());
        for bad in ["", "zz", &"ab".repeat(31), &"ab".repeat(33)] {
            assert_eq!(SealPublicKey::from_hex(bad), Err(SealError::MalformedKey));
            assert_eq!(
                SealSecretKey::from_hex(bad).map(|_| ()),
                Err(SealError::MalformedKey)
            );
        }
        // A small-order point is no key to seal to.
        assert_eq!(
            SealPublicKey::from_hex(&"00".repeat(32)),
            Err(SealError::MalformedKey)
        );
    }
}
