//! Reading a unit's captured output for a logs request (decision 0033): the
//! last lines of a stream, or the lines after a position a previous answer
//! gave, across the stream's rotated files.
//!
//! A stream is its files, oldest first (`stdout.log.N` … `stdout.log.1`,
//! `stdout.log`), read as one sequence of bytes. A position is the file (its
//! inode: a rotation renames, so the inode follows the bytes) and the offset
//! in it, with a hash of the bytes just before the offset; a position whose
//! file is gone (rotated away) or no longer holds those bytes resumes at the
//! oldest bytes kept that are newer, and says `gap`. Only whole lines are
//! given (a line still being written waits for its newline, unless it is
//! already [`MAX_LOG_LINE_BYTES`] long: lines are cut at that size).
//!
//! What is read is bounded: at most [`MAX_REGION_BYTES`] of a stream per
//! answer, at most `tail` lines, and at most the byte budget the caller
//! gives (measured as JSON-escaped text). The directory and file names come
//! from the agent's own unit names and the two stream names, never from the
//! request.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use mesh_protocol::{LogPosition, LogStream, MAX_LOG_LINE_BYTES, StreamLogs};

/// Most bytes of one stream read for one answer.
pub const MAX_REGION_BYTES: u64 = 192 * 1024;
/// Most rotated files looked at (the agent keeps at most 1,000).
const MAX_ROTATED: usize = 1000;
/// Bytes before a position that its check covers.
const CHECK_BYTES: u64 = 32;

/// One file of a stream, open.
struct Piece {
    file: File,
    ino: u64,
    len: u64,
    /// Where it starts in the stream.
    base: u64,
}

/// A stream's files, oldest first.
struct Stream {
    pieces: Vec<Piece>,
    end: u64,
}

fn numbered(dir: &Path, name: &str, i: usize) -> std::path::PathBuf {
    if i == 0 {
        dir.join(name)
    } else {
        dir.join(format!("{name}.{i}"))
    }
}

impl Stream {
    /// Open the files of `stream` in `dir`, newest first as they are named,
    /// keeping each inode once (a rotation while opening shows a file
    /// twice), then ordered oldest first.
    fn open(dir: &Path, stream: LogStream) -> std::io::Result<Stream> {
        let name = format!("{}.log", stream.as_str());
        let mut newest_first: Vec<(File, u64, u64)> = Vec::new();
        let mut missing = 0;
        for i in 0..=MAX_ROTATED {
            match File::open(numbered(dir, &name, i)) {
                Ok(file) => {
                    missing = 0;
                    let meta = file.metadata()?;
                    if !meta.is_file() || newest_first.iter().any(|(_, ino, _)| *ino == meta.ino())
                    {
                        continue;
                    }
                    newest_first.push((file, meta.ino(), meta.len()));
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    // A rotation shifts files one by one: one may be missing
                    // for a moment between two that exist.
                    missing += 1;
                    if i > 0 && missing >= 2 {
                        break;
                    }
                }
                Err(e) => return Err(e),
            }
        }
        let mut pieces = Vec::with_capacity(newest_first.len());
        let mut base = 0;
        for (file, ino, len) in newest_first.into_iter().rev() {
            pieces.push(Piece {
                file,
                ino,
                len,
                base,
            });
            base += len;
        }
        Ok(Stream { pieces, end: base })
    }

    /// Read `[from, to)` of the stream (fewer bytes if a file is shorter
    /// than it was when opened).
    fn read(&mut self, from: u64, to: u64) -> std::io::Result<Vec<u8>> {
        let mut out = Vec::with_capacity(usize::try_from(to.saturating_sub(from)).unwrap_or(0));
        for p in &mut self.pieces {
            let (start, stop) = (from.max(p.base), to.min(p.base + p.len));
            if start >= stop {
                continue;
            }
            p.file.seek(SeekFrom::Start(start - p.base))?;
            let want = stop - start;
            let got = (&mut p.file).take(want).read_to_end(&mut out)?;
            if (got as u64) < want {
                break;
            }
        }
        Ok(out)
    }

    /// The hash of the bytes of piece `i` before `offset`.
    fn check(&mut self, i: usize, offset: u64) -> std::io::Result<u64> {
        let base = self.pieces[i].base;
        let from = base + offset.saturating_sub(CHECK_BYTES);
        let bytes = self.read(from, base + offset)?;
        Ok(fnv1a(&bytes))
    }

    /// Where a position is in the stream, and whether output was lost
    /// since it.
    fn resolve(&mut self, p: &LogPosition) -> std::io::Result<(u64, bool)> {
        if p.file == 0 {
            return Ok((0, false));
        }
        let Some(i) = self.pieces.iter().position(|x| x.ino == p.file) else {
            // Rotated away: everything kept is newer than it.
            return Ok((0, true));
        };
        let piece_base = self.pieces[i].base;
        if p.offset > self.pieces[i].len || self.check(i, p.offset)? != p.check {
            // Not the file it was (truncated, or its inode reused): start
            // at this file's beginning.
            return Ok((piece_base, true));
        }
        Ok((piece_base + p.offset, false))
    }

    /// The position of stream offset `at`, in the file holding the byte
    /// before it (so that it stays valid while that file is kept).
    fn position(&mut self, unit: &str, stream: LogStream, at: u64) -> std::io::Result<LogPosition> {
        let found = self
            .pieces
            .iter()
            .position(|p| at > p.base && at <= p.base + p.len)
            .or_else(|| (!self.pieces.is_empty() && at == 0).then_some(0));
        let Some(i) = found else {
            return Ok(LogPosition {
                unit: unit.to_owned(),
                stream,
                file: 0,
                offset: 0,
                check: 0,
            });
        };
        let offset = at - self.pieces[i].base;
        Ok(LogPosition {
            unit: unit.to_owned(),
            stream,
            file: self.pieces[i].ino,
            offset,
            check: self.check(i, offset)?,
        })
    }
}

/// FNV-1a, 64 bits: what a position's check is.
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// A line of `buf` and the offset just after it (its newline included).
struct Line {
    text: String,
    end: usize,
}

/// Whole lines of `buf`, cut at [`MAX_LOG_LINE_BYTES`]; a last piece without
/// a newline shorter than that is left out (it is still being written).
fn lines(buf: &[u8]) -> Vec<Line> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < buf.len() {
        let rest = &buf[start..];
        let window = &rest[..rest.len().min(MAX_LOG_LINE_BYTES)];
        match window.iter().position(|b| *b == b'\n') {
            Some(n) => {
                out.push(Line {
                    text: String::from_utf8_lossy(&window[..n]).into_owned(),
                    end: start + n + 1,
                });
                start += n + 1;
            }
            None if window.len() == MAX_LOG_LINE_BYTES => {
                out.push(Line {
                    text: String::from_utf8_lossy(window).into_owned(),
                    end: start + window.len(),
                });
                start += window.len();
            }
            None => break,
        }
    }
    out
}

/// What a line costs of an answer's budget: its JSON form and a comma.
fn cost(line: &str) -> usize {
    serde_json::to_string(line).map_or(line.len() * 6, |s| s.len()) + 1
}

/// Read one stream of one unit in `dir`: after `after` when given (at most
/// `tail` lines), else its last `tail` lines; at most `budget` bytes of
/// escaped text.
pub fn read_stream(
    dir: &Path,
    unit: &str,
    stream: LogStream,
    after: Option<&LogPosition>,
    tail: usize,
    budget: usize,
) -> std::io::Result<StreamLogs> {
    let mut s = Stream::open(dir, stream)?;
    let end = s.end;
    let mut gap = false;
    let mut taken: Vec<String> = Vec::new();
    let mut more = false;
    let stop: u64;
    match after {
        Some(p) => {
            let (from, lost) = s.resolve(p)?;
            gap = lost;
            let to = end.min(from + MAX_REGION_BYTES);
            let buf = s.read(from, to)?;
            let all = lines(&buf);
            let mut used = 0;
            let mut last_end = 0;
            for l in &all {
                let c = cost(&l.text);
                if taken.len() >= tail || used + c > budget {
                    break;
                }
                used += c;
                last_end = l.end;
                taken.push(l.text.clone());
            }
            stop = from + last_end as u64;
            // Lines left, or bytes past the region read: ask again.
            more = taken.len() < all.len() || (to < end && stop < end);
        }
        None => {
            let from = end.saturating_sub(MAX_REGION_BYTES);
            let buf = s.read(from, end)?;
            // A region that starts mid-stream starts mid-line: skip to the
            // first line that starts inside it.
            let skip = if from > 0 && s.read(from - 1, from)?.first() != Some(&b'\n') {
                buf.iter()
                    .position(|b| *b == b'\n')
                    .map_or(buf.len(), |n| n + 1)
            } else {
                0
            };
            let all = lines(&buf[skip..]);
            let last_end = all.last().map_or(0, |l| l.end);
            let mut used = 0;
            for l in all.iter().rev() {
                let c = cost(&l.text);
                if taken.len() >= tail || used + c > budget {
                    break;
                }
                used += c;
                taken.push(l.text.clone());
            }
            taken.reverse();
            stop = if all.is_empty() {
                from + skip as u64
            } else {
                from + (skip + last_end) as u64
            };
        }
    }
    let position = s.position(unit, stream, stop)?;
    Ok(StreamLogs {
        stream,
        lines: taken,
        position,
        gap,
        more,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::units::RotatingLog;

    fn read(dir: &Path, after: Option<&LogPosition>, tail: usize) -> StreamLogs {
        read_stream(dir, "web-0", LogStream::Stdout, after, tail, 1 << 20).unwrap()
    }

    fn write(log: &mut RotatingLog, lines: std::ops::Range<u32>) {
        for i in lines {
            log.write(format!("line {i}\n").as_bytes()).unwrap();
        }
    }

    #[test]
    fn nothing_written_yet_then_everything_after() {
        let dir = tempfile::tempdir().unwrap();
        let first = read(dir.path(), None, 10);
        assert!(first.lines.is_empty());
        assert_eq!(first.position.file, 0);
        let mut log = RotatingLog::new(dir.path().join("stdout.log"), 1 << 20, 2);
        write(&mut log, 0..3);
        let next = read(dir.path(), Some(&first.position), 10);
        assert_eq!(next.lines, ["line 0", "line 1", "line 2"]);
        assert!(!next.gap && !next.more);
        let again = read(dir.path(), Some(&next.position), 10);
        assert!(again.lines.is_empty(), "{:?}", again.lines);
        assert_eq!(again.position, next.position);
    }

    #[test]
    fn the_last_lines_across_rotated_files() {
        let dir = tempfile::tempdir().unwrap();
        // 7 bytes a line, 64 a file: several rotations, 3 files kept.
        let mut log = RotatingLog::new(dir.path().join("stdout.log"), 64, 3);
        write(&mut log, 0..30);
        let out = read(dir.path(), None, 5);
        assert_eq!(
            out.lines,
            ["line 25", "line 26", "line 27", "line 28", "line 29"]
        );
        // A line cut by a rotation reads whole.
        let out = read(dir.path(), None, 20);
        assert!(
            out.lines
                .iter()
                .all(|l| l.starts_with("line ") && l.len() >= 6)
        );
        assert_eq!(out.lines.last().map(String::as_str), Some("line 29"));
    }

    #[test]
    fn following_survives_rotation_and_says_what_was_lost() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = RotatingLog::new(dir.path().join("stdout.log"), 64, 2);
        write(&mut log, 0..3);
        let start = read(dir.path(), None, 100);
        assert_eq!(start.lines.len(), 3);
        // A rotation or two: the position's file is now `.1` or `.2`.
        write(&mut log, 3..15);
        let next = read(dir.path(), Some(&start.position), 100);
        let want: Vec<String> = (3..15).map(|i| format!("line {i}")).collect();
        assert_eq!(next.lines, want);
        assert!(!next.gap);
        // So much that the position's file is rotated away: a gap, then
        // the oldest kept lines, in order, to the newest.
        write(&mut log, 15..60);
        let after_gap = read(dir.path(), Some(&next.position), 1000);
        assert!(after_gap.gap);
        assert_eq!(after_gap.lines.last().map(String::as_str), Some("line 59"));
        let nums: Vec<u32> = after_gap
            .lines
            .iter()
            .filter_map(|l| l.strip_prefix("line ")?.parse().ok())
            .collect();
        assert!(nums.windows(2).all(|w| w[1] == w[0] + 1), "{nums:?}");
        assert!(nums[0] > 15);
    }

    #[test]
    fn a_line_being_written_waits_and_long_lines_are_cut() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = RotatingLog::new(dir.path().join("stdout.log"), 1 << 20, 2);
        log.write(b"whole\npart").unwrap();
        let out = read(dir.path(), None, 10);
        assert_eq!(out.lines, ["whole"]);
        log.write(b"ial\n").unwrap();
        let next = read(dir.path(), Some(&out.position), 10);
        assert_eq!(next.lines, ["partial"]);
        log.write(&vec![b'x'; MAX_LOG_LINE_BYTES * 2 + 5]).unwrap();
        let long = read(dir.path(), Some(&next.position), 10);
        assert_eq!(long.lines.len(), 2);
        assert!(long.lines.iter().all(|l| l.len() == MAX_LOG_LINE_BYTES));
    }

    #[test]
    fn at_most_tail_lines_after_a_position_and_more_is_said() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = RotatingLog::new(dir.path().join("stdout.log"), 1 << 20, 2);
        let start = read(dir.path(), None, 10);
        write(&mut log, 0..10);
        let first = read(dir.path(), Some(&start.position), 4);
        assert_eq!(first.lines, ["line 0", "line 1", "line 2", "line 3"]);
        assert!(first.more);
        let second = read(dir.path(), Some(&first.position), 100);
        assert_eq!(second.lines.len(), 6);
        assert!(!second.more);
        // The byte budget bounds an answer too.
        let small = read_stream(
            dir.path(),
            "web-0",
            LogStream::Stdout,
            Some(&start.position),
            100,
            30,
        )
        .unwrap();
        assert_eq!(small.lines.len(), 3);
        assert!(small.more);
    }

    #[test]
    fn a_replaced_file_is_not_mistaken_for_the_one_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("stdout.log");
        std::fs::write(&path, "one\ntwo\n").unwrap();
        let out = read(dir.path(), None, 10);
        // Same inode, other bytes (truncated and rewritten in place).
        std::fs::write(&path, "xyz\nabc\nnew\n").unwrap();
        let next = read(dir.path(), Some(&out.position), 10);
        assert!(next.gap);
        assert_eq!(next.lines, ["xyz", "abc", "new"]);
    }
}
