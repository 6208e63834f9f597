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
}

/// Body of the `units` report: the state of every unit the node supervises.
/// Sent when a unit changes state; a whole list, never a delta.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Units {
    pub units: Vec<UnitStatus>,
}
