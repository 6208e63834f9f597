//! Unit starts per second, with and without the sandbox (decision 0051): a
//! real supervisor of the agent starts `units` units at once (`sleep`, each
//! through its shim), first as the agent's own user with no cgroup, then each
//! as its module's user in a cgroup with limits; the time until every one
//! runs. The premise, checked: every unit runs, and runs as it should (its
//! uid), before a time is taken.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use mesh_host_agent::metrics::Metrics;
use mesh_host_agent::units::sandbox::CgroupMode;
use mesh_host_agent::units::{Supervisor, UnitsConfig};
use mesh_protocol::{DesiredState, RestartPolicy, UnitItem, UnitLimits, UnitState, UnitUser};

/// The modules the units spread over (one user each).
const MODULES: usize = 10;

pub async fn run(units: usize, rounds: usize) -> anyhow::Result<()> {
    if !rustix::process::geteuid().is_root() {
        bail!("the sandbox needs root: run the benchmark as root");
    }
    let shim = std::env::current_exe()?
        .parent()
        .context("the benchmark's directory")?
        .join("mesh-agent");
    if !shim.is_file() {
        bail!("{} not found: `cargo build --bins` first", shim.display());
    }
    println!("| mode | units | round | seconds to all running | units started/s |");
    println!("|---|---|---|---|---|");
    let mut summary = Vec::new();
    for boxed in [false, true] {
        let mut rates = Vec::new();
        for round in 1..=rounds {
            let secs = once(&shim, units, boxed).await?;
            let rate = units as f64 / secs;
            rates.push(rate);
            println!(
                "| {} | {units} | {round} | {secs:.3} | {rate:.1} |",
                mode(boxed)
            );
        }
        rates.sort_by(f64::total_cmp);
        summary.push((boxed, rates[rates.len() / 2]));
    }
    println!();
    println!("| mode | median units started/s |");
    println!("|---|---|");
    for (boxed, rate) in &summary {
        println!("| {} | {rate:.1} |", mode(*boxed));
    }
    if let [(_, plain), (_, boxed)] = summary[..] {
        println!(
            "\nthe box costs {:.1} ms per unit start",
            (1000.0 / boxed - 1000.0 / plain).max(0.0)
        );
    }
    Ok(())
}

fn mode(boxed: bool) -> &'static str {
    if boxed {
        "module user + cgroup"
    } else {
        "agent's user, no cgroup"
    }
}

/// One round: start `units` units, wait until all run, stop them.
async fn once(shim: &std::path::Path, units: usize, boxed: bool) -> anyhow::Result<f64> {
    let dir = tempfile::tempdir()?;
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
    }
    let (root, state): (PathBuf, PathBuf) = (dir.path().join("root"), dir.path().join("state"));
    std::fs::create_dir_all(&root)?;
    std::fs::create_dir_all(&state)?;
    let config = UnitsConfig {
        module_users: boxed,
        cgroups: if boxed {
            CgroupMode::Auto
        } else {
            CgroupMode::Off
        },
        stop_timeout: Duration::from_secs(2),
        shim_program: Some(shim.to_owned()),
        ..UnitsConfig::default()
    };
    let items: Vec<UnitItem> = (0..units)
        .map(|i| UnitItem {
            name: format!("bench-{i}"),
            module: format!("benchmod{}", i % MODULES),
            command: "sleep".into(),
            args: vec!["1000".into()],
            env: Default::default(),
            working_dir: None,
            restart: RestartPolicy::Never,
            desired: DesiredState::Running,
            probes: Vec::new(),
            artifact: None,
            revision: None,
            user: UnitUser::Module,
            limits: UnitLimits {
                memory_bytes: Some(64 << 20),
                pids: Some(64),
                cpu_millis: Some(500),
            },
            stateful: false,
        })
        .collect();
    let mut sup = Supervisor::start(config, &root, &state, Metrics::new()).await;
    // The modules' users exist before the clock starts: their creation is
    // once per module and node, not per start.
    if boxed {
        for m in 0..MODULES {
            mesh_host_agent::units::sandbox::ensure_user(&format!("benchmod{m}"))?;
        }
    }
    let started = Instant::now();
    sup.declare(&items);
    let all_running = |list: &[mesh_protocol::UnitStatus]| {
        list.iter()
            .filter(|u| u.state == UnitState::Running)
            .count()
            == units
    };
    if tokio::time::timeout(Duration::from_secs(120), sup.wait_until(all_running))
        .await
        .is_err()
    {
        let failed: Vec<_> = sup
            .statuses()
            .into_iter()
            .filter(|u| u.state != UnitState::Running)
            .take(3)
            .collect();
        bail!("premise failed: not every unit runs within 120 s: {failed:?}");
    }
    let secs = started.elapsed().as_secs_f64();
    // The premise: boxed units run as their module's users, plain ones as root.
    for u in sup.statuses() {
        let root_uid = u.uid == Some(0);
        if boxed == root_uid {
            bail!(
                "premise failed: unit {} runs as uid {:?} ({})",
                u.name,
                u.uid,
                mode(boxed)
            );
        }
    }
    sup.stop_all().await;
    Ok(secs)
}
