//! The cgroup filesystem backend of the sandbox (where systemd is not PID 1):
//! the unit's shim makes `<hierarchy>/<root>/<name>`, writes its limits, moves
//! the unit's process in before it runs anything of its own, reads whether the
//! kernel OOM-killed in it, and removes it after the unit ended (killing what
//! is left in it first, so nothing escapes by leaving the process group).
//!
//! cgroup v2 where `/sys/fs/cgroup` is the unified hierarchy (`memory.max`,
//! `memory.swap.max`, `pids.max`, `cpu.max`; `memory.events`' `oom_kill`);
//! otherwise v1's `memory`, `cpu`, `cpuacct` and `pids` hierarchies
//! (`memory.limit_in_bytes` and `memsw`, `pids.max`, `cpu.cfs_quota_us`;
//! `memory.oom_control`'s `oom_kill`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::sandbox::Limits;

const BASE: &str = "/sys/fs/cgroup";
/// The CPU quota's period: 100 ms, the kernel's default.
const PERIOD_US: u64 = 100_000;

/// Which cgroup filesystem this host has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Layout {
    V2 {
        base: PathBuf,
    },
    V1 {
        memory: PathBuf,
        cpu: PathBuf,
        cpuacct: Option<PathBuf>,
        pids: PathBuf,
    },
}

/// The host's layout, if units can be put in cgroups here.
pub fn detect() -> Option<Layout> {
    let base = Path::new(BASE);
    if base.join("cgroup.controllers").is_file() {
        return Some(Layout::V2 {
            base: base.to_owned(),
        });
    }
    let v1 = |c: &str| {
        let p = base.join(c);
        p.join("cgroup.procs").is_file().then_some(p)
    };
    Some(Layout::V1 {
        memory: v1("memory")?,
        cpu: v1("cpu")?,
        cpuacct: v1("cpuacct"),
        pids: v1("pids")?,
    })
}

/// One unit's cgroup (one directory per hierarchy on v1).
#[derive(Debug)]
pub struct Cgroup {
    layout: Layout,
    /// Relative to each hierarchy: `<root>/<name>`.
    rel: PathBuf,
}

fn write(path: PathBuf, value: &str) -> std::io::Result<()> {
    std::fs::write(&path, value)
        .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display())))
}

impl Cgroup {
    /// Make the cgroup (empty: a leftover of a unit that ended is removed
    /// first) and write its limits.
    pub fn create(
        layout: &Layout,
        root: &str,
        name: &str,
        limits: &Limits,
    ) -> std::io::Result<Cgroup> {
        let cg = Cgroup {
            layout: layout.clone(),
            rel: Path::new(root).join(name),
        };
        cg.remove(Duration::from_secs(1));
        match layout {
            Layout::V2 { base } => {
                // Controllers must be enabled in every ancestor's subtree.
                let _ = write(base.join("cgroup.subtree_control"), "+memory +pids +cpu");
                std::fs::create_dir_all(base.join(root))?;
                write(
                    base.join(root).join("cgroup.subtree_control"),
                    "+memory +pids +cpu",
                )?;
                let dir = base.join(&cg.rel);
                std::fs::create_dir_all(&dir)?;
                if let Some(m) = limits.memory_bytes {
                    write(dir.join("memory.max"), &m.to_string())?;
                    // No swap: over the limit means killed, not slowed.
                    let _ = write(dir.join("memory.swap.max"), "0");
                }
                write(dir.join("pids.max"), &limits.pids.to_string())?;
                if let Some(c) = limits.cpu_millis {
                    write(dir.join("cpu.max"), &format!("{} {PERIOD_US}", quota_us(c)))?;
                }
            }
            Layout::V1 {
                memory,
                cpu,
                cpuacct,
                pids,
            } => {
                for h in [memory, cpu, pids].into_iter().chain(cpuacct.as_ref()) {
                    std::fs::create_dir_all(h.join(&cg.rel))?;
                }
                if let Some(m) = limits.memory_bytes {
                    let dir = memory.join(&cg.rel);
                    write(dir.join("memory.limit_in_bytes"), &m.to_string())?;
                    // Where swap is accounted, memory and swap together get
                    // the same limit: no swapping past it.
                    let _ = write(dir.join("memory.memsw.limit_in_bytes"), &m.to_string());
                }
                write(
                    pids.join(&cg.rel).join("pids.max"),
                    &limits.pids.to_string(),
                )?;
                if let Some(c) = limits.cpu_millis {
                    let dir = cpu.join(&cg.rel);
                    write(dir.join("cpu.cfs_period_us"), &PERIOD_US.to_string())?;
                    write(dir.join("cpu.cfs_quota_us"), &quota_us(c).to_string())?;
                }
            }
        }
        Ok(cg)
    }

    fn dirs(&self) -> Vec<PathBuf> {
        match &self.layout {
            Layout::V2 { base } => vec![base.join(&self.rel)],
            Layout::V1 {
                memory,
                cpu,
                cpuacct,
                pids,
            } => [memory, cpu, pids]
                .into_iter()
                .chain(cpuacct.as_ref())
                .map(|h| h.join(&self.rel))
                .collect(),
        }
    }

    /// Move `pid` into the cgroup (every hierarchy).
    pub fn add(&self, pid: u32) -> std::io::Result<()> {
        for d in self.dirs() {
            write(d.join("cgroup.procs"), &pid.to_string())?;
        }
        Ok(())
    }

    /// Times the kernel's OOM killer killed a process in this cgroup.
    pub fn oom_kills(&self) -> u64 {
        let (file, dir) = match &self.layout {
            Layout::V2 { base } => ("memory.events", base.join(&self.rel)),
            Layout::V1 { memory, .. } => ("memory.oom_control", memory.join(&self.rel)),
        };
        read_oom_kills(&dir.join(file))
    }

    /// The processes in it.
    pub fn procs(&self) -> Vec<u32> {
        let mut pids = Vec::new();
        for d in self.dirs() {
            if let Ok(t) = std::fs::read_to_string(d.join("cgroup.procs")) {
                pids.extend(t.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
            }
        }
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// Kill what is left in it and remove it, waiting up to `wait` for the
    /// kernel to let go of the dead processes.
    pub fn remove(&self, wait: Duration) {
        let deadline = std::time::Instant::now() + wait;
        loop {
            for pid in self.procs() {
                if let Some(p) = i32::try_from(pid)
                    .ok()
                    .and_then(rustix::process::Pid::from_raw)
                {
                    let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
                }
            }
            let mut left = false;
            for d in self.dirs() {
                match std::fs::remove_dir(&d) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(_) => left = true,
                }
            }
            if !left || std::time::Instant::now() >= deadline {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// The `oom_kill` line of a `memory.events` (v2) or `memory.oom_control`
/// (v1) file; 0 when it cannot be read.
pub fn read_oom_kills(file: &Path) -> u64 {
    std::fs::read_to_string(file)
        .ok()
        .and_then(|t| {
            t.lines().find_map(|l| {
                l.strip_prefix("oom_kill ")
                    .and_then(|n| n.trim().parse().ok())
            })
        })
        .unwrap_or(0)
}

/// Microseconds of CPU per [`PERIOD_US`] for `millis` thousandths of a core.
fn quota_us(millis: u64) -> u64 {
    (millis.saturating_mul(PERIOD_US) / 1000).max(1000)
}

/// The cgroup directory of `pid` in the hierarchy that holds `controller`
/// (v1), or the unified one (v2), as `/proc/<pid>/cgroup` says.
pub fn of_process(pid: u32, controller: &str) -> Option<PathBuf> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let v2 = Path::new(BASE).join("cgroup.controllers").is_file();
    text.lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let (_, ctrls, path) = (f.next()?, f.next()?, f.next()?);
        let path = path.trim_start_matches('/');
        if v2 {
            (ctrls.is_empty()).then(|| Path::new(BASE).join(path))
        } else {
            ctrls
                .split(',')
                .any(|c| c == controller)
                .then(|| Path::new(BASE).join(controller).join(path))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotas() {
        assert_eq!(quota_us(200), 20_000);
        assert_eq!(quota_us(1000), 100_000);
        assert_eq!(quota_us(2500), 250_000);
        assert_eq!(quota_us(1), 1000, "the kernel's minimum");
    }
}
