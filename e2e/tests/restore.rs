//! The restore drill (issue 17, decision 0040), real controller, real agents:
//! a running mesh is backed up with `mesh-bundle backup`; its controller is
//! stopped, its database dropped, its key files removed and its broker state
//! (vhost, node users, the controller's users) deleted; `mesh-bundle restore`
//! puts it into a fresh PostgreSQL cluster of this test's own (initdb, another
//! port) and back onto the broker; the controller starts there. Every node,
//! module, file, secret, certificate, secret grant, resource grant (a
//! database module `pg` provides from a server of its own to module
//! `ledger`) and audit entry is back, the secret still opens, the grant's
//! credential is unchanged, no unit restarted, no node was judged
//! unreachable, a file declared afterwards reaches both nodes, and a node
//! that asks again for its certificate gets a new one from the restored CA
//! and installs it. The restored copy refers to nothing it lacks (references
//! across the contexts' schemas, read as the superuser). Each step's time is
//! printed.
//!
//! A second test backs up while files keep being declared and heartbeats
//! stream: the restored database is one moment (every file a config section
//! declares is in the files table with that content, no generation is
//! recorded as applied that was not declared, and every other reference
//! across the contexts holds).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use mesh_bundle::provision::{self, Rabbit};
use mesh_credentials::AdminCredentials;
use mesh_e2e::sim::request_certificate;
use mesh_e2e::{GRACE, Mesh, bin, output, wait_for};
use serde_json::{Value, json};

const WITHIN: Duration = Duration::from_secs(60);
const PLAIN: &str = "dr1ll-secret-value-never-in-clear";
/// The drill's certificate lifetime.
const CERT_LIFETIME_SECS: i64 = 300;
/// connectivity's floor between two certificates of one node and name: a
/// tenth of the lifetime when shorter than a minute (certs.rs, MIN_REISSUE).
const REISSUE_FLOOR_SECS: i64 = CERT_LIFETIME_SECS / 10;

/// A throwaway PostgreSQL cluster (initdb, pg_ctl, as user postgres, in a
/// temporary directory, on a free port): the "new host"'s database server.
/// Stopped and removed when dropped.
struct Cluster {
    bin: PathBuf,
    dir: tempfile::TempDir,
    port: u16,
}

fn run_as_postgres(program: &Path, args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("runuser")
        .args(["-u", "postgres", "--"])
        .arg(program)
        .args(args)
        .current_dir("/tmp")
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "{program:?} {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

impl Cluster {
    fn start() -> anyhow::Result<Cluster> {
        let bin = std::fs::read_dir("/usr/lib/postgresql")?
            .filter_map(|e| Some(e.ok()?.path().join("bin")))
            .filter(|b| b.join("initdb").exists())
            .max_by_key(|b| {
                b.parent()
                    .and_then(|v| v.file_name()?.to_str()?.parse::<u32>().ok())
                    .unwrap_or(0)
            })
            .ok_or_else(|| anyhow::anyhow!("no initdb under /usr/lib/postgresql/*/bin"))?;
        let dir = tempfile::Builder::new()
            .prefix("mesh-restore-pg-")
            .tempdir()?;
        let chown = Command::new("chown")
            .arg("postgres:postgres")
            .arg(dir.path())
            .status()?;
        anyhow::ensure!(chown.success(), "chown of {:?}", dir.path());
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let data = dir.path().join("data");
        let data = data.to_string_lossy().into_owned();
        run_as_postgres(
            &bin.join("initdb"),
            &["-D", &data, "-U", "postgres", "-A", "trust", "--no-sync"],
        )?;
        let options = format!(
            "-c port={port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={} \
             -c fsync=off -c shared_buffers=32MB -c max_connections=100",
            dir.path().display()
        );
        let log = dir.path().join("log");
        let cluster = Cluster { bin, dir, port };
        run_as_postgres(
            &cluster.bin.join("pg_ctl"),
            &[
                "-D",
                &data,
                "-o",
                &options,
                "-l",
                &log.to_string_lossy(),
                "-w",
                "-t",
                "60",
                "start",
            ],
        )?;
        Ok(cluster)
    }

    /// The cluster's superuser on `database`: reads every schema.
    fn superuser_url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// This host's administrator: the cluster's superuser, the same broker.
    fn admin(&self, broker: &AdminCredentials) -> AdminCredentials {
        let mut a = broker.clone();
        a.postgres_url = mesh_credentials::Secret::new(format!(
            "postgres://postgres@127.0.0.1:{}/postgres",
            self.port
        ));
        a
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let data = self.dir.path().join("data");
        let _ = Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(self.bin.join("pg_ctl"))
            .arg("-D")
            .arg(&data)
            .args(["-m", "immediate", "-w", "stop"])
            .current_dir("/tmp")
            .output();
    }
}

/// `mesh-bundle args`: its stdout; fails with its output when it fails.
fn mesh_bundle(args: &[&str]) -> anyhow::Result<String> {
    let (code, out, err) = output(
        Command::new(bin("mesh-bundle")?)
            .args(args)
            .env_remove("MESH_ETC")
            .env_remove("MESH_ADMIN_PG_PASSWORD")
            .env_remove("MESH_ADMIN_RABBITMQ_PASSWORD"),
    )?;
    anyhow::ensure!(code == 0, "mesh-bundle {args:?}: exit {code}\n{out}\n{err}");
    Ok(out)
}

fn s(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// The pid of the one process whose command line is exactly `argv`.
fn pid_of(argv: &[&str]) -> Option<u32> {
    let want: Vec<u8> = argv
        .iter()
        .flat_map(|a| [a.as_bytes(), b"\0"].concat())
        .collect();
    std::fs::read_dir("/proc").ok()?.find_map(|e| {
        let e = e.ok()?;
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
        (cmd == want).then_some(pid)
    })
}

async fn listing(mesh: &Mesh, path: &str, key: &str) -> anyhow::Result<Vec<Value>> {
    let (status, body) = mesh.get(path).await?;
    anyhow::ensure!(status == 200, "GET {path}: {status} {body}");
    Ok(body[key].as_array().cloned().unwrap_or_default())
}

/// What must come back, by name, with the fields that do not move.
async fn inventory_of(mesh: &Mesh) -> anyhow::Result<Value> {
    let (secret_grants, grants) = grants_of(mesh).await?;
    let pick = |v: &[Value], fields: &[&str]| -> Vec<Value> {
        let mut out: Vec<Value> = v
            .iter()
            .map(|x| {
                Value::Object(
                    fields
                        .iter()
                        .map(|f| (f.to_string(), x[*f].clone()))
                        .collect(),
                )
            })
            .collect();
        out.sort_by_key(|x| x.to_string());
        out
    };
    Ok(json!({
        "nodes": pick(&listing(mesh, "/v1/nodes", "nodes").await?, &["id", "labels"]),
        "modules": pick(&listing(mesh, "/v1/modules", "modules").await?, &["name", "spec", "revision"]),
        "files": pick(&listing(mesh, "/v1/files", "files").await?, &["name", "path", "content"]),
        "secrets": pick(&listing(mesh, "/v1/secrets", "secrets").await?, &["name", "version"]),
        "certificates": pick(
            &listing(mesh, "/v1/certificates", "certificates").await?,
            &["node", "name", "serial", "subject", "not_after"],
        ),
        "secret_grants": pick(
            &secret_grants,
            &["module", "secret", "file", "path", "revision", "created_at", "created_by"],
        ),
        // What each provider node last reported, without when it said so
        // (agents state their resources again on connect).
        "grants": pick(&grants, &[
            "id", "consumer", "requirement", "kind", "provider", "resource", "user", "options",
            "delete", "state", "reason", "credential_version", "credential_file",
            "consumer_nodes", "provider_nodes", "created_at", "revoked_at",
        ]),
    }))
}

/// What [`references_whole`] found, the checks that found nothing left out.
fn summary(counted: &[(String, usize)]) -> String {
    let total: usize = counted.iter().map(|(_, n)| n).sum();
    let found: Vec<String> = counted
        .iter()
        .filter(|(_, n)| *n > 0)
        .map(|(what, n)| format!("{n} × {what}"))
        .collect();
    format!(
        "restored copy: {total} references over {} checks, all present: {}",
        counted.len(),
        found.join("; ")
    )
}

/// Every secret's grants (`GET /v1/secrets/{name}`) and every resource grant
/// (`GET /v1/grants`), each provider node's report without its time.
async fn grants_of(mesh: &Mesh) -> anyhow::Result<(Vec<Value>, Vec<Value>)> {
    let mut secret_grants = Vec::new();
    for s in listing(mesh, "/v1/secrets", "secrets").await? {
        let name = s["name"].as_str().unwrap_or_default();
        let (status, body) = mesh.get(&format!("/v1/secrets/{name}")).await?;
        anyhow::ensure!(status == 200, "GET /v1/secrets/{name}: {status} {body}");
        secret_grants.extend(body["grants"].as_array().cloned().unwrap_or_default());
    }
    let (status, body) = mesh.get("/v1/grants?limit=500").await?;
    anyhow::ensure!(status == 200, "GET /v1/grants: {status} {body}");
    anyhow::ensure!(body["next"].is_null(), "more than a page of grants");
    let mut grants = body["grants"].as_array().cloned().unwrap_or_default();
    for g in &mut grants {
        if let Some(nodes) = g["provider_nodes"].as_array_mut() {
            for n in nodes {
                if let Some(n) = n.as_object_mut() {
                    n.remove("reported_at");
                }
            }
        }
    }
    Ok((secret_grants, grants))
}

/// References across the contexts' schemas that one moment keeps whole,
/// read in the restored database as its superuser (contexts never read each
/// other's tables; a test may). These tests add every node and module before
/// anything names them and delete none, so in any one moment each name below
/// is known where it is owned. Each check gives (reference, present).
fn reference_checks() -> Vec<(String, String)> {
    const SECTIONS: [&str; 5] = [
        "inventory",
        "config",
        "connectivity",
        "delivery",
        "provisioning",
    ];
    let node_in_inventory = "EXISTS (SELECT 1 FROM inventory.nodes n WHERE n.id = x.node)";
    let module_in_inventory = "EXISTS (SELECT 1 FROM inventory.modules m WHERE m.name = x.module)";
    let mut checks = Vec::new();
    for s in SECTIONS {
        checks.push((
            format!("a node {s} declares to is a node of inventory"),
            format!("SELECT x.node, {node_in_inventory} FROM {s}.sections x"),
        ));
        // An agent cannot have applied a generation not yet declared.
        checks.push((
            format!("the {s} generation inventory records as applied was declared by {s}"),
            format!(
                "SELECT x.node || ' applied ' || x.generation || ' of ' || COALESCE(d.generation, 0), \
                        x.generation <= COALESCE(d.generation, 0) \
                 FROM inventory.applied x LEFT JOIN {s}.sections d ON d.node = x.node \
                 WHERE x.section = '{s}'"
            ),
        ));
        // Units declared by any section: their module, revision, artifact.
        let units = format!("FROM {s}.sections d, jsonb_array_elements(d.items->'units') u");
        checks.push((
            format!("a unit {s} declares is of a module of inventory"),
            format!(
                "SELECT d.node || ' ' || (u->>'module'), \
                        EXISTS (SELECT 1 FROM inventory.modules m WHERE m.name = u->>'module') {units}"
            ),
        ));
        checks.push((
            format!("a unit {s} declares names a revision of delivery"),
            format!(
                "SELECT d.node || ' ' || (u->>'revision'), \
                        EXISTS (SELECT 1 FROM delivery.revisions r WHERE r.id::text = u->>'revision') \
                 {units} WHERE u->>'revision' IS NOT NULL"
            ),
        ));
        checks.push((
            format!("a unit {s} declares names an artifact of delivery"),
            format!(
                "SELECT d.node || ' ' || (u->>'artifact'), \
                        EXISTS (SELECT 1 FROM delivery.artifacts a WHERE a.digest = u->>'artifact') \
                 {units} WHERE u->>'artifact' IS NOT NULL"
            ),
        ));
    }
    let more: [(&str, String); 17] = [
        (
            "a file config declares is in config.files with that content",
            "SELECT d.node || ' ' || (f->>'path'), EXISTS (SELECT 1 FROM config.files c \
                 WHERE c.path = f->>'path' AND c.content = f->>'content' \
                   AND (c.node = d.node OR c.selector IS NOT NULL)) \
             FROM config.sections d, jsonb_array_elements(d.items->'files') f \
             WHERE f->>'path' LIKE '/drill/%'"
                .into(),
        ),
        (
            "a secret config declares is a version config keeps",
            "SELECT d.node || ' ' || (s->>'secret') || ' v' || (s->>'version'), \
                    EXISTS (SELECT 1 FROM config.secret_versions v \
                            WHERE v.secret = s->>'secret' AND v.version = (s->>'version')::bigint) \
             FROM config.sections d, jsonb_array_elements(d.items->'secrets') s"
                .into(),
        ),
        (
            "a certificate connectivity declares is one it issued",
            "SELECT d.node || ' ' || (c->>'name') || ' ' || (c->>'serial'), \
                    EXISTS (SELECT 1 FROM connectivity.certificates k \
                            WHERE k.serial = c->>'serial' AND k.node = d.node) \
             FROM connectivity.sections d, jsonb_array_elements(d.items->'certificates') c"
                .into(),
        ),
        (
            "an artifact delivery declares is one it holds",
            "SELECT d.node || ' ' || (a->>'digest'), \
                    EXISTS (SELECT 1 FROM delivery.artifacts x WHERE x.digest = a->>'digest') \
             FROM delivery.sections d, jsonb_array_elements(d.items->'artifacts') a"
                .into(),
        ),
        (
            "a resource provisioning declares is of one of its grants",
            "SELECT d.node || ' ' || (r->>'grant'), \
                    EXISTS (SELECT 1 FROM provisioning.grants g WHERE g.id::text = r->>'grant') \
             FROM provisioning.sections d, jsonb_array_elements(d.items->'resources') r"
                .into(),
        ),
        (
            "a delivery receipt is of a run delivery has",
            "SELECT x.id::text, EXISTS (SELECT 1 FROM delivery.runs r WHERE r.id = x.run) \
             FROM delivery.receipts x"
                .into(),
        ),
        (
            "a node config knows is a node of inventory",
            format!("SELECT x.node, {node_in_inventory} FROM config.nodes x"),
        ),
        (
            "a node config sealed a secret to is a node of inventory",
            format!("SELECT x.node || ' ' || x.path, {node_in_inventory} FROM config.sealed x"),
        ),
        (
            "a node connectivity knows is a node of inventory",
            format!("SELECT x.node, {node_in_inventory} FROM connectivity.nodes x"),
        ),
        (
            "a certificate's node is a node of inventory",
            format!("SELECT x.node || ' ' || x.serial, {node_in_inventory} FROM connectivity.certificates x"),
        ),
        (
            "a node observability knows is a node of inventory",
            format!("SELECT x.node, {node_in_inventory} FROM observability.nodes x"),
        ),
        (
            "a delivery run's node is a node of inventory",
            format!("SELECT x.id::text || ' ' || x.node, {node_in_inventory} FROM delivery.runs x"),
        ),
        (
            "a node a provider reported on is a node of inventory",
            format!("SELECT x.grant_id::text || ' ' || x.node, {node_in_inventory} FROM provisioning.statuses x"),
        ),
        (
            "an assignment's module is a module of inventory",
            format!("SELECT x.node || ' ' || x.module, {module_in_inventory} FROM inventory.assignments x"),
        ),
        (
            "a module the other contexts place is a module of inventory",
            format!(
                "SELECT 'config ' || x.module, {module_in_inventory} FROM config.modules x WHERE NOT x.removed \
                 UNION ALL SELECT 'connectivity ' || x.module, {module_in_inventory} FROM connectivity.modules x WHERE NOT x.removed \
                 UNION ALL SELECT 'provisioning ' || x.module, {module_in_inventory} FROM provisioning.modules x WHERE NOT x.removed \
                 UNION ALL SELECT 'observability ' || x.module, {module_in_inventory} FROM observability.modules x WHERE NOT x.removed \
                 UNION ALL SELECT 'delivery ' || x.module, {module_in_inventory} FROM delivery.modules x"
            ),
        ),
        (
            "a rollout's module is a module of inventory",
            format!("SELECT x.id::text || ' ' || x.module, {module_in_inventory} FROM delivery.rollouts x"),
        ),
        (
            "a live resource grant's consumer and provider are modules of inventory",
            "SELECT x.id::text || ' ' || x.consumer || ' <- ' || COALESCE(x.provider, '-'), \
                    EXISTS (SELECT 1 FROM inventory.modules m WHERE m.name = x.consumer) \
                    AND (x.provider IS NULL OR EXISTS (SELECT 1 FROM inventory.modules m WHERE m.name = x.provider)) \
             FROM provisioning.grants x WHERE x.revoked_at IS NULL"
                .into(),
        ),
    ];
    checks.extend(more.into_iter().map(|(what, sql)| (what.to_owned(), sql)));
    checks
}

/// Run [`reference_checks`] against the database at `url`: how many
/// references each check found (all present), or every one missing.
async fn references_whole(url: &str) -> anyhow::Result<Vec<(String, usize)>> {
    let pool = sqlx::PgPool::connect(url).await?;
    let mut counted = Vec::new();
    let mut missing = Vec::new();
    for (what, sql) in reference_checks() {
        let rows: Vec<(String, bool)> = sqlx::query_as(sqlx::AssertSqlSafe(sql.as_str()))
            .fetch_all(&pool)
            .await
            .map_err(|e| anyhow::anyhow!("{what}: {e}\n{sql}"))?;
        missing.extend(
            rows.iter()
                .filter(|(_, present)| !present)
                .map(|(r, _)| format!("{what}: not so for {r}")),
        );
        counted.push((what, rows.len()));
    }
    pool.close().await;
    anyhow::ensure!(
        missing.is_empty(),
        "the restored copy refers to what it lacks:\n{}",
        missing.join("\n")
    );
    Ok(counted)
}

/// Every audit entry, as listed.
async fn audit(mesh: &Mesh) -> anyhow::Result<BTreeSet<String>> {
    let (status, body) = mesh.get("/v1/audit?limit=100").await?;
    anyhow::ensure!(status == 200, "GET /v1/audit: {status} {body}");
    anyhow::ensure!(body["next"].is_null(), "more than a page of audit entries");
    Ok(body["entries"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(Value::to_string)
        .collect())
}

/// The pid `web`'s unit on `node` wrote to /srv/web/version, while it runs.
fn web_version(mesh: &Mesh, node: &str) -> Option<u32> {
    let text = std::fs::read_to_string(mesh.agent(node).file("/srv/web/version")).ok()?;
    let pid: u32 = text.trim().strip_prefix("v1 ")?.parse().ok()?;
    Path::new(&format!("/proc/{pid}")).exists().then_some(pid)
}

/// Module `web` on the node labelled tier=web, its artifact pushed with
/// meshctl, a revision rolled out to it: (the unit's pid, the run, its receipts).
async fn rolled_out(mesh: &Mesh, node: &str) -> anyhow::Result<(u32, String, Value)> {
    // The unit (its module's user, decision 0051) writes its version there.
    mesh_testkit::open_to_units(&mesh.agent(node).file("/srv/web"))?;
    put(
        mesh,
        "/v1/modules/web",
        json!({
            "unit": {"command": "/bin/sleep", "args": ["600"]},
            "placement": {"match_labels": {"labels": {"tier": "web"}, "replicas": 1}},
        }),
    )
    .await?;
    let app = mesh.dir.path().join("web-v1");
    std::fs::create_dir_all(&app)?;
    let script = app.join("run.sh");
    std::fs::write(
        &script,
        "#!/bin/sh\necho \"v1 $$\" > ./version\nexec sleep 600\n",
    )?;
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755))?;
    std::fs::write(app.join("nonce"), uuid::Uuid::now_v7().to_string())?;
    let (code, digest, err) = mesh.meshctl(&["artifact", "push", &s(&app)])?;
    anyhow::ensure!(code == 0, "meshctl artifact push: {code} {err}");
    let (code, revision, err) = mesh.meshctl(&[
        "revision",
        "create",
        "web",
        "--artifact",
        digest.trim(),
        "--command",
        "run.sh",
        "--working-dir",
        "/srv/web",
        "--restart",
        "on_failure",
    ])?;
    anyhow::ensure!(code == 0, "meshctl revision create: {code} {err}");
    let (code, out, err) = mesh.meshctl(&[
        "rollout",
        "start",
        "web",
        "--revision",
        revision.trim(),
        "--max-unavailable",
        "1",
        "--settle",
        "1",
        "--wait",
        "--timeout",
        "120",
    ])?;
    anyhow::ensure!(code == 0, "meshctl rollout start: {code} {out} {err}");
    let id = out.lines().next().unwrap_or_default().trim().to_owned();
    let pid = wait_for("web v1 running on its node", WITHIN, || async {
        Ok(web_version(mesh, node))
    })
    .await?;
    let (status, view) = mesh.get(&format!("/v1/rollouts/{id}")).await?;
    anyhow::ensure!(status == 200, "GET rollout: {status} {view}");
    let run = view["runs"][0]["id"]
        .as_str()
        .ok_or_else(|| anyhow::anyhow!("no run in {view}"))?
        .to_owned();
    let (status, body) = mesh.get(&format!("/v1/runs/{run}/receipts")).await?;
    anyhow::ensure!(status == 200, "receipts: {status} {body}");
    let receipts = body["receipts"].clone();
    anyhow::ensure!(
        receipts.as_array().is_some_and(|r| r.len() >= 3),
        "a run with receipts: {body}"
    );
    Ok((pid, run, receipts))
}

async fn put(mesh: &Mesh, path: &str, body: Value) -> anyhow::Result<()> {
    let (status, answer) = mesh.put(path, &body).await?;
    anyhow::ensure!(status < 300, "PUT {path}: {status} {answer}");
    Ok(())
}

fn has(bytes: &[u8], needle: &str) -> bool {
    bytes.windows(needle.len()).any(|w| w == needle.as_bytes())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_backed_up_mesh_restored_on_a_fresh_database_server_converges_with_nothing_lost()
-> anyhow::Result<()> {
    let mut mesh = Mesh::prepare().await?;
    // Agents come back quickly once the broker knows their users again.
    mesh.agent_toml = Some("reconnect_max = \"1s\"\n".into());
    // Delivery pushes to the bundle's registry (a rollout leaves receipts);
    // this fleet trusts the controller's signatures (decision 0048), so the
    // artifact pushed runs without an operator's: what is restored is the
    // point here (operator-held keys: e2e/tests/signing.rs).
    let registry = mesh_testkit::registry_url()?;
    let toml_path = mesh.dir.path().join("controller.toml");
    let mut toml = std::fs::read_to_string(&toml_path)?;
    // Certificates of five minutes: a node and name may get a new one 30 s
    // after the last (a tenth of the lifetime) instead of a minute, and the
    // agents' own renewals (from two thirds) fall well after the drill.
    toml.push_str(&format!(
        "registry_url = {registry:?}\nrollout_tick_ms = 200\ncertificate_lifetime_secs = {CERT_LIFETIME_SECS}\ntrust_controller_artifact_signatures = true\n"
    ));
    std::fs::write(&toml_path, toml)?;
    mesh.start_controller(&[]).await?;
    let a = mesh.add_agent("a", &[("role", "app")]).await?;
    let b = mesh
        .add_agent("b", &[("role", "app"), ("tier", "web")])
        .await?;
    wait_for("both nodes alive", WITHIN, || async {
        let n = listing(&mesh, "/v1/nodes", "nodes").await?;
        Ok((n.len() == 2 && n.iter().all(|n| n["state"] == "alive")).then_some(()))
    })
    .await?;

    // A module with a unit, a file, a secret granted to the module, a certificate.
    let unique = format!("{}", 100_000 + rand::random::<u32>() % 800_000);
    let unit_argv = ["sleep", unique.as_str()];
    put(
        &mesh,
        "/v1/files/motd",
        json!({"path": "/etc/motd", "content": "before\n", "mode": "0644", "selector": {}}),
    )
    .await?;
    put(
        &mesh,
        "/v1/modules/app",
        json!({"unit": {"command": "sleep", "args": [unique]}, "placement": {"exact_node": {"node": a}}}),
    )
    .await?;
    put(&mesh, "/v1/secrets/db-pw", json!({"value": PLAIN})).await?;
    put(&mesh, "/v1/modules/app/grants/db-pw", json!({})).await?;
    // A resource grant: module `ledger` on a requires a database, which
    // module `pg` on b provides from a PostgreSQL server of its own (another
    // throwaway cluster: a server the mesh does not own, not lost with the
    // controller's host).
    let provider = Cluster::start()?;
    put(
        &mesh,
        "/v1/modules/pg",
        json!({
            "unit": {"command": "sleep", "args": [format!("{unique}2")]},
            "placement": {"exact_node": {"node": b}},
            "provides": [{
                "kind": "postgres.database", "host": "127.0.0.1", "port": provider.port,
                "admin": {"server": "postgres", "socket_dir": s(provider.dir.path())},
            }],
        }),
    )
    .await?;
    put(
        &mesh,
        "/v1/modules/ledger",
        json!({
            "unit": {"command": "sleep", "args": [format!("{unique}3")]},
            "placement": {"exact_node": {"node": a}},
            "requires": [{"kind": "postgres.database", "name": "db"}],
        }),
    )
    .await?;
    let secret_file = mesh.agent(&a).file("/modules/app/secrets/db-pw");
    let motd = [
        mesh.agent(&a).file("/etc/motd"),
        mesh.agent(&b).file("/etc/motd"),
    ];
    let pid = wait_for("the file, the secret and the unit", WITHIN, || async {
        let files = motd
            .iter()
            .all(|p| std::fs::read_to_string(p).ok().as_deref() == Some("before\n"));
        let secret = std::fs::read_to_string(&secret_file).ok().as_deref() == Some(PLAIN);
        Ok(pid_of(&unit_argv).filter(|_| files && secret))
    })
    .await?;
    let key_pem = mesh_credentials::pki::new_key()?;
    let csr = mesh_credentials::pki::csr(key_pem.expose(), &a, std::slice::from_ref(&a))?;
    request_certificate(mesh.agent(&a).creds.clone(), 1_000_000, "node", csr).await?;
    wait_for("the node's certificate signed", WITHIN, || async {
        Ok((!listing(&mesh, "/v1/certificates", "certificates")
            .await?
            .is_empty())
        .then_some(()))
    })
    .await?;
    // A revision rolled out to b: a run and its receipts.
    let (web_pid, run, receipts) = rolled_out(&mesh, &b).await?;
    // The grant is ready: the database made on the provider's server, the
    // credential written on a.
    let credential = mesh.agent(&a).file("/modules/ledger/secrets/grant-db.env");
    wait_for(
        "ledger's database grant ready, its credential on a",
        WITHIN,
        || async {
            let (_, grants) = grants_of(&mesh).await?;
            let ready = grants.iter().any(|g| {
                g["consumer"] == "ledger" && g["state"] == "ready" && g["credential_version"] == 1
            });
            let file = std::fs::read_to_string(&credential).unwrap_or_default();
            Ok((ready && file.contains("MESH_CREDENTIAL_VERSION=1")).then_some(()))
        },
    )
    .await?;
    let credential_before = std::fs::read_to_string(&credential)?;
    // Every node and module has its certificate (an agent asks for one per
    // module it runs) before the inventory is taken: none is issued later.
    wait_for(
        "a certificate for each node and each module on it",
        WITHIN,
        || async {
            let have: BTreeSet<(String, String)> =
                listing(&mesh, "/v1/certificates", "certificates")
                    .await?
                    .iter()
                    .map(|c| {
                        (
                            c["node"].as_str().unwrap_or_default().to_owned(),
                            c["name"].as_str().unwrap_or_default().to_owned(),
                        )
                    })
                    .collect();
            let want = [
                (&a, "node"),
                (&a, "app"),
                (&a, "ledger"),
                (&b, "node"),
                (&b, "web"),
                (&b, "pg"),
            ];
            let missing: Vec<String> = want
                .iter()
                .filter(|(n, name)| !have.contains(&((*n).clone(), (*name).to_owned())))
                .map(|(n, name)| format!("{n}/{name}"))
                .collect();
            anyhow::ensure!(missing.is_empty(), "no certificate yet for {missing:?}");
            Ok(Some(()))
        },
    )
    .await?;
    let before = inventory_of(&mesh).await?;
    anyhow::ensure!(
        before["secret_grants"]
            .as_array()
            .is_some_and(|g| !g.is_empty())
            && before["grants"].as_array().is_some_and(|g| !g.is_empty()),
        "no grant to restore: {before}"
    );
    let audit_before = audit(&mesh).await?;
    assert!(!audit_before.is_empty(), "no audit entry to restore");
    let unit_dir = mesh.dir.path().join("drill");
    std::fs::create_dir_all(&unit_dir)?;

    // ------------------------------------------------------------ backup
    let admin_file = unit_dir.join("admin-credentials.toml");
    mesh.env.admin_credentials().write(&admin_file)?;
    let key = unit_dir.join("recovery.key");
    let archive = unit_dir.join("mesh.backup.tar");
    let etc_old = unit_dir.join("etc-old");
    std::fs::create_dir_all(&etc_old)?;
    mesh_bundle(&["recovery-key", "--out", &s(&key)])?;
    let t = Instant::now();
    let out = mesh_bundle(&[
        "backup",
        "--out",
        &s(&archive),
        "--recovery-key",
        &s(&key),
        "--etc",
        &s(&etc_old),
        "--controller-credentials",
        &s(&mesh.dir.path().join("credentials.toml")),
        "--admin-credentials",
        &s(&admin_file),
    ])?;
    let t_backup = t.elapsed();
    eprintln!("{out}");
    use std::os::unix::fs::PermissionsExt as _;
    assert_eq!(
        std::fs::metadata(&archive)?.permissions().mode() & 0o777,
        0o600
    );
    // No secret in clear: the secret's value, a context role's password, a
    // node's broker password, the master key.
    let bytes = std::fs::read(&archive)?;
    assert!(has(&bytes, "manifest.json"));
    let role_pw = mesh_credentials::password_of(&mesh.env.database_url("config"))
        .ok_or_else(|| anyhow::anyhow!("no password in the config role's URL"))?;
    let master = std::fs::read_to_string(mesh.env.master_keys_path())?;
    let master_hex = master
        .lines()
        .find_map(|l| l.strip_prefix("key = \""))
        .map(|l| l.trim_end_matches('"').to_owned())
        .ok_or_else(|| anyhow::anyhow!("no key in the master keyring"))?;
    for (what, secret) in [
        ("the secret's value", PLAIN),
        ("the config role's password", role_pw.as_str()),
        (
            "node a's broker password",
            mesh.agent(&a).creds.password.as_str(),
        ),
        ("the master key", master_hex.as_str()),
    ] {
        assert!(secret.len() >= 16, "{what} is a real secret");
        assert!(!has(&bytes, secret), "{what} is in the archive in clear");
    }

    // ------------------------------------------------------------ the host is lost
    mesh.kill_controller();
    let admin = mesh.env.admin_credentials().clone();
    provision::drop_database_and_roles(&admin, mesh.env.names()).await?;
    let key_dir = mesh
        .env
        .signing_key_path()
        .parent()
        .map(Path::to_path_buf)
        .ok_or_else(|| anyhow::anyhow!("the key dir"))?;
    std::fs::remove_dir_all(&key_dir)?;
    let rabbit = Rabbit::new(&admin);
    rabbit.delete_vhost(mesh.env.vhost()).await?;
    let names = mesh.env.names().clone();
    for u in [
        a.clone(),
        b.clone(),
        names.controller_user.clone(),
        names.identity_user.clone(),
    ] {
        rabbit.delete_user(&u).await?;
    }

    // ------------------------------------------------------------ restore
    let t = Instant::now();
    let cluster = Cluster::start()?;
    let t_cluster = t.elapsed();
    let new_admin = unit_dir.join("new-admin-credentials.toml");
    cluster.admin(&admin).write(&new_admin)?;
    let etc = unit_dir.join("etc-new");
    // A wrong key is refused before anything is installed.
    let wrong = unit_dir.join("wrong.key");
    mesh_bundle(&["recovery-key", "--out", &s(&wrong)])?;
    let (code, _, err) = output(Command::new(bin("mesh-bundle")?).args([
        "restore",
        "--archive",
        &s(&archive),
        "--recovery-key",
        &s(&wrong),
        "--etc",
        &s(&etc),
        "--admin-credentials",
        &s(&new_admin),
    ]))?;
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("REFUSED: wrong recovery key") && err.contains("nothing was installed"),
        "{err}"
    );
    assert!(!etc.exists(), "a refused restore wrote {}", etc.display());
    // So does bundle/up --restore, before it installs or starts anything.
    let up = Path::new(env!("CARGO_MANIFEST_DIR")).join("../bundle/up");
    let bin_dir = bin("mesh-bundle")?
        .parent()
        .map(Path::to_path_buf)
        .ok_or_else(|| anyhow::anyhow!("the binaries' directory"))?;
    let (code, _, err) = output(
        Command::new("bash")
            .arg(&up)
            .args(["--restore", &s(&archive), "--recovery-key", &s(&wrong)])
            .env("MESH_BIN_DIR", &bin_dir)
            .env("MESH_ETC", &etc),
    )?;
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("wrong recovery key") && err.contains("nothing was installed"),
        "{err}"
    );
    assert!(
        !etc.exists(),
        "a refused bundle/up --restore wrote {}",
        etc.display()
    );
    let t = Instant::now();
    let out = mesh_bundle(&[
        "restore",
        "--archive",
        &s(&archive),
        "--recovery-key",
        &s(&key),
        "--etc",
        &s(&etc),
        "--admin-credentials",
        &s(&new_admin),
    ])?;
    let t_restore = t.elapsed();
    eprintln!("{out}");
    // A second restore onto what is now a mesh is refused without --force.
    let (code, _, err) = output(Command::new(bin("mesh-bundle")?).args([
        "restore",
        "--archive",
        &s(&archive),
        "--recovery-key",
        &s(&key),
        "--etc",
        &s(&etc),
        "--admin-credentials",
        &s(&new_admin),
    ]))?;
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("refusing to restore over mesh data"), "{err}");
    // The restored copy refers to nothing it lacks.
    let counted = references_whole(&cluster.superuser_url(&mesh.env.names().database)).await?;
    eprintln!("{}", summary(&counted));

    // The agents are back on the broker (their users' hashes were restored)
    // before the controller starts: it judges no node in its first grace.
    wait_for("both agents reconnected to the broker", WITHIN, || async {
        let mut back = 0;
        for n in [&a, &b] {
            back += usize::from(!rabbit.connections_of(n).await?.is_empty());
        }
        Ok((back == 2).then_some(()))
    })
    .await?;

    // ------------------------------------------------------------ the controller there
    let toml_path = mesh.dir.path().join("controller.toml");
    let toml = std::fs::read_to_string(&toml_path)?;
    let toml = toml
        .lines()
        .map(|l| {
            if l.starts_with("credentials = ") {
                format!(
                    "credentials = {:?}",
                    s(&etc.join("controller-credentials.toml"))
                )
            } else {
                l.to_owned()
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    std::fs::write(&toml_path, format!("{toml}\n"))?;
    let unreachable_before = mesh.controller_log().matches("node unreachable").count();
    let t = Instant::now();
    mesh.start_controller(&[]).await?;
    let t_start = t.elapsed();
    // Through the first grace (twice over): no node other than alive.
    let watch_until = Instant::now() + 2 * GRACE;
    let mut seen = BTreeSet::new();
    while Instant::now() < watch_until {
        for n in listing(&mesh, "/v1/nodes", "nodes").await? {
            seen.insert(format!("{} {}", n["id"], n["state"]));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        seen.iter().all(|s| s.ends_with("\"alive\"")),
        "a node was not alive in the restored controller's first grace: {seen:?}"
    );
    // Everything is back.
    assert_eq!(inventory_of(&mesh).await?, before);
    let audit_after = audit(&mesh).await?;
    let lost: Vec<_> = audit_before.difference(&audit_after).collect();
    assert!(lost.is_empty(), "audit entries lost: {lost:?}");
    // The restored CA: the certificate issued before chains to it.
    let ca_pem = std::fs::read_to_string(etc.join("ca.pem"))?;
    let restored =
        mesh_credentials::ControllerCredentials::load(&etc.join("controller-credentials.toml"))?;
    let url = restored.databases["connectivity"].expose().clone();
    assert!(
        url.contains(&format!(":{}/", cluster.port)),
        "restored onto the new cluster"
    );
    let pool = sqlx::PgPool::connect(&url).await?;
    let pems: Vec<(String, String, String)> =
        sqlx::query_as("SELECT node, name, certificate FROM connectivity.certificates")
            .fetch_all(&pool)
            .await?;
    pool.close().await;
    assert!(
        pems.iter().any(|(n, name, _)| *n == a && name == "node"),
        "node a's certificate is not in the restored schema"
    );
    // Each schema as its own role, with its privileges: the audit log is
    // still append-only to the identity role (decision 0018's REVOKE).
    let identity = sqlx::PgPool::connect(restored.databases["identity"].expose()).await?;
    let (owner, may_update): (String, bool) = sqlx::query_as(
        "SELECT tableowner::text, has_table_privilege('identity.audit', 'UPDATE') \
         FROM pg_tables WHERE schemaname = 'identity' AND tablename = 'audit'",
    )
    .fetch_one(&identity)
    .await?;
    identity.close().await;
    assert_eq!(owner, names.role("identity"));
    assert!(
        !may_update,
        "the restored identity role may UPDATE its audit log"
    );
    for (node, name, pem) in &pems {
        mesh_credentials::pki::verify_chain(pem, &ca_pem)
            .map_err(|e| anyhow::anyhow!("{node}/{name} does not chain to the restored CA: {e}"))?;
    }
    // The secret still opens: granted now to a module on b, the restored
    // controller decrypts it with the restored keyring and seals it to b.
    put(
        &mesh,
        "/v1/modules/app2",
        json!({"unit": {"command": "sleep", "args": [format!("{unique}1")]}, "placement": {"exact_node": {"node": b}}}),
    )
    .await?;
    put(&mesh, "/v1/modules/app2/grants/db-pw", json!({})).await?;
    // A file declared after the restore reaches both nodes.
    put(
        &mesh,
        "/v1/files/motd",
        json!({"path": "/etc/motd", "content": "after\n", "mode": "0644", "selector": {}}),
    )
    .await?;
    let b_secret = mesh.agent(&b).file("/modules/app2/secrets/db-pw");
    wait_for(
        "the new file on both nodes and the secret on b",
        WITHIN,
        || async {
            let files = motd
                .iter()
                .all(|p| std::fs::read_to_string(p).ok().as_deref() == Some("after\n"));
            let secret = std::fs::read_to_string(&b_secret).ok().as_deref() == Some(PLAIN);
            Ok((files && secret).then_some(()))
        },
    )
    .await?;
    let t_converged = t.elapsed();
    assert_eq!(std::fs::read_to_string(&secret_file)?, PLAIN, "a's secret");
    assert_eq!(pid_of(&unit_argv), Some(pid), "the unit was restarted");
    assert_eq!(
        web_version(&mesh, &b),
        Some(web_pid),
        "the rolled-out unit was restarted"
    );
    let (status, body) = mesh.get(&format!("/v1/runs/{run}/receipts")).await?;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["receipts"], receipts, "the run's receipts");
    assert_eq!(
        mesh.controller_log().matches("node unreachable").count(),
        unreachable_before,
        "the restored controller judged a node unreachable"
    );
    eprintln!(
        "restore drill: backup {:.1} s, fresh PostgreSQL cluster {:.1} s, restore {:.1} s, \
         controller start {:.1} s, converged {:.1} s after start; total {:.1} s",
        t_backup.as_secs_f64(),
        t_cluster.as_secs_f64(),
        t_restore.as_secs_f64(),
        t_start.as_secs_f64(),
        t_converged.as_secs_f64(),
        (t_backup + t_cluster + t_restore + t_converged).as_secs_f64()
    );
    // The resource grant is still the one of before (no new credential) and
    // its credential on a is unchanged.
    assert_eq!(
        inventory_of(&mesh).await?["grants"],
        before["grants"],
        "resource grants after convergence"
    );
    assert_eq!(
        std::fs::read_to_string(&credential)?,
        credential_before,
        "ledger's credential on a"
    );

    // Renewal from the restored CA: node a asks again for its node
    // certificate, once connectivity's floor since its last one has passed.
    // The CSR is for a's own key (the agent's, so that it installs what comes
    // back) and names both of a's names, so it is not the request already
    // answered (a request like the agent's is answered with the certificate
    // it got, while that is young).
    let t = Instant::now();
    let old: BTreeSet<String> = before["certificates"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter(|c| c["node"] == a.as_str() && c["name"] == "node")
        .filter_map(|c| c["serial"].as_str().map(str::to_owned))
        .collect();
    anyhow::ensure!(
        !old.is_empty(),
        "a had no node certificate before the backup"
    );
    wait_for(
        "the reissue floor since a's last node certificate",
        2 * WITHIN,
        || async {
            let newest = listing(&mesh, "/v1/certificates", "certificates")
                .await?
                .iter()
                .filter(|c| c["node"] == a.as_str() && c["name"] == "node")
                .filter_map(|c| {
                    c["issued_at"]
                        .as_str()?
                        .parse::<chrono::DateTime<chrono::Utc>>()
                        .ok()
                })
                .max()
                .ok_or_else(|| anyhow::anyhow!("no node certificate of a"))?;
            let since = chrono::Utc::now() - newest;
            Ok((since > chrono::TimeDelta::seconds(REISSUE_FLOOR_SECS + 1)).then_some(()))
        },
    )
    .await?;
    let t_floor = t.elapsed();
    let t = Instant::now();
    let (status, overlay) = mesh.get("/v1/overlay").await?;
    anyhow::ensure!(status == 200, "GET /v1/overlay: {status} {overlay}");
    let domain = overlay["domain"]
        .as_str()
        .ok_or_else(|| anyhow::anyhow!("no domain in {overlay}"))?;
    let a_key = std::fs::read_to_string(mesh.agent(&a).state_dir.join("certs/node.key"))?;
    let csr = mesh_credentials::pki::csr(&a_key, &a, &[a.clone(), format!("{a}.{domain}")])?;
    request_certificate(mesh.agent(&a).creds.clone(), 2_000_000, "node", csr).await?;
    // A new serial, and a holds it: its agent checked it against the CA it
    // was declared with and installed it.
    let installed = mesh.agent(&a).file("/etc/mesh/tls/node.pem");
    let renewed = wait_for(
        "a's renewed node certificate, held by a",
        WITHIN,
        || async {
            let certs = listing(&mesh, "/v1/certificates", "certificates").await?;
            let new = certs.iter().find(|c| {
                c["node"] == a.as_str()
                    && c["name"] == "node"
                    && c["serial"].as_str().is_some_and(|s| !old.contains(s))
            });
            let Some(new) = new else {
                let (_, body) = mesh.get("/v1/certificates").await?;
                anyhow::bail!("no new certificate; requests: {}", body["requests"]);
            };
            Ok((new["held"]["serial"] == new["serial"])
                .then(|| new["serial"].as_str().unwrap_or_default().to_owned()))
        },
    )
    .await?;
    let t_renewed = t.elapsed();
    let pem = std::fs::read_to_string(&installed)?;
    let info = mesh_credentials::pki::CertInfo::parse(&pem)?;
    assert_eq!(info.serial, renewed, "the certificate a installed");
    mesh_credentials::pki::verify_chain(&pem, &ca_pem).map_err(|e| {
        anyhow::anyhow!("a's renewed certificate does not chain to the restored CA: {e}")
    })?;
    let pool = sqlx::PgPool::connect(&url).await?;
    let stored: String =
        sqlx::query_scalar("SELECT certificate FROM connectivity.certificates WHERE serial = $1")
            .bind(&renewed)
            .fetch_one(&pool)
            .await?;
    pool.close().await;
    mesh_credentials::pki::verify_chain(&stored, &ca_pem).map_err(|e| {
        anyhow::anyhow!("the stored renewed certificate does not chain to the restored CA: {e}")
    })?;
    // The certificates of before are still valid and unrevoked.
    for c in listing(&mesh, "/v1/certificates", "certificates").await? {
        if c["serial"].as_str().is_some_and(|s| old.contains(s)) {
            assert!(c["revoked_at"].is_null(), "renewal revoked {c}");
        }
    }
    eprintln!(
        "renewal from the restored CA: {:.1} s waiting out the reissue floor, then serial {renewed} \
         held by {a} {:.1} s after asking",
        t_floor.as_secs_f64(),
        t_renewed.as_secs_f64()
    );
    mesh.kill_controller();
    drop(cluster);
    drop(provider);
    mesh.teardown().await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_backup_taken_under_load_restores_to_one_moment() -> anyhow::Result<()> {
    let mut mesh = Mesh::start().await?;
    let a = mesh.add_agent("a", &[("role", "app")]).await?;
    let b = mesh.add_agent("b", &[("role", "app")]).await?;
    wait_for("both nodes alive", WITHIN, || async {
        let n = listing(&mesh, "/v1/nodes", "nodes").await?;
        Ok((n.len() == 2 && n.iter().all(|n| n["state"] == "alive")).then_some(()))
    })
    .await?;
    // The premise checked in the restored copy below (inventory recorded an
    // applied generation): both nodes' join-time inventory sections applied
    // and recorded before the backup starts. Under load the backup once
    // came before any applied report was handled (bundle/test, issue 40).
    for node in [&a, &b] {
        wait_for(
            "the node's inventory section recorded as applied",
            WITHIN,
            || async {
                let (status, view) = mesh.get(&format!("/v1/nodes/{node}")).await?;
                anyhow::ensure!(status == 200, "GET node: {status} {view}");
                Ok((view["sections"]["inventory"]["applied"]
                    .as_i64()
                    .unwrap_or(0)
                    >= 1)
                    .then_some(()))
            },
        )
        .await?;
    }
    let dir = mesh.dir.path().join("drill");
    std::fs::create_dir_all(&dir)?;
    let admin_file = dir.join("admin-credentials.toml");
    mesh.env.admin_credentials().write(&admin_file)?;
    let key = dir.join("recovery.key");
    mesh_bundle(&["recovery-key", "--out", &s(&key)])?;

    // Files keep being declared (one node each, alternately; some replaced)
    // while the backup runs; the agents' heartbeats stream all along.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let declared = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let writer = {
        let api = mesh.api.clone();
        let token = mesh.admin_token().to_owned();
        let stop = stop.clone();
        let declared = declared.clone();
        let nodes = [a.clone(), b.clone()];
        tokio::spawn(async move {
            let http = reqwest::Client::new();
            let mut i = 0usize;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let name = format!("f-{}", i % 40);
                let body = json!({
                    "path": format!("/drill/{name}"),
                    "content": format!("content {i}\n"),
                    "mode": "0644",
                    "node": nodes[i % 2],
                });
                // The first 40 create, the others replace (If-Match: *).
                let mut req = http
                    .put(format!("{api}/v1/files/{name}"))
                    .bearer_auth(&token)
                    .json(&body);
                if i >= 40 {
                    req = req.header("if-match", "*");
                }
                let r = req.send().await;
                if matches!(&r, Ok(r) if r.status().is_success()) {
                    declared.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                i += 1;
            }
        })
    };
    wait_for("some files declared", WITHIN, || async {
        Ok((declared.load(std::sync::atomic::Ordering::Relaxed) >= 20).then_some(()))
    })
    .await?;
    let archive = dir.join("mesh.backup.tar");
    let etc_old = dir.join("etc-old");
    std::fs::create_dir_all(&etc_old)?;
    mesh_bundle(&[
        "backup",
        "--out",
        &s(&archive),
        "--recovery-key",
        &s(&key),
        "--etc",
        &s(&etc_old),
        "--controller-credentials",
        &s(&mesh.dir.path().join("credentials.toml")),
        "--admin-credentials",
        &s(&admin_file),
    ])?;
    let during = declared.load(std::sync::atomic::Ordering::Relaxed);
    wait_for("more files declared after the backup", WITHIN, || async {
        Ok((declared.load(std::sync::atomic::Ordering::Relaxed) > during + 5).then_some(()))
    })
    .await?;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    writer.await?;

    // Restored into a fresh cluster; the broker kept its state (--no-broker).
    let cluster = Cluster::start()?;
    let new_admin = dir.join("new-admin-credentials.toml");
    cluster
        .admin(mesh.env.admin_credentials())
        .write(&new_admin)?;
    let etc = dir.join("etc-new");
    mesh_bundle(&[
        "restore",
        "--archive",
        &s(&archive),
        "--recovery-key",
        &s(&key),
        "--etc",
        &s(&etc),
        "--admin-credentials",
        &s(&new_admin),
        "--no-broker",
    ])?;
    let creds =
        mesh_credentials::ControllerCredentials::load(&etc.join("controller-credentials.toml"))?;
    let url = creds.databases["config"].expose().clone();
    anyhow::ensure!(url.contains(&format!(":{}/", cluster.port)), "restored URL");
    let pool = sqlx::PgPool::connect(&url).await?;
    let files: Vec<(String, String)> =
        sqlx::query_as("SELECT path, content FROM config.files WHERE path LIKE '/drill/%'")
            .fetch_all(&pool)
            .await?;
    let files: std::collections::BTreeMap<String, String> = files.into_iter().collect();
    let sections: Vec<(String, Value)> = sqlx::query_as("SELECT node, items FROM config.sections")
        .fetch_all(&pool)
        .await?;
    pool.close().await;
    assert!(!files.is_empty(), "the backup holds some of the files");
    let mut checked = 0;
    for (node, items) in &sections {
        for f in items["files"].as_array().cloned().unwrap_or_default() {
            let Some(path) = f["path"].as_str().filter(|p| p.starts_with("/drill/")) else {
                continue;
            };
            assert_eq!(
                files.get(path).map(String::as_str),
                f["content"].as_str(),
                "node {node}'s section declares {path} as the files table does not"
            );
            checked += 1;
        }
    }
    assert!(
        checked > 0,
        "no section declared a drill file: {sections:?}"
    );
    // References across the contexts, in the restored copy.
    let counted = references_whole(&cluster.superuser_url(&mesh.env.names().database)).await?;
    let applied: usize = counted
        .iter()
        .filter(|(what, _)| what.contains("as applied"))
        .map(|(_, n)| n)
        .sum();
    assert!(
        applied > 0,
        "inventory recorded no applied generation: {counted:?}"
    );
    eprintln!("{}", summary(&counted));
    eprintln!(
        "consistent backup: {} files in the table, {checked} declared by {} sections, all equal",
        files.len(),
        sections.len()
    );
    drop(cluster);
    mesh.teardown().await
}
