//! Running the host's tools (`ip`, `wg`, `wireguard-go`, `nft`): each with a
//! deadline, its output captured, and errors that say which tool failed and
//! why (a missing tool is its own error, so a report can say "not found").
//!
//! Never pass a secret as an argument: arguments show in `ps`. Secrets go in
//! a mode-0600 file ([`PrivateFile`]) or on stdin.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How long one tool may run before it is killed and counted as failed.
pub const TOOL_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a tool did not do its job.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ToolError {
    #[error("{program} not found")]
    NotFound { program: String },
    #[error("{program} could not be started: {error}")]
    Spawn { program: String, error: String },
    #[error("`{command}` failed ({status}): {output}")]
    Failed {
        command: String,
        status: String,
        output: String,
    },
    #[error("`{command}` did not finish within {}s", TOOL_TIMEOUT.as_secs())]
    Timeout { command: String },
}

impl ToolError {
    pub fn is_not_found(&self) -> bool {
        matches!(self, ToolError::NotFound { .. })
    }
}

/// Run `program args…`, feeding `stdin` if given; its stdout on success.
/// `program` is a path, or a bare name looked up in `PATH`.
pub fn run(program: &Path, args: &[&str], stdin: Option<&[u8]>) -> Result<String, ToolError> {
    run_with(Command::new(program), program, args, stdin)
}

/// As [`run`], on a prepared [`Command`] (environment, process group).
pub fn run_with(
    mut cmd: Command,
    program: &Path,
    args: &[&str],
    stdin: Option<&[u8]>,
) -> Result<String, ToolError> {
    let name = program.display().to_string();
    let command = std::iter::once(name.as_str())
        .chain(args.iter().copied())
        .collect::<Vec<_>>()
        .join(" ");
    cmd.args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            ToolError::NotFound {
                program: name.clone(),
            }
        } else {
            ToolError::Spawn {
                program: name.clone(),
                error: e.to_string(),
            }
        }
    })?;
    if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
        // A tool that exits early closes the pipe; its status says why.
        let _ = pipe.write_all(input);
    }
    // Read both pipes on threads so that a chatty tool never blocks on a full pipe.
    let out = child.stdout.take().map(reader);
    let err = child.stderr.take().map(reader);
    let deadline = Instant::now() + TOOL_TIMEOUT;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(ToolError::Timeout { command });
            }
            Err(e) => {
                return Err(ToolError::Spawn {
                    program: name,
                    error: e.to_string(),
                });
            }
        }
    };
    let stdout = out.and_then(|h| h.join().ok()).unwrap_or_default();
    let stderr = err.and_then(|h| h.join().ok()).unwrap_or_default();
    if status.success() {
        Ok(stdout)
    } else {
        let output = if stderr.trim().is_empty() {
            stdout
        } else {
            stderr
        };
        Err(ToolError::Failed {
            command,
            status: status.to_string(),
            output: short(output.trim()),
        })
    }
}

fn reader(mut pipe: impl Read + Send + 'static) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = pipe.read_to_end(&mut buf);
        String::from_utf8_lossy(&buf).into_owned()
    })
}

/// The last lines of a tool's output, at most 500 characters.
fn short(s: &str) -> String {
    let n = s.chars().count();
    if n <= 500 {
        s.to_owned()
    } else {
        format!("…{}", s.chars().skip(n - 500).collect::<String>())
    }
}

/// A mode-0600 file holding what a tool reads (a WireGuard config with its
/// private key, a ruleset), removed when dropped, whatever happened.
#[derive(Debug)]
pub struct PrivateFile {
    path: PathBuf,
}

impl PrivateFile {
    /// Write `content` to a fresh file named after `stem` in `dir` (made 0700
    /// when missing).
    pub fn new(dir: &Path, stem: &str, content: &[u8]) -> std::io::Result<PrivateFile> {
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
        let path = dir.join(format!(".{stem}.{:016x}", rand::random::<u64>()));
        let file = PrivateFile { path };
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&file.path)?;
        f.write_all(content)?;
        f.sync_all()?;
        Ok(file)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn path_str(&self) -> std::io::Result<&str> {
        self.path
            .to_str()
            .ok_or_else(|| std::io::Error::other("the state directory's path is not UTF-8"))
    }
}

impl Drop for PrivateFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_tools_and_failures_are_named() {
        let e = run(Path::new("/nonexistent/tool"), &[], None).unwrap_err();
        assert!(e.is_not_found(), "{e}");
        assert_eq!(e.to_string(), "/nonexistent/tool not found");
        let e = run(Path::new("sh"), &["-c", "echo bad >&2; exit 3"], None).unwrap_err();
        let text = e.to_string();
        assert!(text.contains("sh -c") && text.contains("bad"), "{text}");
        assert_eq!(
            run(Path::new("cat"), &[], Some(b"in")).unwrap(),
            "in".to_owned()
        );
    }

    #[test]
    fn private_files_are_0600_and_removed() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let f = PrivateFile::new(&dir.path().join("tmp"), "x", b"secret").unwrap();
        let p = f.path().to_owned();
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
        drop(f);
        assert!(!p.exists());
    }
}
