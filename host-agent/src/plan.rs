//! The heartbeat plan the controller declared in this node's inventory section
//! (interval and grace, when the fleet's budget stretches the interval past its
//! floor), kept in its own file `<state_dir>/heartbeat-plan.json` so that a
//! restarted agent beats at the declared interval before it hears from anyone,
//! and so that the store's format (which an agent one version older must still
//! read) does not change. No file: the agent's configured interval.

use std::io::Write;
use std::path::{Path, PathBuf};

use mesh_protocol::HeartbeatPlan;

/// The file name inside the state directory.
pub const PLAN_FILE: &str = "heartbeat-plan.json";

fn path(state_dir: &Path) -> PathBuf {
    state_dir.join(PLAN_FILE)
}

/// The kept plan; none if there is none or it does not read (then the
/// configured interval applies until the controller declares one again).
pub fn load(state_dir: &Path) -> Option<HeartbeatPlan> {
    let p = path(state_dir);
    let bytes = match std::fs::read(&p) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => {
            tracing::warn!(path = %p.display(), error = %e, "cannot read the heartbeat plan; using the configured interval");
            return None;
        }
    };
    match serde_json::from_slice::<HeartbeatPlan>(&bytes) {
        Ok(plan) if plan.validate("heartbeat plan").is_ok() => Some(plan),
        Ok(_) | Err(_) => {
            tracing::warn!(path = %p.display(), "the heartbeat plan is not valid; using the configured interval");
            None
        }
    }
}

/// Keep `plan` (none: remove the file), atomically.
pub fn save(state_dir: &Path, plan: Option<HeartbeatPlan>) -> std::io::Result<()> {
    let p = path(state_dir);
    let Some(plan) = plan else {
        return match std::fs::remove_file(&p) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        };
    };
    let tmp = state_dir.join(format!("{PLAN_FILE}.tmp"));
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(&serde_json::to_vec(&plan).map_err(std::io::Error::other)?)?;
    f.sync_all()?;
    std::fs::rename(&tmp, &p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_is_kept_read_back_and_removed() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        assert_eq!(load(dir.path()), None);
        let plan = HeartbeatPlan {
            interval_ms: 15_000,
            grace_ms: 45_000,
        };
        save(dir.path(), Some(plan)).unwrap_or_else(|e| panic!("save: {e}"));
        assert_eq!(load(dir.path()), Some(plan));
        save(dir.path(), None).unwrap_or_else(|e| panic!("remove: {e}"));
        assert_eq!(load(dir.path()), None);
        std::fs::write(dir.path().join(PLAN_FILE), b"{\"interval_ms\": 5}")
            .unwrap_or_else(|e| panic!("write: {e}"));
        assert_eq!(load(dir.path()), None, "an invalid plan is not used");
    }
}
