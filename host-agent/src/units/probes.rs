//! Probes: the checks a unit declares, run by the agent beside the unit while
//! its process runs, and their results, which the agent states in `health`
//! reports.
//!
//! - One task per probe of a running unit (at most [`mesh_protocol::MAX_PROBES`]
//!   per unit), started when the unit's process starts (or is adopted), ended
//!   when it exits or the unit goes: the tasks die with their [`ProbeSet`].
//! - The first check runs `initial_delay_secs` after the process started (an
//!   adopted process started long ago: at once), then every `interval_secs`;
//!   each check is bounded by `timeout_secs`.
//! - `success_threshold` successes in a row make a probe `healthy`,
//!   `failure_threshold` failures in a row `unhealthy`; before either it is
//!   `unknown` ([`Tracker`], as Kubernetes counts).
//! - A unit that (re)starts, or is declared with other probes, starts its
//!   probes anew (`unknown`). A unit whose process is not running keeps its
//!   probes listed as `unknown` (`unit not running`); a unit stopped or no
//!   longer declared drops them.
//!
//! Checks: `http` is a plain HTTP/1.1 `GET` (status line compared with
//! `expect_status`), `tcp` a connect, `exec` the command with its arguments
//! (no shell), in the unit's environment and working dir, in its own process
//! group, killed (the group) at the timeout.
//!
//! Results land on the [`HealthBoard`] (a `watch` channel holding every
//! probe's [`ProbeResult`]); it notifies only when a state changes or probes
//! come or go, and the agent turns that into `health` reports
//! ([`HealthReporter`]).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use mesh_protocol::{
    ExecCheck, HttpCheck, MAX_PROBE_DETAIL, Probe, ProbeCheck, ProbeResult, ProbeState, TcpCheck,
};
use rustix::process::Signal;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep_until};

use crate::metrics::Metrics;

/// The longest status line read from an HTTP probe's answer.
const MAX_STATUS_LINE: usize = 8 * 1024;

/// Detail of the probes of a unit whose process does not run.
pub const NOT_RUNNING: &str = "unit not running";

/// Counts a probe's results in a row and decides its state: pure, no clock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tracker {
    pub state: ProbeState,
    /// When `state` last changed.
    pub since: DateTime<Utc>,
    pub successes: u32,
    pub failures: u32,
    pub checked_at: Option<DateTime<Utc>>,
    pub detail: Option<String>,
    success_threshold: u32,
    failure_threshold: u32,
}

impl Tracker {
    /// A probe not checked yet: `unknown` since `now`.
    pub fn new(success_threshold: u32, failure_threshold: u32, now: DateTime<Utc>) -> Self {
        Tracker {
            state: ProbeState::Unknown,
            since: now,
            successes: 0,
            failures: 0,
            checked_at: None,
            detail: None,
            success_threshold: success_threshold.max(1),
            failure_threshold: failure_threshold.max(1),
        }
    }

    /// Count one check's result; true if the state changed.
    pub fn record(&mut self, ok: bool, detail: String, now: DateTime<Utc>) -> bool {
        self.checked_at = Some(now);
        self.detail = Some(truncate(&detail, MAX_PROBE_DETAIL));
        let next = if ok {
            self.failures = 0;
            self.successes = self.successes.saturating_add(1);
            (self.successes >= self.success_threshold).then_some(ProbeState::Healthy)
        } else {
            self.successes = 0;
            self.failures = self.failures.saturating_add(1);
            (self.failures >= self.failure_threshold).then_some(ProbeState::Unhealthy)
        };
        match next {
            Some(s) if s != self.state => {
                self.state = s;
                self.since = now;
                true
            }
            _ => false,
        }
    }

    pub fn result(&self, unit: &str, module: &str, probe: &str) -> ProbeResult {
        ProbeResult {
            unit: unit.to_owned(),
            module: module.to_owned(),
            probe: probe.to_owned(),
            state: self.state,
            since: self.since,
            checked_at: self.checked_at,
            failures: self.failures,
            detail: self.detail.clone(),
        }
    }
}

/// Every probe's result, by (unit, probe), with the id of the runner that
/// owns the entry.
pub type HealthMap = BTreeMap<(String, String), (u64, ProbeResult)>;

/// Where probe results land. Cheap to clone.
#[derive(Clone)]
pub struct HealthBoard {
    tx: Arc<watch::Sender<HealthMap>>,
    metrics: Metrics,
}

impl HealthBoard {
    pub fn new(metrics: Metrics) -> Self {
        let (tx, _) = watch::channel(HealthMap::new());
        HealthBoard {
            tx: Arc::new(tx),
            metrics,
        }
    }

    /// A reporter for the agent's session.
    pub fn reporter(&self) -> HealthReporter {
        HealthReporter {
            rx: self.tx.subscribe(),
            pending: false,
            last: None,
            stated_some: false,
        }
    }

    /// Every result now, ordered by unit and probe.
    pub fn results(&self) -> Vec<ProbeResult> {
        list(&self.tx.borrow())
    }

    /// Make the probes of `unit` be `probes`, each `unknown` since now (with
    /// `detail`): the unit (re)started, its probes changed, or its process
    /// does not run. Entries of probes no longer declared go.
    pub fn reset(&self, runner: u64, unit: &str, module: &str, probes: &[Probe], detail: &str) {
        let now = Utc::now();
        // Metrics change under the board's lock, so that a check finishing
        // meanwhile cannot bring back a series of a probe gone.
        self.tx.send_if_modified(|m| {
            let mut changed = false;
            let before: Vec<(String, String)> = m
                .iter()
                .filter(|((u, _), (id, _))| u == unit && *id <= runner)
                .map(|(k, _)| k.clone())
                .collect();
            for key in before {
                if !probes.iter().any(|p| p.name == key.1) {
                    m.remove(&key);
                    self.metrics.probe_forgotten(unit, &key.1);
                    changed = true;
                }
            }
            for p in probes {
                let key = (unit.to_owned(), p.name.clone());
                let was = m.get(&key).map(|(_, r)| r.state);
                if was.is_some_and(|s| s != ProbeState::Unknown) || was.is_none() {
                    changed = true;
                }
                let mut t = Tracker::new(p.success_threshold, p.failure_threshold, now);
                t.detail = Some(detail.to_owned());
                m.insert(key, (runner, t.result(unit, module, &p.name)));
                self.metrics
                    .set_probe_state(unit, &p.name, ProbeState::Unknown);
            }
            changed
        });
    }

    /// Drop every probe of `unit` (stopped, or no longer declared).
    pub fn forget(&self, runner: u64, unit: &str) {
        self.tx.send_if_modified(|m| {
            let before = m.len();
            m.retain(|(u, p), (id, _)| {
                let go = u == unit && *id <= runner;
                if go {
                    self.metrics.probe_forgotten(unit, p);
                }
                !go
            });
            m.len() != before
        });
    }

    /// Keep one probe's result; notify only if its state changed.
    fn put(&self, runner: u64, result: ProbeResult, ok: bool, changed: bool) {
        self.tx.send_if_modified(|m| {
            let key = (result.unit.clone(), result.probe.clone());
            match m.get(&key) {
                Some((id, _)) if *id == runner => {
                    self.metrics.probe_checked(&result.unit, &result.probe, ok);
                    self.metrics
                        .set_probe_state(&result.unit, &result.probe, result.state);
                    m.insert(key, (runner, result));
                    changed
                }
                // Not this runner's (any more): leave it.
                _ => false,
            }
        });
    }
}

fn list(m: &HealthMap) -> Vec<ProbeResult> {
    m.values().map(|(_, r)| r.clone()).collect()
}

/// Turns probe state changes into `health` report bodies, at most one per
/// [`super::REPORT_MIN_INTERVAL`]. Cancel-safe, as [`super::Reporter`].
pub struct HealthReporter {
    rx: watch::Receiver<HealthMap>,
    pending: bool,
    last: Option<Instant>,
    /// The last list stated held a probe (so an empty one is worth stating once).
    stated_some: bool,
}

impl HealthReporter {
    /// Resolves when a report is due: a probe's state changed, or probes came
    /// or went, since the last [`HealthReporter::take`], and the last one is
    /// at least the interval old.
    pub async fn due(&mut self) {
        if !self.pending {
            if self.rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
            self.pending = true;
        }
        if let Some(last) = self.last {
            sleep_until(last + super::REPORT_MIN_INTERVAL).await;
        }
    }

    /// Whether a change is waiting to be stated.
    pub fn changed(&self) -> bool {
        self.pending || self.rx.has_changed().unwrap_or(false)
    }

    /// Whether any probe runs (or is listed) now.
    pub fn any(&self) -> bool {
        !self.rx.borrow().is_empty()
    }

    /// The whole list, now, if it is worth stating: it holds a probe, or it is
    /// the first empty one after a list that held some. Marks everything up
    /// to now stated.
    pub fn take(&mut self) -> Option<Vec<ProbeResult>> {
        self.pending = false;
        self.last = Some(Instant::now());
        let results = list(&self.rx.borrow_and_update());
        if results.is_empty() && !self.stated_some {
            return None;
        }
        self.stated_some = !results.is_empty();
        Some(results)
    }
}

/// What one probe checks, owned, with what an `exec` check runs in.
#[derive(Debug, Clone)]
pub enum Check {
    Http(HttpCheck),
    Tcp(TcpCheck),
    Exec {
        check: ExecCheck,
        env: BTreeMap<String, String>,
        dir: PathBuf,
        user: Option<(u32, u32)>,
    },
}

/// What an `exec` probe runs in: the unit's environment and working dir.
#[derive(Debug, Clone, Default)]
pub struct ExecContext {
    pub env: BTreeMap<String, String>,
    pub dir: PathBuf,
    /// The unit's (uid, gid), when it runs as its module's user: its probes
    /// do too.
    pub user: Option<(u32, u32)>,
}

impl Check {
    /// None for a probe without exactly one check (validation refuses those).
    pub fn of(probe: &Probe, ctx: &ExecContext) -> Option<Check> {
        Some(match probe.check()? {
            ProbeCheck::Http(h) => Check::Http(h.clone()),
            ProbeCheck::Tcp(t) => Check::Tcp(t.clone()),
            ProbeCheck::Exec(e) => Check::Exec {
                check: e.clone(),
                env: ctx.env.clone(),
                dir: ctx.dir.clone(),
                user: ctx.user,
            },
        })
    }

    /// Run the check once, within `timeout`: Ok or Err, each with a detail.
    pub async fn run(&self, timeout: Duration) -> Result<String, String> {
        let timed_out = || format!("timed out after {}", secs(timeout));
        match self {
            Check::Http(h) => tokio::time::timeout(timeout, http(h))
                .await
                .unwrap_or_else(|_| Err(timed_out())),
            Check::Tcp(t) => tokio::time::timeout(timeout, tcp(t))
                .await
                .unwrap_or_else(|_| Err(timed_out())),
            Check::Exec {
                check,
                env,
                dir,
                user,
            } => exec(check, env, dir, *user, timeout).await,
        }
    }
}

/// `2 s`, `1.5 s`.
fn secs(d: Duration) -> String {
    if d.subsec_millis() == 0 {
        format!("{} s", d.as_secs())
    } else {
        format!("{:.1} s", d.as_secs_f64())
    }
}

/// An I/O error in a few words.
fn io_detail(e: &std::io::Error) -> String {
    use std::io::ErrorKind::*;
    match e.kind() {
        ConnectionRefused => "connection refused".into(),
        ConnectionReset => "connection reset".into(),
        ConnectionAborted => "connection aborted".into(),
        TimedOut => "timed out".into(),
        NotFound => "not found".into(),
        PermissionDenied => "permission denied".into(),
        UnexpectedEof => "connection closed before an answer".into(),
        _ => e.to_string(),
    }
}

async fn connect(host: &str, port: u16) -> Result<tokio::net::TcpStream, String> {
    tokio::net::TcpStream::connect((host, port))
        .await
        .map_err(|e| io_detail(&e))
}

async fn tcp(t: &TcpCheck) -> Result<String, String> {
    connect(&t.host, t.port).await.map(|_| "connected".into())
}

async fn http(h: &HttpCheck) -> Result<String, String> {
    let mut s = connect(&h.host, h.port).await?;
    let host = if h.host.contains(':') {
        format!("[{}]:{}", h.host, h.port)
    } else {
        format!("{}:{}", h.host, h.port)
    };
    let request = format!(
        "GET {} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: mesh-agent/{}\r\nAccept: */*\r\nConnection: close\r\n\r\n",
        h.path,
        crate::AGENT_VERSION
    );
    s.write_all(request.as_bytes())
        .await
        .map_err(|e| io_detail(&e))?;
    let mut buf = Vec::with_capacity(256);
    let mut chunk = [0u8; 1024];
    let line = loop {
        if let Some(end) = buf.iter().position(|b| *b == b'\n') {
            let line = &buf[..end];
            break line.strip_suffix(b"\r").unwrap_or(line).to_vec();
        }
        if buf.len() > MAX_STATUS_LINE {
            return Err("HTTP status line too long".into());
        }
        let n = s.read(&mut chunk).await.map_err(|e| io_detail(&e))?;
        if n == 0 {
            if buf.is_empty() {
                return Err("connection closed before an answer".into());
            }
            break buf;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let status = parse_status_line(&line).ok_or_else(|| "not an HTTP answer".to_owned())?;
    if status == h.expect_status {
        Ok(format!("HTTP {status}"))
    } else if h.expect_status == 200 {
        Err(format!("HTTP {status}"))
    } else {
        Err(format!("HTTP {status}, expected {}", h.expect_status))
    }
}

/// The status code of `HTTP/1.x NNN reason`.
fn parse_status_line(line: &[u8]) -> Option<u16> {
    let line = std::str::from_utf8(line).ok()?;
    let mut parts = line.split(' ');
    let version = parts.next()?;
    if !version.starts_with("HTTP/") {
        return None;
    }
    let code = parts.next()?;
    if code.len() != 3 {
        return None;
    }
    code.parse().ok().filter(|c| (100..=599).contains(c))
}

async fn exec(
    e: &ExecCheck,
    env: &BTreeMap<String, String>,
    dir: &std::path::Path,
    user: Option<(u32, u32)>,
    timeout: Duration,
) -> Result<String, String> {
    let mut cmd = tokio::process::Command::new(&e.command);
    if let Some((uid, gid)) = user {
        cmd.uid(uid).gid(gid);
    }
    let mut child = cmd
        .args(&e.args)
        .env_clear()
        .envs(env)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .map_err(|err| format!("cannot run {}: {}", e.command, io_detail(&err)))?;
    // Until the command is reaped its pid stays its group's id: a check
    // dropped half-way (its unit stopped) kills the whole group.
    let mut group = GroupGuard(child.id());
    match tokio::time::timeout(timeout, child.wait()).await {
        Ok(Ok(status)) => {
            group.0 = None;
            match (
                status.code(),
                std::os::unix::process::ExitStatusExt::signal(&status),
            ) {
                (Some(0), _) => Ok("exit status 0".into()),
                (Some(c), _) => Err(format!("exit status {c}")),
                (None, Some(sig)) => Err(format!("killed by signal {sig}")),
                (None, None) => Err("ended without a status".into()),
            }
        }
        Ok(Err(err)) => Err(io_detail(&err)),
        Err(_) => {
            drop(group);
            let _ = child.start_kill();
            let _ = child.wait().await;
            Err(format!("timed out after {}", secs(timeout)))
        }
    }
}

/// Kills the process group it names when dropped (none: nothing to kill).
struct GroupGuard(Option<u32>);

impl Drop for GroupGuard {
    fn drop(&mut self) {
        if let Some(pid) = self.0.take() {
            let _ = super::process::signal_group(pid, Signal::KILL);
        }
    }
}

/// The probe tasks of one running unit process; they end when it is dropped.
pub struct ProbeSet {
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for ProbeSet {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// One unit's identity as its probes state it.
#[derive(Debug, Clone)]
pub struct UnitRef {
    pub runner: u64,
    pub unit: String,
    pub module: String,
}

impl ProbeSet {
    /// Start `probes` of a unit whose process started at `started`: each
    /// `unknown` until its thresholds decide.
    pub fn start(
        board: &HealthBoard,
        unit: &UnitRef,
        probes: &[Probe],
        started: Instant,
        ctx: &ExecContext,
    ) -> ProbeSet {
        board.reset(
            unit.runner,
            &unit.unit,
            &unit.module,
            probes,
            "not checked yet",
        );
        let tasks = probes
            .iter()
            .filter_map(|p| {
                let check = Check::of(p, ctx)?;
                Some(tokio::spawn(run_probe(
                    board.clone(),
                    unit.clone(),
                    p.clone(),
                    check,
                    started,
                )))
            })
            .collect();
        ProbeSet { tasks }
    }
}

async fn run_probe(
    board: HealthBoard,
    unit: UnitRef,
    probe: Probe,
    check: Check,
    started: Instant,
) {
    let interval = Duration::from_secs(u64::from(probe.interval_secs.max(1)));
    let timeout = Duration::from_secs(u64::from(probe.timeout_secs.max(1)));
    let mut tracker = Tracker::new(probe.success_threshold, probe.failure_threshold, Utc::now());
    let mut next = started + Duration::from_secs(u64::from(probe.initial_delay_secs));
    loop {
        sleep_until(next).await;
        let began = Instant::now();
        let (ok, detail) = match check.run(timeout).await {
            Ok(d) => (true, d),
            Err(d) => (false, d),
        };
        let changed = tracker.record(ok, detail, Utc::now());
        if changed {
            tracing::info!(
                unit = %unit.unit,
                probe = %probe.name,
                state = tracker.state.as_str(),
                detail = tracker.detail.as_deref().unwrap_or(""),
                "probe state changed"
            );
        }
        board.put(
            unit.runner,
            tracker.result(&unit.unit, &unit.module, &probe.name),
            ok,
            changed,
        );
        next = (began + interval).max(Instant::now());
    }
}

fn truncate(s: &str, max_chars: usize) -> String {
    if s.chars().count() <= max_chars {
        s.to_owned()
    } else {
        s.chars()
            .take(max_chars.saturating_sub(1))
            .collect::<String>()
            + "…"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t0() -> DateTime<Utc> {
        DateTime::from_timestamp(1_700_000_000, 0).unwrap()
    }

    #[test]
    fn unknown_until_a_threshold_is_met() {
        let mut t = Tracker::new(2, 3, t0());
        assert_eq!(t.state, ProbeState::Unknown);
        assert!(!t.record(true, "HTTP 200".into(), t0()));
        assert_eq!(t.state, ProbeState::Unknown);
        // A failure in between starts the successes over.
        assert!(!t.record(false, "HTTP 503".into(), t0()));
        assert!(!t.record(true, "HTTP 200".into(), t0()));
        assert_eq!(t.state, ProbeState::Unknown);
        let later = t0() + chrono::Duration::seconds(5);
        assert!(t.record(true, "HTTP 200".into(), later));
        assert_eq!(t.state, ProbeState::Healthy);
        assert_eq!(t.since, later);
        assert_eq!(t.failures, 0);
    }

    #[test]
    fn healthy_turns_unhealthy_after_failure_threshold_failures_in_a_row() {
        let mut t = Tracker::new(1, 3, t0());
        assert!(t.record(true, "ok".into(), t0()));
        assert!(!t.record(false, "HTTP 503".into(), t0()));
        assert!(!t.record(false, "HTTP 503".into(), t0()));
        assert_eq!((t.state, t.failures), (ProbeState::Healthy, 2));
        // A success resets the count.
        assert!(!t.record(true, "ok".into(), t0()));
        assert_eq!(t.failures, 0);
        assert!(!t.record(false, "HTTP 503".into(), t0()));
        assert!(!t.record(false, "HTTP 503".into(), t0()));
        assert!(t.record(false, "HTTP 503".into(), t0()));
        assert_eq!((t.state, t.failures), (ProbeState::Unhealthy, 3));
        assert_eq!(t.detail.as_deref(), Some("HTTP 503"));
        // Staying unhealthy is no change.
        assert!(!t.record(false, "HTTP 503".into(), t0()));
        assert_eq!(t.failures, 4);
        // And back.
        assert!(t.record(true, "ok".into(), t0()));
        assert_eq!(t.state, ProbeState::Healthy);
    }

    #[test]
    fn thresholds_of_one_and_zero() {
        let mut t = Tracker::new(0, 0, t0());
        assert!(t.record(false, "x".into(), t0()));
        assert_eq!(t.state, ProbeState::Unhealthy);
        assert!(t.record(true, "y".into(), t0()));
        assert_eq!(t.state, ProbeState::Healthy);
    }

    #[test]
    fn details_are_capped() {
        let mut t = Tracker::new(1, 1, t0());
        t.record(false, "é".repeat(MAX_PROBE_DETAIL * 2), t0());
        assert_eq!(
            t.detail.as_ref().map(|d| d.chars().count()),
            Some(MAX_PROBE_DETAIL)
        );
        let r = t.result("web-0", "web", "ready");
        assert_eq!(
            (r.unit.as_str(), r.probe.as_str(), r.state),
            ("web-0", "ready", ProbeState::Unhealthy)
        );
    }

    #[test]
    fn status_lines() {
        assert_eq!(parse_status_line(b"HTTP/1.1 200 OK"), Some(200));
        assert_eq!(parse_status_line(b"HTTP/1.0 503"), Some(503));
        assert_eq!(parse_status_line(b"HTTP/1.1 99 x"), None);
        assert_eq!(parse_status_line(b"SSH-2.0-OpenSSH"), None);
        assert_eq!(parse_status_line(b"HTTP/1.1 2000 x"), None);
        assert_eq!(secs(Duration::from_secs(2)), "2 s");
        assert_eq!(secs(Duration::from_millis(1500)), "1.5 s");
    }

    #[tokio::test]
    async fn checks_against_real_sockets_and_processes() {
        // TCP: a listener, then nothing.
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        let tcp = Check::Tcp(TcpCheck {
            host: "127.0.0.1".into(),
            port,
        });
        assert_eq!(
            tcp.run(Duration::from_secs(2)).await,
            Ok("connected".into())
        );
        drop(l);
        assert_eq!(
            tcp.run(Duration::from_secs(2)).await,
            Err("connection refused".into())
        );

        // HTTP: a one-answer server.
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        let server = tokio::spawn(async move {
            for answer in [
                "HTTP/1.1 503 Service Unavailable\r\n\r\n",
                "HTTP/1.1 200 OK\r\n",
            ] {
                let (mut s, _) = l.accept().await.unwrap();
                let mut req = vec![0u8; 1024];
                let n = s.read(&mut req).await.unwrap();
                assert!(req[..n].starts_with(b"GET /healthz HTTP/1.1\r\n"));
                s.write_all(answer.as_bytes()).await.unwrap();
            }
            // Then one that never answers.
            let (_s, _) = l.accept().await.unwrap();
            tokio::time::sleep(Duration::from_secs(5)).await;
        });
        let http = Check::Http(HttpCheck {
            host: "127.0.0.1".into(),
            port,
            path: "/healthz".into(),
            expect_status: 200,
        });
        assert_eq!(
            http.run(Duration::from_secs(2)).await,
            Err("HTTP 503".into())
        );
        assert_eq!(
            http.run(Duration::from_secs(2)).await,
            Ok("HTTP 200".into())
        );
        assert_eq!(
            http.run(Duration::from_secs(1)).await,
            Err("timed out after 1 s".into())
        );
        server.abort();

        // exec: exit status, and a kill at the timeout.
        let ctx = ExecContext {
            env: [("PATH".to_owned(), "/usr/bin:/bin".to_owned())].into(),
            dir: PathBuf::from("/"),
            user: None,
        };
        let exec = |script: &str| {
            Check::of(
                &serde_json::from_value::<Probe>(serde_json::json!({
                    "name": "x",
                    "exec": {"command": "/bin/sh", "args": ["-c", script]}
                }))
                .unwrap(),
                &ctx,
            )
            .unwrap()
        };
        assert_eq!(
            exec("exit 0").run(Duration::from_secs(2)).await,
            Ok("exit status 0".into())
        );
        assert_eq!(
            exec("exit 1").run(Duration::from_secs(2)).await,
            Err("exit status 1".into())
        );
        // At the timeout the whole group goes: the shell and its child.
        let pidfile = tempfile::NamedTempFile::new().unwrap();
        let script = format!("sleep 30 & echo $! > {}; wait", pidfile.path().display());
        let began = Instant::now();
        assert_eq!(
            exec(&script).run(Duration::from_secs(1)).await,
            Err("timed out after 1 s".into())
        );
        assert!(began.elapsed() < Duration::from_secs(5));
        let child: u32 = std::fs::read_to_string(pidfile.path())
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let until = Instant::now() + Duration::from_secs(5);
        while std::fs::read_to_string(format!("/proc/{child}/stat"))
            .is_ok_and(|s| !s.contains(") Z"))
        {
            assert!(
                Instant::now() < until,
                "the command's child outlived its timeout"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let missing = Check::Exec {
            check: ExecCheck {
                command: "/nonexistent/probe".into(),
                args: vec![],
            },
            env: BTreeMap::new(),
            dir: PathBuf::from("/"),
            user: None,
        };
        assert_eq!(
            missing.run(Duration::from_secs(1)).await,
            Err("cannot run /nonexistent/probe: not found".into())
        );
    }
}
