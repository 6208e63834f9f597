//! The delivery context's artifact store over the OCI registry (`mesh-oci`):
//! a pushed artifact's blob and manifest stored by digest, and beside it
//! (the manifest tagged `sha256-<hex>.sig`, one layer per key) the
//! signatures agents verify before they unpack or run it: operators'
//! signatures uploaded through the API (decision 0048) and, only in a fleet
//! that trusts the controller's key (`trust_controller_artifact_signatures`),
//! the controller's own, made at push time. The signing key is the
//! controller's, read once, never leaving the process.

use std::sync::Arc;

use mesh_delivery::{ArtifactStore, BoxFuture};
use mesh_oci::Registry;
use mesh_protocol::{ARTIFACT_REPOSITORY, ArtifactDigest, ArtifactSignature, DeclarationSigner};

/// The registry the controller pushes to and the base URL agents pull from.
pub struct RegistryStore {
    registry: Registry,
    signer: Arc<DeclarationSigner>,
    /// Whether the controller signs at push time (and agents trust it).
    trust_controller: bool,
    pull_url: String,
}

impl RegistryStore {
    pub fn new(
        push_url: &str,
        pull_url: Option<&str>,
        signer: Arc<DeclarationSigner>,
        trust_controller: bool,
    ) -> Result<RegistryStore, mesh_oci::OciError> {
        let client = reqwest::Client::builder()
            .timeout(std::time::Duration::from_secs(300))
            .build()
            .map_err(|e| mesh_oci::OciError::BadUrl {
                url: push_url.to_owned(),
                reason: format!("no HTTP client: {e}"),
            })?;
        let registry = Registry::new(push_url, client)?;
        Ok(RegistryStore {
            pull_url: pull_url
                .unwrap_or(push_url)
                .trim_end_matches('/')
                .to_owned(),
            registry,
            signer,
            trust_controller,
        })
    }
}

impl ArtifactStore for RegistryStore {
    fn push<'a>(
        &'a self,
        bytes: &'a [u8],
    ) -> BoxFuture<'a, Result<(ArtifactDigest, Option<String>), String>> {
        Box::pin(async move {
            let digest = self
                .registry
                .push_artifact(ARTIFACT_REPOSITORY, bytes)
                .await
                .map_err(|e| e.to_string())?;
            if !self.trust_controller {
                return Ok((digest, None));
            }
            let signature = ArtifactSignature::sign(&self.signer, &digest);
            self.registry
                .push_signature(ARTIFACT_REPOSITORY, &signature)
                .await
                .map_err(|e| e.to_string())?;
            Ok((digest, Some(signature.key)))
        })
    }

    fn attach_signature<'a>(
        &'a self,
        signature: &'a ArtifactSignature,
    ) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            self.registry
                .push_signature(ARTIFACT_REPOSITORY, signature)
                .await
                .map_err(|e| e.to_string())
        })
    }

    fn controller_key(&self) -> String {
        self.signer.public_key_hex()
    }

    fn controller_trusted(&self) -> bool {
        self.trust_controller
    }

    fn pull_location(&self) -> (String, String) {
        (self.pull_url.clone(), ARTIFACT_REPOSITORY.to_owned())
    }
}
