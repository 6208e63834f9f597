//! A unit's output, captured to size-capped rotating files by its shim (see
//! [`super::shim`]).
//!
//! `<state_dir>/units/<name>/stdout.log` and `stderr.log` take what the unit
//! writes. When the current file would grow past `log_max_bytes` it is renamed
//! `.1` (older ones shift to `.2` … up to `log_files`, the oldest deleted) and a
//! new one is started, so each stream uses at most
//! `log_max_bytes × (log_files + 1)` bytes. A chunk is split at the cap, so a
//! line may continue in the next file. A new writer appends to what is there
//! (a unit restarted, or a shim of the same unit after it).

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

/// One stream's rotating log file.
#[derive(Debug)]
pub struct RotatingLog {
    path: PathBuf,
    file: Option<File>,
    size: u64,
    max_bytes: u64,
    keep: usize,
}

impl RotatingLog {
    /// `path` is the current file; `keep` rotated files are kept beside it.
    pub fn new(path: PathBuf, max_bytes: u64, keep: usize) -> Self {
        RotatingLog {
            path,
            file: None,
            size: 0,
            max_bytes: max_bytes.max(1),
            keep,
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Append `buf`, rotating whenever the current file is full. Unbuffered:
    /// readers (operators, tests) see every chunk at once.
    pub fn write(&mut self, mut buf: &[u8]) -> std::io::Result<()> {
        while !buf.is_empty() {
            if self.file.is_none() {
                let f = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&self.path)?;
                self.size = f.metadata()?.len();
                self.file = Some(f);
            }
            let room = self.max_bytes.saturating_sub(self.size);
            if room == 0 {
                self.rotate()?;
                continue;
            }
            let n = usize::try_from(room).unwrap_or(usize::MAX).min(buf.len());
            let Some(file) = self.file.as_mut() else {
                continue;
            };
            file.write_all(&buf[..n])?;
            self.size += n as u64;
            buf = &buf[n..];
        }
        Ok(())
    }

    /// Shift `path.{i}` to `path.{i+1}` (dropping the oldest), `path` to `path.1`.
    fn rotate(&mut self) -> std::io::Result<()> {
        self.file = None;
        self.size = 0;
        if self.keep == 0 {
            return ignore_missing(std::fs::remove_file(&self.path));
        }
        ignore_missing(std::fs::remove_file(numbered(&self.path, self.keep)))?;
        for i in (1..self.keep).rev() {
            ignore_missing(std::fs::rename(
                numbered(&self.path, i),
                numbered(&self.path, i + 1),
            ))?;
        }
        ignore_missing(std::fs::rename(&self.path, numbered(&self.path, 1)))
    }
}

fn numbered(path: &Path, i: usize) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(format!(".{i}"));
    PathBuf::from(s)
}

fn ignore_missing(r: std::io::Result<()>) -> std::io::Result<()> {
    match r {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

/// Copy a unit's pipe into its log until the pipe closes (every process of the
/// unit's group has exited or closed it). A failing write (disk full) is said
/// once on the shim's stderr and the output dropped: the pipe keeps being
/// drained so the unit never blocks on a full pipe.
pub fn pump(mut src: impl Read, mut log: RotatingLog, unit: &str) {
    let mut buf = vec![0u8; 16 * 1024];
    let mut warned = false;
    loop {
        let n = match src.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return,
        };
        if let Err(e) = log.write(&buf[..n])
            && !warned
        {
            warned = true;
            eprintln!(
                "mesh-agent unit-shim: unit {unit}: cannot write {}: {e}; dropping output",
                log.path().display()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotates_and_caps_size() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("stdout.log");
        let mut log = RotatingLog::new(path.clone(), 10, 2);
        for _ in 0..7 {
            log.write(b"0123456").unwrap();
        }
        // 49 bytes written, 10 per file: current holds the last 9, .1 and .2 are full,
        // the rest was dropped.
        assert_eq!(std::fs::read(&path).unwrap().len(), 9);
        assert_eq!(std::fs::read(numbered(&path, 1)).unwrap().len(), 10);
        assert_eq!(std::fs::read(numbered(&path, 2)).unwrap().len(), 10);
        assert!(!numbered(&path, 3).exists());
        // A new writer appends to what is there.
        let mut log = RotatingLog::new(path.clone(), 10, 2);
        log.write(b"x").unwrap();
        assert_eq!(std::fs::read(&path).unwrap().len(), 10);
    }

    #[test]
    fn keep_zero_truncates() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("stderr.log");
        let mut log = RotatingLog::new(path.clone(), 4, 0);
        log.write(b"abcdefgh").unwrap();
        log.write(b"ij").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"ij");
        assert!(!numbered(&path, 1).exists());
    }
}
