//! The history (Jepsen's word): every operation invoked and answered, every
//! fault started and healed, every sample, one JSON line each in
//! `<out>/history.jsonl`, with milliseconds since the run's start. The checker
//! reads it back from memory. No secret value is ever in it: a secret's
//! value is kept as its SHA-256.

use std::io::Write as _;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case")]
pub enum Event {
    /// A request sent: its id (also its `x-request-id`), method, path and
    /// what it writes (the body, secrets replaced by their hash).
    Invoke {
        op: usize,
        request_id: String,
        method: String,
        path: String,
        #[serde(skip_serializing_if = "Value::is_null", default)]
        body: Value,
        /// What the checker compares the final state with (a file's
        /// content, a layer's values, a secret's hash, replicas…).
        #[serde(skip_serializing_if = "Value::is_null", default)]
        expect: Value,
    },
    /// Its answer: status (None: no answer, the outcome is unknown) and an
    /// excerpt of the body.
    Answer {
        op: usize,
        status: Option<u16>,
        excerpt: String,
    },
    FaultStart {
        fault: usize,
        kind: String,
        agents: Vec<String>,
        #[serde(skip_serializing_if = "Option::is_none", default)]
        variant: Option<String>,
    },
    FaultHeal {
        fault: usize,
        kind: String,
        #[serde(skip_serializing_if = "Option::is_none", default)]
        error: Option<String>,
    },
    /// Node states as the API lists them (`/v1/nodes`).
    NodeStates {
        states: Vec<(String, String)>,
    },
    /// Unit processes of each module on each node, from /proc.
    Units {
        counts: Vec<(String, String, usize)>,
    },
    /// Resource use: CPU seconds per component, the controller's RSS and
    /// open descriptors, the broker's queue count, sections not applied.
    Resources {
        cpu: Vec<(String, f64)>,
        rss_kb: Option<u64>,
        fds: Option<u64>,
        queues: Option<u64>,
        behind: Option<u64>,
    },
    Note {
        text: String,
    },
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Entry {
    pub t_ms: u64,
    #[serde(flatten)]
    pub event: Event,
}

/// The history being written: the file and a copy in memory.
#[derive(Clone)]
pub struct History {
    inner: Arc<Mutex<Inner>>,
    start: Instant,
}

struct Inner {
    file: std::io::BufWriter<std::fs::File>,
    entries: Vec<Entry>,
}

impl History {
    pub fn create(path: &Path, start: Instant) -> anyhow::Result<History> {
        let file = std::io::BufWriter::new(std::fs::File::create(path)?);
        Ok(History {
            inner: Arc::new(Mutex::new(Inner {
                file,
                entries: Vec::new(),
            })),
            start,
        })
    }

    pub fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    pub fn record(&self, event: Event) {
        let entry = Entry {
            t_ms: self.now_ms(),
            event,
        };
        let Ok(mut inner) = self.inner.lock() else {
            return;
        };
        if let Ok(line) = serde_json::to_string(&entry) {
            let _ = writeln!(inner.file, "{line}");
        }
        inner.entries.push(entry);
    }

    pub fn flush(&self) {
        if let Ok(mut inner) = self.inner.lock() {
            let _ = inner.file.flush();
        }
    }

    pub fn entries(&self) -> Vec<Entry> {
        self.inner
            .lock()
            .map(|i| i.entries.clone())
            .unwrap_or_default()
    }
}

/// SHA-256 of a secret value, hex: what the history keeps instead.
pub fn hash(value: &str) -> String {
    use sha2::Digest as _;
    hex::encode(sha2::Sha256::digest(value.as_bytes()))
}

/// At most `n` characters of `s`.
pub fn excerpt(s: &str, n: usize) -> String {
    s.chars().take(n).collect()
}
