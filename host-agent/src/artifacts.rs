//! The artifact cache: the delivery section's artifacts, verified and unpacked
//! under `<state_dir>/artifacts/sha256/<hex>/` (decision 0032).
//!
//! An artifact is fetched once. Before anything of it is written, one of its
//! signatures (the layers of the manifest tagged `sha256-<hex>.sig` beside it
//! in the registry) must verify against a key this mesh trusts: the keys the
//! delivery section declares (`artifact_keys`: operators' keys an admin
//! added, and the controller's own only when the fleet opts in; decision
//! 0048), or, from a controller older than that field, the controller's key
//! received at enrolment. Otherwise the item fails with "no trusted
//! signature"; then its blob is streamed to a temporary file while
//! hashed, and a digest that differs from the declared one throws the file away
//! with nothing unpacked. Only then is the tar unpacked, safely (no absolute
//! paths, no `..`, no link leaving the directory, no device files; modes kept
//! without setuid/setgid) into a temporary directory that one rename makes
//! the cached directory: a directory under `sha256/` is always complete.
//! A cached artifact is never fetched again; units run from it
//! ([`crate::units`]).

use std::io;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use mesh_oci::{OciError, Registry};
use mesh_protocol::{
    ArtifactDigest, ArtifactItem, ArtifactSignature, ArtifactSignatureError, ItemOutcome,
    PublicKey, TrustedArtifactKey,
};
use serde::Deserialize;
use tracing::{info, warn};

use crate::metrics::Metrics;

/// The cache's directory under the state dir.
pub const ARTIFACTS_DIR: &str = "artifacts";

/// The `[artifacts]` table of the agent's config.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ArtifactsConfig {
    /// Largest artifact (its tar, as the registry serves it) the agent pulls;
    /// a larger one is not cached and its item fails. Default 512 MiB.
    pub max_bytes: u64,
    /// How long fetching one artifact (signature, blob, unpacking) may take
    /// before its item fails. The broker session applies no other declaration
    /// meanwhile; its heartbeats go on. Seconds or a string such as `"2m"`.
    /// Default 120 s.
    #[serde(deserialize_with = "crate::duration::de_duration")]
    pub fetch_timeout: Duration,
}

impl Default for ArtifactsConfig {
    fn default() -> Self {
        ArtifactsConfig {
            max_bytes: 512 * 1024 * 1024,
            fetch_timeout: Duration::from_secs(120),
        }
    }
}

impl ArtifactsConfig {
    /// Check what types cannot; errors name the field (`artifacts.<field>`).
    pub fn validate(&self) -> Result<(), (String, String)> {
        if self.max_bytes < 1024 {
            return Err(("artifacts.max_bytes".into(), "must be at least 1024".into()));
        }
        if self.fetch_timeout < Duration::from_secs(1) {
            return Err((
                "artifacts.fetch_timeout".into(),
                "must be at least 1s".into(),
            ));
        }
        Ok(())
    }
}

/// Where the artifact `digest` is (or would be) cached under `state_dir`.
pub fn artifact_dir(state_dir: &Path, digest: &ArtifactDigest) -> PathBuf {
    cache_root(state_dir).join("sha256").join(digest.hex())
}

fn cache_root(state_dir: &Path) -> PathBuf {
    state_dir.join(ARTIFACTS_DIR)
}

/// Whether `digest` is cached (its directory exists: it only ever appears
/// whole, by a rename).
pub fn is_cached(state_dir: &Path, digest: &ArtifactDigest) -> bool {
    artifact_dir(state_dir, digest).is_dir()
}

/// Fetches, verifies and caches artifacts.
#[derive(Clone)]
pub struct Artifacts {
    state_dir: PathBuf,
    config: ArtifactsConfig,
    trusted: Vec<PublicKey>,
    client: reqwest::Client,
    metrics: Metrics,
}

/// The keys one fetch trusts: the delivery section's `artifact_keys`, or
/// (absent) the key received at enrolment.
#[derive(Debug, Clone, Default)]
pub struct TrustedKeys(Vec<(String, PublicKey)>);

impl TrustedKeys {
    /// The keys a delivery section declares: each is validated by the
    /// declaration's decoding already, so one that does not parse here is
    /// left out (trusting less, never more).
    pub fn declared(keys: &[TrustedArtifactKey]) -> TrustedKeys {
        TrustedKeys(
            keys.iter()
                .filter_map(|k| Some((k.name.clone(), PublicKey::from_hex(&k.key).ok()?)))
                .collect(),
        )
    }

    fn keys(&self) -> Vec<PublicKey> {
        self.0.iter().map(|(_, k)| k.clone()).collect()
    }

    fn name_of(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(_, k)| k.to_hex() == key)
            .map(|(n, _)| n.as_str())
    }
}

/// Why an artifact is not cached; the text is its item's error.
#[derive(Debug, thiserror::Error)]
enum FetchError {
    #[error(
        "artifact {digest} has no trusted signature: it has no signature in the registry (tag {tag}): pushed around the mesh, or not signed yet (`meshctl artifact sign`)"
    )]
    NoSignature { digest: ArtifactDigest, tag: String },
    #[error("artifact {digest} has no trusted signature: {}", shown(.refused))]
    NoTrustedSignature {
        digest: ArtifactDigest,
        refused: Vec<ArtifactSignatureError>,
    },
    #[error("artifact {digest}: {source}")]
    Registry {
        digest: ArtifactDigest,
        source: OciError,
    },
    #[error("artifact {digest}: unpacking: {reason}")]
    Unpack {
        digest: ArtifactDigest,
        reason: String,
    },
    #[error("artifact {digest}: not fetched within {timeout:?}")]
    Timeout {
        digest: ArtifactDigest,
        timeout: Duration,
    },
    #[error("artifact {digest}: the cache: {source}")]
    Io {
        digest: ArtifactDigest,
        source: io::Error,
    },
}

/// Why each signature was refused, at most four of them.
fn shown(refused: &[ArtifactSignatureError]) -> String {
    let mut parts: Vec<String> = refused.iter().take(4).map(ToString::to_string).collect();
    if refused.len() > 4 {
        parts.push(format!("and {} more", refused.len() - 4));
    }
    parts.join("; ")
}

impl FetchError {
    fn outcome(&self) -> &'static str {
        match self {
            FetchError::NoSignature { .. } => "no_signature",
            FetchError::NoTrustedSignature { .. } => "untrusted",
            FetchError::Registry {
                source: OciError::DigestMismatch { .. },
                ..
            } => "digest_mismatch",
            _ => "error",
        }
    }
}

impl Artifacts {
    /// The cache under `state_dir`, trusting artifacts signed by one of
    /// `trusted` (the controller's key from enrolment) when a delivery
    /// section declares no keys of its own; https registries are verified
    /// against `ca_pem` (the mesh CA) alone, and without one no https
    /// registry is trusted. Leftovers of an interrupted fetch are removed.
    pub fn new(
        state_dir: &Path,
        config: ArtifactsConfig,
        trusted: Vec<PublicKey>,
        ca_pem: Option<&str>,
        metrics: Metrics,
    ) -> Result<Artifacts, String> {
        let tls = match ca_pem {
            Some(pem) => crate::join::mesh_ca_client_config(pem)?,
            None => rustls::ClientConfig::builder_with_provider(crate::join::provider())
                .with_safe_default_protocol_versions()
                .map_err(|e| e.to_string())?
                .with_root_certificates(rustls::RootCertStore::empty())
                .with_no_client_auth(),
        };
        let client = reqwest::Client::builder()
            .use_preconfigured_tls(tls)
            .connect_timeout(Duration::from_secs(10))
            .timeout(config.fetch_timeout)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| format!("the registry client: {e}"))?;
        let _ = std::fs::remove_dir_all(cache_root(state_dir).join("tmp"));
        let a = Artifacts {
            state_dir: state_dir.to_owned(),
            config,
            trusted,
            client,
            metrics,
        };
        a.metrics.set_artifacts_cached(a.count());
        Ok(a)
    }

    /// How many artifacts are cached.
    pub fn count(&self) -> usize {
        std::fs::read_dir(cache_root(&self.state_dir).join("sha256"))
            .map(|d| d.filter_map(Result::ok).count())
            .unwrap_or(0)
    }

    /// Make every item cached: one outcome per item, named
    /// [`ArtifactItem::item_name`]; `true` in the second place when something
    /// new was cached. `declared` is the section's `artifact_keys`: the
    /// keys a new artifact must be signed by (`None`: a controller older
    /// than them; the key received at enrolment).
    pub async fn ensure_all(
        &self,
        items: &[ArtifactItem],
        declared: Option<&[TrustedArtifactKey]>,
    ) -> (Vec<ItemOutcome>, bool) {
        let trusted = match declared {
            Some(keys) => TrustedKeys::declared(keys),
            None => TrustedKeys(
                self.trusted
                    .iter()
                    .map(|k| ("controller".to_owned(), k.clone()))
                    .collect(),
            ),
        };
        let mut outcomes = Vec::with_capacity(items.len());
        let mut gained = false;
        for item in items {
            let result =
                match tokio::time::timeout(self.config.fetch_timeout, self.ensure(item, &trusted))
                    .await
                {
                    Ok(r) => r,
                    Err(_) => Err(FetchError::Timeout {
                        digest: item.digest.clone(),
                        timeout: self.config.fetch_timeout,
                    }),
                };
            match result {
                Ok(fetched) => {
                    gained |= fetched;
                    outcomes.push(ItemOutcome {
                        item: item.item_name(),
                        ok: true,
                        error: None,
                    });
                }
                Err(e) => {
                    warn!(artifact = %item.digest, registry = %item.registry, error = %e, "artifact not cached");
                    self.metrics.artifact_fetched(e.outcome());
                    outcomes.push(ItemOutcome {
                        item: item.item_name(),
                        ok: false,
                        error: Some(e.to_string()),
                    });
                }
            }
        }
        // Whatever an aborted fetch left.
        let _ = tokio::fs::remove_dir_all(cache_root(&self.state_dir).join("tmp")).await;
        self.metrics.set_artifacts_cached(self.count());
        (outcomes, gained)
    }

    /// Cache one artifact: `Ok(false)` if it already was.
    // Long on purpose: one artifact's way into the cache in its numbered
    // steps (signed by a trusted key before a byte is pulled, the bytes
    // verified while they stream, unpacked and renamed into place whole),
    // each guarding the next.
    async fn ensure(&self, item: &ArtifactItem, trusted: &TrustedKeys) -> Result<bool, FetchError> {
        let digest = &item.digest;
        let target = artifact_dir(&self.state_dir, digest);
        if target.is_dir() {
            return Ok(false);
        }
        let registry_err = |source| FetchError::Registry {
            digest: digest.clone(),
            source,
        };
        let io_err = |source| FetchError::Io {
            digest: digest.clone(),
            source,
        };
        let registry = Registry::new(&item.registry, self.client.clone()).map_err(registry_err)?;

        // 1. Signed by a key this mesh trusts, before a byte of it is pulled.
        let signatures: Vec<ArtifactSignature> = registry
            .fetch_signatures(&item.repository, digest)
            .await
            .map_err(registry_err)?
            .into_iter()
            .map(|(_, s)| s)
            .collect();
        if signatures.is_empty() {
            return Err(FetchError::NoSignature {
                digest: digest.clone(),
                tag: digest.signature_tag(),
            });
        }
        let signature = ArtifactSignature::verify_any(&signatures, digest, &trusted.keys())
            .map_err(|refused| FetchError::NoTrustedSignature {
                digest: digest.clone(),
                refused,
            })?
            .clone();
        let signer = trusted.name_of(&signature.key).unwrap_or("?").to_owned();

        // 2. The bytes, verified while they stream.
        let tmp = cache_root(&self.state_dir).join("tmp").join(format!(
            "{}.{:016x}",
            digest.hex(),
            rand::random::<u64>()
        ));
        tokio::fs::create_dir_all(&tmp).await.map_err(io_err)?;
        let result = async {
            let blob = tmp.join("artifact.tar");
            let size = registry
                .fetch_blob_to_file(&item.repository, digest, &blob, self.config.max_bytes)
                .await
                .map_err(registry_err)?;
            // 3. Unpacked into a temporary directory, renamed into place whole.
            let unpacked = tmp.join("root");
            let (b, u) = (blob.clone(), unpacked.clone());
            tokio::task::spawn_blocking(move || unpack(&b, &u))
                .await
                .map_err(|e| FetchError::Unpack {
                    digest: digest.clone(),
                    reason: e.to_string(),
                })?
                .map_err(|e| FetchError::Unpack {
                    digest: digest.clone(),
                    reason: e.to_string(),
                })?;
            let parent = target.parent().unwrap_or(&self.state_dir).to_owned();
            tokio::fs::create_dir_all(&parent).await.map_err(io_err)?;
            match tokio::fs::rename(&unpacked, &target).await {
                Ok(()) => {}
                // Another fetch of the same artifact won: it is cached.
                Err(_) if target.is_dir() => {}
                Err(e) => return Err(io_err(e)),
            }
            if let Ok(d) = std::fs::File::open(&parent) {
                let _ = d.sync_all();
            }
            Ok(size)
        }
        .await;
        let _ = tokio::fs::remove_dir_all(&tmp).await;
        let size = result?;
        self.metrics.artifact_fetched("ok");
        info!(artifact = %digest, bytes = size, signed_by = %signature.key, signer = %signer, "artifact verified and cached");
        Ok(true)
    }
}

/// Why a tar is not unpacked.
#[derive(Debug, thiserror::Error)]
pub enum UnpackError {
    #[error("entry `{path}`: {reason}")]
    Refused { path: String, reason: &'static str },
    #[error("{0}")]
    Io(#[from] io::Error),
}

/// Unpack the tar at `archive` into `dest` (created; must not exist). Refuses
/// absolute paths, `..`, symlinks whose target leaves `dest`, hard links to
/// anything not already unpacked, entries through a symlink, device files and
/// fifos. Files and directories keep their permission bits, without setuid,
/// setgid or sticky.
pub fn unpack(archive: &Path, dest: &Path) -> Result<(), UnpackError> {
    std::fs::create_dir_all(dest)?;
    let file = std::fs::File::open(archive)?;
    let mut tar = tar::Archive::new(io::BufReader::new(file));
    for entry in tar.entries()? {
        let mut entry = entry?;
        let raw = entry.path()?.into_owned();
        let shown = raw.display().to_string();
        let refuse = |reason| UnpackError::Refused {
            path: shown.chars().take(200).collect(),
            reason,
        };
        let rel = normal_relative(&raw).ok_or_else(|| {
            refuse("absolute paths and `..` are refused: every entry stays in the artifact")
        })?;
        if rel.as_os_str().is_empty() {
            continue; // `./`
        }
        let target = dest.join(&rel);
        if through_symlink(dest, &rel) {
            return Err(refuse("its path goes through a symlink"));
        }
        if std::fs::symlink_metadata(&target).is_ok_and(|m| !m.is_dir()) {
            return Err(refuse("declared twice"));
        }
        let mode = entry.header().mode().unwrap_or(0o644) & 0o777;
        let kind = entry.header().entry_type();
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent)?;
        }
        match kind {
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                let mut out = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(&target)?;
                io::copy(&mut entry, &mut out)?;
                out.set_permissions(std::fs::Permissions::from_mode(mode))?;
            }
            tar::EntryType::Directory => {
                std::fs::create_dir_all(&target)?;
                std::fs::set_permissions(&target, std::fs::Permissions::from_mode(mode | 0o700))?;
            }
            tar::EntryType::Symlink => {
                let link = entry
                    .link_name()?
                    .ok_or_else(|| refuse("a symlink without a target"))?
                    .into_owned();
                if link.is_absolute() {
                    return Err(refuse("a symlink to an absolute path"));
                }
                let base = rel.parent().unwrap_or(Path::new(""));
                if normal_relative(&base.join(&link)).is_none() {
                    return Err(refuse("a symlink that leaves the artifact"));
                }
                std::os::unix::fs::symlink(&link, &target)?;
            }
            tar::EntryType::Link => {
                let link = entry
                    .link_name()?
                    .ok_or_else(|| refuse("a hard link without a target"))?
                    .into_owned();
                let link_rel = normal_relative(&link)
                    .filter(|l| !l.as_os_str().is_empty())
                    .ok_or_else(|| refuse("a hard link that leaves the artifact"))?;
                if through_symlink(dest, &link_rel) {
                    return Err(refuse("a hard link through a symlink"));
                }
                let source = dest.join(&link_rel);
                if !std::fs::symlink_metadata(&source).is_ok_and(|m| m.is_file()) {
                    return Err(refuse("a hard link to a file not unpacked before it"));
                }
                std::fs::hard_link(&source, &target)?;
            }
            tar::EntryType::XGlobalHeader | tar::EntryType::XHeader => {}
            _ => return Err(refuse("only files, directories and links are unpacked")),
        }
    }
    Ok(())
}

/// `path` with `.` dropped, if it is relative and has no `..` (and no root).
fn normal_relative(path: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::Normal(p) => out.push(p),
            Component::CurDir => {}
            Component::ParentDir | Component::RootDir | Component::Prefix(_) => return None,
        }
    }
    Some(out)
}

/// Whether a proper ancestor of `dest/rel` under `dest` is a symlink.
fn through_symlink(dest: &Path, rel: &Path) -> bool {
    let mut cur = dest.to_owned();
    let parts: Vec<_> = rel.components().collect();
    for c in parts.iter().take(parts.len().saturating_sub(1)) {
        cur.push(c);
        if std::fs::symlink_metadata(&cur).is_ok_and(|m| m.file_type().is_symlink()) {
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tar of `entries`, written with raw headers so that the refused
    /// shapes (which `tar::Builder` itself refuses to write) can be made.
    fn tar_of(entries: &[(&str, tar::EntryType, &[u8], Option<&str>)]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (path, kind, data, link) in entries {
            let mut h = tar::Header::new_gnu();
            {
                let name = &mut h.as_old_mut().name;
                name[..path.len()].copy_from_slice(path.as_bytes());
            }
            h.set_entry_type(*kind);
            h.set_mode(0o755);
            h.set_size(data.len() as u64);
            if let Some(l) = link {
                let ln = &mut h.as_old_mut().linkname;
                ln[..l.len()].copy_from_slice(l.as_bytes());
            }
            h.set_cksum();
            b.append(&h, *data).unwrap();
        }
        b.into_inner().unwrap()
    }

    fn try_unpack(bytes: &[u8]) -> (tempfile::TempDir, Result<(), UnpackError>) {
        let dir = tempfile::tempdir().unwrap();
        let archive = dir.path().join("a.tar");
        std::fs::write(&archive, bytes).unwrap();
        let dest = dir.path().join("out");
        let r = unpack(&archive, &dest);
        (dir, r)
    }

    #[test]
    fn files_dirs_and_inner_links_unpack_with_their_modes() {
        let tar = tar_of(&[
            ("bin/", tar::EntryType::Directory, b"", None),
            (
                "bin/run.sh",
                tar::EntryType::Regular,
                b"#!/bin/sh\necho hi\n",
                None,
            ),
            ("run", tar::EntryType::Symlink, b"", Some("bin/run.sh")),
            ("again", tar::EntryType::Link, b"", Some("bin/run.sh")),
        ]);
        let (dir, r) = try_unpack(&tar);
        r.unwrap();
        let out = dir.path().join("out");
        let meta = std::fs::metadata(out.join("bin/run.sh")).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o755);
        assert_eq!(
            std::fs::read(out.join("run")).unwrap(),
            b"#!/bin/sh\necho hi\n"
        );
        assert_eq!(
            std::fs::read(out.join("again")).unwrap(),
            b"#!/bin/sh\necho hi\n"
        );
    }

    #[test]
    fn escapes_are_refused() {
        let cases: Vec<(&str, Vec<u8>)> = vec![
            (
                "dotdot",
                tar_of(&[("../evil", tar::EntryType::Regular, b"x", None)]),
            ),
            (
                "inner dotdot",
                tar_of(&[("a/../../evil", tar::EntryType::Regular, b"x", None)]),
            ),
            (
                "absolute",
                tar_of(&[("/tmp/evil", tar::EntryType::Regular, b"x", None)]),
            ),
            (
                "symlink out",
                tar_of(&[("l", tar::EntryType::Symlink, b"", Some("../../etc"))]),
            ),
            (
                "absolute symlink",
                tar_of(&[("l", tar::EntryType::Symlink, b"", Some("/etc"))]),
            ),
            (
                "through a symlink",
                tar_of(&[
                    ("l", tar::EntryType::Symlink, b"", Some(".")),
                    ("l/x", tar::EntryType::Regular, b"x", None),
                ]),
            ),
            (
                "hard link out",
                tar_of(&[("h", tar::EntryType::Link, b"", Some("../../etc/passwd"))]),
            ),
            (
                "device",
                tar_of(&[("dev", tar::EntryType::Char, b"", None)]),
            ),
        ];
        for (what, tar) in cases {
            let (dir, r) = try_unpack(&tar);
            let e = r.expect_err(what);
            assert!(matches!(e, UnpackError::Refused { .. }), "{what}: {e}");
            assert!(!dir.path().join("evil").exists(), "{what}");
            assert!(
                !dir.path().parent().unwrap().join("evil").exists(),
                "{what}"
            );
        }
    }
}
