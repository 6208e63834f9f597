//! The agent's local store: one JSON file, `<state_dir>/store.json`, rewritten
//! atomically (temp file, fsync, rename, fsync of the directory) on every change.
//!
//! It holds, per section, what was last applied (generation, digest, the paths
//! the agent wrote, so files dropped from a later generation get removed) and how
//! the last attempt went; the upper bound of report sequence numbers handed out;
//! and `applied` reports not yet confirmed by the broker, so a declaration can be
//! acknowledged as soon as its report is here and a restart loses none of them.
//! Since version 2 it also holds each section's declared units, so that a
//! restarted agent runs them again before it hears from anyone. Since version 3
//! it holds the provisioning section's declared resources and what the agent
//! last found of them (the last `resources` report's body), so that a restarted
//! agent reconciles them before it hears from anyone, creates nothing that
//! exists, and states them again at once. Since version 4 it holds the
//! mesh's endpoints its inventory section last declared (decision 0044), so
//! that a restarted agent whose configured brokers are gone reaches the
//! controller's new home.
//!
//! The format is versioned: a store with a `version` this agent does not know is
//! refused, never guessed at. Older versions are migrated when read (and written
//! in the current version at the next save):
//! - 1 → 2: sections gained `units` (absent in version 1: none).
//! - 2 → 3: sections gained `resources` and the store `resources` (absent in
//!   versions 1 and 2: none, nothing found yet).
//! - 3 → 4: the store gained `endpoints` (absent in versions 1 to 3: none
//!   learned yet).

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};

use chrono::{DateTime, Utc};
use mesh_protocol::{
    AppliedGenerations, Endpoints, Outcome, ResourceItem, Resources, Section, UnitItem,
};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// The file name inside the state directory.
pub const STORE_FILE: &str = "store.json";

/// The store format this agent reads and writes.
pub const STORE_VERSION: u32 = 4;

/// Sequence numbers are reserved in blocks so that the store is not rewritten for
/// every heartbeat; a restart skips the rest of the block (seq stays monotonic,
/// with gaps).
pub const SEQ_BLOCK: u64 = 1024;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store {path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("store {path} is not valid: {message}")]
    Malformed { path: PathBuf, message: String },
    #[error(
        "store {path} has format version {found}; this agent knows versions 1 to {STORE_VERSION}"
    )]
    UnknownVersion { path: PathBuf, found: u64 },
}

/// What the agent knows about one section.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SectionState {
    /// Newest generation applied completely (0: none yet).
    pub generation: u64,
    /// Digest ([`mesh_protocol::digest_items`]) of that generation's items.
    pub digest: String,
    /// Declared paths of files the agent has written for this section and not
    /// removed since. After a complete apply this is exactly that generation's
    /// files; after a failed one it also keeps the older ones.
    pub paths: BTreeSet<String>,
    /// The generation last attempted, whatever came of it.
    pub last_generation: u64,
    /// How the last attempt went (`None` before the first).
    pub last_outcome: Option<Outcome>,
    /// What went wrong in the last attempt, if anything.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    pub updated_at: Option<DateTime<Utc>>,
    /// The units of the generation applied last (`generation`): what the
    /// supervisor runs for this section, also right after a restart. Absent in
    /// version 1 stores and when there are none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub units: Vec<UnitItem>,
    /// The resources of the generation applied last (the provisioning
    /// section): what the agent reconciles, also right after a restart.
    /// Absent in version 1 and 2 stores and when there are none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub resources: Vec<ResourceItem>,
}

/// A report that was built but not yet confirmed by the broker. Only `applied`
/// reports are persisted: hellos and heartbeats are rebuilt from current state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PendingReport {
    pub id: Uuid,
    /// Report kind (`applied`).
    pub kind: String,
    pub seq: u64,
    /// The encoded envelope, exactly as it will be published.
    pub payload: String,
}

/// The on-disk document.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreData {
    /// Format version, [`STORE_VERSION`].
    pub version: u32,
    /// Every sequence number handed out so far is at most this.
    pub seq_reserved: u64,
    pub sections: BTreeMap<Section, SectionState>,
    #[serde(default)]
    pub pending_reports: Vec<PendingReport>,
    /// What the agent last found of the provisioning section's resources:
    /// the body of its last `resources` report (absent before the first
    /// pass, and in version 1 and 2 stores). Never a credential.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<Resources>,
    /// The mesh's broker and API endpoints, as the inventory section applied
    /// last declared them (absent: none declared, and in version 1 to 3
    /// stores). Validated when declared; checked again when read back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoints: Option<Endpoints>,
}

impl Default for StoreData {
    fn default() -> Self {
        StoreData {
            version: STORE_VERSION,
            seq_reserved: 0,
            sections: BTreeMap::new(),
            pending_reports: Vec::new(),
            resources: None,
            endpoints: None,
        }
    }
}

/// The store, loaded, with the path it is saved to.
#[derive(Debug)]
pub struct Store {
    path: PathBuf,
    data: StoreData,
    next_seq: u64,
}

impl Store {
    /// Load `<state_dir>/store.json`, or start empty if there is none. Creates the
    /// state directory if it is missing.
    pub fn open(state_dir: &Path) -> Result<Store, StoreError> {
        let path = state_dir.join(STORE_FILE);
        let io = |error| StoreError::Io {
            path: path.clone(),
            error,
        };
        std::fs::create_dir_all(state_dir).map_err(io)?;
        let data = match std::fs::read(&path) {
            Ok(bytes) => parse(&bytes, &path)?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => StoreData::default(),
            Err(e) => return Err(io(e)),
        };
        let next_seq = data.seq_reserved + 1;
        Ok(Store {
            path,
            data,
            next_seq,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn data(&self) -> &StoreData {
        &self.data
    }

    pub fn section(&self, section: Section) -> SectionState {
        self.data
            .sections
            .get(&section)
            .cloned()
            .unwrap_or_default()
    }

    /// Newest completely applied generation per section (sections never applied
    /// are absent).
    pub fn applied_generations(&self) -> AppliedGenerations {
        self.data
            .sections
            .iter()
            .filter(|(_, s)| s.generation > 0)
            .map(|(k, s)| (*k, s.generation))
            .collect()
    }

    /// The next report sequence number; reserves (and saves) a new block when the
    /// current one is used up. If that save fails the number is still handed out
    /// (monotonic within this process) and the failure logged: a report is worth
    /// more than a gap-free sequence across a crash.
    pub fn next_seq(&mut self) -> u64 {
        if self.next_seq > self.data.seq_reserved {
            self.data.seq_reserved = self.next_seq + SEQ_BLOCK - 1;
            if let Err(e) = self.save() {
                tracing::error!(error = %e, "cannot save the sequence reservation");
            }
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        seq
    }

    /// Record a section's new state and, in the same write, a report to keep
    /// until it is confirmed.
    pub fn record(
        &mut self,
        section: Section,
        state: SectionState,
        report: Option<PendingReport>,
        max_pending: usize,
    ) -> Result<(), StoreError> {
        self.data.sections.insert(section, state);
        if let Some(r) = report {
            self.data.pending_reports.push(r);
            let excess = self.data.pending_reports.len().saturating_sub(max_pending);
            self.data.pending_reports.drain(..excess);
        }
        self.save()
    }

    /// Keep a report until it is confirmed.
    pub fn add_pending(
        &mut self,
        report: PendingReport,
        max_pending: usize,
    ) -> Result<(), StoreError> {
        self.data.pending_reports.push(report);
        let excess = self.data.pending_reports.len().saturating_sub(max_pending);
        self.data.pending_reports.drain(..excess);
        self.save()
    }

    /// Keep what the agent found of the provisioning section's resources.
    pub fn set_resources(&mut self, found: Resources) -> Result<(), StoreError> {
        self.data.resources = Some(found);
        self.save()
    }

    /// Keep the endpoints an applied inventory section declared (none: it
    /// declared none). Saves only if they changed; true if they did. A
    /// failed save keeps the ones before.
    pub fn set_endpoints(&mut self, endpoints: Option<Endpoints>) -> Result<bool, StoreError> {
        if self.data.endpoints == endpoints {
            return Ok(false);
        }
        let before = std::mem::replace(&mut self.data.endpoints, endpoints);
        match self.save() {
            Ok(()) => Ok(true),
            Err(e) => {
                // Not kept: what was kept before holds, in memory as on disk.
                self.data.endpoints = before;
                Err(e)
            }
        }
    }

    /// The broker endpoints kept (`(host, port)`, in the declared order);
    /// an entry that does not read as one is left out.
    pub fn broker_endpoints(&self) -> Vec<(String, u16)> {
        self.data
            .endpoints
            .iter()
            .flat_map(|e| e.brokers.iter())
            .filter_map(|b| mesh_protocol::parse_host_port(b).ok())
            .collect()
    }

    /// Forget reports that were confirmed or dropped. Saves only if one was kept.
    pub fn remove_pending(&mut self, ids: &[Uuid]) -> Result<(), StoreError> {
        let before = self.data.pending_reports.len();
        self.data.pending_reports.retain(|r| !ids.contains(&r.id));
        if self.data.pending_reports.len() != before {
            self.save()
        } else {
            Ok(())
        }
    }

    /// Write the store atomically.
    pub fn save(&self) -> Result<(), StoreError> {
        let bytes = serde_json::to_vec_pretty(&self.data).map_err(|e| StoreError::Malformed {
            path: self.path.clone(),
            message: e.to_string(),
        })?;
        write_atomic(&self.path, &bytes, 0o600).map_err(|error| StoreError::Io {
            path: self.path.clone(),
            error,
        })
    }
}

fn parse(bytes: &[u8], path: &Path) -> Result<StoreData, StoreError> {
    let malformed = |e: serde_json::Error| StoreError::Malformed {
        path: path.to_owned(),
        message: e.to_string(),
    };
    let value: serde_json::Value = serde_json::from_slice(bytes).map_err(malformed)?;
    let version = value.get("version").and_then(serde_json::Value::as_u64);
    match version {
        Some(v) if v == u64::from(STORE_VERSION) => {
            serde_json::from_value(value).map_err(malformed)
        }
        // Version 1 is version 2 without units, version 2 is version 3
        // without resources, version 3 is version 4 without endpoints: read
        // them as they are, then say 4.
        Some(1..=3) => {
            let mut data: StoreData = serde_json::from_value(value).map_err(malformed)?;
            data.version = STORE_VERSION;
            Ok(data)
        }
        Some(found) => Err(StoreError::UnknownVersion {
            path: path.to_owned(),
            found,
        }),
        None => Err(StoreError::Malformed {
            path: path.to_owned(),
            message: "no numeric `version` field".into(),
        }),
    }
}

/// Write `bytes` to `path` atomically: a temp file in the same directory, written,
/// fsynced, given `mode`, renamed over `path`, then the directory fsynced. Readers
/// see the old content or the new, never a mix; a crash leaves at most a stray
/// temp file (named `.<name>.mesh-tmp-<random>`), never a torn file.
pub fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    write_atomic_owned(path, bytes, mode, None)
}

/// [`write_atomic`], the file owned by `owner` (uid, gid) from the moment it
/// has its name.
pub fn write_atomic_owned(
    path: &Path,
    bytes: &[u8],
    mode: u32,
    owner: Option<(u32, u32)>,
) -> std::io::Result<()> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let dir = path
        .parent()
        .ok_or_else(|| std::io::Error::other("path has no parent directory"))?;
    let name = path
        .file_name()
        .ok_or_else(|| std::io::Error::other("path has no file name"))?;
    let tmp = dir.join(format!(
        ".{}.mesh-tmp-{:016x}",
        name.to_string_lossy(),
        rand::random::<u64>()
    ));
    let result = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(bytes)?;
        // Set the mode explicitly: the open mode is filtered by the umask.
        f.set_permissions(std::fs::Permissions::from_mode(mode))?;
        if let Some((uid, gid)) = owner {
            std::os::unix::fs::fchown(&f, Some(uid), Some(gid))?;
        }
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, path)?;
        std::fs::File::open(dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_restart() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = Store::open(dir.path()).unwrap();
        assert_eq!(s.next_seq(), 1);
        assert_eq!(s.next_seq(), 2);
        let state = SectionState {
            generation: 3,
            digest: "abc".into(),
            paths: ["/etc/a".to_owned()].into(),
            last_generation: 3,
            last_outcome: Some(Outcome::Applied),
            last_error: None,
            updated_at: Some(Utc::now()),
            units: vec![UnitItem {
                user: Default::default(),
                limits: Default::default(),
                stateful: false,
                artifact: None,
                revision: None,
                name: "web".into(),
                module: "web".into(),
                command: "/bin/sleep".into(),
                args: vec!["1000".into()],
                env: [("A".to_owned(), "1".to_owned())].into(),
                working_dir: Some("/srv".into()),
                restart: mesh_protocol::RestartPolicy::OnFailure,
                desired: mesh_protocol::DesiredState::Running,
                probes: Vec::new(),
            }],
            resources: Vec::new(),
        };
        let report = PendingReport {
            id: Uuid::now_v7(),
            kind: "applied".into(),
            seq: 2,
            payload: "{}".into(),
        };
        s.record(Section::Config, state.clone(), Some(report.clone()), 10)
            .unwrap();
        drop(s);

        let mut s = Store::open(dir.path()).unwrap();
        assert_eq!(s.section(Section::Config), state);
        assert_eq!(s.data().pending_reports, vec![report.clone()]);
        assert_eq!(s.applied_generations().get(&Section::Config), Some(&3));
        // Sequence numbers stay monotonic across a restart.
        assert!(s.next_seq() > 2);
        s.remove_pending(&[report.id]).unwrap();
        drop(s);
        assert!(
            Store::open(dir.path())
                .unwrap()
                .data()
                .pending_reports
                .is_empty()
        );
        // Nothing but the store itself is left in the directory.
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from(STORE_FILE)]);
    }

    #[test]
    fn pending_is_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = Store::open(dir.path()).unwrap();
        for seq in 0..5 {
            let r = PendingReport {
                id: Uuid::now_v7(),
                kind: "applied".into(),
                seq,
                payload: "{}".into(),
            };
            s.add_pending(r, 3).unwrap();
        }
        let seqs: Vec<u64> = s.data().pending_reports.iter().map(|r| r.seq).collect();
        assert_eq!(seqs, vec![2, 3, 4]);
    }

    #[test]
    fn version_1_is_migrated() {
        let dir = tempfile::tempdir().unwrap();
        // Exactly what a version-1 agent wrote.
        let v1 = r#"{
  "version": 1,
  "seq_reserved": 2048,
  "sections": {
    "config": {
      "generation": 4,
      "digest": "d",
      "paths": ["/etc/a"],
      "last_generation": 4,
      "last_outcome": "applied",
      "updated_at": "2025-01-01T00:00:00Z"
    }
  },
  "pending_reports": []
}"#;
        std::fs::write(dir.path().join(STORE_FILE), v1).unwrap();
        let mut s = Store::open(dir.path()).unwrap();
        assert_eq!(s.data().version, STORE_VERSION);
        let c = s.section(Section::Config);
        assert_eq!(c.generation, 4);
        assert!(c.units.is_empty());
        assert!(s.next_seq() > 2048);
        // The next save writes the current version.
        let text = std::fs::read_to_string(dir.path().join(STORE_FILE)).unwrap();
        assert!(text.contains("\"version\": 4"), "{text}");
        assert_eq!(Store::open(dir.path()).unwrap().section(Section::Config), c);
    }

    #[test]
    fn version_2_is_migrated() {
        let dir = tempfile::tempdir().unwrap();
        // Exactly what a version-2 agent wrote: sections with units.
        let v2 = r#"{
  "version": 2,
  "seq_reserved": 1024,
  "sections": {
    "inventory": {
      "generation": 7,
      "digest": "d",
      "paths": [],
      "last_generation": 7,
      "last_outcome": "applied",
      "updated_at": "2025-01-01T00:00:00Z",
      "units": [
        {
          "name": "web",
          "module": "web",
          "command": "/bin/sleep",
          "args": ["1000"],
          "restart": "always",
          "desired": "running"
        }
      ]
    }
  },
  "pending_reports": [
    {"id": "0190b6f0-0000-7000-8000-000000000001", "kind": "applied", "seq": 9, "payload": "{}"}
  ]
}"#;
        std::fs::write(dir.path().join(STORE_FILE), v2).unwrap();
        let mut s = Store::open(dir.path()).unwrap();
        assert_eq!(s.data().version, STORE_VERSION);
        let inv = s.section(Section::Inventory);
        assert_eq!(inv.generation, 7);
        assert_eq!(inv.units.len(), 1);
        assert_eq!(inv.units[0].name, "web");
        // Nothing provisioned, nothing found yet.
        assert!(inv.resources.is_empty());
        assert!(s.section(Section::Provisioning).resources.is_empty());
        assert_eq!(s.data().resources, None);
        assert_eq!(s.data().pending_reports.len(), 1);
        // The next save writes version 4, which reads back the same.
        let found = mesh_protocol::Resources {
            generation: 2,
            resources: vec![mesh_protocol::ResourceStatus {
                grant: Uuid::nil(),
                state: mesh_protocol::ResourceStatusState::Ready,
                credential_version: Some(1),
                reason: None,
                recreated: false,
            }],
        };
        s.set_resources(found.clone()).unwrap();
        let text = std::fs::read_to_string(dir.path().join(STORE_FILE)).unwrap();
        assert!(text.contains("\"version\": 4"), "{text}");
        let again = Store::open(dir.path()).unwrap();
        assert_eq!(again.section(Section::Inventory), inv);
        assert_eq!(again.data().resources, Some(found));
    }

    #[test]
    fn version_3_is_migrated_and_endpoints_are_kept() {
        let dir = tempfile::tempdir().unwrap();
        // Exactly what a version-3 agent wrote: no endpoints.
        let v3 = r#"{
  "version": 3,
  "seq_reserved": 1024,
  "sections": {
    "inventory": {
      "generation": 2,
      "digest": "d",
      "paths": [],
      "last_generation": 2,
      "last_outcome": "applied",
      "updated_at": "2025-01-01T00:00:00Z"
    }
  },
  "pending_reports": []
}"#;
        std::fs::write(dir.path().join(STORE_FILE), v3).unwrap();
        let mut s = Store::open(dir.path()).unwrap();
        assert_eq!(s.data().version, STORE_VERSION);
        assert_eq!(s.data().endpoints, None);
        assert!(s.broker_endpoints().is_empty());
        assert_eq!(s.section(Section::Inventory).generation, 2);
        let e = Endpoints {
            brokers: vec!["127.0.0.1:5673".into(), "[::1]:5674".into()],
            api: vec!["https://ctl.example:7443".into()],
        };
        assert!(s.set_endpoints(Some(e.clone())).unwrap());
        assert!(!s.set_endpoints(Some(e.clone())).unwrap());
        let text = std::fs::read_to_string(dir.path().join(STORE_FILE)).unwrap();
        assert!(text.contains("\"version\": 4"), "{text}");
        let again = Store::open(dir.path()).unwrap();
        assert_eq!(again.data().endpoints, Some(e));
        assert_eq!(
            again.broker_endpoints(),
            vec![("127.0.0.1".to_owned(), 5673), ("::1".to_owned(), 5674)]
        );
    }

    #[test]
    fn unknown_version_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join(STORE_FILE),
            r#"{"version": 99, "whatever": true}"#,
        )
        .unwrap();
        let err = Store::open(dir.path()).unwrap_err();
        assert!(
            matches!(err, StoreError::UnknownVersion { found: 99, .. }),
            "{err}"
        );
        std::fs::write(dir.path().join(STORE_FILE), "not json").unwrap();
        assert!(matches!(
            Store::open(dir.path()).unwrap_err(),
            StoreError::Malformed { .. }
        ));
    }
}
