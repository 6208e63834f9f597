//! What every credential file shares: reading with errors that name the file and
//! the field without echoing a value, the atomic 0600 write, and the helpers
//! that write a [`Secret`] (the one place its value is serialized).

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use mesh_protocol::Secret;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::CredentialsError;

/// The file's text; `Ok(None)` when it does not exist.
pub(crate) fn read_text(path: &Path) -> Result<Option<String>, CredentialsError> {
    match std::fs::read_to_string(path) {
        Ok(t) => Ok(Some(t)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(CredentialsError::Read {
            path: path.to_owned(),
            source,
        }),
    }
}

/// The file's text; a missing file is an error naming it.
pub(crate) fn read_required(path: &Path) -> Result<String, CredentialsError> {
    std::fs::read_to_string(path).map_err(|source| CredentialsError::Read {
        path: path.to_owned(),
        source,
    })
}

/// Decodes `text` (the content of `path`) as TOML into `T`. The error names the
/// field (serde's message does) and the line, and never quotes the file: toml's
/// own rendering shows the offending line, which may hold a password.
pub(crate) fn from_toml<T: DeserializeOwned>(
    text: &str,
    path: &Path,
) -> Result<T, CredentialsError> {
    toml::from_str(text).map_err(|e| {
        let mut message = scrub(e.message());
        if let Some(span) = e.span() {
            let before = text.get(..span.start).unwrap_or(text);
            let line_no = before.matches('\n').count() + 1;
            let line = text.lines().nth(line_no - 1).unwrap_or("");
            match line.split_once('=') {
                Some((key, _)) if !key.trim().is_empty() && !key.contains('"') => {
                    message = format!("{message} (line {line_no}, key `{}`)", key.trim());
                }
                _ => message = format!("{message} (line {line_no})"),
            }
        }
        CredentialsError::Malformed {
            path: path.to_owned(),
            message,
        }
    })
}

/// `message` with every double-quoted part replaced by `"…"`: serde quotes the
/// offending value (`invalid type: string "amqp://u:pw@h", expected …`), while
/// field names are in backticks.
fn scrub(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut in_quotes = false;
    for c in message.chars() {
        if c == '"' {
            if in_quotes {
                out.push_str("…\"");
            } else {
                out.push('"');
            }
            in_quotes = !in_quotes;
        } else if !in_quotes {
            out.push(c);
        }
    }
    out
}

/// Encodes `value` as TOML for the file at `path`.
pub(crate) fn to_toml<T: Serialize>(value: &T, path: &Path) -> Result<String, CredentialsError> {
    toml::to_string(value).map_err(|e| CredentialsError::Write {
        path: path.to_owned(),
        source: std::io::Error::other(format!("cannot encode as TOML: {e}")),
    })
}

/// Serializes a secret's value: only for the fields of a credential file.
pub(crate) fn expose<S: serde::Serializer>(
    secret: &Secret<String>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(secret.expose())
}

/// Serializes a map of secrets' values: only for the fields of a credential file.
pub(crate) fn expose_map<S: serde::Serializer>(
    secrets: &BTreeMap<String, Secret<String>>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.collect_map(secrets.iter().map(|(k, v)| (k, v.expose())))
}

/// Parses the URL in `field`: one of `schemes`, with a host. The error never
/// echoes the URL (it may hold a password).
pub(crate) fn check_url(
    path: &Path,
    field: &str,
    value: &str,
    schemes: &[&str],
) -> Result<url::Url, CredentialsError> {
    let u = url::Url::parse(value)
        .map_err(|e| CredentialsError::invalid(path, field, format!("not a URL ({e})")))?;
    if !schemes.contains(&u.scheme()) {
        return Err(CredentialsError::invalid(
            path,
            field,
            format!(
                "scheme `{}` is not one of {}",
                u.scheme(),
                schemes.join(", ")
            ),
        ));
    }
    if u.host_str().is_none_or(str::is_empty) {
        return Err(CredentialsError::invalid(
            path,
            field,
            "the URL has no host",
        ));
    }
    Ok(u)
}

/// The password inside a `scheme://user:password@host/...` URL, percent-decoded.
pub fn password_of(url: &str) -> Option<String> {
    let u = url::Url::parse(url).ok()?;
    let p = u.password()?;
    urlencoding::decode(p).ok().map(|s| s.into_owned())
}

/// Writes `contents` to `path` atomically with mode 0600 (a temporary file in the
/// same directory, fsync, rename, fsync of the directory), creating the
/// directory with mode 0700 if it is missing. Returns `false` without writing
/// when the file already holds exactly `contents` with mode 0600.
pub fn write_secret_file(path: &Path, contents: &str) -> Result<bool, CredentialsError> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let werr = |p: &Path, source| CredentialsError::Write {
        path: p.to_owned(),
        source,
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if !dir.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(|e| werr(&dir, e))?;
    }
    if let Ok(existing) = std::fs::read_to_string(path) {
        let mode = std::fs::metadata(path)
            .map(|m| m.permissions().mode() & 0o777)
            .unwrap_or(0);
        if existing == contents && mode == 0o600 {
            return Ok(false);
        }
    }
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "credentials".into());
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let tmp = dir.join(format!(
        ".{file_name}.{}-{}-{nanos:08x}.tmp",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed),
    ));
    let result = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(contents.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        if let Ok(d) = std::fs::File::open(&dir) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(werr(path, e));
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_file_is_0600_in_a_0700_dir_and_idempotent() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/x.toml");
        assert!(write_secret_file(&path, "a = 1\n").unwrap());
        assert!(!write_secret_file(&path, "a = 1\n").unwrap());
        assert!(write_secret_file(&path, "a = 2\n").unwrap());
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "a = 2\n");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let dmode = std::fs::metadata(path.parent().unwrap())
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(dmode, 0o700);
        // A file with a looser mode is rewritten even when its content matches.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(write_secret_file(&path, "a = 2\n").unwrap());
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        // No temporary file is left behind.
        let left: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, vec![std::ffi::OsString::from("x.toml")]);
    }

    #[test]
    fn scrub_removes_quoted_values_only() {
        assert_eq!(
            scrub("invalid type: string \"amqp://u:hunter2@h\", expected a map"),
            "invalid type: string \"…\", expected a map"
        );
        assert_eq!(scrub("missing field `node`"), "missing field `node`");
    }

    #[test]
    fn passwords_are_percent_decoded() {
        assert_eq!(
            password_of("amqp://u:p%40ss@h:5672/mesh").as_deref(),
            Some("p@ss")
        );
        assert_eq!(password_of("amqp://u@h/mesh"), None);
        assert_eq!(password_of("junk"), None);
    }
}
