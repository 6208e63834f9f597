//! The delivery context's artifact store over the OCI registry (`mesh-oci`):
//! a pushed artifact's blob and manifest stored by digest, then the
//! controller's signature of the digest beside it (the manifest tagged
//! `sha256-<hex>.sig`), which agents verify before they unpack or run it.
//! The signing key is the controller's, read once, never leaving the process.

use std::sync::Arc;

use mesh_delivery::{ArtifactStore, BoxFuture};
use mesh_oci::Registry;
use mesh_protocol::{ARTIFACT_REPOSITORY, ArtifactDigest, ArtifactSignature, DeclarationSigner};

/// The registry the controller pushes to and the base URL agents pull from.
pub struct RegistryStore {
    registry: Registry,
    signer: Arc<DeclarationSigner>,
    pull_url: String,
}

impl RegistryStore {
    pub fn new(
        push_url: &str,
        pull_url: Option<&str>,
        signer: Arc<DeclarationSigner>,
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
        })
    }
}

impl ArtifactStore for RegistryStore {
    fn push_signed<'a>(
        &'a self,
        bytes: &'a [u8],
    ) -> BoxFuture<'a, Result<(ArtifactDigest, String), String>> {
        Box::pin(async move {
            let digest = self
                .registry
                .push_artifact(ARTIFACT_REPOSITORY, bytes)
                .await
                .map_err(|e| e.to_string())?;
            let signature = ArtifactSignature::sign(&self.signer, &digest);
            self.registry
                .push_signature(ARTIFACT_REPOSITORY, &signature)
                .await
                .map_err(|e| e.to_string())?;
            Ok((digest, signature.key))
        })
    }

    fn pull_location(&self) -> (String, String) {
        (self.pull_url.clone(), ARTIFACT_REPOSITORY.to_owned())
    }
}
