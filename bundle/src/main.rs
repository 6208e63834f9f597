//! `mesh-bundle`: the Rust half of `bundle/up`.
//!
//! - `mesh-bundle probe`: the conformance probe of PostgreSQL and the broker
//!   (exit 1 naming the failed check);
//! - `mesh-bundle tls`: the mesh CA (made once) and the broker's server
//!   certificate (issued again when a third of its lifetime remains);
//! - `mesh-bundle up`: writes the admin credentials file, provisions the production
//!   names with them and writes the controller credentials file (naming the CA
//!   and the advertised endpoints). Idempotent.
//! - `mesh-bundle pack`: one archive of the mesh's packages and every Debian
//!   package the foundation needs (`bundle/up --from` installs from it);
//! - `mesh-bundle verify`: an extracted archive against its manifest and this
//!   host, before anything is installed from it;
//! - `mesh-bundle recovery-key`, `backup`, `restore`: a fresh recovery key;
//!   one consistent archive of every context schema, the keys and the broker's
//!   definitions, sealed under it; that archive verified and installed on a
//!   new host (decision 0040).

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use mesh_bundle::probe::ProbeError;
use mesh_bundle::provision::{self, Names, Secrets};
use mesh_credentials::key::{
    ADMIN_TOKEN_FILE, SIGNING_KEY_FILE, read_signing_key, read_signing_key_if_exists, read_token,
    write_signing_key, write_token,
};
use mesh_credentials::{
    AdminCredentials, AgentCredentials, ControllerCredentials, MASTER_KEYS_FILE, MasterKey,
    MasterKeys, etc_dir,
};
use mesh_protocol::{DeclarationSigner, PublicKey, Secret};

#[derive(Parser)]
#[command(
    name = "mesh-bundle",
    about = "Raises the foundation of a mesh on its first host"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args, Clone)]
struct Endpoints {
    /// PostgreSQL host:port the URLs point at.
    #[arg(long, default_value = "127.0.0.1:5432")]
    postgres: String,
    /// RabbitMQ AMQP host:port the URLs point at.
    #[arg(long, default_value = "127.0.0.1:5672")]
    amqp: String,
    /// RabbitMQ management API base URL.
    #[arg(long, default_value = "http://127.0.0.1:15672")]
    rabbitmq_api: String,
}

#[derive(Subcommand)]
enum Command {
    /// Prove PostgreSQL is 14 or newer with autovacuum on, and that the broker
    /// enforces user_id, write and topic permissions.
    Probe {
        #[command(flatten)]
        endpoints: Endpoints,
        /// A PostgreSQL URL of any login role (the probe only reads settings).
        #[arg(long, env = "MESH_PROBE_POSTGRES_URL", hide_env_values = true)]
        postgres_url: String,
        /// A RabbitMQ administrator to create the probe's temporary vhost and user.
        #[arg(long, env = "MESH_PROBE_ADMIN_USER")]
        admin_user: String,
        #[arg(long, env = "MESH_PROBE_ADMIN_PASSWORD", hide_env_values = true)]
        admin_password: String,
    },
    /// Create a node's broker user and its agent's credentials file.
    NodeAdd(NodeAdd),
    /// Write one archive holding the mesh's packages and every Debian package
    /// the foundation needs, with a flat apt repository and a manifest, for
    /// `bundle/up --from <archive>` on a host without network. Needs network.
    Pack(Pack),
    /// Verify an extracted archive against its manifest and this host's
    /// release and architecture; print the packages to install, one a line.
    Verify {
        /// The directory the archive was extracted into (it holds mesh-bundle/).
        dir: PathBuf,
        /// This host's os-release file.
        #[arg(long, default_value = "/etc/os-release")]
        os_release: PathBuf,
        /// This host's dpkg architecture (default: `dpkg --print-architecture`).
        #[arg(long)]
        arch: Option<String>,
    },
    /// Make the mesh CA once ($MESH_ETC/ca.pem, ca.key 0600) and issue the
    /// broker's TLS certificate into --broker-dir when it is missing, not this
    /// CA's, for other names, or has a third of its lifetime or less left.
    Tls {
        /// Directory of the credential files (default /etc/mesh).
        #[arg(long, env = "MESH_ETC")]
        etc: Option<PathBuf>,
        /// Where RabbitMQ reads ca.pem, broker.pem and broker.key.
        #[arg(long, default_value = mesh_bundle::tls::BROKER_TLS_DIR)]
        broker_dir: PathBuf,
        /// The address nodes reach this host at (a name in the certificate).
        #[arg(long, env = "MESH_ADVERTISE")]
        advertise: Option<String>,
    },
    /// Write the admin credentials; provision db `mesh`, roles, schemas, vhost
    /// `mesh`, user `mesh_controller`; write the controller credentials.
    Up {
        #[command(flatten)]
        endpoints: Endpoints,
        /// Directory of the credential files (default /etc/mesh).
        #[arg(long, env = "MESH_ETC")]
        etc: Option<PathBuf>,
        /// Password of the PostgreSQL role mesh_admin.
        #[arg(long, env = "MESH_ADMIN_PG_PASSWORD", hide_env_values = true)]
        admin_pg_password: String,
        /// Password of the RabbitMQ user mesh-admin.
        #[arg(long, env = "MESH_ADMIN_RABBITMQ_PASSWORD", hide_env_values = true)]
        admin_rabbitmq_password: String,
        /// The address nodes reach this host at: written to the controller's
        /// credentials as `advertise_api` (https://<address>:<api-port>) and
        /// `advertise_broker` (<address>:<amqps-port>). Default: none (a mesh
        /// on loopback only).
        #[arg(long, env = "MESH_ADVERTISE")]
        advertise: Option<String>,
        /// The port of the controller's HTTPS API in `advertise_api`.
        #[arg(long, default_value_t = 7443)]
        api_port: u16,
        /// The broker's AMQPS port in `advertise_broker`.
        #[arg(long, default_value_t = 5671)]
        amqps_port: u16,
    },
    /// Write a fresh recovery key (mode 0600; an existing file is never
    /// replaced). Keep it off the controller's host.
    RecoveryKey {
        #[arg(long)]
        out: PathBuf,
    },
    /// One consistent archive (mode 0600) of every context schema (one
    /// pg_dump, one snapshot), the controller's credentials and keys, the
    /// mesh CA and the broker's definitions, sealed under the recovery key.
    Backup(BackupArgs),
    /// Verify a backup (everything, before anything is installed), then
    /// restore it: key files, controller credentials, roles, schemas (each as
    /// its own role), the broker's definitions.
    Restore(RestoreArgs),
}

#[derive(clap::Args)]
struct BackupArgs {
    /// The archive to write (a tar; replaced atomically).
    #[arg(long)]
    out: PathBuf,
    /// The recovery key file (`mesh-bundle recovery-key`).
    #[arg(long)]
    recovery_key: PathBuf,
    /// Directory of the credential files (default /etc/mesh).
    #[arg(long, env = "MESH_ETC")]
    etc: Option<PathBuf>,
    /// The controller's credentials (default <etc>/controller-credentials.toml).
    #[arg(long)]
    controller_credentials: Option<PathBuf>,
    /// The administrator's credentials (default <etc>/admin-credentials.toml).
    #[arg(long)]
    admin_credentials: Option<PathBuf>,
    /// Directory of pg_dump (default: PATH).
    #[arg(long)]
    pg_bin: Option<PathBuf>,
    /// Also keep the archive in an `s3.bucket` granted to a module on this
    /// node: the grant's credential file
    /// (`/modules/<module>/secrets/grant-<name>.env`), the object named as
    /// the archive's file.
    #[arg(long)]
    to_bucket: Option<PathBuf>,
}

#[derive(clap::Args)]
struct RestoreArgs {
    /// The archive `mesh-bundle backup` wrote.
    #[arg(long)]
    archive: PathBuf,
    /// The recovery key it was sealed under.
    #[arg(long)]
    recovery_key: PathBuf,
    /// Where the key files and the controller's credentials go (default /etc/mesh).
    #[arg(long, env = "MESH_ETC")]
    etc: Option<PathBuf>,
    /// This host's administrator credentials (default <etc>/admin-credentials.toml;
    /// with MESH_ADMIN_PG_PASSWORD and MESH_ADMIN_RABBITMQ_PASSWORD, as bundle/up
    /// passes them, they are made from those and written there).
    #[arg(long)]
    admin_credentials: Option<PathBuf>,
    #[command(flatten)]
    endpoints: Endpoints,
    /// Only verify the archive with the key; install nothing.
    #[arg(long)]
    check: bool,
    /// Only install the archive's mesh CA into <etc> (bundle/up, before it
    /// issues the broker's certificate from it).
    #[arg(long, conflicts_with = "check")]
    ca_only: bool,
    /// Replace what the target holds (context schemas, the vhost, other key files).
    #[arg(long)]
    force: bool,
    /// Leave the broker alone (it kept its state): database and keys only.
    #[arg(long)]
    no_broker: bool,
    /// Directory of pg_restore (default: PATH).
    #[arg(long)]
    pg_bin: Option<PathBuf>,
}

fn recovery_key(out: &std::path::Path) -> anyhow::Result<()> {
    let key = mesh_bundle::backup::RecoveryKey::generate();
    key.write_new(out)?;
    println!(
        "  changed  recovery key {} written to {} (0600): keep it off this host, apart from the backups",
        key.id(),
        out.display()
    );
    Ok(())
}

async fn backup(args: BackupArgs) -> anyhow::Result<()> {
    use mesh_bundle::backup;
    let started = std::time::Instant::now();
    let etc = args.etc.unwrap_or_else(etc_dir);
    let key = backup::RecoveryKey::read(&args.recovery_key)?;
    // The bucket's grant is read first: a backup that cannot be kept where
    // it was asked to be is refused before anything is dumped.
    let bucket = args
        .to_bucket
        .as_deref()
        .map(mesh_bundle::s3::BucketGrant::read)
        .transpose()?;
    let admin_path = args
        .admin_credentials
        .unwrap_or_else(|| etc.join(AdminCredentials::FILE));
    let admin = AdminCredentials::load(&admin_path)?;
    let src = backup::BackupSource {
        controller_file: args
            .controller_credentials
            .unwrap_or_else(|| etc.join(ControllerCredentials::FILE)),
        admin,
        admin_token_file: Some(etc.join(ADMIN_TOKEN_FILE)),
        pg_bin: args.pg_bin,
    };
    let done = backup::backup(&src, &key, &args.out).await?;
    let m = &done.manifest;
    for s in &m.schemas {
        println!(
            "  ok       schema {} ({}): {} migration(s), newest {}",
            s.name,
            s.role,
            s.migrations.len(),
            s.migrations
                .last()
                .map(|x| format!("V{}__{}", x.version, x.name))
                .unwrap_or_else(|| "none".into())
        );
    }
    println!(
        "  ok       broker vhost {}: {} user(s), {} queue(s), {} exchange(s), {} polic(ies)",
        m.broker.vhost,
        m.broker.users.len(),
        m.broker.queues,
        m.broker.exchanges,
        m.broker.policies
    );
    println!(
        "  ok       {}: {} files, {} bytes, snapshot {} at {}, sealed under recovery key {}",
        args.out.display(),
        m.files.len() + 1,
        done.bytes,
        m.postgres.snapshot,
        m.created_at,
        m.recovery_key_id
    );
    println!("  ok       manifest sha256 {}", done.manifest_sha256);
    if let Some(bucket) = bucket {
        let object = args
            .out
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "--out {}: no file name to name the object",
                    args.out.display()
                )
            })?
            .to_owned();
        let body = std::fs::read(&args.out)
            .with_context(|| format!("reading {} back", args.out.display()))?;
        bucket.put(&object, body).await?;
        println!(
            "  changed  s3://{}/{object} at {}: kept in the granted bucket",
            bucket.bucket, bucket.host
        );
    }
    println!(
        "mesh-bundle backup: done in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

async fn restore(args: RestoreArgs) -> anyhow::Result<()> {
    use mesh_bundle::backup;
    let started = std::time::Instant::now();
    let etc = args.etc.unwrap_or_else(etc_dir);
    let key = backup::RecoveryKey::read(&args.recovery_key)?;
    let opened = backup::verify(&args.archive, &key)
        .map_err(|e| anyhow::anyhow!("REFUSED: {e}; nothing was installed"))?;
    let m = &opened.manifest;
    println!(
        "  ok       {} verified: {} files match the manifest and open with recovery key {}",
        args.archive.display(),
        m.files.len(),
        m.recovery_key_id
    );
    println!(
        "  ok       backup {} of database {} (PostgreSQL {}), vhost {} (RabbitMQ {}), taken {} by mesh {}",
        m.backup_id,
        m.postgres.database,
        m.postgres.server_version,
        m.broker.vhost,
        m.broker.rabbitmq_version,
        m.created_at,
        m.mesh_version
    );
    if args.check {
        println!("mesh-bundle restore --check: nothing installed");
        return Ok(());
    }
    if args.ca_only {
        for line in backup::install_ca(&opened, &etc, args.force)? {
            println!("  {line}");
        }
        return Ok(());
    }
    let pg_pw = std::env::var("MESH_ADMIN_PG_PASSWORD").ok();
    let mq_pw = std::env::var("MESH_ADMIN_RABBITMQ_PASSWORD").ok();
    let admin_path = args
        .admin_credentials
        .unwrap_or_else(|| etc.join(AdminCredentials::FILE));
    let admin = match (pg_pw, mq_pw) {
        (Some(pg), Some(mq)) => {
            let admin = admin_for(&args.endpoints, "mesh_admin", &pg, "mesh-admin", &mq);
            if admin.write(&admin_path)? {
                println!("  changed  {} written", admin_path.display());
            }
            admin
        }
        _ => AdminCredentials::load(&admin_path)?,
    };
    let opts = backup::RestoreOptions {
        etc,
        admin,
        force: args.force,
        broker: !args.no_broker,
        pg_bin: args.pg_bin,
    };
    for line in backup::restore(&opened, &opts).await? {
        println!("  {line}");
    }
    println!(
        "mesh-bundle restore: done in {:.1} s; start the controller with {}",
        started.elapsed().as_secs_f64(),
        opts.etc.join(ControllerCredentials::FILE).display()
    );
    Ok(())
}

/// `mesh-bundle tls`: the CA and the broker's certificate. Prints what it did;
/// the line `broker certificate: issued` tells bundle/up that RabbitMQ must
/// re-read its files.
fn tls(
    etc: Option<PathBuf>,
    broker_dir: &std::path::Path,
    advertise: Option<&str>,
) -> anyhow::Result<()> {
    use mesh_bundle::tls;
    let etc = etc.unwrap_or_else(etc_dir);
    let (ca, made) = tls::ensure_ca(&etc)?;
    let (cert, _) = tls::ca_paths(&etc);
    println!(
        "  {:<8} {} ({})",
        if made { "changed" } else { "ok" },
        cert.display(),
        if made {
            "mesh CA created"
        } else {
            "mesh CA exists"
        }
    );
    println!("  ok       CA pin {}", ca.pin());
    let hostname = tls::hostname();
    let names = tls::broker_names(advertise, hostname.as_deref());
    let got = tls::ensure_broker_certificate(
        &ca,
        broker_dir,
        &names,
        tls::BROKER_CERT_LIFETIME,
        chrono::Utc::now(),
    )?;
    match &got.issued_because {
        Some(why) => println!(
            "  changed  broker certificate: issued for {} ({why}); valid until {}, issued again from {}",
            names.join(", "),
            got.not_after,
            got.renew_at
        ),
        None => println!(
            "  ok       broker certificate for {} valid until {}, issued again from {}",
            names.join(", "),
            got.not_after,
            got.renew_at
        ),
    }
    if got.ca_copy_written {
        println!(
            "  changed  {}/{} written",
            broker_dir.display(),
            tls::CA_CERT_FILE
        );
    }
    Ok(())
}

/// `https://<address>:<port>` and `<address>:<port>`, brackets around IPv6.
fn advertised(address: &str, api_port: u16, amqps_port: u16) -> anyhow::Result<(String, String)> {
    let address = address.trim();
    let host = if address.parse::<std::net::Ipv6Addr>().is_ok() {
        format!("[{address}]")
    } else {
        address.to_owned()
    };
    let api = format!("https://{host}:{api_port}");
    let broker = format!("{host}:{amqps_port}");
    mesh_credentials::advertise::check_api_url(&api)
        .map_err(|e| anyhow::anyhow!("MESH_ADVERTISE / --advertise: {e}"))?;
    mesh_protocol::parse_host_port(&broker)
        .map_err(|e| anyhow::anyhow!("MESH_ADVERTISE / --advertise: {e}"))?;
    Ok((api, broker))
}

/// Without the controller (before it runs, or for the local mesh): create a
/// node's broker user on vhost `mesh` with a node's rights and write
/// `<state-dir>/credentials.toml` for its agent, with the controller's public
/// signing key. Idempotent: an existing credentials file's password is kept.
/// A revoked node is refused (exit status 3) until an admin re-admits it
/// with `meshctl node readmit <id>` (decision 0050).
/// The normal way to enrol a node is `meshctl node add` + `mesh-agent join`.
#[derive(clap::Args)]
struct NodeAdd {
    /// The node's id (its broker user): `[a-z0-9-]`, 1 to 63 characters.
    name: String,
    /// The agent's state directory.
    #[arg(long)]
    state_dir: PathBuf,
    /// Directory of the credential files (default /etc/mesh).
    #[arg(long, env = "MESH_ETC")]
    etc: Option<PathBuf>,
}

/// `mesh-bundle node-add`'s exit status when it refused a revoked node, so
/// that a script (bundle/local-mesh) tells it from a failure.
const EXIT_REVOKED: u8 = 3;

async fn node_add(args: NodeAdd) -> anyhow::Result<()> {
    let node = mesh_protocol::NodeId::parse(&args.name)?;
    let etc = args.etc.unwrap_or_else(etc_dir);
    let admin_path = etc.join(AdminCredentials::FILE);
    let admin = AdminCredentials::load_if_exists(&admin_path)?
        .with_context(|| format!("{} is missing: run bundle/up first", admin_path.display()))?;
    let key_path = etc.join(SIGNING_KEY_FILE);
    let signer = read_signing_key_if_exists(&key_path)?
        .with_context(|| format!("{} is missing: run bundle/up first", key_path.display()))?;
    let controller_key = PublicKey::from_hex(&signer.public_key_hex())?;
    // An existing file of this node keeps its password (running agents keep working).
    let existing = AgentCredentials::load_if_exists(&args.state_dir)?;
    let secret = match existing.as_ref().filter(|e| e.node == node) {
        Some(e) => provision::Secret::known(
            e.password()
                .with_context(|| {
                    format!(
                        "{}: field `broker_url` holds no password",
                        AgentCredentials::path_in(&args.state_dir).display()
                    )
                })?
                .expose()
                .clone(),
        ),
        None => provision::Secret::generate(),
    };
    let mut steps = provision::Steps::default();
    // A revoked node is refused here, before anything changes (decision 0050).
    let creds = provision::add_node(
        &admin,
        &Names::production(),
        &node,
        &secret,
        &controller_key,
        &mut steps,
    )
    .await?;
    let written = creds.write(&args.state_dir)?;
    println!(
        "node {node}: {} change(s); credentials in {}",
        steps.changed() + usize::from(written),
        AgentCredentials::path_in(&args.state_dir).display()
    );
    Ok(())
}

#[derive(clap::Args)]
struct Pack {
    /// The archive to write: .tar, .tar.gz (.tgz), .tar.xz or .tar.zst. A
    /// minimal Debian 12 extracts .tar and .tar.gz without installing anything.
    #[arg(long)]
    out: PathBuf,
    /// Where mesh-agent_*.deb and mesh-controller_*.deb are (bundle/package
    /// writes them there); the newest version of each is packed.
    #[arg(long, default_value = "target/debian")]
    debs: PathBuf,
    /// apt's lists and downloaded packages, kept so a second pack downloads
    /// no package again.
    #[arg(long, default_value = "/var/cache/mesh-bundle")]
    cache: PathBuf,
    /// dpkg architecture to pack for (default: this host's).
    #[arg(long)]
    arch: Option<String>,
    /// The Debian mirror.
    #[arg(long, default_value = "http://deb.debian.org/debian")]
    mirror: String,
    /// The Debian security mirror.
    #[arg(long, default_value = "http://deb.debian.org/debian-security")]
    security_mirror: String,
    /// The keyring the mirrors' Release files are checked with.
    #[arg(long, default_value = "/usr/share/keyrings/debian-archive-keyring.gpg")]
    keyring: PathBuf,
}

fn dpkg_arch() -> anyhow::Result<String> {
    let out = std::process::Command::new("dpkg")
        .arg("--print-architecture")
        .output()
        .context("dpkg --print-architecture")?;
    anyhow::ensure!(out.status.success(), "dpkg --print-architecture failed");
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn pack(args: Pack) -> anyhow::Result<()> {
    use mesh_bundle::carry;
    let arch = match args.arch {
        Some(a) => a,
        None => dpkg_arch()?,
    };
    let opts = carry::PackOptions {
        out: args.out,
        debs: args.debs,
        cache: args.cache,
        architecture: arch,
        mirror: args.mirror,
        security_mirror: args.security_mirror,
        keyring: args.keyring,
    };
    let started = std::time::Instant::now();
    let packed = carry::pack(&opts)?;
    let m = &packed.manifest;
    let debs = m
        .files
        .iter()
        .filter(|f| matches!(f.kind, carry::Kind::Deb | carry::Kind::Mesh))
        .count();
    println!(
        "  ok       {}: {debs} packages for {} {} ({} MB), mesh {}",
        opts.out.display(),
        m.release,
        m.architecture,
        packed.bytes / 1_000_000,
        m.mesh_version
    );
    println!(
        "  ok       {} downloaded this run (cache {})",
        packed.downloaded,
        opts.cache.display()
    );
    println!("  ok       manifest sha256 {}", packed.manifest_sha256);
    println!(
        "mesh-bundle pack: done in {} s; on the host: bundle/up --from {}",
        started.elapsed().as_secs(),
        opts.out.display()
    );
    Ok(())
}

fn verify(
    dir: &std::path::Path,
    os_release: &std::path::Path,
    arch: Option<String>,
) -> anyhow::Result<()> {
    use mesh_bundle::carry;
    let text =
        std::fs::read_to_string(os_release).with_context(|| format!("{}", os_release.display()))?;
    let host = carry::Release::from_os_release(&text);
    let arch = match arch {
        Some(a) => a,
        None => dpkg_arch()?,
    };
    let v = carry::verify(dir, &host, &arch)?;
    let m = &v.manifest;
    eprintln!(
        "  ok       {} files ({} MB) match the manifest (sha256 {})",
        m.files.len(),
        v.bytes / 1_000_000,
        v.manifest_sha256
    );
    eprintln!(
        "  ok       packed {} for {} {}, mesh {}",
        m.packed_at, m.release, m.architecture, m.mesh_version
    );
    for p in &m.install {
        println!("{p}");
    }
    Ok(())
}

fn admin_for(
    e: &Endpoints,
    pg_user: &str,
    pg_pw: &str,
    mq_user: &str,
    mq_pw: &str,
) -> AdminCredentials {
    let enc = |s: &str| urlencoding::encode(s).into_owned();
    AdminCredentials {
        postgres_url: Secret::new(format!(
            "postgres://{}:{}@{}/postgres",
            enc(pg_user),
            enc(pg_pw),
            e.postgres
        )),
        rabbitmq_api: e.rabbitmq_api.trim_end_matches('/').to_string(),
        rabbitmq_user: mq_user.to_string(),
        rabbitmq_password: Secret::new(mq_pw.to_string()),
        amqp_url: Secret::new(format!("amqp://{}:{}@{}", enc(mq_user), enc(mq_pw), e.amqp)),
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Probe {
            endpoints,
            postgres_url,
            admin_user,
            admin_password,
        } => {
            let mut admin = admin_for(&endpoints, "", "", &admin_user, &admin_password);
            admin.postgres_url = mesh_credentials::Secret::new(postgres_url);
            match mesh_bundle::probe::run(&admin).await {
                Ok(report) => {
                    for p in report.passed {
                        println!("  ok   {}: {}", p.check, p.detail);
                    }
                    ExitCode::SUCCESS
                }
                Err(e @ ProbeError::Failed { .. }) => {
                    eprintln!("  FAIL {e}");
                    eprintln!("refusing: PostgreSQL or the broker is not what the mesh rests on");
                    ExitCode::FAILURE
                }
                Err(e) => {
                    eprintln!("  FAIL conformance probe could not run: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::NodeAdd(args) => match node_add(args).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e)
                if matches!(
                    e.downcast_ref::<provision::ProvisionError>(),
                    Some(provision::ProvisionError::Revoked { .. })
                ) =>
            {
                eprintln!("mesh-bundle node-add refused: {e:#}");
                ExitCode::from(EXIT_REVOKED)
            }
            Err(e) => {
                eprintln!("mesh-bundle node-add failed: {e:#}");
                ExitCode::FAILURE
            }
        },
        Command::Pack(args) => match pack(args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("mesh-bundle pack failed: {e:#}");
                ExitCode::FAILURE
            }
        },
        Command::Verify {
            dir,
            os_release,
            arch,
        } => match verify(&dir, &os_release, arch) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("  REFUSED  {e:#}");
                ExitCode::FAILURE
            }
        },
        Command::Tls {
            etc,
            broker_dir,
            advertise,
        } => match tls(etc, &broker_dir, advertise.as_deref()) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("mesh-bundle tls failed: {e:#}");
                ExitCode::FAILURE
            }
        },
        Command::Up {
            endpoints,
            etc,
            admin_pg_password,
            admin_rabbitmq_password,
            advertise,
            api_port,
            amqps_port,
        } => match up(
            &endpoints,
            etc,
            &admin_pg_password,
            &admin_rabbitmq_password,
            advertise.as_deref().map(|a| (a, api_port, amqps_port)),
        )
        .await
        {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("mesh-bundle up failed: {e:#}");
                ExitCode::FAILURE
            }
        },
        Command::RecoveryKey { out } => match recovery_key(&out) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("mesh-bundle recovery-key failed: {e:#}");
                ExitCode::FAILURE
            }
        },
        Command::Backup(args) => match backup(args).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("mesh-bundle backup failed: {e:#}");
                ExitCode::FAILURE
            }
        },
        Command::Restore(args) => match restore(args).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("mesh-bundle restore: {e:#}");
                ExitCode::FAILURE
            }
        },
    }
}

async fn up(
    endpoints: &Endpoints,
    etc: Option<PathBuf>,
    pg_pw: &str,
    mq_pw: &str,
    advertise: Option<(&str, u16, u16)>,
) -> anyhow::Result<()> {
    let etc = etc.unwrap_or_else(etc_dir);
    let admin = admin_for(endpoints, "mesh_admin", pg_pw, "mesh-admin", mq_pw);
    let admin_path = etc.join(AdminCredentials::FILE);
    let controller_path = etc.join(ControllerCredentials::FILE);
    let mut changes = 0usize;

    if admin.write(&admin_path)? {
        println!("  changed  {} written", admin_path.display());
        changes += 1;
    } else {
        println!("  ok       {} unchanged", admin_path.display());
    }

    provision::Rabbit::new(&admin)
        .wait_ready(std::time::Duration::from_secs(60))
        .await
        .context("rabbitmq management api as mesh-admin")?;

    let existing = ControllerCredentials::load_if_exists(&controller_path)?;
    let secrets = Secrets::from_existing(existing.as_ref());
    let names = Names::production();
    let steps = provision::provision(&admin, &names, &secrets).await?;
    for s in &steps.0 {
        println!(
            "  {:<8} {}",
            if s.changed { "changed" } else { "ok" },
            s.what
        );
    }
    changes += steps.changed();

    // The controller's declaration-signing key: created once, kept forever (a new
    // key would need every agent to learn it; see docs/security.md on rotation).
    let key_path = etc.join(SIGNING_KEY_FILE);
    if key_path.exists() {
        read_signing_key(&key_path)?;
        println!("  ok       {} exists", key_path.display());
    } else {
        let signer = DeclarationSigner::from_seed(rand::random());
        write_signing_key(&key_path, &signer)?;
        println!("  changed  {} created", key_path.display());
        changes += 1;
    }
    // The secrets master keyring: created once; the controller rotates it
    // (POST /v1/secrets/master-key/rotate), never the bundle.
    let master_path = etc.join(MASTER_KEYS_FILE);
    if MasterKeys::load_if_exists(&master_path)?.is_some() {
        println!("  ok       {} exists", master_path.display());
    } else {
        let id = format!("m-{}", hex::encode(rand::random::<[u8; 4]>()));
        MasterKeys::new(vec![MasterKey::new(id, rand::random())]).write(&master_path)?;
        println!("  changed  {} created", master_path.display());
        changes += 1;
    }
    // The first admin API token: created once, printed once; the controller
    // only ever sees its hash.
    let token_path = etc.join(ADMIN_TOKEN_FILE);
    let token = match read_token(&token_path)? {
        Some(t) => {
            println!("  ok       {} exists", token_path.display());
            t
        }
        None => {
            let t = Secret::new(mesh_protocol::new_token("mesh_at_", rand::random()));
            write_token(&token_path, &t)?;
            println!("  changed  {} created", token_path.display());
            println!();
            println!(
                "  first admin API token (shown once; also in {}):",
                token_path.display()
            );
            println!("    {}", t.expose());
            println!(
                "  it ends 90 days after the controller first starts (`meshctl get tokens` shows when);"
            );
            println!(
                "  before then make one of your own and revoke this one: `meshctl token create --role admin --name <you>`,"
            );
            println!(
                "  then `meshctl token revoke <id of bootstrap-admin>` (or `meshctl token rotate <id>` for a new secret)."
            );
            println!();
            changes += 1;
            t
        }
    };

    let mut creds = provision::controller_credentials(&admin, &names, &secrets)?;
    creds.signing_key_file = Some(key_path);
    creds.master_keys_file = Some(master_path);
    creds.bootstrap_admin_token_sha256 = Some(mesh_protocol::token_sha256_hex(token.expose()));
    // The mesh CA (`mesh-bundle tls` made it; made here too if it did not run):
    // the controller serves HTTPS with it and hands its certificate to nodes.
    let (_, made) = mesh_bundle::tls::ensure_ca(&etc)?;
    if made {
        println!(
            "  changed  {} created",
            etc.join(mesh_bundle::tls::CA_CERT_FILE).display()
        );
        changes += 1;
    }
    let (ca_cert, ca_key) = mesh_bundle::tls::ca_paths(&etc);
    creds.ca_certificate_file = Some(ca_cert);
    creds.ca_key_file = Some(ca_key);
    if let Some((address, api_port, amqps_port)) = advertise {
        let (api, broker) = advertised(address, api_port, amqps_port)?;
        creds.advertise_api = Some(api);
        creds.advertise_broker = Some(broker);
    }
    if creds.write(&controller_path)? {
        println!("  changed  {} written", controller_path.display());
        changes += 1;
    } else {
        println!("  ok       {} unchanged", controller_path.display());
    }
    if changes == 0 {
        println!("mesh-bundle up: nothing changed");
    } else {
        println!("mesh-bundle up: {changes} change(s)");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::advertised;

    #[test]
    fn advertised_endpoints_of_an_address() {
        assert_eq!(
            advertised("192.0.2.2", 7443, 5671).unwrap(),
            ("https://192.0.2.2:7443".into(), "192.0.2.2:5671".into())
        );
        assert_eq!(
            advertised("2001:db8::2", 7443, 5671).unwrap(),
            (
                "https://[2001:db8::2]:7443".into(),
                "[2001:db8::2]:5671".into()
            )
        );
        let err = advertised("not an address!", 7443, 5671)
            .unwrap_err()
            .to_string();
        assert!(err.contains("MESH_ADVERTISE"), "{err}");
    }
}
