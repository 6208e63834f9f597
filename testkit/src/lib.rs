//! The test kit: one isolated mesh environment per test, against the real
//! PostgreSQL and RabbitMQ of this machine.
//!
//! [`TestEnv::new`] provisions, under a unique id `t` + 8 hex digits, a database
//! `mesh_<id>` with the seven context schemas each owned by its role
//! `mesh_<id>_<context>`, a vhost `mesh_<id>` and a controller broker user
//! `mesh_<id>-controller`; [`TestEnv::add_node`] adds node users `<id>-<suffix>`.
//! Tests in parallel never share a name. [`TestEnv::teardown`] removes all of it;
//! dropping a `TestEnv` without teardown does the same, best effort, on a separate
//! thread with its own runtime (so it works inside and outside async contexts).
//!
//! The kit only composes the bundle's production functions
//! ([`mesh_bundle::provision`]) and the credential files' one definition
//! ([`mesh_credentials`]) under test names; production code never calls it. It
//! is a dev-dependency of every crate that uses it (the e2e harness, itself a
//! test crate, aside): e2e/tests/architecture.rs checks that no production crate
//! depends on it.
//!
//! [`container`] boots a Debian 12 container with systemd as its PID 1, for
//! tests of what only a real systemd shows.
//!
//! Admin access comes from `$MESH_ADMIN_CREDENTIALS` or
//! `/etc/mesh/admin-credentials.toml` (written by `bundle/up`), else from this
//! machine's defaults (see [`local_admin_credentials`]).

pub use mesh_bundle::s3;

pub mod container;

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use mesh_bundle::CONTEXTS;
use mesh_bundle::provision::{self, Names, Rabbit, Secret, Secrets, Steps};
use mesh_credentials::key::{SIGNING_KEY_FILE, write_signing_key};
use mesh_credentials::{
    AdminCredentials, AgentCredentials, BrokerManagement, ControllerCredentials,
};
use mesh_credentials::{MASTER_KEYS_FILE, MasterKey, MasterKeys};
use mesh_protocol::{DeclarationSigner, NodeId, PublicKey};

/// This machine's defaults when no admin credentials file exists: the local
/// `postgres` superuser over TCP and RabbitMQ's `guest` user (loopback only).
/// For tests and development only: production code reads the file.
pub fn local_admin_credentials() -> AdminCredentials {
    AdminCredentials {
        postgres_url: mesh_credentials::Secret::new(
            "postgres://postgres@127.0.0.1:5432/postgres".into(),
        ),
        rabbitmq_api: "http://127.0.0.1:15672".into(),
        rabbitmq_user: "guest".into(),
        rabbitmq_password: mesh_credentials::Secret::new("guest".into()),
        amqp_url: mesh_credentials::Secret::new("amqp://guest:guest@127.0.0.1:5672".into()),
    }
}

/// The admin credentials tests run with: the file at
/// [`AdminCredentials::default_path`] (`$MESH_ADMIN_CREDENTIALS`, else
/// `$MESH_ETC/admin-credentials.toml`, else `/etc/mesh/admin-credentials.toml`),
/// or [`local_admin_credentials`] when that file does not exist.
pub fn admin_credentials() -> anyhow::Result<AdminCredentials> {
    Ok(
        AdminCredentials::load_if_exists(&AdminCredentials::default_path())?
            .unwrap_or_else(local_admin_credentials),
    )
}

/// The bundle's TLS, which the broker's one TLS listener is set up with: the
/// mesh CA `bundle/up` made and the endpoint its broker certificate names.
#[derive(Clone, Debug)]
pub struct BundleTls {
    /// `$MESH_ETC/ca.pem`.
    pub ca_certificate_file: PathBuf,
    /// `$MESH_ETC/ca.key` (0600).
    pub ca_key_file: PathBuf,
    /// The advertised address the broker's certificate names (not loopback
    /// unless the bundle was told to).
    pub advertise_host: String,
    /// The broker's AMQPS port.
    pub amqps_port: u16,
}

impl BundleTls {
    /// The CA's certificate (PEM).
    pub fn ca_pem(&self) -> anyhow::Result<String> {
        std::fs::read_to_string(&self.ca_certificate_file)
            .with_context(|| format!("reading {}", self.ca_certificate_file.display()))
    }

    /// The CA, key included (a test controller serves HTTPS with it).
    pub fn ca(&self) -> anyhow::Result<mesh_credentials::pki::MeshCa> {
        Ok(mesh_credentials::pki::MeshCa::load(
            &self.ca_certificate_file,
            &self.ca_key_file,
        )?)
    }
}

/// The bundle's CA and advertised broker endpoint, for tests that connect to
/// the broker over AMQPS: its TLS listener has one certificate, issued by the
/// CA `bundle/up` made (`$MESH_ETC`, default /etc/mesh). An error says to run
/// `bundle/up` when it has not run (CI runs it first).
pub fn bundle_tls() -> anyhow::Result<BundleTls> {
    let etc = mesh_credentials::etc_dir();
    let ca_certificate_file = etc.join("ca.pem");
    let ca_key_file = etc.join("ca.key");
    let creds_path = etc.join(ControllerCredentials::FILE);
    for f in [&ca_certificate_file, &ca_key_file, &creds_path] {
        anyhow::ensure!(
            f.exists(),
            "{} is missing: run `bash bundle/up` first (the broker's TLS listener has the one certificate the bundle's CA issues)",
            f.display()
        );
    }
    let creds = ControllerCredentials::load(&creds_path)?;
    let broker = creds.advertise_broker.with_context(|| {
        format!(
            "{}: no advertise_broker: run `bash bundle/up` again",
            creds_path.display()
        )
    })?;
    let (advertise_host, amqps_port) = mesh_protocol::parse_host_port(&broker)
        .map_err(|e| anyhow::anyhow!("{}: advertise_broker: {e}", creds_path.display()))?;
    Ok(BundleTls {
        ca_certificate_file,
        ca_key_file,
        advertise_host,
        amqps_port,
    })
}

/// The environment variable naming the OCI registry's port on 127.0.0.1
/// (`bundle/up` reads the same one; default [`DEFAULT_REGISTRY_PORT`]).
pub const REGISTRY_PORT_ENV: &str = "MESH_REGISTRY_PORT";

/// The OCI registry's port when [`REGISTRY_PORT_ENV`] is not set.
pub const DEFAULT_REGISTRY_PORT: u16 = 5000;

/// Whether `MESH_REQUIRE_ALL` is set (not empty, not `0`): `bundle/test` sets
/// it, so that in CI a test that cannot run here fails instead of skipping.
pub fn require_all() -> bool {
    std::env::var("MESH_REQUIRE_ALL").is_ok_and(|v| !v.is_empty() && v != "0")
}

/// The environment variable naming the file [`skip`] appends a line to, one
/// per skip (`<test>: <why>`): `bundle/test` sets it and fails when the file
/// is not empty afterwards, so a skip cannot hide in captured output.
pub const SKIP_LOG_ENV: &str = "MESH_SKIP_LOG";

/// The one way a test gives up on a machine that cannot run it (not root, a
/// tool missing): under [`require_all`] an error naming `why`, else a line
/// saying it skipped and `Ok`. Either way the skip is appended to the file
/// `$MESH_SKIP_LOG` names, when set. Use as `return mesh_testkit::skip(why);`.
pub fn skip(why: &str) -> anyhow::Result<()> {
    if let Some(log) = std::env::var_os(SKIP_LOG_ENV) {
        use std::io::Write as _;
        // libtest names each test's thread after the test.
        let test = std::thread::current().name().unwrap_or("?").to_owned();
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .and_then(|mut f| writeln!(f, "{test}: {why}"))
            .with_context(|| format!("recording a skip in {log:?} (${SKIP_LOG_ENV})"))?;
    }
    if require_all() {
        anyhow::bail!("MESH_REQUIRE_ALL is set and this machine cannot run the test: {why}");
    }
    eprintln!("skipped: {why}");
    Ok(())
}

/// The base URL (`http://127.0.0.1:<port>`) of the OCI registry `bundle/up`
/// raised on loopback (Debian's docker-registry, docs/decisions/0031), for
/// tests that push and pull artifacts. The port is `$MESH_REGISTRY_PORT`, else
/// 5000. An error says to run `bundle/up` when `GET /v2/` does not answer 200
/// (CI runs it first). Repositories are not isolated per test: name yours
/// uniquely (deletes are disabled, so nothing is torn down).
pub fn registry_url() -> anyhow::Result<String> {
    let port = match std::env::var(REGISTRY_PORT_ENV) {
        Ok(p) => p
            .parse::<u16>()
            .with_context(|| format!("{REGISTRY_PORT_ENV}={p} is not a port"))?,
        Err(_) => DEFAULT_REGISTRY_PORT,
    };
    let url = format!("http://127.0.0.1:{port}");
    let status = registry_version_check(port).with_context(|| {
        format!("the OCI registry at {url}/v2/ does not answer: run `bash bundle/up` first")
    })?;
    anyhow::ensure!(
        status == 200,
        "the OCI registry at {url}/v2/ answered {status}, not 200: run `bash bundle/up` first"
    );
    Ok(url)
}

/// `GET /v2/` (the distribution API's version check) on 127.0.0.1:`port`: the
/// status code. Plain HTTP/1.0 over a socket with timeouts, so the kit needs
/// no HTTP client.
fn registry_version_check(port: u16) -> anyhow::Result<u16> {
    use std::io::{BufRead as _, BufReader, Write as _};
    use std::time::Duration;
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut stream = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(3))
        .with_context(|| format!("connecting to {addr}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.set_write_timeout(Some(Duration::from_secs(5)))?;
    stream.write_all(b"GET /v2/ HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
    let mut line = String::new();
    BufReader::new(stream)
        .read_line(&mut line)
        .context("reading the status line")?;
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse::<u16>().ok())
        .with_context(|| format!("not an HTTP status line: {line:?}"))?;
    Ok(status)
}

/// One test's isolated environment.
pub struct TestEnv {
    id: String,
    admin: AdminCredentials,
    names: Names,
    secrets: Secrets,
    /// The controller's declaration-signing key of this environment; its file is
    /// `<key_dir>/controller-signing.key`.
    signer: DeclarationSigner,
    key_dir: PathBuf,
    /// The first admin API token (its hash goes into the controller credentials).
    admin_token: String,
    torn_down: bool,
}

/// A test's handle on a node user: its id, broker URL and password in clear (tests
/// connect and publish as the node), and the controller's public key. Its
/// agent's file is [`AgentCredentials`]: [`NodeCredentials::write_to`] writes it.
#[derive(Clone, Debug)]
pub struct NodeCredentials {
    pub node: NodeId,
    /// `amqp://<node>:<password>@host:port/<vhost>`.
    pub broker_url: String,
    pub password: String,
    /// The controller's declaration-signing public key (hex) the agent verifies
    /// every declaration against.
    pub controller_key: String,
}

impl NodeCredentials {
    /// The handle on the node whose agent's file is `creds`.
    pub fn from_agent(creds: &AgentCredentials) -> NodeCredentials {
        NodeCredentials {
            node: creds.node.clone(),
            broker_url: creds.broker_url.expose().clone(),
            password: creds
                .password()
                .map(|p| p.expose().clone())
                .unwrap_or_default(),
            controller_key: creds.controller_key.to_hex(),
        }
    }

    /// The node's agent's credentials file.
    pub fn agent_credentials(&self) -> anyhow::Result<AgentCredentials> {
        Ok(AgentCredentials {
            node: self.node.clone(),
            broker_url: mesh_credentials::Secret::new(self.broker_url.clone()),
            controller_key: PublicKey::from_hex(&self.controller_key)
                .context("the controller key of a test node")?,
            ca_certificate: None,
            api_url: None,
        })
    }

    /// Writes `<state_dir>/credentials.toml` (mode 0600), the agent's file.
    pub fn write_to(&self, state_dir: &Path) -> anyhow::Result<()> {
        self.agent_credentials()?.write(state_dir)?;
        Ok(())
    }

    /// The agent's file for reaching the broker from another host: AMQPS to
    /// the bundle's advertised address, verified against the bundle's CA (plain
    /// AMQP is for loopback only).
    pub fn agent_credentials_over_tls(&self, tls: &BundleTls) -> anyhow::Result<AgentCredentials> {
        let mut url = url::Url::parse(&self.broker_url).context("a test node's broker URL")?;
        let scheme = url.set_scheme("amqps");
        let host = url.set_host(Some(&tls.advertise_host));
        let port = url.set_port(Some(tls.amqps_port));
        anyhow::ensure!(
            scheme.is_ok() && host.is_ok() && port.is_ok(),
            "cannot point a test node's broker URL at {}:{}",
            tls.advertise_host,
            tls.amqps_port
        );
        let mut creds = self.agent_credentials()?;
        creds.broker_url = mesh_credentials::Secret::new(url.to_string());
        creds.ca_certificate = Some(tls.ca_pem()?);
        Ok(creds)
    }

    /// Writes [`NodeCredentials::agent_credentials_over_tls`] to `state_dir`.
    pub fn write_to_over_tls(&self, state_dir: &Path, tls: &BundleTls) -> anyhow::Result<()> {
        self.agent_credentials_over_tls(tls)?.write(state_dir)?;
        Ok(())
    }
}

impl TestEnv {
    /// A fresh database with the seven roles and schemas, a vhost and a controller
    /// user with full permissions on it.
    pub async fn new() -> anyhow::Result<TestEnv> {
        TestEnv::with_admin(admin_credentials()?).await
    }

    /// [`TestEnv::new`] with its vhost and broker users on another broker
    /// of this machine (a `bundle/rabbit-cluster`, through node 1's
    /// management API): RabbitMQ's `guest` administrator on loopback, AMQP on
    /// `amqp_port`, the management API on `management_port`; the database as
    /// [`TestEnv::new`]'s. Its teardown needs that broker still running.
    pub async fn on_broker(amqp_port: u16, management_port: u16) -> anyhow::Result<TestEnv> {
        let mut admin = admin_credentials()?;
        admin.rabbitmq_api = format!("http://127.0.0.1:{management_port}");
        admin.rabbitmq_user = "guest".into();
        admin.rabbitmq_password = mesh_credentials::Secret::new("guest".into());
        admin.amqp_url =
            mesh_credentials::Secret::new(format!("amqp://guest:guest@127.0.0.1:{amqp_port}"));
        TestEnv::with_admin(admin).await
    }

    async fn with_admin(admin: AdminCredentials) -> anyhow::Result<TestEnv> {
        let id = format!("t{}", hex::encode(rand::random::<[u8; 4]>()));
        let names = Names::for_test(&id);
        let key_dir = std::env::temp_dir().join(format!("mesh-{id}"));
        let signer = DeclarationSigner::from_seed(rand::random());
        let env = TestEnv {
            id,
            admin,
            names,
            secrets: Secrets::generate(),
            signer,
            key_dir,
            admin_token: mesh_protocol::new_token("mesh_at_", rand::random()),
            torn_down: false,
        };
        write_signing_key(&env.signing_key_path(), &env.signer)
            .context("writing the test signing key")?;
        MasterKeys::new(vec![MasterKey::new("m-test", rand::random())])
            .write(&env.master_keys_path())
            .context("writing the test secrets master keyring")?;
        let (ca_cert, ca_key) = env.ca_paths();
        mesh_credentials::pki::MeshCa::generate(&format!("mesh CA {}", env.id))
            .and_then(|ca| ca.write(&ca_cert, &ca_key))
            .context("writing the test mesh CA")?;
        // On failure `env` is dropped, which removes whatever was created.
        provision::provision(&env.admin, &env.names, &env.secrets)
            .await
            .with_context(|| format!("provisioning test environment {}", env.id))?;
        Ok(env)
    }

    /// The unique id, `t` + 8 hex digits.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The database URL of `context`'s own role on this environment's database.
    ///
    /// # Panics
    /// When `context` is not one of [`CONTEXTS`] (a bug in the test).
    pub fn database_url(&self, context: &str) -> String {
        let secret = self
            .secrets
            .roles
            .get(context)
            .unwrap_or_else(|| panic!("unknown context `{context}`; known: {CONTEXTS:?}"));
        provision::postgres_url(
            &self.admin,
            &self.names.role(context),
            &secret.value,
            &self.names.database,
        )
        .unwrap_or_else(|e| panic!("{e}"))
    }

    /// The admin role's URL on this environment's database.
    pub fn admin_database_url(&self) -> String {
        provision::admin_url_on(&self.admin, &self.names.database).unwrap_or_else(|e| panic!("{e}"))
    }

    /// The controller's credentials for this environment (all seven databases,
    /// the signing key file, the identity management account, the first admin
    /// token's hash).
    pub fn controller_credentials(&self) -> ControllerCredentials {
        let mut c = provision::controller_credentials(&self.admin, &self.names, &self.secrets)
            .unwrap_or_else(|e| panic!("{e}"));
        c.signing_key_file = Some(self.signing_key_path());
        c.master_keys_file = Some(self.master_keys_path());
        c.bootstrap_admin_token_sha256 = Some(mesh_protocol::token_sha256_hex(&self.admin_token));
        let (ca_cert, ca_key) = self.ca_paths();
        c.ca_certificate_file = Some(ca_cert);
        c.ca_key_file = Some(ca_key);
        c
    }

    /// This environment's own mesh CA: (certificate, key) files, the key mode
    /// 0600. Named in [`TestEnv::controller_credentials`]; what the controller
    /// signs with (its HTTPS certificate, nodes' certificates). The broker's
    /// TLS listener does not know it: a test that connects over AMQPS uses
    /// [`bundle_tls`] instead.
    pub fn ca_paths(&self) -> (PathBuf, PathBuf) {
        (self.key_dir.join("ca.pem"), self.key_dir.join("ca.key"))
    }

    /// This environment's mesh CA, loaded.
    pub fn ca(&self) -> anyhow::Result<mesh_credentials::pki::MeshCa> {
        let (cert, key) = self.ca_paths();
        Ok(mesh_credentials::pki::MeshCa::load(&cert, &key)?)
    }

    /// Where this environment's controller signing key is (mode 0600).
    pub fn signing_key_path(&self) -> PathBuf {
        self.key_dir.join(SIGNING_KEY_FILE)
    }

    /// Where this environment's secrets master keyring is (mode 0600).
    pub fn master_keys_path(&self) -> PathBuf {
        self.key_dir.join(MASTER_KEYS_FILE)
    }

    /// This environment's controller signing key (tests sign or forge with it).
    pub fn signer(&self) -> &DeclarationSigner {
        &self.signer
    }

    /// The controller's public key (hex), as agents hold it.
    pub fn controller_public_key(&self) -> String {
        self.signer.public_key_hex()
    }

    /// The first admin API token: the controller creates `bootstrap-admin` with
    /// its hash at start.
    pub fn admin_token(&self) -> &str {
        &self.admin_token
    }

    /// The identity context's management API account of this environment.
    pub fn identity_management(&self) -> BrokerManagement {
        self.controller_credentials()
            .broker_management
            .unwrap_or_else(|| panic!("provisioning always sets broker_management"))
    }

    /// Writes [`TestEnv::controller_credentials`] as TOML to `path` (mode 0600).
    pub fn write_controller_credentials(&self, path: &Path) -> anyhow::Result<()> {
        self.controller_credentials().write(path)?;
        Ok(())
    }

    /// The controller user's AMQP URL on this environment's vhost.
    pub fn controller_amqp_url(&self) -> String {
        self.controller_credentials().broker_url.expose().clone()
    }

    /// The admin user's AMQP URL on this environment's vhost (full permissions
    /// there), for inspecting queues and publishing test messages.
    pub fn admin_amqp_url(&self) -> String {
        provision::amqp_url(
            &self.admin,
            &self.admin.rabbitmq_user,
            self.admin.rabbitmq_password.expose(),
            &self.names.vhost,
        )
        .unwrap_or_else(|e| panic!("{e}"))
    }

    /// This environment's vhost.
    pub fn vhost(&self) -> &str {
        &self.names.vhost
    }

    /// The admin credentials in use (for tests that inspect the broker's API).
    pub fn admin_credentials(&self) -> &AdminCredentials {
        &self.admin
    }

    /// The environment's names (database, role prefix, vhost, controller user).
    pub fn names(&self) -> &Names {
        &self.names
    }

    /// A node user `<id>-<suffix>` with a node's permissions on this vhost: write
    /// `reports` with routing keys `<node>.*`, read `decl.<node>`, configure nothing.
    /// Refused, as `mesh-bundle node-add` is, for a node revoked in this
    /// environment (decision 0050).
    pub async fn add_node(&self, suffix: &str) -> anyhow::Result<NodeCredentials> {
        let node = NodeId::parse(&format!("{}-{suffix}", self.id))
            .with_context(|| format!("node suffix `{suffix}`"))?;
        let controller_key = PublicKey::from_hex(&self.controller_public_key())
            .context("the environment's controller key")?;
        let creds = provision::add_node(
            &self.admin,
            &self.names,
            &node,
            &Secret::generate(),
            &controller_key,
            &mut Steps::default(),
        )
        .await?;
        Ok(NodeCredentials::from_agent(&creds))
    }

    /// Drops the database (terminating its sessions), the roles, the vhost, the
    /// controller user and every node user of this environment.
    pub async fn teardown(mut self) -> anyhow::Result<()> {
        self.torn_down = true;
        // Every step of the cleanup is idempotent; the management API can
        // answer a passing 500 on a loaded machine: try again, twice at most.
        let mut attempt = 1;
        loop {
            match cleanup(&self.admin, &self.id, &self.names).await {
                Err(e) if attempt < 3 => {
                    eprintln!("teardown of {} failed ({e:#}); trying again", self.id);
                    attempt += 1;
                    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                }
                result => return result,
            }
        }
    }
}

fn remove_key_dir(id: &str) {
    let _ = std::fs::remove_dir_all(std::env::temp_dir().join(format!("mesh-{id}")));
}

async fn cleanup(admin: &AdminCredentials, id: &str, names: &Names) -> anyhow::Result<()> {
    remove_key_dir(id);
    let rabbit = Rabbit::new(admin);
    // Broker first: deleting the vhost closes every connection to it.
    let mut first_err: Option<anyhow::Error> = None;
    if let Err(e) = rabbit.delete_vhost(&names.vhost).await {
        first_err.get_or_insert(e.into());
    }
    match rabbit.users().await {
        Ok(users) => {
            let node_prefix = format!("{id}-");
            for u in users.iter().filter(|u| {
                u.starts_with(&node_prefix)
                    || **u == names.controller_user
                    || **u == names.identity_user
            }) {
                if let Err(e) = rabbit.delete_user(u).await {
                    first_err.get_or_insert(e.into());
                }
            }
        }
        Err(e) => {
            first_err.get_or_insert(e.into());
        }
    }
    if let Err(e) = provision::drop_database_and_roles(admin, names).await {
        first_err.get_or_insert(e.into());
    }
    match first_err {
        Some(e) => Err(e.context(format!("tearing down test environment {id}"))),
        None => Ok(()),
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        if self.torn_down {
            return;
        }
        self.torn_down = true;
        let admin = self.admin.clone();
        let id = self.id.clone();
        let names = self.names.clone();
        let handle = std::thread::spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("testkit: cannot clean up {id}: no runtime: {e}");
                    return;
                }
            };
            if let Err(e) = rt.block_on(cleanup(&admin, &id, &names)) {
                eprintln!("testkit: cleanup of {id} failed: {e:#}");
            }
        });
        let _ = handle.join();
    }
}

/// A directory that the units of a test's agent may write into (a test's
/// marks, their output): units run as their module's own user (decision
/// 0051), and a test's temporary directory is its owner's alone (0700).
/// Makes `dir` world-writable with the sticky bit (as /tmp), and lets anyone
/// through its parent.
pub fn open_to_units(dir: &std::path::Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o1777))?;
    if let Some(parent) = dir.parent() {
        let mode = std::fs::metadata(parent)?.permissions().mode();
        std::fs::set_permissions(parent, std::fs::Permissions::from_mode(mode | 0o111))?;
    }
    Ok(())
}

/// A temporary directory for a test's agent root, or for files its units
/// write or read: open to units as [`open_to_units`] makes it.
pub fn units_tempdir() -> std::io::Result<tempfile::TempDir> {
    let dir = tempfile::tempdir()?;
    open_to_units(dir.path())?;
    Ok(dir)
}
