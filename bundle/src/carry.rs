//! The carried bundle: one archive holding the mesh's own packages and every
//! Debian package the foundation needs, so `bundle/up --from <archive>` raises
//! the foundation on a host with no network at all (issue 15, decision 0037).
//!
//! - [`pack`] (`mesh-bundle pack`): computes the foundation's dependency closure
//!   with apt against a throwaway dpkg status of a minbase Debian 12, downloads
//!   it, writes a flat apt repository (`repo/Packages`), the [`Manifest`] and
//!   one tar archive.
//! - [`verify`] (`mesh-bundle verify`, run by `bundle/up --from` before it
//!   installs anything): every file against the manifest (a missing, extra or
//!   altered file is refused, naming it), and the manifest against the host
//!   (another release or architecture is refused).
//!
//! The archive's layout, under one top directory [`TOP`]:
//!
//! ```text
//! mesh-bundle/manifest.json     the manifest (this module's Manifest)
//! mesh-bundle/up                bundle/up, as the mesh-controller package ships it
//! mesh-bundle/repo/Packages     the flat repository's index
//! mesh-bundle/repo/<name>_<version>_<arch>.deb
//! ```
//!
//! The manifest is JSON with one line per file, so that `bundle/up` can check
//! the mesh-controller package (which carries the verifier) with `sha256sum`
//! before it runs anything from it. It proves integrity (nothing altered,
//! missing or added since packing), not who packed it: `pack` prints the
//! manifest's sha256 to compare out of band.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::Read as _;
use std::path::{Component, Path, PathBuf};
use std::process::Command;

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

/// The archive's top directory.
pub const TOP: &str = "mesh-bundle";
/// The manifest's file name in [`TOP`].
pub const MANIFEST_FILE: &str = "manifest.json";
/// The flat repository's directory in [`TOP`].
pub const REPO_DIR: &str = "repo";
/// The format this code writes and reads; another is refused.
pub const FORMAT: u32 = 1;

/// The mesh's own packages, built by bundle/package (cargo-deb).
pub const MESH_PACKAGES: [&str; 2] = ["mesh-agent", "mesh-controller"];

/// The Debian packages the foundation needs: what `bundle/up`'s networked path
/// installs (a test keeps the two lists equal), their dependencies come with
/// them.
pub const FOUNDATION: [&str; 8] = [
    "postgresql",
    "rabbitmq-server",
    "python3-venv",
    "iproute2",
    "wireguard-tools",
    "wireguard-go",
    "nftables",
    "docker-registry",
];

/// The Debian release of a manifest or of a host (`/etc/os-release`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Release {
    pub id: String,
    pub version_id: String,
    pub codename: String,
}

impl std::fmt::Display for Release {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} ({})", self.id, self.version_id, self.codename)
    }
}

impl Release {
    /// The release archives are packed for: the only one the mesh supports.
    pub fn bookworm() -> Release {
        Release {
            id: "debian".into(),
            version_id: "12".into(),
            codename: "bookworm".into(),
        }
    }

    /// The release named by an os-release file's `ID`, `VERSION_ID` and
    /// `VERSION_CODENAME`.
    pub fn from_os_release(text: &str) -> Release {
        let mut fields = BTreeMap::new();
        for line in text.lines() {
            if let Some((k, v)) = line.split_once('=') {
                fields.insert(k.trim(), v.trim().trim_matches('"').to_string());
            }
        }
        let get = |k: &str| fields.get(k).cloned().unwrap_or_default();
        Release {
            id: get("ID"),
            version_id: get("VERSION_ID"),
            codename: get("VERSION_CODENAME"),
        }
    }

    fn same(&self, other: &Release) -> bool {
        self.id == other.id && self.version_id == other.version_id
    }
}

/// What a file of the archive is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// A Debian package of the foundation.
    Deb,
    /// One of the mesh's own packages.
    Mesh,
    /// The flat repository's `Packages`.
    Index,
    /// A script (`up`).
    Script,
}

/// One file of the archive. `package`, `version` and `architecture` are the
/// package's own control fields (read with dpkg-deb) for `deb` and `mesh`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileEntry {
    /// Relative to [`TOP`].
    pub path: String,
    pub kind: Kind,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub package: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub architecture: Option<String>,
    pub size: u64,
    pub sha256: String,
}

/// The manifest: what the archive holds, for which release and architecture.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// [`FORMAT`].
    pub format: u32,
    /// The Debian release the closure was computed for.
    pub release: Release,
    /// dpkg's architecture of the packages (`amd64`).
    pub architecture: String,
    /// When it was packed (RFC 3339, UTC).
    pub packed_at: String,
    /// The version of the mesh-controller package inside.
    pub mesh_version: String,
    /// What `bundle/up --from` installs (apt brings the rest from the repository).
    pub install: Vec<String>,
    /// Every file of the archive but the manifest itself.
    pub files: Vec<FileEntry>,
}

impl Manifest {
    /// JSON with one file per line (bundle/up reads the mesh-controller line
    /// with sed before it has a verifier).
    pub fn to_json(&self) -> String {
        let head = serde_json::json!({
            "format": self.format,
            "release": self.release,
            "architecture": self.architecture,
            "packed_at": self.packed_at,
            "mesh_version": self.mesh_version,
            "install": self.install,
        });
        let mut out = serde_json::to_string(&head).unwrap_or_default();
        out.pop(); // the closing brace: files follow
        out.push_str(",\n\"files\": [\n");
        let lines: Vec<String> = self
            .files
            .iter()
            .map(|f| serde_json::to_string(f).unwrap_or_default())
            .collect();
        out.push_str(&lines.join(",\n"));
        out.push_str("\n]}\n");
        out
    }

    /// Parse a manifest, naming what is wrong: not JSON, a missing or unknown
    /// field, or a format this code does not read.
    pub fn parse(text: &str) -> Result<Manifest, CarryError> {
        // The format first, so a future format with other fields says so
        // instead of naming an unknown field.
        let value: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| CarryError::ManifestUnparsable(e.to_string()))?;
        match value.get("format") {
            None => {
                return Err(CarryError::ManifestUnparsable(
                    "missing field `format`".into(),
                ));
            }
            Some(f) if f.as_u64() != Some(u64::from(FORMAT)) => {
                return Err(CarryError::ManifestFormat(f.to_string()));
            }
            Some(_) => {}
        }
        let m: Manifest = serde_json::from_value(value)
            .map_err(|e| CarryError::ManifestUnparsable(e.to_string()))?;
        let mut seen = BTreeSet::new();
        for f in &m.files {
            check_relative(&f.path)?;
            if f.path == MANIFEST_FILE {
                return Err(CarryError::ManifestUnparsable(format!(
                    "file `{}` lists the manifest itself",
                    f.path
                )));
            }
            if !seen.insert(f.path.as_str()) {
                return Err(CarryError::ManifestUnparsable(format!(
                    "file `{}` is listed twice",
                    f.path
                )));
            }
            if f.sha256.len() != 64 || !f.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(CarryError::ManifestUnparsable(format!(
                    "file `{}`: field `sha256` is not 64 hex digits",
                    f.path
                )));
            }
            if matches!(f.kind, Kind::Deb | Kind::Mesh)
                && (f.package.is_none() || f.version.is_none() || f.architecture.is_none())
            {
                return Err(CarryError::ManifestUnparsable(format!(
                    "file `{}`: a package needs `package`, `version` and `architecture`",
                    f.path
                )));
            }
        }
        Ok(m)
    }
}

/// Everything that can go wrong packing or verifying; each names what is wrong.
#[derive(Debug, thiserror::Error)]
pub enum CarryError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("manifest {MANIFEST_FILE} is missing from the archive")]
    ManifestMissing,
    #[error("manifest {MANIFEST_FILE} is not a bundle manifest: {0}")]
    ManifestUnparsable(String),
    #[error("manifest {MANIFEST_FILE} has format {0}; this mesh-bundle reads format {FORMAT}")]
    ManifestFormat(String),
    #[error("the archive was packed for {packed}, this host is {host}")]
    WrongRelease {
        packed: Box<Release>,
        host: Box<Release>,
    },
    #[error("the archive was packed for architecture {packed}, this host is {host}")]
    WrongArchitecture { packed: String, host: String },
    #[error("file `{0}` is in the manifest but missing from the archive")]
    Missing(String),
    #[error("file `{0}` is in the archive but not in the manifest")]
    Extra(String),
    #[error("file `{path}` is altered: sha256 {actual}, the manifest says {expected}")]
    Altered {
        path: String,
        expected: String,
        actual: String,
    },
    #[error("file `{path}` is altered: {actual} bytes, the manifest says {expected}")]
    Size {
        path: String,
        expected: u64,
        actual: u64,
    },
    #[error("`{0}` is not a plain relative path")]
    UnsafePath(String),
    #[error("`{0}` is not a regular file or directory (links are refused)")]
    NotRegular(String),
    #[error("`{command}` failed ({status}): {stderr}")]
    Command {
        command: String,
        status: String,
        stderr: String,
    },
    #[error("{0}")]
    Pack(String),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CarryError + '_ {
    move |source| CarryError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A path in the manifest: relative, only normal components.
fn check_relative(path: &str) -> Result<(), CarryError> {
    let p = Path::new(path);
    if path.is_empty() || !p.components().all(|c| matches!(c, Component::Normal(_))) {
        return Err(CarryError::UnsafePath(path.to_string()));
    }
    Ok(())
}

/// The sha256 (hex) and size of a file.
pub fn sha256_file(path: &Path) -> Result<(String, u64), CarryError> {
    let mut f = fs::File::open(path).map_err(io(path))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    let mut size = 0u64;
    loop {
        let n = f.read(&mut buf).map_err(io(path))?;
        if n == 0 {
            break;
        }
        size += n as u64;
        h.update(&buf[..n]);
    }
    Ok((hex::encode(h.finalize()), size))
}

/// What a verified archive holds.
#[derive(Debug)]
pub struct Verified {
    pub manifest: Manifest,
    /// The manifest file's own sha256.
    pub manifest_sha256: String,
    /// Bytes of all files checked.
    pub bytes: u64,
}

/// Verify an extracted archive (`root` holds [`TOP`]) against its manifest and
/// the host: the manifest parses, is for `host` and `arch`, every file it lists
/// is there with its size and sha256, and nothing else is (a link or a special
/// file is refused).
pub fn verify(root: &Path, host: &Release, arch: &str) -> Result<Verified, CarryError> {
    let top = root.join(TOP);
    // Nothing but TOP at the root.
    for entry in fs::read_dir(root).map_err(io(root))? {
        let entry = entry.map_err(io(root))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name != TOP {
            return Err(CarryError::Extra(name));
        }
    }
    let manifest_path = top.join(MANIFEST_FILE);
    let meta = match fs::symlink_metadata(&manifest_path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(CarryError::ManifestMissing);
        }
        Err(e) => return Err(io(&manifest_path)(e)),
    };
    if !meta.is_file() {
        return Err(CarryError::NotRegular(format!("{TOP}/{MANIFEST_FILE}")));
    }
    let text = fs::read_to_string(&manifest_path).map_err(|e| match e.kind() {
        std::io::ErrorKind::InvalidData => CarryError::ManifestUnparsable("not UTF-8".into()),
        _ => io(&manifest_path)(e),
    })?;
    let manifest = Manifest::parse(&text)?;
    if !manifest.release.same(host) {
        return Err(CarryError::WrongRelease {
            packed: Box::new(manifest.release.clone()),
            host: Box::new(host.clone()),
        });
    }
    if manifest.architecture != arch {
        return Err(CarryError::WrongArchitecture {
            packed: manifest.architecture.clone(),
            host: arch.to_string(),
        });
    }
    let (manifest_sha256, _) = sha256_file(&manifest_path)?;

    // What is on disk, relative to TOP.
    let mut on_disk = BTreeSet::new();
    walk(&top, &top, &mut on_disk)?;
    on_disk.remove(MANIFEST_FILE);
    let listed: BTreeMap<&str, &FileEntry> = manifest
        .files
        .iter()
        .map(|f| (f.path.as_str(), f))
        .collect();
    if let Some(extra) = on_disk.iter().find(|p| !listed.contains_key(p.as_str())) {
        return Err(CarryError::Extra(format!("{TOP}/{extra}")));
    }
    let mut bytes = 0;
    for f in &manifest.files {
        if !on_disk.contains(&f.path) {
            return Err(CarryError::Missing(format!("{TOP}/{}", f.path)));
        }
        let (sha, size) = sha256_file(&top.join(&f.path))?;
        if size != f.size {
            return Err(CarryError::Size {
                path: format!("{TOP}/{}", f.path),
                expected: f.size,
                actual: size,
            });
        }
        if !sha.eq_ignore_ascii_case(&f.sha256) {
            return Err(CarryError::Altered {
                path: format!("{TOP}/{}", f.path),
                expected: f.sha256.clone(),
                actual: sha,
            });
        }
        bytes += size;
    }
    Ok(Verified {
        manifest,
        manifest_sha256,
        bytes,
    })
}

fn walk(top: &Path, dir: &Path, out: &mut BTreeSet<String>) -> Result<(), CarryError> {
    for entry in fs::read_dir(dir).map_err(io(dir))? {
        let entry = entry.map_err(io(dir))?;
        let path = entry.path();
        let rel = path
            .strip_prefix(top)
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default();
        let ft = entry.file_type().map_err(io(&path))?;
        if ft.is_dir() {
            walk(top, &path, out)?;
        } else if ft.is_file() {
            out.insert(rel);
        } else {
            return Err(CarryError::NotRegular(format!("{TOP}/{rel}")));
        }
    }
    Ok(())
}

// ------------------------------------------------------------------ control files

/// A deb822 stanza: fields in order, continuation lines kept.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stanza(pub Vec<(String, String)>);

impl Stanza {
    pub fn get(&self, field: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(field))
            .map(|(_, v)| v.as_str())
    }

    fn render(&self) -> String {
        let mut out = String::new();
        for (k, v) in &self.0 {
            out.push_str(k);
            out.push(':');
            if !v.starts_with('\n') {
                out.push(' ');
            }
            out.push_str(v);
            out.push('\n');
        }
        out
    }
}

/// Parse deb822 stanzas (a Packages file, `apt-cache dumpavail`, a control file).
pub fn parse_stanzas(text: &str) -> Vec<Stanza> {
    let mut all = Vec::new();
    let mut cur = Stanza::default();
    for line in text.lines() {
        if line.trim().is_empty() {
            if !cur.0.is_empty() {
                all.push(std::mem::take(&mut cur));
            }
        } else if line.starts_with(' ') || line.starts_with('\t') {
            if let Some((_, v)) = cur.0.last_mut() {
                v.push('\n');
                v.push_str(line);
            }
        } else if let Some((k, v)) = line.split_once(':') {
            cur.0.push((k.trim().to_string(), v.trim().to_string()));
        }
    }
    if !cur.0.is_empty() {
        all.push(cur);
    }
    all
}

/// One package apt would install: `Inst name [old] (version origin [arch])`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Planned {
    pub package: String,
    pub version: String,
    pub architecture: String,
}

/// The `Inst` lines of `apt-get -s install` output.
pub fn parse_simulation(output: &str) -> Vec<Planned> {
    let mut out = Vec::new();
    for line in output.lines() {
        let Some(rest) = line.strip_prefix("Inst ") else {
            continue;
        };
        let mut words = rest.split_whitespace();
        let Some(package) = words.next() else {
            continue;
        };
        let Some(open) = rest.find('(') else { continue };
        let inner = &rest[open + 1..];
        let Some(version) = inner.split_whitespace().next() else {
            continue;
        };
        let arch = inner
            .rfind('[')
            .and_then(|i| inner[i + 1..].split(']').next())
            .unwrap_or_default();
        out.push(Planned {
            package: package.to_string(),
            version: version.to_string(),
            architecture: arch.to_string(),
        });
    }
    out
}

/// A package's file name in apt's archives cache: `name_version_arch.deb`
/// with the epoch's colon escaped as apt does.
pub fn archive_file_name(p: &Planned) -> String {
    format!(
        "{}_{}_{}.deb",
        p.package,
        p.version.replace(':', "%3a"),
        p.architecture
    )
}

/// The flat repository's `Packages`: each package's control, then `Filename`,
/// `Size` and `SHA256`.
pub fn packages_index(entries: &[(Stanza, String, u64, String)]) -> String {
    let mut out = String::new();
    for (control, filename, size, sha256) in entries {
        let mut s = control.clone();
        s.0.retain(|(k, _)| {
            !matches!(
                k.to_ascii_lowercase().as_str(),
                "filename" | "size" | "sha256" | "md5sum" | "sha1" | "sha512"
            )
        });
        s.0.push(("Filename".into(), format!("./{filename}")));
        s.0.push(("Size".into(), size.to_string()));
        s.0.push(("SHA256".into(), sha256.clone()));
        out.push_str(&s.render());
        out.push('\n');
    }
    out
}

/// The dpkg status of the packages a minbase debootstrap installs: each
/// stanza (from `apt-cache dumpavail`) marked installed.
pub fn minbase_status(available: &[Stanza], planned: &[Planned]) -> Result<String, CarryError> {
    const KEEP: [&str; 12] = [
        "Package",
        "Essential",
        "Priority",
        "Architecture",
        "Multi-Arch",
        "Version",
        "Provides",
        "Pre-Depends",
        "Depends",
        "Breaks",
        "Conflicts",
        "Replaces",
    ];
    let mut out = String::new();
    for p in planned {
        let found = available.iter().find(|s| {
            s.get("Package") == Some(p.package.as_str())
                && s.get("Version") == Some(p.version.as_str())
        });
        let Some(stanza) = found else {
            return Err(CarryError::Pack(format!(
                "{} {} is planned by apt but not in its index",
                p.package, p.version
            )));
        };
        let mut s = Stanza::default();
        for (k, v) in &stanza.0 {
            if KEEP.iter().any(|want| want.eq_ignore_ascii_case(k)) {
                s.0.push((k.clone(), v.clone()));
            }
            if k.eq_ignore_ascii_case("Package") {
                s.0.push(("Status".into(), "install ok installed".into()));
            }
        }
        out.push_str(&s.render());
        out.push('\n');
    }
    Ok(out)
}

// ------------------------------------------------------------------ pack

/// What [`pack`] needs.
#[derive(Clone, Debug)]
pub struct PackOptions {
    /// The archive to write: `.tar`, `.tar.gz`/`.tgz`, `.tar.xz` or `.tar.zst`.
    pub out: PathBuf,
    /// Where the mesh's `.deb`s are (cargo-deb's `target/debian`).
    pub debs: PathBuf,
    /// apt's lists and downloaded packages, kept between runs.
    pub cache: PathBuf,
    /// dpkg architecture of the packages.
    pub architecture: String,
    /// The Debian mirror.
    pub mirror: String,
    /// The Debian security mirror.
    pub security_mirror: String,
    /// The keyring that signs the mirror's Release files.
    pub keyring: PathBuf,
}

/// What [`pack`] wrote.
#[derive(Debug)]
pub struct Packed {
    pub manifest: Manifest,
    pub manifest_sha256: String,
    pub bytes: u64,
    /// Packages apt downloaded this run (0 when the cache had them all).
    pub downloaded: usize,
}

fn run(cmd: &mut Command) -> Result<String, CarryError> {
    let shown = format!("{cmd:?}").replace('"', "");
    let out = cmd.output().map_err(|e| CarryError::Command {
        command: shown.clone(),
        status: "not run".into(),
        stderr: e.to_string(),
    })?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let tail: Vec<&str> = stderr
            .lines()
            .chain(stdout.lines())
            .rev()
            .take(15)
            .collect();
        return Err(CarryError::Command {
            command: shown,
            status: out.status.to_string(),
            stderr: tail.into_iter().rev().collect::<Vec<_>>().join("\n"),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A .deb's control fields (dpkg-deb).
pub fn deb_control(deb: &Path) -> Result<Stanza, CarryError> {
    let text = run(Command::new("dpkg-deb").arg("-f").arg(deb))?;
    parse_stanzas(&text)
        .into_iter()
        .next()
        .ok_or_else(|| CarryError::Pack(format!("{}: no control fields", deb.display())))
}

fn field<'a>(s: &'a Stanza, name: &str, deb: &Path) -> Result<&'a str, CarryError> {
    s.get(name)
        .ok_or_else(|| CarryError::Pack(format!("{}: control has no {name}", deb.display())))
}

/// `dpkg --compare-versions a gt b`.
fn version_gt(a: &str, b: &str) -> bool {
    Command::new("dpkg")
        .args(["--compare-versions", a, "gt", b])
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// The newest `.deb` of each of [`MESH_PACKAGES`] in `dir`.
fn mesh_debs(dir: &Path, arch: &str) -> Result<Vec<(PathBuf, Stanza)>, CarryError> {
    let mut best: BTreeMap<String, (PathBuf, Stanza)> = BTreeMap::new();
    let entries = fs::read_dir(dir).map_err(io(dir))?;
    for entry in entries {
        let path = entry.map_err(io(dir))?.path();
        if path.extension().and_then(|e| e.to_str()) != Some("deb") {
            continue;
        }
        let control = deb_control(&path)?;
        let name = field(&control, "Package", &path)?.to_string();
        if !MESH_PACKAGES.contains(&name.as_str()) {
            continue;
        }
        let a = field(&control, "Architecture", &path)?;
        if a != arch && a != "all" {
            continue;
        }
        let version = field(&control, "Version", &path)?.to_string();
        let newer = match best.get(&name) {
            None => true,
            Some((_, old)) => version_gt(&version, old.get("Version").unwrap_or_default()),
        };
        if newer {
            best.insert(name, (path, control));
        }
    }
    for want in MESH_PACKAGES {
        if !best.contains_key(want) {
            return Err(CarryError::Pack(format!(
                "no {want}_*_{arch}.deb in {} (build them with bundle/package, or name the directory with --debs)",
                dir.display()
            )));
        }
    }
    Ok(best.into_values().collect())
}

/// apt confined to `cache`: its own sources, lists, status and package cache;
/// nothing of the host's apt state is read or written but its configuration
/// (a proxy set there still applies).
struct Apt {
    cache: PathBuf,
    arch: String,
}

impl Apt {
    fn cmd(&self, tool: &str, sources: &str, status: &Path) -> Command {
        let c = &self.cache;
        let mut cmd = Command::new(tool);
        let opt = |k: &str, v: String| ["-o".to_string(), format!("{k}={v}")];
        let d = |p: &str| c.join(p).display().to_string();
        for (k, v) in [
            ("Dir::Etc::SourceList", d(sources)),
            ("Dir::Etc::SourceParts", d("empty")),
            ("Dir::Etc::Preferences", d("empty/none")),
            ("Dir::Etc::PreferencesParts", d("empty")),
            ("Dir::State", d("state")),
            ("Dir::State::Lists", d("lists")),
            ("Dir::State::status", status.display().to_string()),
            ("Dir::Cache", d(&format!("apt-{sources}"))),
            ("Dir::Cache::Archives", d("archives")),
            ("APT::Architecture", self.arch.clone()),
            ("APT::Architectures", self.arch.clone()),
            ("APT::Install-Recommends", "false".into()),
            ("APT::Install-Suggests", "false".into()),
            ("Acquire::Languages", "none".into()),
            ("APT::Get::List-Cleanup", "false".into()),
        ] {
            cmd.args(opt(k, v));
        }
        cmd.env("DEBIAN_FRONTEND", "noninteractive");
        cmd
    }
}

/// Pack the archive (see the module's documentation). Needs network (apt
/// downloads what the cache lacks), apt-get, dpkg-deb and tar.
pub fn pack(opts: &PackOptions) -> Result<Packed, CarryError> {
    let arch = opts.architecture.as_str();
    if !opts.keyring.is_file() {
        return Err(CarryError::Pack(format!(
            "{} is missing (install debian-archive-keyring)",
            opts.keyring.display()
        )));
    }
    let mesh = mesh_debs(&opts.debs, arch)?;
    let cache = &opts.cache;
    for d in ["empty", "state", "lists/partial", "archives/partial"] {
        fs::create_dir_all(cache.join(d)).map_err(io(&cache.join(d)))?;
    }
    let out_dir = match opts.out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let stage = tempfile::Builder::new()
        .prefix(".mesh-bundle-pack.")
        .tempdir_in(&out_dir)
        .map_err(io(&out_dir))?;
    let top = stage.path().join(TOP);
    let repo = top.join(REPO_DIR);
    fs::create_dir_all(&repo).map_err(io(&repo))?;

    // The mesh's packages first, in a flat repository of their own that apt
    // reads beside Debian's: their dependencies join the closure.
    let mut index = Vec::new();
    let mut files = Vec::new();
    let mut mesh_version = String::new();
    for (path, control) in &mesh {
        let name = field(control, "Package", path)?.to_string();
        let version = field(control, "Version", path)?.to_string();
        let a = field(control, "Architecture", path)?.to_string();
        let planned = Planned {
            package: name.clone(),
            version: version.clone(),
            architecture: a.clone(),
        };
        let file = archive_file_name(&planned);
        let dest = repo.join(&file);
        fs::copy(path, &dest).map_err(io(path))?;
        let (sha, size) = sha256_file(&dest)?;
        if name == "mesh-controller" {
            mesh_version = version.clone();
        }
        index.push((control.clone(), file.clone(), size, sha.clone()));
        files.push(FileEntry {
            path: format!("{REPO_DIR}/{file}"),
            kind: Kind::Mesh,
            package: Some(name),
            version: Some(version),
            architecture: Some(a),
            size,
            sha256: sha,
        });
    }
    fs::write(repo.join("Packages"), packages_index(&index)).map_err(io(&repo))?;
    // apt reads them from a fixed place in the cache (a source that moved
    // would cost apt its package cache on every run).
    let mesh_repo = cache.join("mesh-repo");
    if mesh_repo.exists() {
        fs::remove_dir_all(&mesh_repo).map_err(io(&mesh_repo))?;
    }
    fs::create_dir_all(&mesh_repo).map_err(io(&mesh_repo))?;
    for entry in fs::read_dir(&repo).map_err(io(&repo))? {
        let src = entry.map_err(io(&repo))?.path();
        if let Some(name) = src.file_name() {
            link_or_copy(&src, &mesh_repo.join(name))?;
        }
    }

    let signed = format!("[signed-by={}]", opts.keyring.display());
    let main = format!("deb {signed} {} bookworm main\n", opts.mirror);
    let all = format!(
        "{main}deb {signed} {} bookworm-updates main\ndeb {signed} {} bookworm-security main\ndeb [trusted=yes] file:{} ./\n",
        opts.mirror,
        opts.security_mirror,
        mesh_repo.display()
    );
    // Written only when they change: apt keeps its package cache while its
    // sources and status files are the same, which makes a second pack fast.
    let write = |name: &str, text: &str| {
        let p = cache.join(name);
        if fs::read_to_string(&p).ok().as_deref() == Some(text) {
            return Ok(());
        }
        fs::write(&p, text).map_err(io(&p))
    };
    write("sources-main.list", &main)?;
    write("sources-all.list", &all)?;
    write("status-empty", "")?;
    let apt = Apt {
        cache: cache.clone(),
        arch: arch.to_string(),
    };
    let empty = cache.join("status-empty");
    run(apt
        .cmd("apt-get", "sources-all.list", &empty)
        .args(["-q", "update"]))?;

    // A minbase system: Priority required and apt, with their dependencies,
    // at the point release's versions (what debootstrap installs today).
    let dump = run(apt
        .cmd("apt-cache", "sources-main.list", &empty)
        .arg("dumpavail"))?;
    // Tens of thousands of stanzas: only those marked required are parsed here.
    let mut base: BTreeSet<String> = dump
        .split("\n\n")
        .filter(|s| s.contains("\nPriority: required\n"))
        .flat_map(parse_stanzas)
        .filter(|s| matches!(s.get("Architecture"), Some(a) if a == arch || a == "all"))
        .filter_map(|s| s.get("Package").map(str::to_string))
        .collect();
    base.insert("apt".into());
    // init-system-helpers depends on `usrmerge | usr-is-merged`: debootstrap
    // installs usr-is-merged, apt alone would pick usrmerge and with it perl,
    // which a minbase tree lacks (and postgresql-common needs: it must come
    // in the archive). Naming it makes the set debootstrap's exactly
    // (bundle/check-carried compares them).
    base.insert("usr-is-merged".into());
    let sim = run(apt
        .cmd("apt-get", "sources-main.list", &empty)
        .args(["-s", "-q", "install"])
        .args(&base))?;
    let minbase = parse_simulation(&sim);
    let wanted: BTreeSet<&str> = minbase.iter().map(|p| p.package.as_str()).collect();
    let avail_main: Vec<Stanza> = dump
        .split("\n\n")
        .filter(|s| {
            s.trim_start()
                .strip_prefix("Package: ")
                .and_then(|rest| rest.split('\n').next())
                .is_some_and(|name| wanted.contains(name.trim()))
        })
        .flat_map(parse_stanzas)
        .collect();
    if minbase.len() < base.len() {
        return Err(CarryError::Pack(format!(
            "apt planned {} packages for a minbase system of {} required ones",
            minbase.len(),
            base.len()
        )));
    }
    let status = cache.join("status-minbase");
    write("status-minbase", &minbase_status(&avail_main, &minbase)?)?;

    // The closure: what apt installs on that system for the foundation and the
    // mesh's packages, from every bookworm suite.
    let mut install: Vec<String> = FOUNDATION.iter().map(|s| s.to_string()).collect();
    install.extend(MESH_PACKAGES.iter().map(|s| s.to_string()));
    let sim = run(apt
        .cmd("apt-get", "sources-all.list", &status)
        .args(["-s", "-q", "install"])
        .args(&install))?;
    let closure = parse_simulation(&sim);
    let before = count_debs(&cache.join("archives"))?;
    run(apt
        .cmd("apt-get", "sources-all.list", &status)
        .args(["-q", "-y", "--download-only", "install"])
        .args(&install))?;
    let downloaded = count_debs(&cache.join("archives"))?.saturating_sub(before);

    for p in closure
        .iter()
        .filter(|p| !MESH_PACKAGES.contains(&p.package.as_str()))
    {
        let file = archive_file_name(p);
        let src = cache.join("archives").join(&file);
        if !src.is_file() {
            return Err(CarryError::Pack(format!(
                "apt planned {} {} but {} was not downloaded",
                p.package,
                p.version,
                src.display()
            )));
        }
        let control = deb_control(&src)?;
        let (name, version, a) = (
            field(&control, "Package", &src)?,
            field(&control, "Version", &src)?,
            field(&control, "Architecture", &src)?,
        );
        if name != p.package || version != p.version {
            return Err(CarryError::Pack(format!(
                "{} holds {name} {version}, apt planned {} {}",
                src.display(),
                p.package,
                p.version
            )));
        }
        let dest = repo.join(&file);
        link_or_copy(&src, &dest)?;
        let (sha, size) = sha256_file(&dest)?;
        index.push((control.clone(), file.clone(), size, sha.clone()));
        files.push(FileEntry {
            path: format!("{REPO_DIR}/{file}"),
            kind: Kind::Deb,
            package: Some(name.to_string()),
            version: Some(version.to_string()),
            architecture: Some(a.to_string()),
            size,
            sha256: sha,
        });
    }
    let packages = repo.join("Packages");
    fs::write(&packages, packages_index(&index)).map_err(io(&packages))?;
    let (sha, size) = sha256_file(&packages)?;
    files.push(FileEntry {
        path: format!("{REPO_DIR}/Packages"),
        kind: Kind::Index,
        package: None,
        version: None,
        architecture: None,
        size,
        sha256: sha,
    });

    // bundle/up, as the mesh-controller package ships it: the one script the
    // operator needs before anything is installed.
    let controller = mesh
        .iter()
        .find(|(_, c)| c.get("Package") == Some("mesh-controller"))
        .map(|(p, _)| p.clone())
        .ok_or_else(|| CarryError::Pack("no mesh-controller package".into()))?;
    let up = top.join("up");
    extract_from_deb(&controller, "./usr/share/mesh/bundle/up", &up)?;
    let (sha, size) = sha256_file(&up)?;
    files.push(FileEntry {
        path: "up".into(),
        kind: Kind::Script,
        package: None,
        version: None,
        architecture: None,
        size,
        sha256: sha,
    });

    files.sort_by(|a, b| a.path.cmp(&b.path));
    let manifest = Manifest {
        format: FORMAT,
        release: Release::bookworm(),
        architecture: arch.to_string(),
        packed_at: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        mesh_version,
        install,
        files,
    };
    let manifest_path = top.join(MANIFEST_FILE);
    fs::write(&manifest_path, manifest.to_json()).map_err(io(&manifest_path))?;
    let (manifest_sha256, _) = sha256_file(&manifest_path)?;
    // Check what was written the way bundle/up will.
    verify(stage.path(), &Release::bookworm(), arch)?;

    let name = opts.out.to_string_lossy();
    let compress: &[&str] = if name.ends_with(".tar.gz") || name.ends_with(".tgz") {
        &["--gzip"]
    } else if name.ends_with(".tar.xz") {
        &["--xz"]
    } else if name.ends_with(".tar.zst") {
        &["--zstd"]
    } else if name.ends_with(".tar") {
        &[]
    } else {
        return Err(CarryError::Pack(format!(
            "--out {name}: name it .tar, .tar.gz, .tgz, .tar.xz or .tar.zst"
        )));
    };
    let tmp = out_dir.join(format!(
        ".{}.tmp",
        opts.out
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    ));
    run(Command::new("tar")
        .arg("-C")
        .arg(stage.path())
        .args([
            "--sort=name",
            "--owner=0",
            "--group=0",
            "--numeric-owner",
            "-c",
        ])
        .args(compress)
        .arg("-f")
        .arg(&tmp)
        .arg(TOP))?;
    fs::rename(&tmp, &opts.out).map_err(io(&opts.out))?;
    let bytes = fs::metadata(&opts.out).map_err(io(&opts.out))?.len();
    Ok(Packed {
        manifest,
        manifest_sha256,
        bytes,
        downloaded,
    })
}

/// A hard link (the cache and the output on one file system), else a copy.
fn link_or_copy(src: &Path, dest: &Path) -> Result<(), CarryError> {
    if fs::hard_link(src, dest).is_err() {
        fs::copy(src, dest).map_err(io(src))?;
    }
    Ok(())
}

fn count_debs(dir: &Path) -> Result<usize, CarryError> {
    Ok(fs::read_dir(dir)
        .map_err(io(dir))?
        .filter_map(Result::ok)
        .filter(|e| e.path().extension().and_then(|x| x.to_str()) == Some("deb"))
        .count())
}

/// One file of a .deb's data, written to `dest`.
fn extract_from_deb(deb: &Path, member: &str, dest: &Path) -> Result<(), CarryError> {
    let out = Command::new("sh")
        .arg("-c")
        .arg("dpkg-deb --fsys-tarfile \"$1\" | tar -xO \"$2\"")
        .arg("sh")
        .arg(deb)
        .arg(member)
        .output()
        .map_err(io(deb))?;
    if !out.status.success() || out.stdout.is_empty() {
        return Err(CarryError::Pack(format!(
            "{} has no {member} (the mesh-controller package ships the bundle scripts)",
            deb.display()
        )));
    }
    fs::write(dest, &out.stdout).map_err(io(dest))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(path: &str, kind: Kind, content: &[u8]) -> FileEntry {
        let (package, version, architecture) = match kind {
            Kind::Deb | Kind::Mesh => (
                Some(
                    path.rsplit('/')
                        .next()
                        .unwrap_or(path)
                        .split('_')
                        .next()
                        .unwrap_or("")
                        .to_string(),
                ),
                Some("1.0-1".to_string()),
                Some("amd64".to_string()),
            ),
            _ => (None, None, None),
        };
        FileEntry {
            path: path.into(),
            kind,
            package,
            version,
            architecture,
            size: content.len() as u64,
            sha256: hex::encode(Sha256::digest(content)),
        }
    }

    /// An extracted archive of three files and its manifest.
    fn bundle() -> (tempfile::TempDir, Manifest) {
        let dir = tempfile::tempdir().unwrap();
        let top = dir.path().join(TOP);
        fs::create_dir_all(top.join(REPO_DIR)).unwrap();
        let files = [
            ("repo/Packages", Kind::Index, b"Package: x\n".as_slice()),
            (
                "repo/mesh-controller_1.0-1_amd64.deb",
                Kind::Mesh,
                b"controller".as_slice(),
            ),
            (
                "repo/postgresql_1.0-1_amd64.deb",
                Kind::Deb,
                b"postgres".as_slice(),
            ),
            ("up", Kind::Script, b"#!/bin/sh\n".as_slice()),
        ];
        let mut entries = Vec::new();
        for (path, kind, content) in files {
            fs::write(top.join(path), content).unwrap();
            entries.push(entry(path, kind, content));
        }
        let m = Manifest {
            format: FORMAT,
            release: Release::bookworm(),
            architecture: "amd64".into(),
            packed_at: "2026-12-02T00:00:00Z".into(),
            mesh_version: "1.0-1".into(),
            install: vec!["postgresql".into(), "mesh-controller".into()],
            files: entries,
        };
        fs::write(top.join(MANIFEST_FILE), m.to_json()).unwrap();
        (dir, m)
    }

    fn check(dir: &tempfile::TempDir) -> Result<Verified, CarryError> {
        verify(dir.path(), &Release::bookworm(), "amd64")
    }

    #[test]
    fn an_intact_archive_verifies_and_its_manifest_round_trips() {
        let (dir, m) = bundle();
        let v = check(&dir).unwrap();
        assert_eq!(v.manifest, m);
        assert_eq!(v.bytes, 11 + 10 + 8 + 10);
    }

    #[test]
    fn an_altered_file_is_refused_naming_it() {
        let (dir, _) = bundle();
        let p = dir.path().join(TOP).join("repo/postgresql_1.0-1_amd64.deb");
        fs::write(&p, b"postgrez").unwrap(); // same size, other content
        let err = check(&dir).unwrap_err();
        assert!(matches!(err, CarryError::Altered { .. }), "{err}");
        assert!(
            err.to_string()
                .contains("mesh-bundle/repo/postgresql_1.0-1_amd64.deb"),
            "{err}"
        );
        fs::write(&p, b"postgres!").unwrap(); // another size
        let err = check(&dir).unwrap_err().to_string();
        assert!(
            err.contains("postgresql_1.0-1_amd64.deb") && err.contains("9 bytes"),
            "{err}"
        );
    }

    #[test]
    fn a_missing_file_is_refused_naming_it() {
        let (dir, _) = bundle();
        fs::remove_file(dir.path().join(TOP).join("up")).unwrap();
        let err = check(&dir).unwrap_err();
        assert!(
            matches!(&err, CarryError::Missing(p) if p == "mesh-bundle/up"),
            "{err}"
        );
    }

    #[test]
    fn an_extra_file_is_refused_naming_it() {
        let (dir, _) = bundle();
        fs::write(dir.path().join(TOP).join("repo/evil_1_amd64.deb"), b"x").unwrap();
        let err = check(&dir).unwrap_err();
        assert!(
            matches!(&err, CarryError::Extra(p) if p == "mesh-bundle/repo/evil_1_amd64.deb"),
            "{err}"
        );
        let (dir, _) = bundle();
        fs::write(dir.path().join("beside"), b"x").unwrap();
        let err = check(&dir).unwrap_err();
        assert!(
            matches!(&err, CarryError::Extra(p) if p == "beside"),
            "{err}"
        );
    }

    #[test]
    fn a_link_is_refused() {
        let (dir, _) = bundle();
        let link = dir.path().join(TOP).join("repo/link.deb");
        std::os::unix::fs::symlink("/etc/passwd", &link).unwrap();
        let err = check(&dir).unwrap_err();
        assert!(
            matches!(&err, CarryError::NotRegular(p) if p == "mesh-bundle/repo/link.deb"),
            "{err}"
        );
    }

    #[test]
    fn another_release_or_architecture_is_refused() {
        let (dir, _) = bundle();
        let trixie = Release {
            id: "debian".into(),
            version_id: "13".into(),
            codename: "trixie".into(),
        };
        let err = verify(dir.path(), &trixie, "amd64")
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "the archive was packed for debian 12 (bookworm), this host is debian 13 (trixie)"
        );
        let err = verify(dir.path(), &Release::bookworm(), "arm64")
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "the archive was packed for architecture amd64, this host is arm64"
        );
    }

    fn with_manifest(text: &str) -> String {
        let (dir, _) = bundle();
        fs::write(dir.path().join(TOP).join(MANIFEST_FILE), text).unwrap();
        check(&dir).unwrap_err().to_string()
    }

    #[test]
    fn a_bad_manifest_is_refused_naming_what_is_wrong() {
        let (_, m) = bundle();
        let err = with_manifest("{ not json");
        assert!(
            err.starts_with(
                "manifest manifest.json is not a bundle manifest: key must be a string at line 1"
            ),
            "{err}"
        );
        let err = with_manifest(&m.to_json().replace("\"format\":1", "\"format\":2"));
        assert_eq!(
            err,
            "manifest manifest.json has format 2; this mesh-bundle reads format 1"
        );
        let err = with_manifest(&m.to_json().replace("\"format\":1,", ""));
        assert!(err.ends_with("missing field `format`"), "{err}");
        let err = with_manifest(&m.to_json().replacen("\"architecture\":\"amd64\",", "", 1));
        assert!(err.contains("missing field `architecture`"), "{err}");
        let err = with_manifest(&m.to_json().replace("\"path\":\"up\"", "\"path\":\"../up\""));
        assert_eq!(err, "`../up` is not a plain relative path");
        let err = with_manifest(
            &m.to_json()
                .replace("\"kind\":\"script\"", "\"kind\":\"script\",\"extra\":1"),
        );
        assert!(err.contains("unknown field `extra`"), "{err}");
        let (dir, _) = bundle();
        fs::remove_file(dir.path().join(TOP).join(MANIFEST_FILE)).unwrap();
        assert_eq!(
            check(&dir).unwrap_err().to_string(),
            "manifest manifest.json is missing from the archive"
        );
    }

    #[test]
    fn the_manifest_has_one_line_per_file_for_bundle_up() {
        let (_, m) = bundle();
        let json = m.to_json();
        let line = json
            .lines()
            .find(|l| l.contains("\"package\":\"mesh-controller\""))
            .unwrap();
        assert!(
            line.contains("\"path\":\"repo/mesh-controller_1.0-1_amd64.deb\""),
            "{line}"
        );
        assert!(
            line.contains(&format!(
                "\"sha256\":\"{}\"",
                hex::encode(Sha256::digest(b"controller"))
            )),
            "{line}"
        );
    }

    #[test]
    fn apt_simulation_lines_parse() {
        let out = "NOTE: x\nInst libpq5 (15.10-0+deb12u1 Debian-Security:12/oldstable-security [amd64])\n\
                   Inst tzdata [2024a-0] (2026b-0+deb12u1 Debian:12.15/oldstable [all])\n\
                   Conf libpq5 (15.10-0+deb12u1 Debian-Security:12/oldstable-security [amd64])\n\
                   Inst erlang-base (1:25.2.3+dfsg-1+deb12u2 Debian:12.15/oldstable [amd64])\n";
        let p = parse_simulation(out);
        assert_eq!(p.len(), 3);
        assert_eq!(p[1].package, "tzdata");
        assert_eq!(p[1].version, "2026b-0+deb12u1");
        assert_eq!(p[1].architecture, "all");
        assert_eq!(
            archive_file_name(&p[2]),
            "erlang-base_1%3a25.2.3+dfsg-1+deb12u2_amd64.deb"
        );
    }

    #[test]
    fn the_index_names_each_file_with_its_size_and_sha256() {
        let control = parse_stanzas(
            "Package: mesh-agent\nVersion: 1.0\nArchitecture: amd64\nDescription: x\n more\n",
        )
        .remove(0);
        let idx = packages_index(&[(
            control,
            "mesh-agent_1.0_amd64.deb".into(),
            42,
            "ab".repeat(32),
        )]);
        assert_eq!(
            idx,
            format!(
                "Package: mesh-agent\nVersion: 1.0\nArchitecture: amd64\nDescription: x\n more\n\
                 Filename: ./mesh-agent_1.0_amd64.deb\nSize: 42\nSHA256: {}\n\n",
                "ab".repeat(32)
            )
        );
    }

    #[test]
    fn the_minbase_status_marks_each_planned_package_installed() {
        let avail = parse_stanzas(
            "Package: dpkg\nVersion: 1.21\nPriority: required\nEssential: yes\nFilename: pool/d.deb\n\n\
             Package: dpkg\nVersion: 1.22\nPriority: required\n",
        );
        let planned = [Planned {
            package: "dpkg".into(),
            version: "1.21".into(),
            architecture: "amd64".into(),
        }];
        assert_eq!(
            minbase_status(&avail, &planned).unwrap(),
            "Package: dpkg\nStatus: install ok installed\nVersion: 1.21\nPriority: required\nEssential: yes\n\n"
        );
    }

    #[test]
    fn os_release_names_the_release() {
        let r = Release::from_os_release(
            "PRETTY_NAME=\"Debian GNU/Linux 12 (bookworm)\"\nVERSION_ID=\"12\"\nVERSION_CODENAME=bookworm\nID=debian\n",
        );
        assert_eq!(r, Release::bookworm());
    }

    /// What bundle/up's networked path installs is what the archive carries:
    /// a package added there (`missing+=(name)`) fails this until it is in
    /// FOUNDATION too.
    #[test]
    fn the_foundation_is_what_bundle_up_installs() {
        let up = include_str!("../up");
        let installed: BTreeSet<&str> = up
            .match_indices("missing+=(")
            .filter_map(|(i, m)| up[i + m.len()..].split(')').next())
            .collect();
        let carried: BTreeSet<&str> = FOUNDATION.into_iter().collect();
        assert_eq!(installed, carried);
    }
}
