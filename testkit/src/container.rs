//! A Debian 12 container booted with systemd as its PID 1, for tests of what
//! only a real systemd shows (transient scopes, units, the journal) on a
//! machine whose own PID 1 is not systemd. `systemd-nspawn -b` boots it; a
//! test runs commands inside with `nsenter` (all of the container's
//! namespaces, cgroup namespace included) and shares files through bind
//! mounts. Dropping a [`Container`] shuts it down cleanly (systemd halts) and
//! removes the cgroups it was given.
//!
//! - **The tree.** One Debian 12 tree (`debootstrap --variant=minbase` with
//!   systemd, systemd-sysv and dbus), made once per machine at [`TREE`] (outside
//!   any clone: it is large and slow to make) by [`ensure_tree`] when missing
//!   (a minute or two; `bundle/up` installs debootstrap and systemd-container).
//!   Containers never write it: each boots with `--volatile=overlay` (the tree
//!   read-only under a tmpfs that is gone at shutdown), so several containers
//!   boot from it at once.
//! - **cgroups.** systemd-nspawn without a host systemd (`--keep-unit`) makes
//!   its `payload`/`supervisor` cgroups in the cgroup it runs in, so each
//!   container runs in a cgroup of its own (`mesh-nspawn-<name>` under this
//!   process's, in the `name=systemd`, unified, memory, pids and cpu
//!   hierarchies), removed on drop. On a cgroup v1 or hybrid host nspawn mounts
//!   the controller hierarchies read-only inside, and systemd there enforces no
//!   memory, pids or CPU limit: [`Container::boot`] remounts them writable and
//!   re-executes systemd so that it sees them (the container's view stays
//!   rooted at its own cgroup). On a v2 host nothing of this is needed.
//! - **Network.** `--private-network`: loopback only.
//!
//! What it never does: touch the host's systemd (there is none), register the
//! machine (`--register=no`), or write the tree after it is made.

use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context as _;

/// Where the tree is made and cached (outside any clone).
pub const TREE: &str = "/var/cache/mesh-ci/nspawn-tree";
/// How long a boot may take before it is an error.
pub const BOOT_TIMEOUT: Duration = Duration::from_secs(90);
/// How long a clean shutdown may take before the container is killed.
pub const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(30);
/// nspawn's per-machine state; it fails without a tmpfs here (facts.md).
const NSPAWN_RUN: &str = "/run/systemd/nspawn";
const CGROUP_BASE: &str = "/sys/fs/cgroup";
/// The hierarchies a container gets a cgroup of its own in (v1 names as
/// `/proc/self/cgroup` gives them; "" is the unified one).
const HIERARCHIES: &[&str] = &[
    "name=systemd",
    "",
    "memory",
    "pids",
    "cpu",
    "cpuacct",
    "cpu,cpuacct",
];
/// The v1 controllers made writable inside.
const CONTROLLERS: &[&str] = &["memory", "pids", "cpu", "cpuacct", "cpu,cpuacct"];

/// A path of the host bound into the container.
#[derive(Debug, Clone)]
pub struct Bind {
    pub host: PathBuf,
    pub guest: PathBuf,
    pub read_only: bool,
}

impl Bind {
    /// `host` at `guest`, read-only (a binary under test).
    pub fn read_only(host: impl Into<PathBuf>, guest: impl Into<PathBuf>) -> Bind {
        Bind {
            host: host.into(),
            guest: guest.into(),
            read_only: true,
        }
    }

    /// `host` at `guest`, writable (a directory to share files through).
    pub fn writable(host: impl Into<PathBuf>, guest: impl Into<PathBuf>) -> Bind {
        Bind {
            host: host.into(),
            guest: guest.into(),
            read_only: false,
        }
    }
}

/// Why this machine cannot boot a container, if it cannot: not root, or a
/// tool missing (`systemd-nspawn`, `nsenter`; `debootstrap` while the tree is
/// not made). Pass it to [`crate::skip`].
pub fn unavailable() -> Option<String> {
    if !is_root() {
        return Some("booting a systemd container needs root".into());
    }
    for tool in ["systemd-nspawn", "nsenter"] {
        if which(tool).is_none() {
            return Some(format!(
                "{tool} is missing (apt-get install systemd-container util-linux; bundle/up installs it)"
            ));
        }
    }
    if !tree_ready(Path::new(TREE)) && which("debootstrap").is_none() {
        return Some(format!(
            "{TREE} is not made and debootstrap is missing (apt-get install debootstrap; bundle/up installs it)"
        ));
    }
    None
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|l| l.split_whitespace().nth(1).map(|e| e == "0"))
        })
        .unwrap_or(false)
}

fn which(tool: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/sbin:/usr/bin:/sbin:/bin".into());
    std::env::split_paths(&path)
        .chain(["/usr/sbin".into(), "/sbin".into()])
        .map(|d| d.join(tool))
        .find(|p| p.is_file())
}

fn tree_ready(tree: &Path) -> bool {
    tree.join("lib/systemd/systemd").exists() && tree.join("usr/bin/dbus-daemon").exists()
}

/// The cached tree, made with debootstrap when missing. Several tests may
/// race to make it: each makes its own beside it and the first rename wins.
pub fn ensure_tree() -> anyhow::Result<PathBuf> {
    let tree = PathBuf::from(TREE);
    if tree_ready(&tree) {
        return Ok(tree);
    }
    let parent = tree.parent().context("the tree's path has no parent")?;
    std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    let tmp = parent.join(format!(".nspawn-tree.{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    eprintln!("making {TREE} with debootstrap (once per machine; a minute or two)");
    let out = Command::new("debootstrap")
        .args([
            "--variant=minbase",
            "--include=systemd,systemd-sysv,dbus",
            "bookworm",
        ])
        .arg(&tmp)
        .arg("http://deb.debian.org/debian")
        .stdin(Stdio::null())
        .output()
        .context("running debootstrap")?;
    if !out.status.success() {
        let _ = std::fs::remove_dir_all(&tmp);
        anyhow::bail!(
            "debootstrap failed ({}): {}",
            out.status,
            tail(&String::from_utf8_lossy(&out.stderr), 20)
        );
    }
    match std::fs::rename(&tmp, &tree) {
        Ok(()) => Ok(tree),
        Err(_) if tree_ready(&tree) => {
            let _ = std::fs::remove_dir_all(&tmp);
            Ok(tree)
        }
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            Err(e).with_context(|| format!("renaming the new tree to {TREE}"))
        }
    }
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// A booted container. Dropping it shuts it down.
pub struct Container {
    name: String,
    nspawn: Child,
    /// The container's PID 1, as the host sees it.
    leader: u32,
    /// Its own cgroup in each hierarchy (host paths).
    cgroups: Vec<PathBuf>,
    /// nspawn's output (the container's console).
    log: tempfile::NamedTempFile,
}

impl Container {
    /// Boot the cached tree (made first if missing) with `binds`, and wait
    /// until systemd inside says `running` (or `degraded`).
    pub fn boot(binds: &[Bind]) -> anyhow::Result<Container> {
        let tree = ensure_tree()?;
        ensure_nspawn_run()?;
        let name = format!("mesh-{:08x}", rand::random::<u32>());
        let cgroups = own_cgroups(&name)?;
        let log = tempfile::NamedTempFile::new().context("nspawn's log file")?;
        let procs: Vec<String> = cgroups
            .iter()
            .map(|c| c.join("cgroup.procs").display().to_string())
            .collect();
        let mut cmd = Command::new("sh");
        // Into its own cgroups before it execs nspawn.
        cmd.arg("-c")
            .arg(r#"for f in $MESH_CGROUP_PROCS; do echo $$ > "$f" || exit 1; done; exec "$@""#)
            .arg("sh")
            .arg("systemd-nspawn")
            .arg("-D")
            .arg(&tree)
            .args([
                "--volatile=overlay",
                "-b",
                "--register=no",
                "--keep-unit",
                "--console=passive",
                "--private-network",
            ])
            .arg(format!("--machine={name}"));
        for b in binds {
            let flag = if b.read_only { "--bind-ro" } else { "--bind" };
            cmd.arg(format!("{flag}={}:{}", b.host.display(), b.guest.display()));
        }
        cmd.env("MESH_CGROUP_PROCS", procs.join(" "))
            .stdin(Stdio::null())
            .stdout(log.reopen()?)
            .stderr(log.reopen()?);
        let nspawn = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                remove_cgroups(&cgroups);
                return Err(e).context("starting systemd-nspawn");
            }
        };
        let mut container = Container {
            name,
            nspawn,
            leader: 0,
            cgroups,
            log,
        };
        container.wait_booted()?;
        container.writable_controllers()?;
        Ok(container)
    }

    /// The machine name it was booted with.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The container's PID 1 as the host sees it.
    pub fn leader(&self) -> u32 {
        self.leader
    }

    /// What nspawn and the container's console wrote so far.
    pub fn console(&self) -> String {
        let mut s = String::new();
        if let Ok(mut f) = self.log.reopen() {
            let _ = f.read_to_string(&mut s);
        }
        s
    }

    fn wait_booted(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + BOOT_TIMEOUT;
        let mut last = String::new();
        loop {
            if let Some(status) = self.nspawn.try_wait()? {
                anyhow::bail!(
                    "systemd-nspawn exited ({status}) before the container booted:\n{}",
                    tail(&self.console(), 30)
                );
            }
            if self.leader == 0 {
                self.leader = child_of(self.nspawn.id()).unwrap_or(0);
            }
            if self.leader != 0
                && let Ok(out) = self.command(&["systemctl", "is-system-running"]).output()
            {
                last = String::from_utf8_lossy(&out.stdout).trim().to_owned();
                if last == "running" || last == "degraded" {
                    return Ok(());
                }
            }
            if Instant::now() >= deadline {
                anyhow::bail!(
                    "the container did not boot within {BOOT_TIMEOUT:?} (systemd says {last:?}):\n{}",
                    tail(&self.console(), 30)
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// On a v1 or hybrid host: remount the controllers writable inside and
    /// re-execute systemd, which looks for usable controllers at start only.
    fn writable_controllers(&mut self) -> anyhow::Result<()> {
        let mut remounted = false;
        for c in CONTROLLERS {
            let dir = format!("{CGROUP_BASE}/{c}");
            let test = self.command(&["test", "-d", &dir]).status()?;
            if !test.success() {
                continue;
            }
            let out = Command::new("nsenter")
                .args(["-t", &self.leader.to_string(), "-m", "--"])
                .args(["mount", "-n", "-o", "remount,bind,rw", &dir])
                .output()
                .context("nsenter mount")?;
            anyhow::ensure!(
                out.status.success(),
                "cannot make {dir} writable in the container: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
            remounted = true;
        }
        if remounted {
            self.run(&["systemctl", "daemon-reexec"])?;
            self.wait_booted()?;
        }
        Ok(())
    }

    /// A command to run inside (`nsenter` into all its namespaces, as root,
    /// with a plain PATH and nothing else of this process's environment).
    pub fn command(&self, argv: &[&str]) -> Command {
        let mut cmd = Command::new("nsenter");
        cmd.args(["-t", &self.leader.to_string(), "-a", "--"])
            .args(argv)
            .env_clear()
            .env(
                "PATH",
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            )
            .stdin(Stdio::null());
        cmd
    }

    /// Run `argv` inside; its output, an error (with stderr) if it failed.
    pub fn run(&self, argv: &[&str]) -> anyhow::Result<Output> {
        let out = self
            .command(argv)
            .output()
            .with_context(|| format!("running {argv:?} in the container"))?;
        anyhow::ensure!(
            out.status.success(),
            "{argv:?} in the container: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
        Ok(out)
    }

    /// Run a shell script inside; its stdout, trimmed.
    pub fn sh(&self, script: &str) -> anyhow::Result<String> {
        let out = self.run(&["sh", "-c", script])?;
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    /// Shut down cleanly (systemd halts) and remove its cgroups; what
    /// dropping does, with the error said.
    pub fn shutdown(mut self) -> anyhow::Result<()> {
        self.stop()
    }

    fn stop(&mut self) -> anyhow::Result<()> {
        let result = (|| {
            if self.nspawn.try_wait()?.is_some() {
                return Ok(());
            }
            // nspawn turns SIGTERM into the container's halt.
            signal(self.nspawn.id(), rustix::process::Signal::TERM);
            let deadline = Instant::now() + SHUTDOWN_TIMEOUT;
            while Instant::now() < deadline {
                if self.nspawn.try_wait()?.is_some() {
                    return Ok(());
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = self.nspawn.kill();
            let _ = self.nspawn.wait();
            anyhow::bail!(
                "the container did not halt within {SHUTDOWN_TIMEOUT:?}: killed:\n{}",
                tail(&self.console(), 20)
            )
        })();
        remove_cgroups(&self.cgroups);
        self.cgroups.clear();
        result
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            eprintln!("container {}: {e:#}", self.name);
        }
    }
}

fn signal(pid: u32, sig: rustix::process::Signal) {
    if let Some(p) = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
    {
        let _ = rustix::process::kill_process(p, sig);
    }
}

/// A child of `parent` (nspawn has one: the container's PID 1).
fn child_of(parent: u32) -> Option<u32> {
    let children = std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children"))
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|p| p.parse().ok()));
    if children.is_some() {
        return children;
    }
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
        // The fields after the command (which may hold spaces) in parens.
        let rest = &stat[stat.rfind(')')? + 2..];
        let ppid: u32 = rest.split_whitespace().nth(1)?.parse().ok()?;
        (ppid == parent).then_some(pid)
    })
}

fn ensure_nspawn_run() -> anyhow::Result<()> {
    std::fs::create_dir_all(NSPAWN_RUN).with_context(|| format!("creating {NSPAWN_RUN}"))?;
    let mounted = std::fs::read_to_string("/proc/self/mountinfo")
        .map(|m| {
            m.lines()
                .any(|l| l.split_whitespace().nth(4) == Some(NSPAWN_RUN))
        })
        .unwrap_or(false);
    if !mounted {
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "tmpfs", NSPAWN_RUN])
            .output()
            .context("mount")?;
        // Another test may have mounted it meanwhile: fine either way.
        if !out.status.success() {
            let again = std::fs::read_to_string("/proc/self/mountinfo")
                .map(|m| {
                    m.lines()
                        .any(|l| l.split_whitespace().nth(4) == Some(NSPAWN_RUN))
                })
                .unwrap_or(false);
            anyhow::ensure!(
                again,
                "cannot mount a tmpfs on {NSPAWN_RUN}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
    }
    Ok(())
}

/// A cgroup `mesh-nspawn-<name>` under this process's own in each hierarchy
/// of [`HIERARCHIES`] that is mounted here.
fn own_cgroups(name: &str) -> anyhow::Result<Vec<PathBuf>> {
    let mine = std::fs::read_to_string("/proc/self/cgroup").context("/proc/self/cgroup")?;
    let v2_only = Path::new(CGROUP_BASE).join("cgroup.controllers").is_file();
    let mut made = Vec::new();
    for line in mine.lines() {
        let mut f = line.splitn(3, ':');
        let (Some(_), Some(ctrls), Some(path)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        if !HIERARCHIES.contains(&ctrls) {
            continue;
        }
        let mount = match ctrls {
            "" if v2_only => PathBuf::from(CGROUP_BASE),
            "" => Path::new(CGROUP_BASE).join("unified"),
            c => Path::new(CGROUP_BASE).join(c.trim_start_matches("name=")),
        };
        if !mount.join("cgroup.procs").is_file() {
            continue;
        }
        let dir = mount
            .join(path.trim_start_matches('/'))
            .join(format!("mesh-nspawn-{name}"));
        if let Err(e) = std::fs::create_dir(&dir) {
            remove_cgroups(&made);
            return Err(e).with_context(|| format!("creating {}", dir.display()));
        }
        made.push(dir);
    }
    Ok(made)
}

/// Remove each cgroup and what the container made under it (deepest first).
fn remove_cgroups(cgroups: &[PathBuf]) {
    fn remove(dir: &Path) {
        if let Ok(entries) = std::fs::read_dir(dir) {
            for e in entries.flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    remove(&e.path());
                }
            }
        }
        // The kernel may need a moment to let go of the last processes.
        for _ in 0..50 {
            match std::fs::remove_dir(dir) {
                Ok(()) => return,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
    for c in cgroups {
        remove(c);
    }
}
