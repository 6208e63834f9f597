//! End-to-end harness: a whole mesh on this machine — the real `mesh-controller`
//! and `mesh-agent` binaries as child processes, against the real broker and
//! database, isolated per test by the bundle's test kit (own database, roles,
//! vhost and users), so tests run in parallel and leave nothing behind.
//!
//! The binaries are taken from the target directory the tests were built in;
//! build them first (`cargo build --workspace --bins`, which `bundle/test` does).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, anyhow, bail};
use mesh_testkit::{NodeCredentials, TestEnv};
use serde_json::Value;

pub mod netns;
pub mod sim;

/// `meshctl` isolated from the test's own environment: no `MESH_*`
/// variable and no config file of the user running the tests.
pub fn meshctl_command() -> anyhow::Result<Command> {
    let mut cmd = Command::new(bin("meshctl")?);
    for var in [
        "MESH_API",
        "MESH_TOKEN",
        "MESH_TOKEN_FILE",
        "MESH_CA",
        "MESH_CONFIG",
    ] {
        cmd.env_remove(var);
    }
    cmd.env("HOME", "/nonexistent")
        .env_remove("XDG_CONFIG_HOME");
    Ok(cmd)
}

/// A finished command's (exit code, stdout, stderr).
pub fn output(cmd: &mut Command) -> anyhow::Result<(i32, String, String)> {
    let out = cmd.output()?;
    Ok((
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

/// `meshctl args` against `api` with `token`: (exit code, stdout, stderr).
pub fn meshctl_at(api: &str, token: &str, args: &[&str]) -> anyhow::Result<(i32, String, String)> {
    output(
        meshctl_command()?
            .args(args)
            .env("MESH_API", api)
            .env("MESH_TOKEN", token),
    )
}

/// Path of a workspace binary next to the test executable's directory.
pub fn bin(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    // A binary run from target/<profile>/ (the benchmark): its siblings.
    if let Some(sibling) = exe.parent().map(|d| d.join(name))
        && sibling.exists()
    {
        return Ok(sibling);
    }
    // target/<profile>/deps/<test> → target/<profile>/<name>
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .ok_or_else(|| anyhow!("no target dir above {exe:?}"))?;
    let path = dir.join(name);
    if !path.exists() {
        bail!(
            "{path:?} is missing: run `cargo build --workspace --bins` before the tests (bundle/test does)"
        );
    }
    Ok(path)
}

/// Wait until `check` returns Some, or fail after `within`, naming `what`.
pub async fn wait_for<T, F, Fut>(what: &str, within: Duration, mut check: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<Option<T>>>,
{
    let deadline = Instant::now() + within;
    let mut last_err = None;
    loop {
        match check().await {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last_err = Some(e),
        }
        if Instant::now() >= deadline {
            return Err(anyhow!(
                "timed out after {within:?} waiting for {what} (last error: {last_err:?})"
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// A child process killed when dropped.
pub struct Proc(Child);

impl Proc {
    /// Spawn `cmd`; the process is killed when the handle is dropped.
    pub fn spawn(cmd: &mut Command) -> anyhow::Result<Proc> {
        Ok(Proc(
            cmd.spawn().with_context(|| format!("spawning {cmd:?}"))?,
        ))
    }

    pub fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }

    /// Ask the process to stop (SIGTERM), wait up to `within` for it, then
    /// SIGKILL. An agent leaves its units running either way (the next agent
    /// adopts them); [`drain_units`] stops them.
    pub fn terminate(&mut self, within: Duration) {
        if let Ok(None) = self.0.try_wait() {
            let _ = Command::new("kill")
                .args(["-TERM", &self.0.id().to_string()])
                .status();
            let deadline = Instant::now() + within;
            while Instant::now() < deadline {
                if matches!(self.0.try_wait(), Ok(Some(_))) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        self.kill();
    }

    pub fn pid(&self) -> u32 {
        self.0.id()
    }

    /// Wait for the process to exit by itself, up to `within`.
    pub async fn wait_exit(
        &mut self,
        within: Duration,
    ) -> anyhow::Result<std::process::ExitStatus> {
        wait_for("the process to exit", within, || {
            let status = self.0.try_wait();
            async move { Ok(status?) }
        })
        .await
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `mesh-agent drain-local`: stop every unit an agent left in `state_dir`.
pub fn drain_units(state_dir: &Path) {
    if let Ok(bin) = bin("mesh-agent") {
        let _ = Command::new(bin)
            .args(["drain-local", "--stop-timeout", "5s", "--state-dir"])
            .arg(state_dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// An agent's units outlive their agent (decision 0016); stop the agent, then
/// its units, even when a test fails half-way.
impl Drop for AgentHandle {
    fn drop(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.terminate(Duration::from_secs(5));
        }
        drain_units(&self.state_dir);
    }
}

/// How many lines of each process's log a failed test prints.
const LOG_TAIL_LINES: usize = 150;

/// A failed test prints the tail of every process log the harness kept in
/// the mesh's directory (the controller's, each agent's, each join's), since
/// the directory goes with it. A test failed when it panicked or when its
/// mesh is dropped without [`Mesh::teardown`] (it returned an error).
struct LogsOnFailure {
    dir: PathBuf,
    torn_down: bool,
}

impl LogsOnFailure {
    fn controller_log(&self) -> PathBuf {
        self.dir.join("controller.log")
    }
}

impl Drop for LogsOnFailure {
    fn drop(&mut self) {
        if self.torn_down && !std::thread::panicking() {
            return;
        }
        print_logs(&self.dir, LOG_TAIL_LINES);
    }
}

/// Print the last `tail` lines of every `*.log` in `dir` to stderr (the
/// test's output), the controller's first.
pub fn print_logs(dir: &Path, tail: usize) {
    let mut logs: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "log"))
                .collect()
        })
        .unwrap_or_default();
    logs.sort_by_key(|p| (p.file_stem().is_none_or(|s| s != "controller"), p.clone()));
    for path in logs {
        let name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let log = std::fs::read_to_string(&path).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        let from = lines.len().saturating_sub(tail);
        eprintln!(
            "--- {name}.log, last {} of {} lines ---\n{}\n--- end of {name}.log ---",
            lines.len() - from,
            lines.len(),
            lines[from..].join("\n")
        );
    }
}

/// One agent of the mesh: its credentials, state dir and file root.
pub struct AgentHandle {
    pub creds: NodeCredentials,
    pub state_dir: PathBuf,
    pub root: PathBuf,
    pub labels: BTreeMap<String, String>,
    proc: Option<Proc>,
}

impl AgentHandle {
    pub fn node(&self) -> &str {
        self.creds.node.as_str()
    }

    /// The agent's process id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.proc.as_ref().map(Proc::pid)
    }

    /// The path under this agent's root where a declared absolute path lands.
    pub fn file(&self, declared: &str) -> PathBuf {
        self.root.join(declared.trim_start_matches('/'))
    }
}

/// What every harness agent's config ends with unless its test configures
/// the overlay itself: off the overlay and without a packet filter, so
/// agents sharing the test host never fight over `mesh0` or `inet mesh`.
pub const AGENT_OFF_THE_OVERLAY: &str =
    "\n[overlay]\nenabled = false\n\n[firewall]\nenabled = false\n";

/// Liveness settings of the test controller: agents beat every second (the
/// harness starts them with `--heartbeat-interval 1`), a node is unreachable after
/// [`GRACE`], the sweeper runs four times a second and last_seen is written from
/// memory four times a second (production: every 5 s), so failure tests take
/// seconds.
pub const FLEET_SETTINGS: &str = "heartbeat_interval_ms = 1000\ngrace_intervals = 3\nsweep_interval_ms = 250\nliveness_write_ms = 250\n";

/// The harness's agents state their labels (`--label role=web`) and are
/// selected by them, so the harness's controller trusts those keys, as a
/// fleet may opt in to (issue 29; the default trusts none:
/// `e2e/tests/security.rs` runs a controller without this line).
pub const HARNESS_TRUST: &str = "trusted_stated_labels = [\"role\", \"zone\", \"tier\"]\n";

/// The grace those settings give.
pub const GRACE: Duration = Duration::from_secs(3);

pub struct Mesh {
    pub env: TestEnv,
    /// Declared before `dir`: a failed test's agents stop, and their units
    /// with them (`drain-local` reads the state dir), before the directory
    /// is removed; else the units outlive the test.
    pub agents: BTreeMap<String, AgentHandle>,
    /// Declared before `dir`: it reads the logs before the directory is
    /// removed.
    logs_on_failure: LogsOnFailure,
    pub dir: tempfile::TempDir,
    pub api: String,
    api_port: u16,
    controller: Option<Proc>,
    /// Agent settings (TOML) every agent started from now on reads with
    /// `--config` (flags still override them). Default: none.
    pub agent_toml: Option<String>,
    http: reqwest::Client,
}

impl Mesh {
    /// A fresh isolated environment with a running controller.
    pub async fn start() -> anyhow::Result<Mesh> {
        let mut mesh = Mesh::prepare().await?;
        mesh.start_controller(&[]).await?;
        Ok(mesh)
    }

    /// A fresh isolated environment and the controller's files, no controller
    /// running yet (start it with [`Mesh::start_controller`]).
    pub async fn prepare() -> anyhow::Result<Mesh> {
        Mesh::prepare_on(TestEnv::new().await?)
    }

    /// [`Mesh::prepare`] on an environment of the test's own (another
    /// broker: [`TestEnv::on_broker`]).
    pub fn prepare_on(env: TestEnv) -> anyhow::Result<Mesh> {
        let dir = tempfile::tempdir()?;
        // Units run as their modules' users (decision 0051): they pass through
        // to their agent's root, as they would through `/`.
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
        }
        env.write_controller_credentials(&dir.path().join("credentials.toml"))?;
        let api_port = free_port()?;
        std::fs::write(
            dir.path().join("controller.toml"),
            format!(
                "credentials = {:?}\napi_listen = \"127.0.0.1:{api_port}\"\nresend_after_secs = 2\nrelay_poll_ms = 200\nshutdown_deadline_secs = 3\nevaluate_ms = 500\nbroker_stats_secs = 1\n{FLEET_SETTINGS}{HARNESS_TRUST}",
                dir.path().join("credentials.toml")
            ),
        )?;
        Ok(Mesh {
            env,
            logs_on_failure: LogsOnFailure {
                dir: dir.path().to_owned(),
                torn_down: false,
            },
            dir,
            api: format!("http://127.0.0.1:{api_port}"),
            api_port,
            controller: None,
            agents: BTreeMap::new(),
            agent_toml: None,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()?,
        })
    }

    pub fn api_port(&self) -> u16 {
        self.api_port
    }

    fn log(&self, name: &str) -> anyhow::Result<std::fs::File> {
        Ok(std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join(format!("{name}.log")))?)
    }

    /// Start the controller with extra environment variables and wait until its
    /// API answers and its broker session is up.
    pub async fn start_controller(&mut self, env: &[(&str, &str)]) -> anyhow::Result<()> {
        let mut cmd = Command::new(bin("mesh-controller")?);
        cmd.arg("--config")
            .arg(self.dir.path().join("controller.toml"))
            .arg("run")
            .env("RUST_LOG", "info,mesh_controller=debug")
            .stdin(Stdio::null())
            .stdout(self.log("controller")?)
            .stderr(self.log("controller")?);
        for (k, v) in env {
            cmd.env(k, v);
        }
        self.controller = Some(Proc(cmd.spawn().context("spawning mesh-controller")?));
        self.wait_healthy().await
    }

    pub async fn wait_healthy(&self) -> anyhow::Result<()> {
        wait_for(
            "the controller to be healthy",
            Duration::from_secs(60),
            || async {
                match self.http.get(format!("{}/healthz", self.api)).send().await {
                    Ok(r) if r.status().is_success() => Ok(Some(())),
                    Ok(r) => Err(anyhow!("healthz {}", r.status())),
                    Err(e) => Err(e.into()),
                }
            },
        )
        .await
    }

    pub fn controller(&mut self) -> Option<&mut Proc> {
        self.controller.as_mut()
    }

    pub fn kill_controller(&mut self) {
        if let Some(mut p) = self.controller.take() {
            p.kill();
        }
    }

    /// Take the controller process handle (e.g. to wait for a failpoint exit).
    pub fn take_controller(&mut self) -> Option<Proc> {
        self.controller.take()
    }

    /// Enrol a node (broker user) and start its agent with `labels`.
    pub async fn add_agent(
        &mut self,
        suffix: &str,
        labels: &[(&str, &str)],
    ) -> anyhow::Result<String> {
        let creds = self.env.add_node(suffix).await?;
        let node = creds.node.as_str().to_owned();
        let state_dir = self.dir.path().join(format!("agent-{suffix}/state"));
        let root = self.dir.path().join(format!("agent-{suffix}/root"));
        std::fs::create_dir_all(&state_dir)?;
        std::fs::create_dir_all(&root)?;
        creds.write_to(&state_dir)?;
        let labels = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        self.agents.insert(
            node.clone(),
            AgentHandle {
                creds,
                state_dir,
                root,
                labels,
                proc: None,
            },
        );
        self.start_agent(&node)?;
        Ok(node)
    }

    pub fn start_agent(&mut self, node: &str) -> anyhow::Result<()> {
        let log = self.log(&format!("agent-{node}"))?;
        let log2 = self.log(&format!("agent-{node}"))?;
        let agent = self
            .agents
            .get_mut(node)
            .ok_or_else(|| anyhow!("no agent {node}"))?;
        let mut cmd = Command::new(bin("mesh-agent")?);
        cmd.arg("run")
            .arg("--state-dir")
            .arg(&agent.state_dir)
            .arg("--root")
            .arg(&agent.root)
            .arg("--heartbeat-interval")
            .arg("1")
            .env("RUST_LOG", "info,mesh_host_agent=debug")
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2);
        for (k, v) in &agent.labels {
            cmd.arg("--label").arg(format!("{k}={v}"));
        }
        // Agents of the harness share this host: they join no overlay (no
        // WireGuard interface, no nftables table on the test machine) unless
        // a test's `agent_toml` has an `[overlay]` table of its own.
        let mut toml = self.agent_toml.clone().unwrap_or_default();
        if !toml.contains("[overlay]") {
            toml.push_str(AGENT_OFF_THE_OVERLAY);
        }
        let path = agent.state_dir.join("agent.toml");
        std::fs::write(&path, toml)?;
        cmd.arg("--config").arg(path);
        agent.proc = Some(Proc(cmd.spawn().context("spawning mesh-agent")?));
        Ok(())
    }

    pub fn stop_agent(&mut self, node: &str) {
        if let Some(mut p) = self.agents.get_mut(node).and_then(|a| a.proc.take()) {
            p.kill();
        }
    }

    pub fn agent(&self, node: &str) -> &AgentHandle {
        &self.agents[node]
    }

    /// The environment's first admin API token (the controller registers it at start).
    /// `meshctl args` against this mesh, as its admin: (exit code, stdout,
    /// stderr).
    pub fn meshctl(&self, args: &[&str]) -> anyhow::Result<(i32, String, String)> {
        meshctl_at(&self.api, self.admin_token(), args)
    }

    pub fn admin_token(&self) -> &str {
        self.env.admin_token()
    }

    /// A request with `token` as bearer (None: no Authorization header).
    pub async fn request_as(
        &self,
        method: reqwest::Method,
        path: &str,
        token: Option<&str>,
        body: Option<&Value>,
    ) -> anyhow::Result<(u16, Value)> {
        let mut req = self.http.request(method, format!("{}{path}", self.api));
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        if let Some(b) = body {
            req = req.json(b);
        }
        let r = req.send().await?;
        Ok((r.status().as_u16(), r.json().await.unwrap_or(Value::Null)))
    }

    /// GET as the admin.
    pub async fn get(&self, path: &str) -> anyhow::Result<(u16, Value)> {
        self.request_as(reqwest::Method::GET, path, Some(self.admin_token()), None)
            .await
    }

    /// PUT as the admin, creating or replacing whatever is there: `If-Match: *`
    /// first (replace), then, when there is nothing to replace (412), without
    /// a precondition (create). Tests of the preconditions themselves use
    /// [`Mesh::request`].
    pub async fn put(&self, path: &str, body: &Value) -> anyhow::Result<(u16, Value)> {
        let (status, _, answer) = self
            .request(reqwest::Method::PUT, path, &[("if-match", "*")], Some(body))
            .await?;
        if status != 412 {
            return Ok((status, answer));
        }
        self.request_as(
            reqwest::Method::PUT,
            path,
            Some(self.admin_token()),
            Some(body),
        )
        .await
    }

    /// POST a JSON body as the admin.
    pub async fn post_json(&self, path: &str, body: &Value) -> anyhow::Result<(u16, Value)> {
        self.request_as(
            reqwest::Method::POST,
            path,
            Some(self.admin_token()),
            Some(body),
        )
        .await
    }

    /// DELETE as the admin.
    pub async fn delete(&self, path: &str) -> anyhow::Result<u16> {
        Ok(self
            .request_as(
                reqwest::Method::DELETE,
                path,
                Some(self.admin_token()),
                None,
            )
            .await?
            .0)
    }

    /// Create an API token with `role` (as the admin); returns its secret.
    pub async fn create_token(&self, name: &str, role: &str) -> anyhow::Result<String> {
        let (status, body) = self
            .post_json(
                "/v1/tokens",
                &serde_json::json!({"name": name, "role": role}),
            )
            .await?;
        anyhow::ensure!(status == 201, "POST /v1/tokens: {status} {body}");
        body["token"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| anyhow!("no token in {body}"))
    }

    /// Enrol a node the real way: a join token from the API, then
    /// `mesh-agent join` (its output goes to `<dir>/join-<suffix>.log`). The
    /// agent is not started; returns the node id and its state dir.
    pub async fn join_node(&self, suffix: &str) -> anyhow::Result<(String, PathBuf)> {
        let node = format!("{}-{suffix}", self.env.id());
        let (status, body) = self
            .post_json(
                &format!("/v1/nodes/{node}/join-tokens"),
                &serde_json::json!({}),
            )
            .await?;
        anyhow::ensure!(status == 201, "join token: {status} {body}");
        let token = body["token"].as_str().ok_or_else(|| anyhow!("no token"))?;
        let state_dir = self.dir.path().join(format!("agent-{suffix}/state"));
        let out = self.run_join(&node, token, &state_dir, suffix).await?;
        anyhow::ensure!(out.success(), "mesh-agent join failed: {out}");
        Ok((node, state_dir))
    }

    /// Run `mesh-agent join` with RUST_LOG=debug, logging to `join-<log>.log`.
    pub async fn run_join(
        &self,
        node: &str,
        token: &str,
        state_dir: &Path,
        log: &str,
    ) -> anyhow::Result<std::process::ExitStatus> {
        let mut cmd = tokio::process::Command::new(bin("mesh-agent")?);
        cmd.arg("join")
            .arg("--api")
            .arg(&self.api)
            .arg("--node")
            .arg(node)
            .arg("--state-dir")
            .arg(state_dir)
            .env("MESH_JOIN_TOKEN", token)
            .env("RUST_LOG", "debug")
            .stdin(Stdio::null())
            .stdout(self.log(&format!("join-{log}"))?)
            .stderr(self.log(&format!("join-{log}"))?);
        Ok(cmd.status().await?)
    }

    /// Start an agent for a node enrolled with [`Mesh::join_node`].
    pub fn add_joined_agent(
        &mut self,
        node: &str,
        state_dir: PathBuf,
        labels: &[(&str, &str)],
    ) -> anyhow::Result<()> {
        let file = mesh_credentials::AgentCredentials::load(&state_dir)?;
        anyhow::ensure!(
            file.node.as_str() == node,
            "{} is node {}, not {node}",
            mesh_credentials::AgentCredentials::path_in(&state_dir).display(),
            file.node
        );
        let creds = NodeCredentials::from_agent(&file);
        let root = state_dir
            .parent()
            .ok_or_else(|| anyhow!("state dir has no parent"))?
            .join("root");
        std::fs::create_dir_all(&root)?;
        let labels = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        self.agents.insert(
            node.to_owned(),
            AgentHandle {
                creds,
                state_dir,
                root,
                labels,
                proc: None,
            },
        );
        self.start_agent(node)
    }

    /// The log of a process started by the harness (`controller`, `agent-<node>`,
    /// `join-<suffix>`).
    pub fn log_of(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("{name}.log"))).unwrap_or_default()
    }

    /// Any request with extra headers: (status, ETag, JSON body or null).
    pub async fn request(
        &self,
        method: reqwest::Method,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<&Value>,
    ) -> anyhow::Result<(u16, Option<String>, Value)> {
        let mut r = self.http.request(method, format!("{}{path}", self.api));
        // As the admin, unless the caller brings its own Authorization.
        if !headers
            .iter()
            .any(|(k, _)| k.eq_ignore_ascii_case("authorization"))
        {
            r = r.bearer_auth(self.admin_token());
        }
        for (k, v) in headers {
            r = r.header(*k, *v);
        }
        if let Some(body) = body {
            r = r.json(body);
        }
        let r = r.send().await?;
        let status = r.status().as_u16();
        let etag = r
            .headers()
            .get("etag")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        Ok((status, etag, r.json().await.unwrap_or(Value::Null)))
    }

    pub async fn post(&self, path: &str) -> anyhow::Result<(u16, Value)> {
        let (status, _, body) = self.request(reqwest::Method::POST, path, &[], None).await?;
        Ok((status, body))
    }

    /// The controller's log so far, for assertions and failure messages.
    pub fn controller_log(&self) -> String {
        std::fs::read_to_string(self.logs_on_failure.controller_log()).unwrap_or_default()
    }

    /// Stop every process and remove the environment.
    pub async fn teardown(mut self) -> anyhow::Result<()> {
        self.logs_on_failure.torn_down = true;
        for a in self.agents.values_mut() {
            if let Some(mut p) = a.proc.take() {
                p.terminate(Duration::from_secs(5));
            }
            // The units outlive their agent: stop them too.
            drain_units(&a.state_dir);
        }
        self.kill_controller();
        let Mesh { env, .. } = self;
        env.teardown().await
    }
}

/// Publish raw bytes to `reports` as a node would, over that node's own broker
/// connection. `user_id` is set to the node unless `with_user_id` is false.
pub async fn publish_as(
    creds: &NodeCredentials,
    routing_key: &str,
    payload: &[u8],
    with_user_id: bool,
) -> anyhow::Result<()> {
    use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
    let conn = lapin::Connection::connect(&creds.broker_url, Default::default()).await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let mut props = lapin::BasicProperties::default()
        .with_message_id(uuid::Uuid::now_v7().to_string().as_str().into())
        .with_content_type("application/json".into())
        .with_delivery_mode(2);
    if with_user_id {
        props = props.with_user_id(creds.node.as_str().into());
    }
    let confirm = ch
        .basic_publish(
            "reports".into(),
            routing_key.into(),
            BasicPublishOptions::default(),
            payload,
            props,
        )
        .await?
        .await?;
    anyhow::ensure!(
        confirm.is_ack(),
        "broker did not accept the publish: {confirm:?}"
    );
    let _ = conn.close(200, "done".into()).await;
    Ok(())
}

/// A hello body as an agent would send it.
pub fn hello(
    node: &str,
    labels: &[(&str, &str)],
) -> mesh_protocol::Envelope<mesh_protocol::Report> {
    let node = mesh_protocol::NodeId::parse(node).expect("test node ids are valid");
    mesh_protocol::Envelope::new(
        node,
        1,
        mesh_protocol::Report::Hello(mesh_protocol::Hello {
            hostname: "test-host".into(),
            arch: "x86_64".into(),
            cpus: 2,
            memory_bytes: 1 << 30,
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            agent_version: "test".into(),
            public_key: None,
            seal_key: None,
            overlay: None,
            applied: Default::default(),
            protocol: None,
            outage: None,
            metrics: None,
        }),
    )
}

/// Take every message now in the dead-letter queue: (reason code, reason, origin user).
pub async fn drain_dead_letters(
    amqp_url: &str,
) -> anyhow::Result<Vec<(String, String, Option<String>)>> {
    use lapin::options::{BasicAckOptions, BasicGetOptions};
    use lapin::types::AMQPValue;
    let conn = lapin::Connection::connect(amqp_url, Default::default()).await?;
    let ch = conn.create_channel().await?;
    let mut out = Vec::new();
    while let Some(msg) = ch
        .basic_get("dead-letter".into(), BasicGetOptions::default())
        .await?
    {
        let headers = msg
            .delivery
            .properties
            .headers()
            .clone()
            .unwrap_or_default();
        let text = |k: &str| match headers.inner().get(k) {
            Some(AMQPValue::LongString(s)) => Some(s.to_string()),
            _ => None,
        };
        out.push((
            text("x-mesh-reason-code").unwrap_or_default(),
            text("x-mesh-reason").unwrap_or_default(),
            text("x-mesh-origin-user"),
        ));
        msg.delivery.acker.ack(BasicAckOptions::default()).await?;
    }
    let _ = conn.close(200, "done".into()).await;
    Ok(out)
}

/// Count `inventory.node.joined` events the inventory context wrote for `node`,
/// reading its outbox as the inventory role.
pub async fn joined_events(mesh: &Mesh, node: &str) -> anyhow::Result<i64> {
    let pool = sqlx::PgPool::connect(&mesh.env.database_url("inventory")).await?;
    let n: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM inventory.outbox WHERE kind = 'node.joined' \
         AND convert_from(payload, 'UTF8')::jsonb -> 'body' ->> 'node' = $1",
    )
    .bind(node)
    .fetch_one(&pool)
    .await?;
    pool.close().await;
    Ok(n)
}
