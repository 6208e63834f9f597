//! The conformance probe against this machine's servers: it passes where they
//! are what the mesh rests on, and refuses, naming the check and leaving
//! nothing behind, a broker that lets a user forge `user_id`, a PostgreSQL
//! older than 14, and a PostgreSQL with autovacuum off (a throwaway cluster of
//! our own, started here and removed again).

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::path::{Path, PathBuf};
use std::process::Command;

use mesh_bundle::probe::{self, BrokerTarget, ProbeError};
use mesh_bundle::provision::Rabbit;
use sqlx::{Connection as _, PgConnection};

/// Everything conformant: the machine's broker, and a PostgreSQL of our own with
/// the defaults (autovacuum on; the shared server's setting is whatever
/// `bundle/up` or the machine left, see the live test below).
#[tokio::test]
async fn probe_passes_and_cleans_up() {
    let cluster = Cluster::start(&[]);
    let before = cluster.objects().await;
    let mut admin = mesh_testkit::admin_credentials().unwrap();
    admin.postgres_url = mesh_credentials::Secret::new(cluster.url());
    let report = probe::run(&admin).await.unwrap();
    assert_eq!(
        cluster.objects().await,
        before,
        "the probe created something"
    );
    let checks: Vec<_> = report.passed.iter().map(|p| p.check).collect();
    assert_eq!(
        checks,
        [
            "postgresql-version",
            "autovacuum",
            "control",
            "user_id",
            "write-permission",
            "topic-permission"
        ]
    );
    let rabbit = Rabbit::new(&admin);
    assert!(!rabbit.vhost_exists(&report.vhost).await.unwrap());
    assert!(!rabbit.user_exists(&report.user).await.unwrap());
}

/// A RabbitMQ user tagged `impersonator` may publish with any `user_id`: to the
/// probe that is a broker that does not enforce `user_id`. Refused, the check
/// named, its vhost and user removed.
#[tokio::test]
async fn a_broker_that_lets_the_user_forge_user_id_is_refused() {
    let admin = mesh_testkit::admin_credentials().unwrap();
    let target = BrokerTarget {
        user_tags: "impersonator".into(),
        ..BrokerTarget::fresh()
    };
    let err = probe::broker(&admin, &target).await.unwrap_err();
    match &err {
        ProbeError::Failed { check, detail } => {
            assert_eq!(*check, "user_id", "{err}");
            assert!(detail.contains("Confirmed"), "{err}");
        }
        other => panic!("expected the user_id check to fail, got {other}"),
    }
    assert!(
        err.to_string()
            .starts_with("conformance check `user_id` failed"),
        "{err}"
    );
    let rabbit = Rabbit::new(&admin);
    assert!(!rabbit.vhost_exists(&target.vhost).await.unwrap());
    assert!(!rabbit.user_exists(&target.user).await.unwrap());
}

fn failed_check(result: Result<probe::Passed, ProbeError>) -> (&'static str, String) {
    match result {
        Err(ProbeError::Failed { check, detail }) => (check, detail),
        other => panic!("expected a failed check, got {other:?}"),
    }
}

/// The version decision on `server_version_num` strings as real servers report
/// them (9.6.24, 10.23, 13.11, 14.0, 15.4, 16.2, 17.2).
#[test]
fn postgresql_older_than_14_is_refused_by_its_server_version_num() {
    for (num, version) in [
        ("90624", "9.6.24"),
        ("100023", "10.23"),
        ("130011", "13.11"),
    ] {
        let (check, detail) = failed_check(probe::check_server_version(num));
        assert_eq!(check, "postgresql-version");
        assert!(
            detail.contains(&format!("(PostgreSQL {version}) is older than 140000")),
            "{detail}"
        );
    }
    for (num, version) in [
        ("140000", "14.0"),
        ("150004", "15.4"),
        ("160002", "16.2"),
        ("170002\n", "17.2"),
    ] {
        let passed = probe::check_server_version(num).unwrap();
        assert_eq!(passed.check, "postgresql-version");
        assert!(
            passed.detail.contains(&format!("PostgreSQL {version})")),
            "{}",
            passed.detail
        );
    }
    for junk in ["", "15beta1", "-"] {
        let (check, detail) = failed_check(probe::check_server_version(junk));
        assert_eq!(check, "postgresql-version");
        assert!(detail.contains("is not a number"), "{detail}");
    }
}

#[test]
fn autovacuum_or_its_statistics_off_is_refused() {
    assert!(probe::check_autovacuum("on", "on").is_ok());
    let (check, detail) = failed_check(probe::check_autovacuum("off", "on"));
    assert_eq!(check, "autovacuum");
    assert!(detail.starts_with("autovacuum = off:"), "{detail}");
    let (check, detail) = failed_check(probe::check_autovacuum("on", "off"));
    assert_eq!(check, "autovacuum");
    assert!(detail.starts_with("track_counts = off:"), "{detail}");
}

/// The live path against this machine's shared server: it reads the real
/// `server_version_num`, `autovacuum` and `track_counts`, and comes to the
/// decision the checks make on them (a server configured with autovacuum off,
/// as some CI images are until `bundle/up` turns it on, is refused).
#[tokio::test]
async fn the_postgresql_checks_read_the_live_server() {
    let admin = mesh_testkit::admin_credentials().unwrap();
    let mut conn = PgConnection::connect(admin.postgres_url.expose())
        .await
        .unwrap();
    let mut show = async |setting: &str| -> String {
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SHOW {setting}")))
            .fetch_one(&mut conn)
            .await
            .unwrap()
    };
    let num = show("server_version_num").await;
    let autovacuum = show("autovacuum").await;
    let track_counts = show("track_counts").await;
    conn.close().await.unwrap();
    let version = probe::check_server_version(&num).expect("this machine runs PostgreSQL 14+");
    let expected = probe::check_autovacuum(&autovacuum, &track_counts)
        .map(|vacuum| vec![version.detail.clone(), vacuum.detail]);
    let got = probe::postgres(admin.postgres_url.expose())
        .await
        .map(|passed| passed.into_iter().map(|p| p.detail).collect::<Vec<_>>());
    match (got, expected) {
        (Ok(got), Ok(expected)) => assert_eq!(got, expected),
        (Err(got), Err(expected)) => assert_eq!(got.to_string(), expected.to_string()),
        (got, expected) => panic!("the probe said {got:?}, the settings say {expected:?}"),
    }
}

/// A throwaway PostgreSQL cluster of this test's own (initdb, pg_ctl, as user
/// postgres, in a temporary directory, on a free port), stopped and removed
/// when dropped.
struct Cluster {
    bin: PathBuf,
    dir: tempfile::TempDir,
    port: u16,
}

fn run_as_postgres(program: &Path, args: &[&str]) {
    let out = Command::new("runuser")
        .args(["-u", "postgres", "--"])
        .arg(program)
        .args(args)
        .current_dir("/tmp")
        .output()
        .unwrap_or_else(|e| panic!("running {program:?}: {e}"));
    assert!(
        out.status.success(),
        "{program:?} {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Cluster {
    /// Start a cluster with `settings` (`-c` options) added.
    fn start(settings: &[&str]) -> Cluster {
        let bin = std::fs::read_dir("/usr/lib/postgresql")
            .expect("PostgreSQL's binaries in /usr/lib/postgresql")
            .filter_map(|e| Some(e.ok()?.path().join("bin")))
            .filter(|b| b.join("initdb").exists())
            .max_by_key(|b| {
                b.parent()
                    .and_then(|v| v.file_name()?.to_str()?.parse::<u32>().ok())
                    .unwrap_or(0)
            })
            .expect("an initdb under /usr/lib/postgresql/*/bin");
        let dir = tempfile::Builder::new()
            .prefix("mesh-probe-pg-")
            .tempdir()
            .unwrap();
        let chown = Command::new("chown")
            .args(["postgres:postgres"])
            .arg(dir.path())
            .status()
            .unwrap();
        assert!(chown.success(), "chown of {:?}", dir.path());
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let data = dir.path().join("data");
        let data = data.to_str().unwrap();
        run_as_postgres(
            &bin.join("initdb"),
            &["-D", data, "-U", "postgres", "-A", "trust", "--no-sync"],
        );
        let mut options = format!(
            "-c port={port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={} \
             -c fsync=off -c shared_buffers=16MB -c max_connections=10",
            dir.path().display()
        );
        for s in settings {
            options.push_str(&format!(" -c {s}"));
        }
        let log = dir.path().join("log");
        let cluster = Cluster { bin, dir, port };
        run_as_postgres(
            &cluster.bin.join("pg_ctl"),
            &[
                "-D",
                data,
                "-o",
                &options,
                "-l",
                log.to_str().unwrap(),
                "-w",
                "-t",
                "60",
                "start",
            ],
        );
        cluster
    }

    fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Every database and role of the cluster.
    async fn objects(&self) -> Vec<String> {
        let mut conn = PgConnection::connect(&self.url()).await.unwrap();
        let names: Vec<String> = sqlx::query_scalar(
            "SELECT 'database ' || datname FROM pg_database \
             UNION ALL SELECT 'role ' || rolname FROM pg_roles ORDER BY 1",
        )
        .fetch_all(&mut conn)
        .await
        .unwrap();
        conn.close().await.unwrap();
        names
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let data = self.dir.path().join("data");
        let _ = Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(self.bin.join("pg_ctl"))
            .args([
                "-D",
                data.to_str().unwrap_or_default(),
                "-m",
                "immediate",
                "-w",
                "stop",
            ])
            .current_dir("/tmp")
            .output();
        // The temporary directory goes with `dir`.
    }
}

/// A real server with autovacuum off: the probe refuses it (check
/// `autovacuum`) before it touches the broker, and creates nothing in it.
#[tokio::test]
async fn postgresql_with_autovacuum_off_is_refused() {
    let cluster = Cluster::start(&["autovacuum=off"]);
    let before = cluster.objects().await;
    let mut admin = mesh_testkit::admin_credentials().unwrap();
    admin.postgres_url = mesh_credentials::Secret::new(cluster.url());
    let err = probe::run(&admin).await.unwrap_err();
    match &err {
        ProbeError::Failed { check, detail } => {
            assert_eq!(*check, "autovacuum", "{err}");
            assert!(detail.starts_with("autovacuum = off:"), "{err}");
        }
        other => panic!("expected the autovacuum check to fail, got {other}"),
    }
    assert!(
        err.to_string()
            .starts_with("conformance check `autovacuum` failed"),
        "{err}"
    );
    assert_eq!(
        cluster.objects().await,
        before,
        "the probe created something"
    );
    let dir = cluster.dir.path().to_path_buf();
    drop(cluster);
    assert!(!dir.exists(), "the throwaway cluster's directory is left");
}
