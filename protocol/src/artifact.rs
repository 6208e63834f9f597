//! Artifacts and revisions (the delivery context; decision 0032).
//!
//! An artifact is content-addressed: its name is the SHA-256 digest of its
//! bytes (`sha256:<64 lowercase hex>`), never a mutable tag. It lives in an OCI
//! registry as one blob of repository [`ARTIFACT_REPOSITORY`]; its signature
//! lives beside it as a manifest tagged [`ArtifactDigest::signature_tag`]
//! (cosign's convention) whose one layer is an [`ArtifactSignature`]. An agent
//! verifies both before it unpacks or runs anything: the digest against the
//! bytes it pulled, the signature against the keys the mesh trusts, so a
//! registry that serves the right digest from a compromised account still
//! cannot run code no operator approved.
//!
//! The delivery section declares [`ArtifactItem`]s (what a node must hold in
//! its cache); a unit names the artifact it runs from by digest
//! ([`crate::UnitItem::artifact`]). `delivery.module.targets`
//! ([`ModuleTargets`]) tells inventory which revision each node's replica of a
//! module runs.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Deserializer, Serialize};
use uuid::Uuid;

use crate::signing::{PublicKey, SignatureError};
use crate::{DecodeError, NodeId, Probe, RestartPolicy, validate_module_name};

/// The registry repository every artifact of the mesh is a blob of.
pub const ARTIFACT_REPOSITORY: &str = "mesh/artifacts";

/// Media type of an artifact's blob (a tar archive: a pushed file is a tar of
/// that one file).
pub const ARTIFACT_MEDIA_TYPE: &str = "application/vnd.mesh.artifact.v1.tar";

/// Media type of the layer holding an [`ArtifactSignature`].
pub const SIGNATURE_MEDIA_TYPE: &str = "application/vnd.mesh.artifact.signature.v1+json";

/// Most artifacts one delivery section declares.
pub const MAX_ARTIFACTS: usize = 64;

/// Most keys one delivery section declares trusted for artifacts.
pub const MAX_ARTIFACT_KEYS: usize = 64;

/// Most signatures one artifact's signature manifest holds (one per key).
pub const MAX_ARTIFACT_SIGNATURES: usize = 16;

/// Most revisions one `delivery.module.targets` event carries.
pub const MAX_TARGET_REVISIONS: usize = 16;

/// A content address: `sha256:` and 64 lowercase hex digits.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(transparent)]
pub struct ArtifactDigest(String);

impl ArtifactDigest {
    /// Parse `sha256:<64 lowercase hex>`; anything else (a tag, another
    /// algorithm, upper case) is refused, naming `field`.
    pub fn parse(field: &str, text: &str) -> Result<Self, DecodeError> {
        let ok = text.strip_prefix("sha256:").is_some_and(|hex| {
            hex.len() == 64
                && hex
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        });
        if ok {
            Ok(ArtifactDigest(text.to_owned()))
        } else {
            Err(DecodeError::invalid(
                field,
                format!(
                    "`{}` is not a digest: sha256: and 64 lowercase hex digits (never a tag)",
                    text.chars().take(80).collect::<String>()
                ),
            ))
        }
    }

    /// The digest of `bytes`.
    pub fn of(bytes: &[u8]) -> Self {
        use sha2::{Digest, Sha256};
        ArtifactDigest(format!("sha256:{}", hex::encode(Sha256::digest(bytes))))
    }

    /// From a finished SHA-256 of a stream.
    pub fn from_sha256(hash: [u8; 32]) -> Self {
        ArtifactDigest(format!("sha256:{}", hex::encode(hash)))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The 64 hex digits.
    pub fn hex(&self) -> &str {
        &self.0["sha256:".len()..]
    }

    /// The tag of the manifest holding this artifact's signature:
    /// `sha256-<hex>.sig`.
    pub fn signature_tag(&self) -> String {
        format!("sha256-{}.sig", self.hex())
    }
}

impl fmt::Display for ArtifactDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for ArtifactDigest {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        ArtifactDigest::parse("digest", &s).map_err(serde::de::Error::custom)
    }
}

/// The bytes a signature covers: a fixed, versioned prefix and the digest, so
/// an artifact signature is never mistaken for a declaration's.
pub fn signature_payload(digest: &ArtifactDigest) -> Vec<u8> {
    format!("mesh artifact signature v1\n{digest}").into_bytes()
}

/// Why an artifact's signature was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ArtifactSignatureError {
    #[error("the signature is for {signed}, not {expected}")]
    OtherDigest { signed: String, expected: String },
    #[error("signed by a key this mesh does not trust ({key})")]
    Untrusted { key: String },
    #[error("the signature does not verify: {0}")]
    Invalid(SignatureError),
}

/// A key whose artifact signatures a node trusts, as the delivery section
/// declares it (decision 0048): an operator's signing key an admin added, or
/// the controller's own key when the fleet opts in
/// (`trust_controller_artifact_signatures`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TrustedArtifactKey {
    /// The key's name (as `/v1/signing-keys` lists it), shown in errors.
    pub name: String,
    /// The Ed25519 public key, 64 hex digits.
    pub key: String,
}

impl TrustedArtifactKey {
    pub fn validate(&self, field: &str) -> Result<PublicKey, DecodeError> {
        if self.name.is_empty() || self.name.len() > 64 || self.name.chars().any(|c| c.is_control())
        {
            return Err(DecodeError::invalid(
                format!("{field}.name"),
                "1 to 64 characters, no control characters",
            ));
        }
        PublicKey::from_hex(&self.key).map_err(|e| {
            DecodeError::invalid(
                format!("{field}.key"),
                format!("not an Ed25519 public key (64 hex digits): {e}"),
            )
        })
    }
}

/// An artifact's signature, as its signature manifest's layer holds it (JSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArtifactSignature {
    pub digest: ArtifactDigest,
    /// The signer's Ed25519 public key, 64 hex digits.
    pub key: String,
    /// Ed25519 over [`signature_payload`], 128 hex digits.
    pub signature: String,
}

impl ArtifactSignature {
    /// Sign `digest` with `signer`: an operator's key (`meshctl artifact
    /// sign`), or the controller's at push time when the fleet trusts it.
    pub fn sign(signer: &crate::DeclarationSigner, digest: &ArtifactDigest) -> Self {
        ArtifactSignature {
            digest: digest.clone(),
            key: signer.public_key_hex(),
            signature: signer.sign_hex(&signature_payload(digest)),
        }
    }

    /// The first of `signatures` that signs `expected` with one of
    /// `trusted`; otherwise why each was refused (empty: there were none).
    pub fn verify_any<'a>(
        signatures: &'a [ArtifactSignature],
        expected: &ArtifactDigest,
        trusted: &[PublicKey],
    ) -> Result<&'a ArtifactSignature, Vec<ArtifactSignatureError>> {
        let mut refused = Vec::new();
        for s in signatures {
            match s.verify(expected, trusted) {
                Ok(()) => return Ok(s),
                Err(e) => refused.push(e),
            }
        }
        Err(refused)
    }

    /// Check that this signs `expected` with one of `trusted`.
    pub fn verify(
        &self,
        expected: &ArtifactDigest,
        trusted: &[PublicKey],
    ) -> Result<(), ArtifactSignatureError> {
        if &self.digest != expected {
            return Err(ArtifactSignatureError::OtherDigest {
                signed: self.digest.to_string(),
                expected: expected.to_string(),
            });
        }
        let key = PublicKey::from_hex(&self.key).map_err(ArtifactSignatureError::Invalid)?;
        if !trusted.contains(&key) {
            return Err(ArtifactSignatureError::Untrusted {
                key: self.key.chars().take(64).collect(),
            });
        }
        key.verify_hex(&signature_payload(expected), Some(&self.signature))
            .map_err(ArtifactSignatureError::Invalid)
    }
}

/// An artifact a node must hold (the delivery section): pulled from
/// `registry` (base URL, `http://` only to loopback), repository
/// `repository`, by digest; cached by digest under the agent's state dir.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ArtifactItem {
    pub digest: ArtifactDigest,
    pub registry: String,
    pub repository: String,
}

impl ArtifactItem {
    pub fn validate(&self, field: &str) -> Result<(), DecodeError> {
        let r = &self.registry;
        let scheme_ok = r.starts_with("http://") || r.starts_with("https://");
        if !scheme_ok || r.len() > 512 || r.chars().any(|c| c.is_control() || c == ' ') {
            return Err(DecodeError::invalid(
                format!("{field}.registry"),
                "an http:// or https:// base URL of at most 512 characters",
            ));
        }
        let repo_ok = !self.repository.is_empty()
            && self.repository.len() <= 255
            && self.repository.split('/').all(|part| {
                !part.is_empty()
                    && part.bytes().all(|b| {
                        b.is_ascii_lowercase()
                            || b.is_ascii_digit()
                            || matches!(b, b'.' | b'_' | b'-')
                    })
            });
        if !repo_ok {
            return Err(DecodeError::invalid(
                format!("{field}.repository"),
                "path components of a-z 0-9 . _ - separated by /",
            ));
        }
        Ok(())
    }

    /// The item's name in an `applied` report: `artifact:<digest>`.
    pub fn item_name(&self) -> String {
        format!("artifact:{}", self.digest)
    }
}

/// What one revision runs, as `delivery.module.targets` carries it to
/// inventory: the unit of every replica that runs this revision.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RevisionUnit {
    /// The revision's id.
    pub id: Uuid,
    /// The artifact it runs from, if any: a relative `command` is resolved in
    /// the artifact's directory, which is also the default working directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact: Option<ArtifactDigest>,
    pub command: String,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub working_dir: Option<String>,
    #[serde(default)]
    pub restart: RestartPolicy,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[cfg_attr(feature = "openapi", schema(value_type = Vec<Object>))]
    pub probes: Vec<Probe>,
}

/// Body of `delivery.module.targets`: the revision each node's replicas of
/// `module` must run, whole (never a delta). A node absent from `targets`
/// runs the module's own unit spec (inventory's). `version` grows with every
/// event of the module; a receiver keeps the newest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModuleTargets {
    pub module: String,
    pub version: i64,
    /// The revisions `targets` names.
    pub revisions: Vec<RevisionUnit>,
    /// Each node's revision, a node at most once.
    pub targets: Vec<NodeTarget>,
}

/// One node's revision in a [`ModuleTargets`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeTarget {
    pub node: NodeId,
    pub revision: Uuid,
}

impl ModuleTargets {
    pub(crate) fn validate(&self) -> Result<(), DecodeError> {
        validate_module_name("body.module", &self.module)?;
        if self.revisions.len() > MAX_TARGET_REVISIONS {
            return Err(DecodeError::invalid(
                "body.revisions",
                format!("more than {MAX_TARGET_REVISIONS} revisions"),
            ));
        }
        for (i, r) in self.revisions.iter().enumerate() {
            r.unit_item(&self.module, &self.module, None)
                .validate(&format!("body.revisions[{i}]"))?;
        }
        let mut nodes = std::collections::BTreeSet::new();
        for (i, t) in self.targets.iter().enumerate() {
            if !self.revisions.iter().any(|r| r.id == t.revision) {
                return Err(DecodeError::invalid(
                    format!("body.targets[{i}].revision"),
                    format!("revision {} is not among the event's revisions", t.revision),
                ));
            }
            if !nodes.insert(&t.node) {
                return Err(DecodeError::invalid(
                    format!("body.targets[{i}].node"),
                    format!("`{}` is targeted twice", t.node),
                ));
            }
        }
        Ok(())
    }
}

impl RevisionUnit {
    /// The unit one replica runs under this revision.
    pub fn unit_item(
        &self,
        module: &str,
        unit_name: &str,
        desired: Option<crate::DesiredState>,
    ) -> crate::UnitItem {
        crate::UnitItem {
            user: Default::default(),
            limits: Default::default(),
            stateful: false,
            name: unit_name.to_owned(),
            module: module.to_owned(),
            command: self.command.clone(),
            args: self.args.clone(),
            env: self.env.clone(),
            working_dir: self.working_dir.clone(),
            restart: self.restart,
            desired: desired.unwrap_or_default(),
            probes: self.probes.clone(),
            artifact: self.artifact.clone(),
            revision: Some(self.id),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_parse_strictly() {
        let d = ArtifactDigest::of(b"hello");
        assert_eq!(
            d.as_str(),
            "sha256:2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
        );
        assert!(ArtifactDigest::parse("d", d.as_str()).is_ok());
        for bad in [
            "latest",
            "sha256:2CF24DBA5FB0A30E26E83B2AC5B9E29E1B161E5C1FA7425E73043362938B9824",
            "sha512:00",
            "sha256:abc",
        ] {
            let e = ArtifactDigest::parse("unit.artifact", bad).unwrap_err();
            assert!(e.to_string().contains("unit.artifact"), "{e}");
        }
        assert_eq!(
            d.signature_tag(),
            "sha256-2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824.sig"
        );
    }

    #[test]
    fn declared_artifact_keys_are_validated_naming_the_field() {
        let key = crate::DeclarationSigner::from_seed([1; 32]).public_key_hex();
        let items = |keys: Vec<TrustedArtifactKey>| crate::DeclarationItems {
            artifact_keys: Some(keys),
            ..Default::default()
        };
        let k = |name: &str, key: &str| TrustedArtifactKey {
            name: name.to_owned(),
            key: key.to_owned(),
        };
        assert!(items(vec![k("alice", &key)]).validate().is_ok());
        assert!(items(vec![]).validate().is_ok(), "an empty list: nobody");
        for (keys, field) in [
            (vec![k("alice", "zz")], "body.items.artifact_keys[0].key"),
            (vec![k("", &key)], "body.items.artifact_keys[0].name"),
            (
                vec![k("alice", &key), k("bob", &key)],
                "body.items.artifact_keys[1].key",
            ),
        ] {
            let e = items(keys).validate().unwrap_err();
            assert!(e.to_string().contains(field), "{e}");
        }
    }

    #[test]
    fn signatures_verify_only_for_trusted_keys_and_their_digest() {
        let controller = crate::DeclarationSigner::from_seed([1; 32]);
        let stranger = crate::DeclarationSigner::from_seed([2; 32]);
        let trusted = [PublicKey::from_hex(&controller.public_key_hex()).unwrap()];
        let d = ArtifactDigest::of(b"bytes");
        let other = ArtifactDigest::of(b"other");
        assert!(
            ArtifactSignature::sign(&controller, &d)
                .verify(&d, &trusted)
                .is_ok()
        );
        assert!(matches!(
            ArtifactSignature::sign(&stranger, &d).verify(&d, &trusted),
            Err(ArtifactSignatureError::Untrusted { .. })
        ));
        assert!(matches!(
            ArtifactSignature::sign(&controller, &other).verify(&d, &trusted),
            Err(ArtifactSignatureError::OtherDigest { .. })
        ));
        // Of several signatures, one by a trusted key is enough.
        let both = [
            ArtifactSignature::sign(&stranger, &d),
            ArtifactSignature::sign(&controller, &d),
        ];
        let ok = ArtifactSignature::verify_any(&both, &d, &trusted).unwrap();
        assert_eq!(ok.key, controller.public_key_hex());
        let refused = ArtifactSignature::verify_any(&both[..1], &d, &trusted).unwrap_err();
        assert!(matches!(
            refused.as_slice(),
            [ArtifactSignatureError::Untrusted { .. }]
        ));
        assert!(
            ArtifactSignature::verify_any(&[], &d, &trusted)
                .unwrap_err()
                .is_empty()
        );
        // A trusted key claimed over a stranger's signature does not verify.
        let mut forged = ArtifactSignature::sign(&stranger, &d);
        forged.key = controller.public_key_hex();
        assert!(matches!(
            forged.verify(&d, &trusted),
            Err(ArtifactSignatureError::Invalid(_))
        ));
    }
}
