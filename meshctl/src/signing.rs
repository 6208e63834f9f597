//! Operator-held signing keys (issue 29, point 4; decision 0048): make a key
//! pair file, sign an artifact's digest with it and upload the signature,
//! and (admins) add, list and remove the public keys nodes trust.
//!
//! A private key file is the Ed25519 seed as 64 hex digits and a newline,
//! mode 0600 (the controller's signing key file has the same shape); its
//! public half is `<file>.pub` (64 hex digits). The private key never leaves
//! this process: only the signature is sent.

use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context as _, bail};
use clap::Subcommand;
use mesh_protocol::{ArtifactDigest, ArtifactSignature, DeclarationSigner, PublicKey};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::client::{Api, Body, urlencode};

#[derive(Subcommand)]
pub enum KeyCommand {
    /// Make an Ed25519 key pair for signing artifacts: the private key in
    /// <file> (mode 0600; never overwritten), the public key in <file>.pub,
    /// printed alone on stdout (give it to an admin: `signing-key add`).
    Generate {
        /// Where to write the private key.
        file: PathBuf,
    },
}

#[derive(Subcommand)]
pub enum SigningKeyCommand {
    /// Trust artifacts signed by a key (admin): nodes are told at once.
    Add {
        /// The key's name: 1 to 63 of a-z 0-9 . _ -.
        name: String,
        /// The public key: 64 hex digits, or a file holding them (`<file>.pub`
        /// of `meshctl key generate`).
        #[arg(long)]
        key: String,
    },
    /// The keys nodes trust (admin).
    List,
    /// Stop trusting a key (admin): nodes refuse artifacts signed only by it
    /// from their next delivery section on.
    Remove { name: String },
}

pub fn key(cmd: KeyCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        KeyCommand::Generate { file } => {
            let signer = DeclarationSigner::from_seed(random_seed()?);
            let public = signer.public_key_hex();
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&file)
                .with_context(|| format!("creating {} (never overwritten)", file.display()))?;
            f.write_all(format!("{}\n", signer.to_hex()).as_bytes())
                .and_then(|()| f.sync_all())
                .with_context(|| format!("writing {}", file.display()))?;
            let pub_path = pub_path(&file);
            std::fs::write(&pub_path, format!("{public}\n"))
                .with_context(|| format!("writing {}", pub_path.display()))?;
            eprintln!(
                "private key: {} (0600: keep it off the controller's host); public key: {}",
                file.display(),
                pub_path.display()
            );
            println!("{public}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn pub_path(file: &Path) -> PathBuf {
    let mut name = file.as_os_str().to_owned();
    name.push(".pub");
    PathBuf::from(name)
}

fn random_seed() -> anyhow::Result<[u8; 32]> {
    use std::io::Read as _;
    let mut seed = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut seed))
        .context("reading /dev/urandom")?;
    Ok(seed)
}

/// Read a private key file (64 hex digits).
pub fn read_private_key(path: &Path) -> anyhow::Result<DeclarationSigner> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    DeclarationSigner::from_hex(text.trim()).map_err(|e| {
        anyhow::anyhow!(
            "{} is not a private signing key (64 hex digits, as `meshctl key generate` writes): {e}",
            path.display()
        )
    })
}

/// A public key given as hex or as a file holding it.
fn public_key_arg(arg: &str) -> anyhow::Result<String> {
    let text = if arg.len() == 64 && arg.bytes().all(|b| b.is_ascii_hexdigit()) {
        arg.to_owned()
    } else {
        std::fs::read_to_string(arg)
            .with_context(|| format!("`{arg}` is neither 64 hex digits nor a readable file"))?
    };
    let key = PublicKey::from_hex(text.trim())
        .map_err(|e| anyhow::anyhow!("`{arg}`: not an Ed25519 public key: {e}"))?;
    Ok(key.to_hex())
}

/// `artifact sign <file-or-digest> --key <file>`: the digest (of the
/// archive `artifact push` would send, or as given), signed and uploaded.
pub async fn sign(api: &Api, target: &str, key: &Path) -> anyhow::Result<ExitCode> {
    let digest = if target.starts_with("sha256:") {
        ArtifactDigest::parse("digest", target)?
    } else {
        let archive = crate::pack::pack(Path::new(target))?;
        ArtifactDigest::parse("digest", &crate::pack::digest(&archive))?
    };
    let signer = read_private_key(key)?;
    let signature = ArtifactSignature::sign(&signer, &digest);
    let (status, v) = api
        .send(
            Method::POST,
            &format!("/v1/artifacts/{}/signatures", urlencode(digest.as_str())),
            Body::Json(json!({"key": signature.key, "signature": signature.signature})),
        )
        .await?;
    let what = if status == StatusCode::CREATED {
        "signed"
    } else {
        "already signed"
    };
    let signers: Vec<&str> = v["signers"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    eprintln!("{what}: {digest}, signed by {}", signers.join(", "));
    println!("{digest}");
    Ok(ExitCode::SUCCESS)
}

pub async fn signing_key(api: &Api, cmd: SigningKeyCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        SigningKeyCommand::Add { name, key } => {
            let key = public_key_arg(&key)?;
            let (status, v) = api
                .send(
                    Method::POST,
                    "/v1/signing-keys",
                    Body::Json(json!({"name": name, "key": key})),
                )
                .await?;
            let what = if status == StatusCode::CREATED {
                "added"
            } else {
                "already trusted"
            };
            eprintln!("{what}: {name} ({key})");
            println!("{}", v["name"].as_str().unwrap_or(&name));
        }
        SigningKeyCommand::List => {
            let v = api.call(Method::GET, "/v1/signing-keys", None).await?;
            let mut rows: Vec<Vec<String>> = v["keys"]
                .as_array()
                .map(Vec::as_slice)
                .unwrap_or_default()
                .iter()
                .map(|k| {
                    ["name", "key", "added_by", "added_at"]
                        .iter()
                        .map(|f| k[*f].as_str().unwrap_or("-").to_owned())
                        .collect()
                })
                .collect();
            if let Some(c) = v["controller_key"].as_str() {
                rows.push(vec![
                    "controller".into(),
                    c.to_owned(),
                    "trust_controller_artifact_signatures".into(),
                    "-".into(),
                ]);
            }
            print!(
                "{}",
                crate::output::compact_table(&["NAME", "KEY", "ADDED_BY", "ADDED_AT"], &rows)
            );
        }
        SigningKeyCommand::Remove { name } => {
            if name.is_empty() {
                bail!("a key's name is not empty");
            }
            api.call(
                Method::DELETE,
                &format!("/v1/signing-keys/{}", urlencode(&name)),
                None,
            )
            .await?;
            eprintln!("removed: {name}; nodes refuse artifacts signed only by it from now on");
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_generated_key_signs_what_its_public_half_verifies() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("release.key");
        key(KeyCommand::Generate { file: file.clone() }).unwrap();
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(&file).unwrap().permissions(),
        );
        assert_eq!(mode & 0o777, 0o600);
        let signer = read_private_key(&file).unwrap();
        let public = public_key_arg(&pub_path(&file).to_string_lossy()).unwrap();
        assert_eq!(public, signer.public_key_hex());
        let d = ArtifactDigest::of(b"bytes");
        let trusted = [PublicKey::from_hex(&public).unwrap()];
        ArtifactSignature::sign(&signer, &d)
            .verify(&d, &trusted)
            .unwrap();
        // Never overwritten.
        assert!(key(KeyCommand::Generate { file }).is_err());
        assert!(public_key_arg("nothing-here").is_err());
    }
}
