//! The checker: judges the history and the final state once every fault is
//! healed and the mesh had its convergence allowance. One verdict per
//! invariant, PASS or FAIL with counterexamples (docs/reliability.md lists
//! them and what each allows).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::Value;

use crate::history::{Entry, Event, hash};
use crate::sample::Sampler;
use crate::schedule::{FILES, MODULES, SECRETS};

/// After a fault on a node heals, how long the node may still be judged
/// unreachable or still run a surplus replica (the grace, a heartbeat, a
/// sweep, the agent's reconnect and hello).
pub const AFTER_HEAL_MS: u64 = 30_000;
/// How long after a module change or a drain both old and new replicas may
/// run (make-before-break, the stop timeout).
pub const MOVE_MS: u64 = 30_000;

#[derive(Debug, Clone, Serialize)]
pub struct Verdict {
    pub name: String,
    pub pass: bool,
    pub counterexamples: Vec<String>,
}

impl Verdict {
    fn of(name: &str, mut counterexamples: Vec<String>) -> Verdict {
        let total = counterexamples.len();
        counterexamples.truncate(20);
        if total > 20 {
            counterexamples.push(format!("… and {} more", total - 20));
        }
        Verdict {
            name: name.to_owned(),
            pass: total == 0,
            counterexamples,
        }
    }

    pub fn line(&self) -> String {
        if self.pass {
            format!("PASS {}", self.name)
        } else {
            format!("FAIL {}: {}", self.name, self.counterexamples.join("; "))
        }
    }
}

/// One host of the fleet as the checker needs it.
#[derive(Debug, Clone)]
pub struct HostInfo {
    pub name: String,
    pub node: String,
    pub role: String,
    pub zone: String,
    pub root: PathBuf,
}

/// An operation as the history tells it.
#[derive(Debug, Clone)]
pub struct OpRecord {
    pub op: usize,
    pub request_id: String,
    pub method: String,
    pub invoked_ms: u64,
    pub answered_ms: Option<u64>,
    pub expect: Value,
    pub status: Option<u16>,
}

impl OpRecord {
    pub fn ok(&self) -> bool {
        self.status.is_some_and(|s| (200..300).contains(&s))
    }
    /// No answer: it may or may not have taken effect.
    pub fn unknown(&self) -> bool {
        self.answered_ms.is_none() || self.status.is_none()
    }
    pub fn kind(&self) -> &str {
        self.expect["kind"].as_str().unwrap_or_default()
    }
    pub fn key(&self) -> &str {
        self.expect["key"].as_str().unwrap_or_default()
    }
}

pub fn ops_of(entries: &[Entry]) -> Vec<OpRecord> {
    let mut ops: BTreeMap<usize, OpRecord> = BTreeMap::new();
    let mut order = Vec::new();
    for e in entries {
        match &e.event {
            Event::Invoke {
                op,
                request_id,
                method,
                expect,
                ..
            } => {
                order.push(*op);
                ops.insert(
                    *op,
                    OpRecord {
                        op: *op,
                        request_id: request_id.clone(),
                        method: method.clone(),
                        invoked_ms: e.t_ms,
                        answered_ms: None,
                        expect: expect.clone(),
                        status: None,
                    },
                );
            }
            Event::Answer { op, status, .. } => {
                if let Some(r) = ops.get_mut(op) {
                    r.answered_ms = Some(e.t_ms);
                    r.status = *status;
                }
            }
            _ => {}
        }
    }
    order.into_iter().filter_map(|o| ops.remove(&o)).collect()
}

/// Fault windows from the history: (kind, node names, start, heal).
pub fn fault_windows(entries: &[Entry], end_ms: u64) -> Vec<(String, Vec<String>, u64, u64)> {
    let mut open: BTreeMap<usize, (String, Vec<String>, u64)> = BTreeMap::new();
    let mut out = Vec::new();
    for e in entries {
        match &e.event {
            Event::FaultStart {
                fault,
                kind,
                agents,
                ..
            } => {
                open.insert(*fault, (kind.clone(), agents.clone(), e.t_ms));
            }
            Event::FaultHeal { fault, .. } => {
                if let Some((k, a, s)) = open.remove(fault) {
                    out.push((k, a, s, e.t_ms));
                }
            }
            _ => {}
        }
    }
    for (_, (k, a, s)) in open {
        out.push((k, a, s, end_ms));
    }
    out
}

/// What the final state must be for one key: the last acknowledged write,
/// or one sent after it that got no answer. None: no acknowledged write.
fn candidates<'a>(ops: &[&'a OpRecord]) -> (Vec<&'a OpRecord>, Vec<&'a OpRecord>) {
    let last_ok = ops.iter().rposition(|o| o.ok());
    let mut allowed = Vec::new();
    let from = match last_ok {
        Some(i) => {
            allowed.push(ops[i]);
            i + 1
        }
        None => 0,
    };
    allowed.extend(ops[from..].iter().filter(|o| o.unknown()));
    let failed = ops
        .iter()
        .filter(|o| !o.ok() && !o.unknown())
        .copied()
        .collect();
    (allowed, failed)
}

fn matches_final(expect: &Value, fin: &Option<Value>) -> bool {
    match expect["kind"].as_str() {
        Some("file") => match fin {
            None => expect["deleted"] == true,
            Some(v) => {
                expect["deleted"] != true
                    && v["content"] == expect["content"]
                    && v["selector"] == expect["selector"]
            }
        },
        Some("layer") => fin.as_ref().is_some_and(|v| {
            v["values"] == expect["values"] && v["selector"] == expect["selector"]
        }),
        Some("module") => fin.as_ref().is_some_and(|v| {
            let m = &v["placement"]["match_labels"];
            m["replicas"] == expect["replicas"] && m["labels"]["role"] == expect["role"]
        }),
        Some("freeze") => fin
            .as_ref()
            .is_some_and(|v| v["frozen"] == expect["frozen"]),
        Some("drain") => fin.as_ref().is_some_and(|v| {
            let drained = matches!(v["state"].as_str(), Some("draining") | Some("drained"));
            drained == (expect["drained"] == true)
        }),
        _ => true,
    }
}

/// A key's final value through the API (None: absent).
async fn final_of(s: &Sampler, kind: &str, key: &str) -> anyhow::Result<Option<Value>> {
    let path = match kind {
        "file" => format!("/v1/files/{key}"),
        "layer" => format!("/v1/settings/labels/{key}"),
        "module" => format!("/v1/modules/{key}"),
        "freeze" => "/v1/freeze".to_owned(),
        "drain" => format!("/v1/nodes/{key}"),
        other => anyhow::bail!("no final state for {other}"),
    };
    let (status, v) = s.client.get(&path).await?;
    match status {
        200 => Ok(Some(v)),
        404 => Ok(None),
        other => anyhow::bail!("GET {path}: {other} {v}"),
    }
}

/// (a) Every acknowledged write is visible, every failed one changed nothing.
pub async fn writes_visible(s: &Sampler, ops: &[OpRecord]) -> Verdict {
    let mut bad = Vec::new();
    let mut keys: BTreeMap<(String, String), Vec<&OpRecord>> = BTreeMap::new();
    for o in ops {
        if matches!(o.kind(), "file" | "layer" | "module" | "freeze" | "drain") {
            keys.entry((o.kind().to_owned(), o.key().to_owned()))
                .or_default()
                .push(o);
        }
    }
    for ((kind, key), list) in keys {
        let fin = match final_of(s, &kind, &key).await {
            Ok(f) => f,
            Err(e) => {
                bad.push(format!("{kind} {key}: {e:#}"));
                continue;
            }
        };
        let (allowed, failed) = candidates(&list);
        if allowed.is_empty() {
            // Never acknowledged: absent, or as before the run.
            let absent_ok = match kind.as_str() {
                "file" | "layer" => fin.is_none(),
                "freeze" => fin.as_ref().is_some_and(|v| v["frozen"] == false),
                _ => true,
            };
            if !absent_ok {
                let culprit = failed
                    .iter()
                    .find(|o| matches_final(&o.expect, &fin))
                    .map(|o| format!(" (failed op {} status {:?} took effect)", o.op, o.status))
                    .unwrap_or_default();
                bad.push(format!(
                    "{kind} {key}: no write acknowledged, yet it is {}{culprit}",
                    short(&fin)
                ));
            }
            continue;
        }
        if !allowed.iter().any(|o| matches_final(&o.expect, &fin)) {
            let culprit = failed
                .iter()
                .find(|o| matches_final(&o.expect, &fin))
                .map(|o| format!("; failed op {} (status {:?}) took effect", o.op, o.status))
                .unwrap_or_default();
            bad.push(format!(
                "{kind} {key}: last acknowledged op {} expects {} but the API has {}{culprit}",
                allowed[0].op,
                allowed[0].expect,
                short(&fin)
            ));
        }
    }
    Verdict::of("acknowledged-writes-visible", bad)
}

fn short(v: &Option<Value>) -> String {
    match v {
        None => "absent".into(),
        Some(v) => crate::history::excerpt(&v.to_string(), 200),
    }
}

fn selector_matches(selector: &Value, h: &HostInfo) -> bool {
    selector.as_object().is_none_or(|m| {
        m.iter().all(|(k, v)| match k.as_str() {
            "role" => v == h.role.as_str(),
            "zone" => v == h.zone.as_str(),
            _ => false,
        })
    })
}

fn sha_of_file(p: &Path) -> Option<String> {
    use sha2::Digest as _;
    std::fs::read(p)
        .ok()
        .map(|b| hex::encode(sha2::Sha256::digest(&b)))
}

/// (b) Every node has applied the newest generation of every section it is
/// declared, its files and secrets on disk are the API's, each module runs
/// its replicas and nowhere else. Empty: converged.
pub async fn convergence_problems(
    s: &Sampler,
    hosts: &[HostInfo],
    ops: &[OpRecord],
) -> Vec<String> {
    let mut bad = Vec::new();
    for h in hosts {
        match s.client.get(&format!("/v1/nodes/{}", h.node)).await {
            Ok((200, view)) => {
                // Drained stays drained when its undrain got no answer
                // ((a) judges the drain); any other state is a failure.
                if !matches!(
                    view["state"].as_str(),
                    Some("alive" | "draining" | "drained")
                ) {
                    bad.push(format!("{} is {}", h.name, view["state"]));
                }
                for (name, sec) in view["sections"].as_object().into_iter().flatten() {
                    if !sec["declared"].is_null() && sec["declared"] != sec["applied"] {
                        bad.push(format!(
                            "{} section {name}: declared {} applied {}",
                            h.name, sec["declared"], sec["applied"]
                        ));
                    }
                    if !sec["error"].is_null() {
                        bad.push(format!("{} section {name}: error {}", h.name, sec["error"]));
                    }
                }
            }
            Ok((status, v)) => bad.push(format!("GET node {}: {status} {v}", h.name)),
            Err(e) => bad.push(format!("GET node {}: {e:#}", h.name)),
        }
    }
    // Files.
    for f in 0..FILES {
        let declared = match s.client.get(&format!("/v1/files/f{f}")).await {
            Ok((200, v)) => Some(v),
            Ok((404, _)) => None,
            Ok((st, v)) => {
                bad.push(format!("GET file f{f}: {st} {v}"));
                continue;
            }
            Err(e) => {
                bad.push(format!("GET file f{f}: {e:#}"));
                continue;
            }
        };
        for h in hosts {
            let path = h.root.join(format!("etc/soak/f{f}"));
            let on_disk = std::fs::read_to_string(&path).ok();
            let want = declared
                .as_ref()
                .filter(|d| selector_matches(&d["selector"], h))
                .and_then(|d| d["content"].as_str().map(str::to_owned));
            if on_disk != want {
                bad.push(format!(
                    "{}: /etc/soak/f{f} is {:?}, the API says {:?}",
                    h.name,
                    on_disk.map(|c| crate::history::excerpt(&c, 60)),
                    want.map(|c| crate::history::excerpt(&c, 60))
                ));
            }
        }
    }
    // Secrets on the nodes running m0: the last acknowledged (or an
    // unanswered later) value.
    let m0_nodes: BTreeSet<String> = match s.client.get("/v1/modules/m0").await {
        Ok((200, v)) => v["assignments"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|a| a["role"] == "active")
            .filter_map(|a| a["node"].as_str().map(str::to_owned))
            .collect(),
        _ => BTreeSet::new(),
    };
    for k in 0..SECRETS {
        let key = format!("s{k}");
        let list: Vec<&OpRecord> = ops
            .iter()
            .filter(|o| o.kind() == "secret" && o.key() == key)
            .collect();
        let (allowed, _) = candidates(&list);
        let hashes: BTreeSet<&str> = allowed
            .iter()
            .filter_map(|o| o.expect["sha256"].as_str())
            .collect();
        for h in hosts.iter().filter(|h| m0_nodes.contains(&h.node)) {
            let got = sha_of_file(&h.root.join(format!("modules/m0/secrets/{key}")));
            if !got.as_deref().is_some_and(|g| hashes.contains(g)) {
                bad.push(format!(
                    "{}: secret {key} on disk (sha256 {:?}) is not the last acknowledged value",
                    h.name,
                    got.map(|g| g[..12].to_owned())
                ));
            }
        }
    }
    // Units: each module's processes are its active replicas, on their nodes.
    let host_dirs: Vec<(String, PathBuf)> = s.hosts.clone();
    let counts = tokio::task::spawn_blocking(move || crate::sample::unit_counts(&host_dirs))
        .await
        .unwrap_or_default();
    for m in 0..MODULES {
        let name = format!("m{m}");
        let Ok((200, v)) = s.client.get(&format!("/v1/modules/{name}")).await else {
            bad.push(format!("GET module {name} failed"));
            continue;
        };
        // One replica per node: at most as many as the role has nodes.
        let role = v["placement"]["match_labels"]["labels"]["role"]
            .as_str()
            .unwrap_or_default();
        let room = hosts.iter().filter(|h| h.role == role).count();
        let replicas = (v["placement"]["match_labels"]["replicas"]
            .as_u64()
            .unwrap_or(0) as usize)
            .min(room);
        let active: Vec<&Value> = v["assignments"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|a| a["role"] == "active")
            .collect();
        if let Some(e) = v["placement_error"].as_str() {
            bad.push(format!("{name}: placement error: {e}"));
        }
        let running = active
            .iter()
            .filter(|a| a["unit_state"] == "running")
            .count();
        if running != replicas || active.len() != replicas {
            bad.push(format!(
                "{name}: {running} of {} active replicas running, {replicas} declared",
                active.len()
            ));
        }
        let mut per_node: BTreeMap<String, usize> = BTreeMap::new();
        for a in &active {
            if let Some(n) = a["node"].as_str() {
                *per_node.entry(n.to_owned()).or_default() += 1;
            }
        }
        for h in hosts {
            let have = counts
                .get(&(h.name.clone(), name.clone()))
                .copied()
                .unwrap_or(0);
            let want = per_node.get(&h.node).copied().unwrap_or(0);
            if have != want {
                bad.push(format!(
                    "{}: {have} processes of {name}, {want} assigned",
                    h.name
                ));
            }
        }
    }
    bad
}

/// Whether `node` was under an agent fault around `t`.
fn excused(windows: &[(String, Vec<String>, u64, u64)], node: &str, t: u64) -> bool {
    windows.iter().any(|(kind, nodes, from, to)| {
        matches!(kind.as_str(), "agent-kill" | "agent-pause" | "partition")
            && nodes.iter().any(|n| n == node)
            && t + 1_000 >= *from
            && t <= to + AFTER_HEAL_MS
    })
}

/// (c) No module ran more copies than allowed on nodes no fault touched:
/// the replicas declared over the last [`MOVE_MS`], twice that when its
/// role changed or a node was drained or undrained in that time.
pub fn no_replica_twice(
    entries: &[Entry],
    ops: &[OpRecord],
    hosts: &[HostInfo],
    windows: &[(String, Vec<String>, u64, u64)],
) -> Verdict {
    let node_of: BTreeMap<&str, &str> = hosts
        .iter()
        .map(|h| (h.name.as_str(), h.node.as_str()))
        .collect();
    let module_ops: Vec<&OpRecord> = ops
        .iter()
        .filter(|o| o.kind() == "module" && (o.ok() || o.unknown()))
        .collect();
    let moves: Vec<u64> = ops
        .iter()
        .filter(|o| o.kind() == "drain")
        .map(|o| o.invoked_ms)
        .collect();
    let mut bad = Vec::new();
    for e in entries {
        let Event::Units { counts } = &e.event else {
            continue;
        };
        let t = e.t_ms;
        let mut per_module: BTreeMap<&str, usize> = BTreeMap::new();
        for (host, module, n) in counts {
            let node = node_of.get(host.as_str()).copied().unwrap_or_default();
            if !excused(windows, node, t) {
                *per_module.entry(module.as_str()).or_default() += n;
            }
        }
        for (module, n) in per_module {
            let mine: Vec<&&OpRecord> = module_ops.iter().filter(|o| o.key() == module).collect();
            // What may be declared at t: the last acknowledged change before
            // the window, every change sent after it that got no answer (it
            // may or may not have taken effect), and every change within it.
            let before = mine
                .iter()
                .rev()
                .find(|o| o.ok() && o.invoked_ms + MOVE_MS <= t)
                .or_else(|| mine.first());
            let since = before.map(|b| b.invoked_ms).unwrap_or(0);
            let within: Vec<&&&OpRecord> = mine
                .iter()
                .filter(|o| {
                    o.invoked_ms <= t
                        && ((o.invoked_ms + MOVE_MS > t) || (o.unknown() && o.invoked_ms > since))
                })
                .collect();
            let mut max = before
                .map(|o| o.expect["replicas"].as_u64().unwrap_or(0))
                .unwrap_or(0);
            let mut role_changed = false;
            for o in &within {
                max = max.max(o.expect["replicas"].as_u64().unwrap_or(0));
                if before.is_some_and(|b| b.expect["role"] != o.expect["role"]) {
                    role_changed = true;
                }
            }
            let moving = role_changed || moves.iter().any(|m| *m <= t && m + MOVE_MS > t);
            let allowed = if moving { 2 * max } else { max } as usize;
            if n > allowed {
                bad.push(format!(
                    "at {:.1}s {module} ran {n} copies on healthy nodes, {allowed} allowed",
                    t as f64 / 1000.0
                ));
            }
        }
    }
    Verdict::of("no-replica-twice", bad)
}

/// (d) No node judged unreachable while no fault touched it.
pub fn no_false_unreachable(
    entries: &[Entry],
    windows: &[(String, Vec<String>, u64, u64)],
) -> Verdict {
    let mut bad = Vec::new();
    let mut reported = BTreeSet::new();
    for e in entries {
        let Event::NodeStates { states } = &e.event else {
            continue;
        };
        for (node, state) in states {
            if state == "unreachable" && !excused(windows, node, e.t_ms) {
                // One counterexample per node per 10 s.
                if reported.insert((node.clone(), e.t_ms / 10_000)) {
                    let around: Vec<String> = windows
                        .iter()
                        .filter(|(_, _, from, to)| {
                            *from <= e.t_ms + 1_000 && e.t_ms <= to + AFTER_HEAL_MS
                        })
                        .map(|(k, n, from, to)| {
                            format!(
                                "{k}{n:?} {:.1}-{:.1}s",
                                *from as f64 / 1000.0,
                                *to as f64 / 1000.0
                            )
                        })
                        .collect();
                    bad.push(format!(
                        "{node} unreachable at {:.1}s (faults then: {})",
                        e.t_ms as f64 / 1000.0,
                        if around.is_empty() {
                            "none".to_owned()
                        } else {
                            around.join(", ")
                        }
                    ));
                }
            }
        }
    }
    Verdict::of("no-false-unreachable", bad)
}

/// (e) Nothing waits in a queue of the vhost or an outbox: each is seen
/// empty at least once within `within` (heartbeats and the relay keep
/// flowing, so one poll may catch a message in passing; one that stays is
/// stuck).
pub async fn nothing_waiting(
    s: &Sampler,
    env: &mesh_testkit::TestEnv,
    within: Duration,
) -> Verdict {
    const CONTEXTS: [&str; 7] = [
        "inventory",
        "config",
        "identity",
        "connectivity",
        "observability",
        "delivery",
        "provisioning",
    ];
    let deadline = Instant::now() + within;
    // What was never seen empty: name → last count (or error).
    let mut waiting: Option<BTreeMap<String, String>> = None;
    loop {
        let mut now: BTreeMap<String, String> = BTreeMap::new();
        match s.queues().await {
            Ok(q) => {
                // Heartbeats never stop: one per agent may be ready at any
                // instant without anything waiting.
                let allowed = |name: &str| {
                    if name == "reports.heartbeat" {
                        s.client.nodes.len() as u64
                    } else {
                        0
                    }
                };
                for (name, n) in q.iter().filter(|(name, n)| *n > allowed(name)) {
                    now.insert(format!("queue {name}"), format!("{n} messages"));
                }
            }
            Err(e) => {
                now.insert("queues".into(), format!("cannot list: {e:#}"));
            }
        }
        for c in CONTEXTS {
            match mesh_e2e::sim::scalar(
                env,
                c,
                &format!("SELECT count(*) FROM {c}.outbox WHERE sent_at IS NULL"),
            )
            .await
            {
                Ok(0) => {}
                Ok(n) => {
                    now.insert(format!("{c}.outbox"), format!("{n} unsent"));
                }
                Err(e) => {
                    now.insert(format!("{c}.outbox"), format!("{e:#}"));
                }
            }
        }
        let still: BTreeMap<String, String> = match waiting {
            None => now,
            Some(before) => now
                .into_iter()
                .filter(|(k, _)| before.contains_key(k))
                .collect(),
        };
        if still.is_empty() || Instant::now() >= deadline {
            return Verdict::of(
                "nothing-waiting",
                still
                    .into_iter()
                    .map(|(k, v)| format!("{k}: {v}, never empty in {}s", within.as_secs()))
                    .collect(),
            );
        }
        waiting = Some(still);
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// (f) Every acknowledged mutation has exactly one successful audit entry
/// (its request id), every refused one none.
pub async fn one_audit_entry(s: &Sampler, ops: &[OpRecord]) -> Verdict {
    let mut by_id: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    let mut after: Option<i64> = None;
    let mut bad = Vec::new();
    loop {
        let path = match after {
            Some(a) => format!("/v1/audit?limit=500&after={a}"),
            None => "/v1/audit?limit=500".to_owned(),
        };
        match s.client.get(&path).await {
            Ok((200, page)) => {
                for e in page["entries"].as_array().into_iter().flatten() {
                    if let Some(id) = e["request_id"].as_str() {
                        by_id
                            .entry(id.to_owned())
                            .or_default()
                            .push(e["status"].as_i64().unwrap_or(0));
                    }
                }
                match page["next"].as_i64() {
                    Some(n) => after = Some(n),
                    None => break,
                }
            }
            other => {
                bad.push(format!("GET {path}: {other:?}"));
                break;
            }
        }
    }
    for o in ops {
        let ok_entries = by_id
            .get(&o.request_id)
            .map(|v| v.iter().filter(|s| (200..300).contains(*s)).count())
            .unwrap_or(0);
        if o.ok() && ok_entries != 1 {
            bad.push(format!(
                "op {} ({} {} {}): {ok_entries} successful audit entries",
                o.op,
                o.method,
                o.kind(),
                o.key()
            ));
        } else if !o.ok() && !o.unknown() && ok_entries != 0 {
            bad.push(format!(
                "op {} refused ({:?}) but audited as successful",
                o.op, o.status
            ));
        } else if o.unknown() && ok_entries > 1 {
            bad.push(format!(
                "op {}: {ok_entries} successful audit entries",
                o.op
            ));
        }
    }
    Verdict::of("one-audit-entry-per-mutation", bad)
}

/// (g) No secret value in a log, an event, the metrics or a dead letter.
pub async fn no_secret_leaked(
    s: &Sampler,
    env: &mesh_testkit::TestEnv,
    secrets: &[String],
    log_dir: &Path,
) -> Verdict {
    let mut bad = Vec::new();
    let mut sources: Vec<(String, Vec<u8>)> = Vec::new();
    for entry in std::fs::read_dir(log_dir).into_iter().flatten().flatten() {
        let p = entry.path();
        if p.extension().is_some_and(|e| e == "log")
            && let Ok(b) = std::fs::read(&p)
        {
            sources.push((p.display().to_string(), b));
        }
    }
    if let Ok((_, ev)) = s.client.get("/v1/events?follow=false&limit=1000").await {
        sources.push(("GET /v1/events".into(), ev.to_string().into_bytes()));
    }
    if let Ok(r) = s
        .client
        .http
        .get(format!("{}/metrics", s.client.api))
        .send()
        .await
        && let Ok(t) = r.text().await
    {
        sources.push(("/metrics".into(), t.into_bytes()));
    }
    match mesh_e2e::sim::drain(env, "dead-letter").await {
        Ok(dead) => sources.push(("dead letters".into(), format!("{dead:?}").into_bytes())),
        Err(e) => bad.push(format!("reading dead letters: {e:#}")),
    }
    for v in secrets {
        for (name, bytes) in &sources {
            if bytes.windows(v.len()).any(|w| w == v.as_bytes()) {
                bad.push(format!("a secret (sha256 {}) is in {name}", &hash(v)[..12]));
            }
        }
    }
    Verdict::of("no-secret-leaked", bad)
}

/// Least-squares slope of (x, y), per unit of x.
pub fn slope(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    if n < 2.0 {
        return 0.0;
    }
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let num: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let den: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    if den == 0.0 { 0.0 } else { num / den }
}

/// (h) The controller's RSS and descriptors and the broker's queue count
/// do not grow without bound: over the last half of the run (at most its
/// last ten minutes), the fitted growth stays under a bound.
pub fn bounded_resources(entries: &[Entry], end_ms: u64) -> Verdict {
    let window = (end_ms / 2).min(600_000);
    let from = end_ms.saturating_sub(window);
    let mut rss = Vec::new();
    let mut fds = Vec::new();
    let mut queues = Vec::new();
    for e in entries
        .iter()
        .filter(|e| e.t_ms >= from && e.t_ms <= end_ms)
    {
        if let Event::Resources {
            rss_kb,
            fds: f,
            queues: q,
            ..
        } = &e.event
        {
            let t = e.t_ms as f64 / 1000.0;
            if let Some(r) = rss_kb {
                rss.push((t, *r as f64));
            }
            if let Some(f) = f {
                fds.push((t, *f as f64));
            }
            if let Some(q) = q {
                queues.push((t, *q as f64));
            }
        }
    }
    let secs = window as f64 / 1000.0;
    let mut bad = Vec::new();
    // (name, points, absolute allowance over the window, relative allowance)
    for (name, pts, abs, rel) in [
        ("controller RSS (kB)", &rss, 32_768.0_f64, 0.25),
        ("controller open fds", &fds, 40.0, 0.5),
        ("broker queues", &queues, 5.0, 0.2),
    ] {
        if pts.len() < 5 {
            bad.push(format!("{name}: only {} samples", pts.len()));
            continue;
        }
        let mean = pts.iter().map(|p| p.1).sum::<f64>() / pts.len() as f64;
        let growth = slope(pts) * secs;
        if growth > abs.max(rel * mean) {
            bad.push(format!(
                "{name} grew {growth:.0} over the last {secs:.0}s (mean {mean:.0})"
            ));
        }
    }
    Verdict::of("bounded-resources", bad)
}

/// Every fault healed without error.
pub fn faults_healed(entries: &[Entry]) -> Verdict {
    let mut started = BTreeMap::new();
    let mut bad = Vec::new();
    for e in entries {
        match &e.event {
            Event::FaultStart { fault, kind, .. } => {
                started.insert(*fault, kind.clone());
            }
            Event::FaultHeal { fault, kind, error } => {
                started.remove(fault);
                if let Some(err) = error {
                    bad.push(format!(
                        "fault {fault} ({kind}) healed with an error: {err}"
                    ));
                }
            }
            Event::Note { text } if text.contains("did not start") => bad.push(text.clone()),
            _ => {}
        }
    }
    bad.extend(
        started
            .iter()
            .map(|(f, k)| format!("fault {f} ({k}) never healed")),
    );
    Verdict::of("faults-healed", bad)
}
