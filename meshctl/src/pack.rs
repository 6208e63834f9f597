//! Packing an artifact: a tar archive the same tree always gives byte for
//! byte (so the same digest): entries sorted by name, modes kept, mtime 0,
//! uid/gid 0, no owner names, no extended attributes.

use anyhow::{Context as _, bail};
use sha2::{Digest as _, Sha256};
use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;

/// The archive of `path`: a directory's contents at the archive's root, or a
/// single file as one entry named by its file name.
pub fn pack(path: &Path) -> anyhow::Result<Vec<u8>> {
    let meta = std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?;
    let mut builder = tar::Builder::new(Vec::new());
    builder.follow_symlinks(false);
    if meta.is_dir() {
        add_dir(&mut builder, path, "")?;
    } else if meta.is_file() {
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .with_context(|| format!("{}: no usable file name", path.display()))?;
        add_file(&mut builder, path, name, &meta)?;
    } else {
        bail!("{}: neither a file nor a directory", path.display());
    }
    builder
        .into_inner()
        .with_context(|| format!("packing {}", path.display()))
}

/// `sha256:<hex>` of `bytes`, the way the controller names an artifact.
pub fn digest(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

fn header(kind: tar::EntryType, mode: u32, size: u64) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    h.set_mode(mode & 0o7777);
    h.set_size(size);
    h.set_mtime(0);
    h.set_uid(0);
    h.set_gid(0);
    h
}

fn add_file(
    builder: &mut tar::Builder<Vec<u8>>,
    path: &Path,
    name: &str,
    meta: &std::fs::Metadata,
) -> anyhow::Result<()> {
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut h = header(
        tar::EntryType::Regular,
        meta.permissions().mode(),
        meta.len(),
    );
    builder
        .append_data(&mut h, name, file)
        .with_context(|| format!("packing {}", path.display()))
}

fn add_dir(builder: &mut tar::Builder<Vec<u8>>, dir: &Path, prefix: &str) -> anyhow::Result<()> {
    let mut entries = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("reading {}", dir.display()))?;
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let path = entry.path();
        let file_name = entry.file_name();
        let Some(file_name) = file_name.to_str() else {
            bail!("{}: the name is not UTF-8", path.display());
        };
        let name = format!("{prefix}{file_name}");
        let meta = std::fs::symlink_metadata(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let kind = meta.file_type();
        if kind.is_dir() {
            let mut h = header(tar::EntryType::Directory, meta.permissions().mode(), 0);
            builder
                .append_data(&mut h, format!("{name}/"), std::io::empty())
                .with_context(|| format!("packing {}", path.display()))?;
            add_dir(builder, &path, &format!("{name}/"))?;
        } else if kind.is_symlink() {
            let target = std::fs::read_link(&path)
                .with_context(|| format!("reading the link {}", path.display()))?;
            let mut h = header(tar::EntryType::Symlink, 0o777, 0);
            builder
                .append_link(&mut h, &name, &target)
                .with_context(|| format!("packing {}", path.display()))?;
        } else if kind.is_file() {
            add_file(builder, &path, &name, &meta)?;
        } else {
            bail!(
                "{}: neither a file, a directory nor a symlink",
                path.display()
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    fn tree(root: &Path, mtime: std::time::SystemTime) {
        // Made in an order other than the sorted one.
        fs::create_dir_all(root.join("bin")).unwrap();
        fs::write(root.join("z.txt"), b"last").unwrap();
        fs::write(root.join("bin/app"), b"#!/bin/sh\necho hi\n").unwrap();
        fs::write(root.join("a.txt"), b"first").unwrap();
        fs::set_permissions(root.join("bin/app"), fs::Permissions::from_mode(0o755)).unwrap();
        fs::set_permissions(root.join("a.txt"), fs::Permissions::from_mode(0o640)).unwrap();
        std::os::unix::fs::symlink("bin/app", root.join("run")).unwrap();
        // Past ustar's 100-byte names (a GNU long-name entry, itself mtime 0).
        let deep = root.join("share").join("d".repeat(60)).join("e".repeat(60));
        fs::create_dir_all(&deep).unwrap();
        fs::write(deep.join("f.txt"), b"deep").unwrap();
        for f in ["z.txt", "bin/app", "a.txt"] {
            fs::File::options()
                .write(true)
                .open(root.join(f))
                .unwrap()
                .set_modified(mtime)
                .unwrap();
        }
    }

    fn entries(archive: &[u8]) -> Vec<(String, u32, u64, u64, u64)> {
        let mut a = tar::Archive::new(archive);
        a.entries()
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                let h = e.header();
                (
                    e.path().unwrap().to_string_lossy().into_owned(),
                    h.mode().unwrap(),
                    h.mtime().unwrap(),
                    h.uid().unwrap(),
                    h.gid().unwrap(),
                )
            })
            .collect()
    }

    #[test]
    fn the_same_tree_gives_the_same_digest() {
        let one = tempfile::tempdir().unwrap();
        let two = tempfile::tempdir().unwrap();
        tree(
            one.path(),
            std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_000),
        );
        tree(two.path(), std::time::SystemTime::now());
        let a = pack(one.path()).unwrap();
        let b = pack(one.path()).unwrap();
        let c = pack(two.path()).unwrap();
        assert_eq!(digest(&a), digest(&b));
        assert_eq!(
            digest(&a),
            digest(&c),
            "mtimes and the temp dir's name do not count"
        );
        assert!(digest(&a).starts_with("sha256:") && digest(&a).len() == 7 + 64);
        // A changed byte changes it.
        fs::write(two.path().join("z.txt"), b"Last").unwrap();
        assert_ne!(digest(&a), digest(&pack(two.path()).unwrap()));
    }

    #[test]
    fn entries_are_sorted_at_the_root_with_modes_kept_and_no_times_or_owners() {
        let dir = tempfile::tempdir().unwrap();
        tree(dir.path(), std::time::SystemTime::now());
        let archive = pack(dir.path()).unwrap();
        let got = entries(&archive);
        let names: Vec<&str> = got.iter().map(|e| e.0.as_str()).collect();
        let deep = format!("share/{}/{}/", "d".repeat(60), "e".repeat(60));
        assert_eq!(
            names,
            [
                "a.txt",
                "bin/",
                "bin/app",
                "run",
                "share/",
                &format!("share/{}/", "d".repeat(60)),
                &deep,
                &format!("{deep}f.txt"),
                "z.txt"
            ]
        );
        let mode = |n: &str| got.iter().find(|e| e.0 == n).unwrap().1;
        assert_eq!(mode("bin/app"), 0o755);
        assert_eq!(mode("a.txt"), 0o640);
        assert!(got.iter().all(|e| e.2 == 0 && e.3 == 0 && e.4 == 0));
        let mut a = tar::Archive::new(&archive[..]);
        let link = a
            .entries()
            .unwrap()
            .map(|e| e.unwrap())
            .find(|e| e.path().unwrap().to_str() == Some("run"))
            .unwrap();
        assert_eq!(link.header().entry_type(), tar::EntryType::Symlink);
        assert_eq!(link.link_name().unwrap().unwrap().to_str(), Some("bin/app"));
    }

    #[test]
    fn a_single_file_is_one_entry_named_by_its_file_name() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("server");
        fs::write(&f, b"\x7fELF...").unwrap();
        fs::set_permissions(&f, fs::Permissions::from_mode(0o750)).unwrap();
        let archive = pack(&f).unwrap();
        assert_eq!(entries(&archive), [("server".to_owned(), 0o750, 0, 0, 0)]);
        let mut a = tar::Archive::new(&archive[..]);
        let mut e = a.entries().unwrap().next().unwrap().unwrap();
        let mut content = Vec::new();
        std::io::Read::read_to_end(&mut e, &mut content).unwrap();
        assert_eq!(content, b"\x7fELF...");
        assert_eq!(digest(&archive), digest(&pack(&f).unwrap()));
    }

    #[test]
    fn a_missing_path_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let e = pack(&dir.path().join("nope")).unwrap_err();
        assert!(format!("{e:#}").contains("nope"));
    }
}
