//! A unit's output, captured to size-capped rotating files.
//!
//! `<state_dir>/units/<name>/stdout.log` and `stderr.log` take what the unit
//! writes. When the current file would grow past `log_max_bytes` it is renamed
//! `.1` (older ones shift to `.2` … up to `log_files`, the oldest deleted) and a
//! new one is started, so each stream uses at most
//! `log_max_bytes × (log_files + 1)` bytes. A chunk is split at the cap, so a
//! line may continue in the next file.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::sync::Mutex;
use tracing::warn;

/// One stream's rotating log file.
#[derive(Debug)]
pub struct RotatingLog {
    path: PathBuf,
    file: Option<tokio::fs::File>,
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

    /// Append `buf`, rotating whenever the current file is full.
    pub async fn write(&mut self, mut buf: &[u8]) -> std::io::Result<()> {
        while !buf.is_empty() {
            if self.file.is_none() {
                let f = tokio::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&self.path)
                    .await?;
                self.size = f.metadata().await?.len();
                self.file = Some(f);
            }
            let room = self.max_bytes.saturating_sub(self.size);
            if room == 0 {
                self.rotate().await?;
                continue;
            }
            let n = usize::try_from(room).unwrap_or(usize::MAX).min(buf.len());
            let Some(f) = self.file.as_mut() else {
                continue;
            };
            f.write_all(&buf[..n]).await?;
            // Hand it to the kernel now: readers (operators, tests) see it at once.
            f.flush().await?;
            self.size += n as u64;
            buf = &buf[n..];
        }
        Ok(())
    }

    /// Shift `path.{i}` to `path.{i+1}` (dropping the oldest), `path` to `path.1`.
    async fn rotate(&mut self) -> std::io::Result<()> {
        if let Some(mut f) = self.file.take() {
            f.flush().await?;
        }
        self.size = 0;
        if self.keep == 0 {
            return ignore_missing(tokio::fs::remove_file(&self.path).await);
        }
        ignore_missing(tokio::fs::remove_file(numbered(&self.path, self.keep)).await)?;
        for i in (1..self.keep).rev() {
            ignore_missing(
                tokio::fs::rename(numbered(&self.path, i), numbered(&self.path, i + 1)).await,
            )?;
        }
        ignore_missing(tokio::fs::rename(&self.path, numbered(&self.path, 1)).await)
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

/// Copy a child's pipe into its log until the pipe closes (every process of the
/// unit's group has exited or closed it). A failing write (disk full) is logged
/// once and the output dropped: the pipe keeps being drained so the unit never
/// blocks on a full pipe.
pub async fn pump(mut src: impl AsyncRead + Unpin, log: Arc<Mutex<RotatingLog>>, unit: String) {
    let mut buf = vec![0u8; 16 * 1024];
    let mut warned = false;
    loop {
        let n = match src.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let mut log = log.lock().await;
        if let Err(e) = log.write(&buf[..n]).await
            && !warned
        {
            warned = true;
            warn!(%unit, path = %log.path().display(), error = %e, "cannot write the unit's output; dropping it");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn rotates_and_caps_size() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("stdout.log");
        let mut log = RotatingLog::new(path.clone(), 10, 2);
        for _ in 0..7 {
            log.write(b"0123456").await.unwrap();
        }
        // 49 bytes written, 10 per file: current holds the last 9, .1 and .2 are full,
        // the rest was dropped.
        assert_eq!(std::fs::read(&path).unwrap().len(), 9);
        assert_eq!(std::fs::read(numbered(&path, 1)).unwrap().len(), 10);
        assert_eq!(std::fs::read(numbered(&path, 2)).unwrap().len(), 10);
        assert!(!numbered(&path, 3).exists());
        // A new writer appends to what is there.
        let mut log = RotatingLog::new(path.clone(), 10, 2);
        log.write(b"x").await.unwrap();
        assert_eq!(std::fs::read(&path).unwrap().len(), 10);
    }

    #[tokio::test]
    async fn keep_zero_truncates() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("stderr.log");
        let mut log = RotatingLog::new(path.clone(), 4, 0);
        log.write(b"abcdefgh").await.unwrap();
        log.write(b"ij").await.unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"ij");
        assert!(!numbered(&path, 1).exists());
    }
}
