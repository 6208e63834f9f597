//! `mesh-soak`: the fleet soak (issue 32, docs/reliability.md). A whole mesh
//! — the real controller, PostgreSQL and RabbitMQ through the bundle's test
//! kit, N real agents each in its own network namespace — under a seeded
//! workload and a seeded nemesis, its history judged afterwards by a
//! checker, as Jepsen judges a database. The seed fixes the schedule of
//! operations and faults; the processes are real, so the interleaving is not.
//!
//! Writes `<out>/{seed,schedule.json,history.jsonl,verdict.json,timeline.svg}`
//! and the processes' logs under `<out>/logs/`; exits 1 when an invariant
//! fails, 2 when the run could not be made.

mod checker;
mod fleet;
mod history;
mod nemesis;
mod plot;
mod sample;
mod schedule;
mod workload;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Parser;
use serde_json::json;

use crate::checker::{HostInfo, Verdict};
use crate::fleet::Fleet;
use crate::history::{Event, History};
use crate::nemesis::{BrokerLimits, Nemesis};
use crate::sample::Sampler;
use crate::schedule::{FAULT_KINDS, SHARED_SERVICE_KINDS};
use crate::workload::Client;

#[derive(Debug, Parser)]
#[command(
    name = "mesh-soak",
    about = "The fleet soak: a whole mesh under seeded faults, checked afterwards",
    version
)]
struct Args {
    /// Agents, each in a network namespace of its own.
    #[arg(long, default_value_t = 30)]
    agents: usize,
    /// How long the workload and the nemesis run.
    #[arg(long, default_value_t = 30.0)]
    minutes: f64,
    /// The seed of the schedule (default: random, printed).
    #[arg(long)]
    seed: Option<u64>,
    /// Fault kinds, comma-separated (default: all): controller-kill,
    /// agent-kill, agent-pause, partition, rabbitmq-restart,
    /// postgres-restart, broker-alarm. `none` for no fault.
    #[arg(long, value_delimiter = ',')]
    faults: Option<Vec<String>>,
    /// The report's directory.
    #[arg(long, default_value = "soak-out")]
    out: PathBuf,
    /// Seconds the mesh is given to converge after the last heal.
    #[arg(long, default_value_t = 120)]
    converge_secs: u64,
    /// Seconds between two samples.
    #[arg(long, default_value_t = 2)]
    sample_secs: u64,
    /// Write the schedule (and the seed) and stop.
    #[arg(long)]
    schedule_only: bool,
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("mesh-soak: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    match rt.block_on(soak(args)) {
        Ok(true) => std::process::ExitCode::SUCCESS,
        Ok(false) => std::process::ExitCode::from(1),
        Err(e) => {
            eprintln!("mesh-soak: {e:#}");
            std::process::ExitCode::from(2)
        }
    }
}

async fn soak(args: Args) -> anyhow::Result<bool> {
    let seed = args.seed.unwrap_or_else(rand::random);
    println!("seed {seed}");
    let kinds: Vec<String> = match &args.faults {
        None => FAULT_KINDS.iter().map(|k| k.to_string()).collect(),
        Some(list) if list.iter().any(|k| k == "none") => Vec::new(),
        Some(list) => list.iter().map(|k| k.trim().to_owned()).collect(),
    };
    for k in &kinds {
        anyhow::ensure!(
            FAULT_KINDS.contains(&k.as_str()),
            "unknown fault kind `{k}` (one of {})",
            FAULT_KINDS.join(", ")
        );
    }
    anyhow::ensure!(args.agents >= 1 && args.agents < 250, "--agents: 1 to 249");
    anyhow::ensure!(args.minutes > 0.0, "--minutes must be positive");
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {:?}", args.out))?;
    std::fs::write(args.out.join("seed"), format!("{seed}\n"))?;
    let schedule = schedule::generate(seed, args.agents, args.minutes, &kinds);
    std::fs::write(
        args.out.join("schedule.json"),
        serde_json::to_string_pretty(&schedule)?,
    )?;
    let mut by_kind: std::collections::BTreeMap<&str, usize> = Default::default();
    for f in &schedule.faults {
        *by_kind.entry(f.kind.as_str()).or_default() += 1;
    }
    println!(
        "schedule: {} operations, {} faults {by_kind:?}",
        schedule.ops.len(),
        schedule.faults.len()
    );
    if args.schedule_only {
        return Ok(true);
    }
    if let Some(why) = fleet::unavailable() {
        anyhow::bail!("this machine cannot run the soak: {why}");
    }
    if kinds
        .iter()
        .any(|k| SHARED_SERVICE_KINDS.contains(&k.as_str()))
    {
        println!("note: the faults restart or block this machine's RabbitMQ/PostgreSQL");
    }
    let limits = if kinds.iter().any(|k| k == "broker-alarm") {
        Some(BrokerLimits::read()?)
    } else {
        None
    };

    let raise = Instant::now();
    // Interrupted while raising: what is made so far is dropped (the
    // namespaces, the processes), not left behind.
    let fleet = tokio::select! {
        f = Fleet::raise(args.agents) => f?,
        _ = interrupt() => anyhow::bail!("interrupted while raising the fleet"),
    };
    println!(
        "{} agents alive in {:.1}s",
        args.agents,
        raise.elapsed().as_secs_f64()
    );
    let origin = Instant::now();
    let history = History::create(&args.out.join("history.jsonl"), origin)?;
    let hosts: Vec<HostInfo> = fleet
        .agents
        .iter()
        .enumerate()
        .map(|(i, a)| HostInfo {
            name: a.name.clone(),
            node: a.host.node.clone(),
            role: a.role.to_owned(),
            zone: if i % 2 == 0 { "a" } else { "b" }.to_owned(),
            root: a.host.root.clone(),
        })
        .collect();
    let nodes: Vec<String> = hosts.iter().map(|h| h.node.clone()).collect();
    let client = Client::new(&fleet.mesh.api, fleet.mesh.admin_token(), nodes)?;
    let admin = fleet.mesh.env.admin_credentials().clone();
    let sampler = Arc::new(Sampler {
        history: history.clone(),
        client: client.clone(),
        pids: fleet.pids.clone(),
        hosts: (0..fleet.agents.len())
            .map(|i| (fleet.agents[i].name.clone(), fleet.host_dir(i)))
            .collect(),
        rabbitmq_api: admin.rabbitmq_api.clone(),
        rabbitmq_user: admin.rabbitmq_user.clone(),
        rabbitmq_password: admin.rabbitmq_password.expose().to_owned(),
        vhost: fleet.mesh.env.vhost().to_owned(),
    });
    let admin_db = fleet.mesh.env.admin_database_url();
    let log_dir = fleet.dir().to_owned();
    let fleet = Arc::new(tokio::sync::Mutex::new(fleet));

    let result = run(
        &args, seed, &schedule, &history, &client, &sampler, &hosts, &fleet, limits, admin_db,
        &log_dir, origin,
    )
    .await;
    history.flush();

    // Keep the logs, then take everything down.
    let logs = args.out.join("logs");
    let _ = std::fs::create_dir_all(&logs);
    for entry in std::fs::read_dir(&log_dir).into_iter().flatten().flatten() {
        let p = entry.path();
        if p.extension().is_some_and(|e| e == "log")
            && let Some(name) = p.file_name()
        {
            let _ = std::fs::copy(&p, logs.join(name));
        }
    }
    let fleet = Arc::try_unwrap(fleet)
        .map_err(|_| anyhow::anyhow!("the fleet is still shared"))?
        .into_inner();
    let Fleet {
        mesh,
        lan,
        mut agents,
        ..
    } = fleet;
    for a in &mut agents {
        if let Some(mut p) = a.proc.take() {
            p.terminate(Duration::from_secs(5));
        }
    }
    drop(lan);
    mesh.teardown().await?;
    result
}

/// SIGINT or SIGTERM (a CI's timeout): the run heals what it broke (a
/// broker alarm left set would block every publisher of the machine).
async fn interrupt() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
}

#[allow(clippy::too_many_arguments)]
async fn run(
    args: &Args,
    seed: u64,
    schedule: &schedule::Schedule,
    history: &History,
    client: &Client,
    sampler: &Arc<Sampler>,
    hosts: &[HostInfo],
    fleet: &Arc<tokio::sync::Mutex<Fleet>>,
    limits: Option<BrokerLimits>,
    admin_db: String,
    log_dir: &std::path::Path,
    origin: Instant,
) -> anyhow::Result<bool> {
    let mut secrets = workload::setup(client, history, 1_000_000).await?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let sampling = {
        let s = sampler.clone();
        let rx = stop_rx.clone();
        let every = Duration::from_secs(args.sample_secs.max(1));
        tokio::spawn(async move { s.run(every, rx).await })
    };
    let start = Instant::now();
    let nemesis = Nemesis {
        fleet: fleet.clone(),
        history: history.clone(),
        limits,
        admin_db,
    };
    let interrupted = {
        let tx = stop_tx.clone();
        tokio::spawn(async move {
            interrupt().await;
            eprintln!("interrupted: healing every fault, then stopping");
            let _ = tx.send(true);
        })
    };
    let (_, set) = tokio::join!(
        nemesis.run(&schedule.faults, start, stop_rx.clone()),
        workload::run(client, history, &schedule.ops, seed, start, stop_rx.clone()),
    );
    secrets.extend(set);
    // Stopped before the schedule's end: judged, but never a pass.
    let cut_short = *stop_rx.borrow();
    let healed_ms = history.now_ms();
    history.record(Event::Note {
        text: "every fault healed; the workload is done".into(),
    });
    println!(
        "[{:>6.1}s] every fault healed; converging (at most {} s)",
        healed_ms as f64 / 1000.0,
        args.converge_secs
    );

    // Convergence: until (b) holds, at most --converge-secs.
    let ops_now = checker::ops_of(&history.entries());
    let converge_start = Instant::now();
    let mut problems;
    loop {
        problems = checker::convergence_problems(sampler, hosts, &ops_now).await;
        if problems.is_empty()
            || converge_start.elapsed() >= Duration::from_secs(args.converge_secs)
            || *stop_rx.borrow()
        {
            break;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let converged_secs = converge_start.elapsed().as_secs_f64();
    history.record(Event::Note {
        text: format!(
            "converged: {} after {converged_secs:.1}s",
            problems.is_empty()
        ),
    });
    println!("convergence: {converged_secs:.1}s after the last heal");
    let _ = stop_tx.send(true);
    let _ = sampling.await;
    interrupted.abort();

    let entries = history.entries();
    let ops = checker::ops_of(&entries);
    let end_ms = history.now_ms();
    let windows = checker::fault_windows(&entries, end_ms);
    let env = {
        let f = fleet.lock().await;
        // The checks that read the database and the broker use the
        // environment; they run while the lock is held (nothing else uses
        // the fleet now).
        let mut verdicts: Vec<Verdict> = vec![checker::faults_healed(&entries)];
        verdicts.push(checker::writes_visible(sampler, &ops).await);
        verdicts.push(Verdict {
            name: "nodes-converged".into(),
            pass: problems.is_empty(),
            counterexamples: problems.iter().take(20).cloned().collect(),
        });
        verdicts.push(checker::no_replica_twice(&entries, &ops, hosts, &windows));
        verdicts.push(checker::no_false_unreachable(&entries, &windows));
        verdicts
            .push(checker::nothing_waiting(sampler, &f.mesh.env, Duration::from_secs(30)).await);
        verdicts.push(checker::one_audit_entry(sampler, &ops).await);
        let values: Vec<String> = secrets.values().cloned().collect();
        verdicts.push(checker::no_secret_leaked(sampler, &f.mesh.env, &values, log_dir).await);
        verdicts.push(checker::bounded_resources(&entries, healed_ms));
        verdicts
    };
    let verdicts = env;
    let mut ok = !cut_short;
    if cut_short {
        println!("FAIL interrupted: the schedule did not run to its end");
    }
    for v in &verdicts {
        println!("{}", v.line());
        ok &= v.pass;
    }
    let mut fault_counts: std::collections::BTreeMap<String, usize> = Default::default();
    for (k, _, _, _) in &windows {
        *fault_counts.entry(k.clone()).or_default() += 1;
    }
    let answered: Vec<_> = ops.iter().filter(|o| !o.unknown()).collect();
    let verdict = json!({
        "seed": seed,
        "agents": args.agents,
        "minutes": args.minutes,
        "faults": fault_counts,
        "operations": ops.len(),
        "operations_acknowledged": ops.iter().filter(|o| o.ok()).count(),
        "operations_unanswered": ops.len() - answered.len(),
        "converge_secs_allowed": args.converge_secs,
        "converged_after_secs": converged_secs,
        "pass": ok,
        "invariants": verdicts,
        "elapsed_secs": origin.elapsed().as_secs_f64(),
    });
    std::fs::write(
        args.out.join("verdict.json"),
        serde_json::to_string_pretty(&verdict)?,
    )?;
    if let Err(e) = plot::timeline(&args.out.join("timeline.svg"), &entries, end_ms) {
        eprintln!("the timeline plot failed: {e:#}");
    }
    println!(
        "{} — report in {}",
        if ok { "PASS" } else { "FAIL" },
        args.out.display()
    );
    Ok(ok)
}
