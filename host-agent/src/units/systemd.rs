//! The systemd backend of the sandbox: where systemd is PID 1, a unit's
//! process runs in a transient scope (`<name>.scope`) that systemd makes
//! through its D-Bus API with the unit's limits (`MemoryMax`, `TasksMax`,
//! `CPUQuotaPerSecUSec`). The scope outlives the agent and the shim as the
//! process does.

use super::sandbox::Limits;

/// A unit process's scope.
#[derive(Debug, Clone)]
pub struct Scope {
    /// `<name>.scope`.
    pub unit: String,
}

/// Whether systemd is PID 1 here (as `sd_booted()` tells).
pub fn booted() -> bool {
    std::path::Path::new("/run/systemd/system").is_dir()
}

/// Ask systemd to make the scope `<name>.scope` holding `pid`, with `limits`;
/// returns once systemd made it (its start job finished).
pub fn start_scope(name: &str, pid: u32, limits: &Limits) -> Result<Scope, String> {
    let _ = (pid, limits);
    Err(format!("{name}.scope: the systemd backend is not built"))
}

/// After the scope's process ended: whether systemd saw an OOM kill in it.
/// Also lets systemd forget the scope (a failed scope stays loaded).
pub fn finish(scope: &Scope) -> bool {
    let _ = scope;
    false
}
