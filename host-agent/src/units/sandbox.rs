//! The box a unit runs in (decision 0051): its module's own unprivileged user,
//! a data volume that outlives its processes, and a cgroup that enforces its
//! limits.
//!
//! - **Users.** Each module that runs or has files on the node gets a system
//!   user and group `mesh-<module>` (shortened with a hash past 32 bytes), with
//!   a uid (= gid) from [`MODULE_UID_MIN`]..=[`MODULE_UID_MAX`]. The agent
//!   creates it with `groupadd`/`useradd` the first time the module needs it and
//!   finds it again by name afterwards (`/etc/passwd`), so the uid is stable
//!   across agent restarts and upgrades and file ownership holds. It is removed
//!   with the module's data volume. A unit declared `user: root` runs as root.
//! - **Data volume.** `<state>/modules/<module>/data` (`MESH_DATA_DIR`, and the
//!   unit's `HOME`), 0700 and owned by the module's user; `<state>/modules/<module>`
//!   is `root:mesh-<module>` 0750, so no other module's user reaches it. It is
//!   kept across unit restarts, new revisions and agent upgrades; when no unit of
//!   the module is declared any more, the agent notes when (`left`) and removes
//!   the volume and the user after `units.data_retention`, unless the module is
//!   stateful (then it is kept until an operator removes it).
//! - **Limits.** A unit's `limits` (CPU quota, memory, pids; pids defaults to
//!   `units.default_pids`) are a [`CgroupPlan`] the shim carries out: where
//!   systemd is PID 1, as a transient scope through systemd's D-Bus API
//!   ([`super::systemd`]); elsewhere by writing the cgroup filesystem
//!   ([`super::cgroup`], v2 where mounted, v1 otherwise).
//!
//! An agent that is not root can do none of this: its units run as itself,
//! without limits, and it says so once at start.

use std::collections::BTreeSet;
use std::os::unix::fs::{PermissionsExt, chown};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use mesh_protocol::{MODULE_UID_MAX, MODULE_UID_MIN, UnitItem, UnitLimits, UnitUser};
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

/// The directory under the state dir that holds one directory per module.
pub const MODULES_DIR: &str = "modules";
/// A module's data volume, under its directory.
pub const DATA_DIR: &str = "data";
/// The file in a module's directory recording when its last unit left.
const LEFT_FILE: &str = "left";

/// What the shim is told about the box of one unit. `None` fields: the shim
/// does not change that (the agent's user; no cgroup).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<CgroupPlan>,
}

/// The cgroup of one unit process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CgroupPlan {
    pub backend: Backend,
    /// The unit's cgroup (cgroupfs: a directory under the backend's root) or
    /// scope (systemd: `<name>.scope`) name: unique per agent and unit.
    pub name: String,
    pub limits: Limits,
}

/// Who carries out a [`CgroupPlan`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    /// The agent's shim writes the cgroup filesystem: `<hierarchy>/<root>/<name>`.
    Cgroupfs { root: String },
    /// systemd (PID 1) runs the process in a transient scope `<name>.scope`.
    Systemd,
}

/// A unit's limits as enforced: pids always has one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    pub cpu_millis: Option<u64>,
    pub memory_bytes: Option<u64>,
    pub pids: u64,
}

impl Limits {
    pub fn of(declared: &UnitLimits, default_pids: u64) -> Limits {
        Limits {
            cpu_millis: declared.cpu_millis,
            memory_bytes: declared.memory_bytes,
            pids: declared.pids.unwrap_or(default_pids),
        }
    }
}

/// How units are put in cgroups: the `units.cgroups` setting.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CgroupMode {
    /// systemd where it is PID 1, the cgroup filesystem elsewhere, none where
    /// neither can be used (said at start).
    #[default]
    Auto,
    Systemd,
    Cgroupfs,
    /// No cgroups: limits are not enforced.
    Off,
}

/// The user of one module.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModuleUser {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
}

/// `mesh-<module>`, or past 32 bytes (useradd's limit) `mesh-<first 18>-<8 hex>`.
pub fn user_name(module: &str) -> String {
    let full = format!("mesh-{module}");
    if full.len() <= 32 {
        return full;
    }
    let head: String = module.chars().take(18).collect();
    format!("mesh-{head}-{:08x}", fnv(module.as_bytes()) as u32)
}

/// FNV-1a, for short stable names (not for security).
pub fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// `(uid, gid)` of the user `name` in `/etc/passwd`.
fn lookup(name: &str) -> Option<(u32, u32)> {
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        if f.len() >= 4 && f[0] == name {
            Some((f[2].parse().ok()?, f[3].parse().ok()?))
        } else {
            None
        }
    })
}

/// The gid of the group `name` in `/etc/group`.
fn group_gid(name: &str) -> Option<u32> {
    let group = std::fs::read_to_string("/etc/group").ok()?;
    group.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        if f.len() >= 3 && f[0] == name {
            f[2].parse().ok()
        } else {
            None
        }
    })
}

/// Whether `/etc/passwd` has a user with `uid`.
fn uid_taken(uid: u32) -> bool {
    std::fs::read_to_string("/etc/passwd").is_ok_and(|text| {
        text.lines()
            .any(|l| l.split(':').nth(2).and_then(|n| n.parse::<u32>().ok()) == Some(uid))
    })
}

fn useradd(module: &str, name: &str, id: u32) -> std::io::Result<()> {
    let id_s = id.to_string();
    run(
        "useradd",
        &[
            "--system",
            "--uid",
            &id_s,
            "--gid",
            &id_s,
            "--no-create-home",
            "--home-dir",
            "/nonexistent",
            "--shell",
            "/usr/sbin/nologin",
            "--comment",
            &format!("mesh module {module}"),
            name,
        ],
    )
}

/// Every uid of `/etc/passwd` and gid of `/etc/group`.
fn ids_taken() -> BTreeSet<u32> {
    let mut taken = BTreeSet::new();
    for file in ["/etc/passwd", "/etc/group"] {
        if let Ok(text) = std::fs::read_to_string(file) {
            taken.extend(
                text.lines()
                    .filter_map(|l| l.split(':').nth(2).and_then(|n| n.parse::<u32>().ok())),
            );
        }
    }
    taken
}

fn run(program: &str, args: &[&str]) -> std::io::Result<()> {
    let out = std::process::Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()?;
    if out.status.success() {
        Ok(())
    } else {
        Err(std::io::Error::other(format!(
            "{program} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

/// Serializes user creation within this agent; other agents on the same host
/// (tests) race through `useradd`'s own lock and are retried.
static USERS: Mutex<()> = Mutex::new(());

/// The module's user, created if it does not exist yet.
pub fn ensure_user(module: &str) -> std::io::Result<ModuleUser> {
    let name = user_name(module);
    let _guard = USERS.lock().unwrap_or_else(|e| e.into_inner());
    let mut last = None;
    for _ in 0..8 {
        if let Some((uid, gid)) = lookup(&name) {
            return Ok(ModuleUser { name, uid, gid });
        }
        // The module's group without its user: a creation that stopped
        // half-way, or one another agent of this host is making right now.
        // Two agents creating two modules' users at once can both take one
        // free id; the second's useradd is refused (the uid is the first's),
        // and the groupdel undoing its groupadd too ("cannot remove the
        // primary group of user …": the gid is the first user's). Left
        // alone, every later groupadd fails "already exists" and the
        // module's units never start (found by the fleet soak, issue 32).
        // Its gid, in the range and free as a uid, is adopted; otherwise the
        // group is moved to a free id (groupmod), which the user then takes.
        if let Some(gid) = group_gid(&name) {
            let adopted = if (MODULE_UID_MIN..=MODULE_UID_MAX).contains(&gid) && !uid_taken(gid) {
                useradd(module, &name, gid)
            } else {
                let taken = ids_taken();
                match (MODULE_UID_MIN..=MODULE_UID_MAX).find(|i| !taken.contains(i)) {
                    Some(id) => run("groupmod", &["--gid", &id.to_string(), &name])
                        .and_then(|()| useradd(module, &name, id)),
                    None => Err(std::io::Error::other(format!(
                        "no free uid left in {MODULE_UID_MIN}..={MODULE_UID_MAX} for {name}"
                    ))),
                }
            };
            match adopted {
                Ok(()) => continue,
                Err(e) => {
                    last = Some(e);
                    continue;
                }
            }
        }
        let taken = ids_taken();
        let Some(id) = (MODULE_UID_MIN..=MODULE_UID_MAX).find(|i| !taken.contains(i)) else {
            return Err(std::io::Error::other(format!(
                "no free uid left in {MODULE_UID_MIN}..={MODULE_UID_MAX} for {name}"
            )));
        };
        let id_s = id.to_string();
        let created = run("groupadd", &["--system", "--gid", &id_s, &name]).and_then(|()| {
            useradd(module, &name, id).inspect_err(|_| {
                let _ = run("groupdel", &[&name]);
            })
        });
        match created {
            Ok(()) => {
                info!(module, user = %name, uid = id, "created the module's user");
                return Ok(ModuleUser {
                    name,
                    uid: id,
                    gid: id,
                });
            }
            // Another agent took the name or the id meanwhile: look again.
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::other("cannot create the module's user")))
}

/// Remove the module's user and group, if they exist.
pub fn remove_user(module: &str) {
    let name = user_name(module);
    let _guard = USERS.lock().unwrap_or_else(|e| e.into_inner());
    if lookup(&name).is_none() {
        return;
    }
    match run("userdel", &[&name]) {
        Ok(()) => info!(module, user = %name, "removed the module's user"),
        Err(e) => warn!(module, user = %name, error = %e, "cannot remove the module's user"),
    }
    // userdel removes the group of the same name where USERGROUPS_ENAB says
    // so; where it does not, it is removed here.
    let _ = run("groupdel", &[&name]);
}

/// `<state>/modules/<module>`.
pub fn module_dir(state_dir: &Path, module: &str) -> PathBuf {
    state_dir.join(MODULES_DIR).join(module)
}

/// `<state>/modules/<module>/data`.
pub fn data_dir(state_dir: &Path, module: &str) -> PathBuf {
    module_dir(state_dir, module).join(DATA_DIR)
}

fn set_mode(path: &Path, mode: u32) -> std::io::Result<()> {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
}

/// Make the module's data volume exist, owned by `user` (or root), and let
/// module users through the state dir to it (0711: through, not list).
pub fn ensure_volume(
    state_dir: &Path,
    module: &str,
    user: Option<&ModuleUser>,
) -> std::io::Result<PathBuf> {
    let modules = state_dir.join(MODULES_DIR);
    let dir = module_dir(state_dir, module);
    let data = dir.join(DATA_DIR);
    std::fs::create_dir_all(&data)?;
    if let Some(u) = user {
        set_mode(state_dir, 0o711)?;
        set_mode(&modules, 0o711)?;
        chown(&dir, Some(0), Some(u.gid))?;
        set_mode(&dir, 0o750)?;
        chown(&data, Some(u.uid), Some(u.gid))?;
        set_mode(&data, 0o700)?;
    }
    // Back again: it is not leaving.
    match std::fs::remove_file(dir.join(LEFT_FILE)) {
        Ok(()) => info!(
            module,
            "the module is back on this node: its data volume is kept"
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    Ok(data)
}

/// Bytes in a directory tree (files' lengths; symlinks not followed).
pub fn tree_bytes(dir: &Path) -> u64 {
    let mut total = 0u64;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            match e.metadata() {
                Ok(m) if m.is_dir() => stack.push(e.path()),
                Ok(m) if m.is_file() => total = total.saturating_add(m.len()),
                _ => {}
            }
        }
    }
    total
}

/// What [`sweep_volumes`] did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Swept {
    /// Modules whose volumes were noted as left now.
    pub left: Vec<String>,
    /// Modules whose volumes (and users) were removed.
    pub removed: Vec<String>,
}

/// The `stateful` marker in a module's directory: its volume is never swept.
const STATEFUL_FILE: &str = "stateful";

/// Note that these modules' units run here (and which are stateful).
pub fn mark_present(state_dir: &Path, items: &[UnitItem]) {
    for u in items {
        let dir = module_dir(state_dir, &u.module);
        let marker = dir.join(STATEFUL_FILE);
        if u.stateful
            && !marker.exists()
            && let Err(e) =
                std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&marker, b""))
        {
            warn!(module = %u.module, error = %e, "cannot mark the module stateful: its volume could be swept");
        }
    }
}

/// Volumes of modules no declared unit belongs to: noted as left (their
/// time), removed with their users once `retention` passed, never for a
/// stateful module.
pub fn sweep_volumes(
    state_dir: &Path,
    declared: &BTreeSet<String>,
    retention: Duration,
    users: bool,
) -> Swept {
    let mut swept = Swept::default();
    let Ok(entries) = std::fs::read_dir(state_dir.join(MODULES_DIR)) else {
        return swept;
    };
    let now = std::time::SystemTime::now();
    for e in entries.flatten() {
        let Some(module) = e.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        if declared.contains(&module) {
            continue;
        }
        let dir = e.path();
        if dir.join(STATEFUL_FILE).exists() {
            continue;
        }
        let left = dir.join(LEFT_FILE);
        match std::fs::metadata(&left).and_then(|m| m.modified()) {
            Err(_) => {
                if std::fs::write(&left, b"").is_ok() {
                    info!(module, retention = ?retention, "the module left this node: its data volume is removed after the retention");
                    swept.left.push(module);
                }
            }
            Ok(t) if now.duration_since(t).unwrap_or_default() >= retention => {
                match std::fs::remove_dir_all(&dir) {
                    Ok(()) => {
                        info!(module, "removed the data volume of a module that left");
                        if users {
                            remove_user(&module);
                        }
                        swept.removed.push(module);
                    }
                    Err(e) => {
                        warn!(module, error = %e, "cannot remove the data volume of a module that left")
                    }
                }
            }
            Ok(_) => {}
        }
    }
    swept
}

/// Whether a unit of this item runs as its module's user (root: not).
pub fn runs_as_module(item: &UnitItem) -> bool {
    item.user == UnitUser::Module
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_names_fit_useradd() {
        assert_eq!(user_name("web"), "mesh-web");
        let long = "a".repeat(48);
        let n = user_name(&long);
        assert!(n.len() <= 32, "{n}");
        assert!(n.starts_with("mesh-aaaaaaaaaaaaaaaaaa-"));
        assert_ne!(user_name(&long), user_name(&"a".repeat(47)));
    }

    /// A group of the module's name left without its user (a creation
    /// that stopped half-way) no longer blocks the module's user for good:
    /// its gid is adopted when free as a uid, else it is made again (issue
    /// 32: the soak found units that never started, `groupadd: group
    /// 'mesh-m3' already exists` at every try).
    #[test]
    fn a_group_left_without_its_user_is_adopted_or_made_again() -> anyhow::Result<()> {
        if !rustix::process::geteuid().is_root() {
            return mesh_testkit::skip("not root: cannot create users");
        }
        let tag = format!("{:06x}", std::process::id() & 0xff_ffff);
        // Adopted: the group's gid is in the range and free as a uid.
        let module = format!("orphan-a-{tag}");
        let name = user_name(&module);
        let taken = ids_taken();
        let id = (MODULE_UID_MIN..=MODULE_UID_MAX)
            .rev()
            .find(|i| !taken.contains(i))
            .expect("a free id");
        run("groupadd", &["--system", "--gid", &id.to_string(), &name]).expect("groupadd");
        let user = ensure_user(&module);
        remove_user(&module);
        let user = user.expect("the module's user despite the orphan group");
        assert_eq!((user.uid, user.gid), (id, id));
        // Made again: the group's gid is outside the range.
        let module = format!("orphan-b-{tag}");
        let name = user_name(&module);
        run("groupadd", &["--system", &name]).expect("groupadd");
        let user = ensure_user(&module);
        remove_user(&module);
        let user = user.expect("the module's user despite the orphan group");
        assert!(
            (MODULE_UID_MIN..=MODULE_UID_MAX).contains(&user.uid),
            "{user:?}"
        );
        assert_eq!(user.uid, user.gid);
        assert_eq!(group_gid(&name), None, "removed with the user");
        // Moved: the group's gid is another module user's (two groupadds
        // took one id; groupdel refuses such a group).
        let first = format!("orphan-c1-{tag}");
        let owner = ensure_user(&first).expect("the first module's user");
        let module = format!("orphan-c2-{tag}");
        let name = user_name(&module);
        let dup = run(
            "groupadd",
            &[
                "--system",
                "--non-unique",
                "--gid",
                &owner.gid.to_string(),
                &name,
            ],
        );
        let user = dup.and_then(|()| ensure_user(&module));
        remove_user(&module);
        remove_user(&first);
        let user = user.expect("the module's user despite the orphan group");
        assert_ne!(user.uid, owner.uid);
        assert_eq!(user.uid, user.gid);
        Ok(())
    }

    #[test]
    fn default_pids_fill_in() {
        let l = Limits::of(&UnitLimits::default(), 4096);
        assert_eq!(l.pids, 4096);
        let l = Limits::of(
            &UnitLimits {
                pids: Some(16),
                ..Default::default()
            },
            4096,
        );
        assert_eq!(l.pids, 16);
    }

    #[test]
    fn volumes_of_modules_that_left_go_after_retention() {
        let state = tempfile::tempdir().unwrap();
        ensure_volume(state.path(), "gone", None).unwrap();
        ensure_volume(state.path(), "kept", None).unwrap();
        ensure_volume(state.path(), "db", None).unwrap();
        std::fs::write(data_dir(state.path(), "gone").join("f"), b"12345").unwrap();
        assert_eq!(tree_bytes(&data_dir(state.path(), "gone")), 5);
        let db = UnitItem {
            stateful: true,
            ..serde_json::from_value(
                serde_json::json!({"name": "db", "module": "db", "command": "x"}),
            )
            .unwrap()
        };
        mark_present(state.path(), &[db]);
        let declared: BTreeSet<String> = ["kept".to_owned()].into();
        let s = sweep_volumes(state.path(), &declared, Duration::ZERO, false);
        assert_eq!(s.left, vec!["gone".to_owned()]);
        assert!(
            data_dir(state.path(), "gone").is_dir(),
            "noted first, not removed"
        );
        let s = sweep_volumes(state.path(), &declared, Duration::ZERO, false);
        assert_eq!(s.removed, vec!["gone".to_owned()]);
        assert!(!module_dir(state.path(), "gone").exists());
        assert!(data_dir(state.path(), "db").is_dir(), "stateful: kept");
        assert!(data_dir(state.path(), "kept").is_dir());
        // Back before the retention ends: kept.
        let s = sweep_volumes(
            state.path(),
            &BTreeSet::new(),
            Duration::from_secs(3600),
            false,
        );
        assert_eq!(s.left, vec!["kept".to_owned()]);
        ensure_volume(state.path(), "kept", None).unwrap();
        assert!(!module_dir(state.path(), "kept").join(LEFT_FILE).exists());
    }
}
