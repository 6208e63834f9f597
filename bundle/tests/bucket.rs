//! A backup kept in a granted bucket (`mesh-bundle backup --to-bucket`,
//! decision 0039's "the controller is a consumer like any other"): against a
//! real Garage (the `s3.bucket` provider's server, started from
//! e2e/providers/garage.sh with the binary `bundle/garage` caches), with a
//! key allowed on one bucket only, through the credential file an
//! `s3.bucket` grant writes.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use mesh_bundle::s3::{BucketGrant, Request, S3Error, signed_headers};

const KEY: &str = "GK0123456789abcdef0badc0de";
const SECRET: &str = "5ec2e75ec2e75ec2e75ec2e75ec2e75ec2e75ec2e75ec2e75ec2e75ec2e75ec2";

fn garage_bin() -> PathBuf {
    let cache =
        std::env::var_os("MESH_GARAGE_CACHE").unwrap_or_else(|| "/var/cache/mesh-ci".into());
    let cached = Path::new(&cache).join("garage-2.5.0/bin/garage");
    if cached.exists() {
        cached
    } else {
        PathBuf::from("garage")
    }
}

/// A single-node Garage on free loopback ports, killed on drop.
struct Garage {
    child: Child,
    config: PathBuf,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Drop for Garage {
    fn drop(&mut self) {
        // garage.sh stops its server on TERM; pkill catches one left behind.
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status();
        let _ = self.child.wait();
        let _ = Command::new("pkill")
            .arg("-f")
            .arg(format!("{} server", self.config.display()))
            .status();
    }
}

impl Garage {
    fn start() -> anyhow::Result<Garage> {
        let dir = tempfile::tempdir()?;
        // Three ports in a row (S3, RPC, admin): probe a base whose next two
        // are free too.
        let port = (0..50)
            .find_map(|_| {
                let base = std::net::TcpListener::bind("127.0.0.1:0")
                    .ok()?
                    .local_addr()
                    .ok()?
                    .port();
                let free = |p: u16| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok();
                (base < 65000 && free(base + 1) && free(base + 2)).then_some(base)
            })
            .ok_or_else(|| anyhow::anyhow!("no three free ports in a row"))?;
        let base = dir.path().join("garage");
        let log = std::fs::File::create(dir.path().join("server.log"))?;
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../e2e/providers/garage.sh");
        let child = Command::new("bash")
            .arg(script)
            .arg(&base)
            .arg(port.to_string())
            .env("PATH", path_with_garage())
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        let garage = Garage {
            child,
            config: base.join("garage.toml"),
            port,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let shown = Command::new(garage_bin())
                .arg("-c")
                .arg(&garage.config)
                .args(["layout", "show"])
                .output();
            if shown.is_ok_and(|o| {
                String::from_utf8_lossy(&o.stdout).contains("Current cluster layout version: 1")
            }) {
                return Ok(garage);
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "Garage's layout not applied in 60 s"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn cli(&self, args: &[&str]) -> anyhow::Result<()> {
        let out = Command::new(garage_bin())
            .arg("-c")
            .arg(&self.config)
            .args(args)
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "garage {}: {}",
            args.first().copied().unwrap_or_default(),
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }

    /// A signed request as `key`/`secret`: the status and body.
    async fn request(
        &self,
        secret: &str,
        method: &str,
        path: &str,
    ) -> anyhow::Result<(u16, Vec<u8>)> {
        let host = format!("127.0.0.1:{}", self.port);
        let headers = signed_headers(
            &Request {
                host: &host,
                region: "garage",
                key: KEY,
                secret,
                method,
                path,
                body: b"",
            },
            chrono::Utc::now(),
        );
        let mut request =
            reqwest::Client::new().request(method.parse()?, format!("http://{host}{path}"));
        for (k, v) in headers {
            request = request.header(k, v);
        }
        let answer = request.send().await?;
        Ok((answer.status().as_u16(), answer.bytes().await?.to_vec()))
    }
}

fn path_with_garage() -> String {
    let dir = garage_bin()
        .parent()
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    format!("{dir}:{}", std::env::var("PATH").unwrap_or_default())
}

/// The credential file an `s3.bucket` grant writes (contexts/provisioning's
/// plan: the same keys).
fn grant_file(dir: &Path, port: u16, secret: &str, bucket: &str) -> anyhow::Result<PathBuf> {
    let path = dir.join("grant-backups.env");
    std::fs::write(
        &path,
        format!(
            "# mesh grant\nAWS_ENDPOINT_URL=http://127.0.0.1:{port}\nAWS_REGION=garage\nAWS_ACCESS_KEY_ID={KEY}\nAWS_SECRET_ACCESS_KEY={secret}\nS3_BUCKET={bucket}\nMESH_CREDENTIAL_VERSION=1\n"
        ),
    )?;
    Ok(path)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_backup_is_kept_in_its_granted_bucket_and_nowhere_else() -> anyhow::Result<()> {
    let garage = Garage::start()?;
    garage.cli(&["key", "import", "--yes", "-n", "backups-key", KEY, SECRET])?;
    garage.cli(&["bucket", "create", "backups"])?;
    garage.cli(&["bucket", "create", "other"])?;
    garage.cli(&[
        "bucket", "allow", "--read", "--write", "backups", "--key", KEY,
    ])?;
    let dir = tempfile::tempdir()?;

    // The archive's bytes land under its name, and read back the same.
    let archive: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    let grant = BucketGrant::read(&grant_file(dir.path(), garage.port, SECRET, "backups")?)?;
    assert_eq!(grant.bucket, "backups");
    assert!(
        !format!("{grant:?}").contains(SECRET),
        "the secret in Debug"
    );
    grant.put("mesh-2026-12-04.tar", archive.clone()).await?;
    let (status, body) = garage
        .request(SECRET, "GET", "/backups/mesh-2026-12-04.tar")
        .await?;
    assert_eq!(status, 200);
    assert!(body == archive, "the object differs from the archive");

    // The key is allowed on its bucket only: another bucket refuses it, and
    // the error names the bucket and the status, never the secret.
    let other = BucketGrant::read(&grant_file(dir.path(), garage.port, SECRET, "other")?)?;
    match other.put("mesh.tar", archive.clone()).await {
        Err(e @ S3Error::Refused { status: 403, .. }) => {
            let said = e.to_string();
            assert!(said.contains("s3://other/mesh.tar"), "{said}");
            assert!(!said.contains(SECRET), "{said}");
        }
        other => panic!("another bucket: {other:?}"),
    }
    let (status, _) = garage.request(SECRET, "GET", "/other/mesh.tar").await?;
    assert_eq!(status, 403, "read on another bucket");

    // A wrong secret is refused.
    let wrong = "0".repeat(64);
    let bad = BucketGrant::read(&grant_file(dir.path(), garage.port, &wrong, "backups")?)?;
    assert!(matches!(
        bad.put("mesh.tar", vec![1]).await,
        Err(S3Error::Refused { status: 403, .. })
    ));

    // A credential file that is not an s3.bucket grant's names what it lacks;
    // an object name that is not one is refused before anything is sent.
    let partial = dir.path().join("partial.env");
    std::fs::write(
        &partial,
        "AWS_ENDPOINT_URL=http://127.0.0.1:1\nAWS_REGION=garage\n",
    )?;
    let e = BucketGrant::read(&partial).map(|_| ()).unwrap_err();
    assert!(
        e.to_string().contains("AWS_ACCESS_KEY_ID is missing"),
        "{e}"
    );
    let https = dir.path().join("https.env");
    std::fs::write(&https, "AWS_ENDPOINT_URL=https://h:1/x\n")?;
    let e = BucketGrant::read(&https).map(|_| ()).unwrap_err();
    assert!(e.to_string().contains("AWS_ENDPOINT_URL"), "{e}");
    assert!(matches!(
        grant.put("../etc/passwd", vec![1]).await,
        Err(S3Error::Name(_))
    ));

    // The command refuses a backup it could not keep where asked, before
    // dumping anything: its grant file is read first.
    let key = dir.path().join("recovery.key");
    mesh_bundle::backup::RecoveryKey::generate().write_new(&key)?;
    let out = Command::new(env!("CARGO_BIN_EXE_mesh-bundle"))
        .arg("backup")
        .arg("--out")
        .arg(dir.path().join("never.tar"))
        .arg("--recovery-key")
        .arg(&key)
        .arg("--to-bucket")
        .arg(&partial)
        .output()?;
    assert!(!out.status.success());
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("AWS_ACCESS_KEY_ID is missing"), "{said}");
    assert!(!dir.path().join("never.tar").exists());
    Ok(())
}
