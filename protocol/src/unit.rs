//! Units: processes a node must run (declared in its inventory section) and the
//! state it reports about them (the `units` report).

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::DecodeError;

/// What the agent does when a unit's process exits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum RestartPolicy {
    /// Restart whatever the exit status (with capped backoff).
    #[default]
    Always,
    /// Restart only after a non-zero exit or a signal.
    OnFailure,
    /// Never restart.
    Never,
}

/// Whether the unit should run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum DesiredState {
    #[default]
    Running,
    Stopped,
}

/// A process a node must supervise. `name` is unique per node; it is the
/// assignment's name (`<module>` or `<module>-<replica>`), so a unit is always
/// traceable to the module that asked for it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct UnitItem {
    pub name: String,
    /// The module this unit runs.
    pub module: String,
    /// Executable: an absolute path, or a name looked up in the agent's PATH.
    pub command: String,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub working_dir: Option<String>,
    #[serde(default)]
    pub restart: RestartPolicy,
    #[serde(default)]
    pub desired: DesiredState,
    /// Probes the agent runs beside the unit; their results go in `health`
    /// reports. An agent older than probes ignores them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub probes: Vec<crate::Probe>,
    /// The artifact the unit runs from (delivery), by digest: the agent starts
    /// it only from its verified cache; a relative `command` is resolved in
    /// the artifact's directory, which is also the default working directory.
    /// Absent for a unit of the host's own programs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact: Option<crate::ArtifactDigest>,
    /// The delivery revision this unit runs, echoed in the unit's status so a
    /// rollout knows which revision is running where.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<uuid::Uuid>,
    /// Who the unit runs as: its module's own unprivileged user (default), or
    /// root, which only an admin may ask for (decision 0051). An agent older
    /// than the sandbox ignores it and runs every unit as itself.
    #[serde(default, skip_serializing_if = "UnitUser::is_module")]
    pub user: UnitUser,
    /// The unit's limits, enforced through its cgroup; all absent: none but the
    /// agent's default pids limit.
    #[serde(default, skip_serializing_if = "UnitLimits::is_empty")]
    pub limits: UnitLimits,
    /// The module is stateful and pinned to this node: its data volume is
    /// never removed by the agent when the module leaves.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stateful: bool,
}

/// Who a unit runs as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum UnitUser {
    /// `mesh-<module>`, a system user the agent allocates per module on the
    /// node (uid in [`MODULE_UID_MIN`]..=[`MODULE_UID_MAX`]).
    #[default]
    Module,
    /// uid 0: the agent's own rights. Admin only, audited.
    Root,
}

impl UnitUser {
    pub fn is_module(&self) -> bool {
        *self == UnitUser::Module
    }
}

/// The first uid (and gid) the agent gives a module's user.
pub const MODULE_UID_MIN: u32 = 60_100;
/// The last: 900 modules per node, below systemd's dynamic users (61184).
pub const MODULE_UID_MAX: u32 = 60_999;

/// A unit's resource limits, enforced by its cgroup: over `memory_bytes` the
/// kernel OOM-kills it (reported `oom_killed`); `pids` caps its processes and
/// threads; `cpu_millis` is its CPU quota in thousandths of a core.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct UnitLimits {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_millis: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pids: Option<u64>,
}

/// The smallest limits a unit may declare: below them nothing starts.
pub const MIN_CPU_MILLIS: u64 = 1;
pub const MIN_MEMORY_BYTES: u64 = 4 * 1024 * 1024;
pub const MIN_PIDS: u64 = 2;

impl UnitLimits {
    pub fn is_empty(&self) -> bool {
        *self == UnitLimits::default()
    }

    /// Each limit, if present, at least its minimum (and CPU at most 1024 cores).
    pub fn validate(&self, field: &str) -> Result<(), DecodeError> {
        let bad = |f: &str, reason: String| {
            Err(DecodeError::Invalid {
                field: format!("{field}.{f}"),
                reason,
            })
        };
        if let Some(c) = self.cpu_millis
            && !(MIN_CPU_MILLIS..=1_024_000).contains(&c)
        {
            return bad(
                "cpu_millis",
                format!("{c}: must be {MIN_CPU_MILLIS} to 1024000"),
            );
        }
        if let Some(m) = self.memory_bytes
            && m < MIN_MEMORY_BYTES
        {
            return bad(
                "memory_bytes",
                format!("{m}: must be at least {MIN_MEMORY_BYTES} (4 MiB)"),
            );
        }
        if let Some(p) = self.pids
            && p < MIN_PIDS
        {
            return bad("pids", format!("{p}: must be at least {MIN_PIDS}"));
        }
        Ok(())
    }
}

/// Unit names: 1 to 63 characters of `[a-z0-9-_.]`, starting with a letter or digit.
pub fn validate_unit_name(field: &str, name: &str) -> Result<(), DecodeError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        && name.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'_' | b'.')
        });
    if ok {
        Ok(())
    } else {
        Err(DecodeError::Invalid {
            field: field.to_owned(),
            reason: format!(
                "`{}`: 1 to 63 characters of a-z 0-9 - _ . starting with a letter or digit",
                name.chars().take(80).collect::<String>()
            ),
        })
    }
}

impl UnitItem {
    pub fn validate(&self, field: &str) -> Result<(), DecodeError> {
        let invalid = |f: &str, reason: &str| DecodeError::Invalid {
            field: format!("{field}.{f}"),
            reason: reason.to_owned(),
        };
        validate_unit_name(&format!("{field}.name"), &self.name)?;
        validate_unit_name(&format!("{field}.module"), &self.module)?;
        if self.command.is_empty() || self.command.len() > 4096 || self.command.contains('\0') {
            return Err(invalid("command", "must be 1 to 4096 bytes without NUL"));
        }
        if self.args.len() > 256 || self.args.iter().any(|a| a.len() > 4096 || a.contains('\0')) {
            return Err(invalid(
                "args",
                "at most 256 arguments of at most 4096 bytes, without NUL",
            ));
        }
        if self.env.len() > 256
            || self.env.iter().any(|(k, v)| {
                k.is_empty() || k.contains(['=', '\0']) || v.contains('\0') || v.len() > 4096
            })
        {
            return Err(invalid(
                "env",
                "at most 256 variables; names non-empty without = or NUL; values without NUL",
            ));
        }
        if let Some(dir) = &self.working_dir {
            crate::validate_path(&format!("{field}.working_dir"), dir)?;
        }
        self.limits.validate(&format!("{field}.limits"))?;
        crate::validate_probes(&format!("{field}.probes"), &self.probes)
    }
}

/// A unit's observed state on its node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnitState {
    Starting,
    Running,
    /// Exited and will not be restarted (policy, or desired stopped).
    Exited,
    /// Exited abnormally; a restart is pending (backoff) or the policy gave up.
    Failed,
    Stopped,
}

impl UnitState {
    /// The state as the wire and every store spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            UnitState::Starting => "starting",
            UnitState::Running => "running",
            UnitState::Exited => "exited",
            UnitState::Failed => "failed",
            UnitState::Stopped => "stopped",
        }
    }
}

/// One unit as the agent sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnitStatus {
    pub name: String,
    pub module: String,
    pub state: UnitState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// Restarts since the unit was (re)declared.
    pub restarts: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<DateTime<Utc>>,
    /// The revision of the unit as declared (its `revision`), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<uuid::Uuid>,
    /// Why the last process ended, when the agent knows more than its exit
    /// code: [`REASON_OOM_KILLED`] (over its memory limit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Times the unit was OOM-killed since it was (re)declared.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub oom_kills: u32,
    /// The uid its process runs as.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    /// Bytes in its module's data volume on this node (as of the report).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_bytes: Option<u64>,
}

/// A unit's last process was killed by the kernel for going over its memory
/// limit.
pub const REASON_OOM_KILLED: &str = "oom_killed";

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// Body of the `units` report: the state of every unit the node supervises.
/// Sent when a unit changes state; a whole list, never a delta.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Units {
    pub units: Vec<UnitStatus>,
}
