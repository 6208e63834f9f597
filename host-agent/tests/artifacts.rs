//! Artifacts end to end, in-process against the real broker and the real OCI
//! registry of `bundle/up`: the delivery section's artifacts are fetched,
//! verified (signature by the controller's key, digest while streaming) and
//! cached once; a unit runs from its artifact; a tampered blob, a missing
//! signature and a stranger's signature are failed items with nothing cached
//! and nothing running disturbed; a section that declares its trusted keys
//! is verified against those alone (decision 0048); an agent's restart
//! adopts the unit.
//!
//! The controller is not here: the test pushes and signs artifacts as the
//! controller does (with the environment's controller key) and publishes
//! signed declarations itself. Every wait is on a condition with a deadline.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use common::{controller_side, declaration_queue_for, free_port, scrape};
use futures_util::StreamExt;
use lapin::{Channel, Consumer};
use mesh_host_agent::Config;
use mesh_oci::Registry;
use mesh_protocol::{
    Applied, ArtifactDigest, ArtifactItem, ArtifactSignature, Declaration, DeclarationItems,
    DeclarationSigner, DesiredState, Envelope, MAX_REPORT_BYTES, NodeId, Outcome, Report,
    RestartPolicy, Section, TrustedArtifactKey, UnitItem, UnitState, UnitStatus,
};
use mesh_testkit::TestEnv;
use tokio::time::{Instant, timeout};

const DEADLINE: Duration = Duration::from_secs(30);

/// Where registry 2.8's filesystem driver keeps a blob's bytes.
const BLOBS: &str = "/var/lib/docker-registry/docker/registry/v2/blobs/sha256";

fn blob_data(d: &ArtifactDigest) -> PathBuf {
    Path::new(BLOBS)
        .join(&d.hex()[..2])
        .join(d.hex())
        .join("data")
}

/// A tar holding an executable `run.sh` (unique: a nonce in a comment).
fn artifact_tar(version: &str) -> Vec<u8> {
    let script = format!(
        "#!/bin/sh\n# {:032x}\necho \"{version} $MESH_ARTIFACT_DIR $(pwd)\" > \"$OUT\"\nexec sleep 1000\n",
        rand::random::<u128>()
    );
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_size(script.len() as u64);
    h.set_mode(0o755);
    h.set_cksum();
    b.append_data(&mut h, "run.sh", script.as_bytes())
        .expect("tar");
    b.into_inner().expect("tar")
}

/// Publish a declaration as the controller does: signed.
async fn declare(
    ch: &Channel,
    signer: &DeclarationSigner,
    node: &NodeId,
    section: Section,
    generation: u64,
    items: DeclarationItems,
) -> anyhow::Result<()> {
    let decl = Declaration {
        section,
        generation,
        items,
    };
    common::publish_declaration(ch, signer, node, decl).await
}

/// The next report of `node` matching `pick`, within the deadline.
async fn wait_report<T>(
    consumer: &mut Consumer,
    what: &str,
    pick: impl Fn(&Report) -> Option<T>,
) -> anyhow::Result<T> {
    let until = Instant::now() + DEADLINE;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        let d = match timeout(left, consumer.next()).await {
            Ok(Some(d)) => d?,
            Ok(None) => bail!("report consumer ended while waiting for {what}"),
            Err(_) => bail!("no {what} within {DEADLINE:?}"),
        };
        let env = Envelope::<Report>::decode(&d.data, MAX_REPORT_BYTES)?;
        if let Some(t) = pick(&env.body) {
            return Ok(t);
        }
    }
}

async fn wait_applied(
    consumer: &mut Consumer,
    section: Section,
    generation: u64,
) -> anyhow::Result<Applied> {
    wait_report(
        consumer,
        &format!("applied {section} {generation}"),
        |r| match r {
            Report::Applied(a)
                if a.section == Some(section) && a.generation == Some(generation) =>
            {
                Some(a.clone())
            }
            _ => None,
        },
    )
    .await
}

async fn wait_units(
    consumer: &mut Consumer,
    what: &str,
    pred: impl Fn(&[UnitStatus]) -> bool,
) -> anyhow::Result<Vec<UnitStatus>> {
    wait_report(consumer, what, |r| match r {
        Report::Units(u) if pred(&u.units) => Some(u.units.clone()),
        _ => None,
    })
    .await
}

/// Wait for a plain condition (files), polling.
async fn wait_for(what: &str, check: impl Fn() -> bool) -> anyhow::Result<()> {
    let until = Instant::now() + DEADLINE;
    while !check() {
        ensure!(Instant::now() < until, "no {what} within {DEADLINE:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

fn item<'a>(a: &'a Applied, name: &str) -> anyhow::Result<&'a mesh_protocol::ItemOutcome> {
    a.items
        .iter()
        .find(|i| i.item == name)
        .with_context(|| format!("no item {name} in {a:?}"))
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rfind(')')
            .and_then(|i| s[i + 1..].split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X")
    })
}

fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn artifacts_are_verified_cached_once_and_run_from() -> anyhow::Result<()> {
    let registry_url = mesh_testkit::registry_url()?;
    let reg = Registry::new(&registry_url, reqwest::Client::new())?;
    let repo = format!("mesh-test/agent-{:012x}", rand::random::<u64>() >> 16);
    let env = TestEnv::new().await?;
    let creds = env.add_node("art").await?;
    let node = creds.node.clone();
    let (admin, ch, mut reports) = controller_side(&env).await?;
    declaration_queue_for(&ch, &node).await?;

    // Artifacts as the controller pushes them: signed with its key.
    let push = |bytes: Vec<u8>, signer: Option<DeclarationSigner>| {
        let (reg, repo) = (reg.clone(), repo.clone());
        async move {
            let d = reg.push_artifact(&repo, &bytes).await?;
            if let Some(s) = signer {
                reg.push_signature(&repo, &ArtifactSignature::sign(&s, &d))
                    .await?;
            }
            anyhow::Ok(d)
        }
    };
    let controller = env.signer().clone();
    let v1 = push(artifact_tar("v1"), Some(controller.clone())).await?;
    let item_of = |d: &ArtifactDigest| ArtifactItem {
        digest: d.clone(),
        registry: registry_url.clone(),
        repository: repo.clone(),
    };
    let delivery = |artifacts: Vec<ArtifactItem>| DeclarationItems {
        artifacts,
        ..Default::default()
    };

    let state = tempfile::tempdir()?;
    let root = mesh_testkit::units_tempdir()?;
    let marks = mesh_testkit::units_tempdir()?;
    mesh_testkit::open_to_units(marks.path())?;
    creds.write_to(state.path())?;
    let metrics_port = free_port();
    let config = || Config {
        state_dir: state.path().to_owned(),
        root: root.path().to_owned(),
        heartbeat_interval: Duration::from_millis(500),
        reconnect_min: Duration::from_millis(50),
        reconnect_max: Duration::from_millis(400),
        metrics_listen: Some(([127, 0, 0, 1], metrics_port).into()),
        units: mesh_host_agent::units::UnitsConfig {
            restart_backoff_min: Duration::from_millis(50),
            stop_timeout: Duration::from_secs(2),
            shim_program: Some(env!("CARGO_BIN_EXE_mesh-agent").into()),
            ..Default::default()
        },
        ..Config::default()
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let agent = tokio::spawn(mesh_host_agent::run(config(), async {
        let _ = stopped.await;
    }));
    let cache = |d: &ArtifactDigest| state.path().join("artifacts/sha256").join(d.hex());

    // (a) Declared: fetched, verified, cached, reported applied.
    declare(
        &ch,
        &controller,
        &node,
        Section::Delivery,
        1,
        delivery(vec![item_of(&v1)]),
    )
    .await?;
    let a = wait_applied(&mut reports, Section::Delivery, 1).await?;
    assert_eq!(a.outcome, Outcome::Applied, "{a:?}");
    let i = item(&a, &format!("artifact:{v1}"))?;
    assert!(i.ok, "{i:?}");
    let script = cache(&v1).join("run.sh");
    assert!(script.is_file(), "{}", script.display());
    use std::os::unix::fs::PermissionsExt as _;
    assert_eq!(
        std::fs::metadata(&script)?.permissions().mode() & 0o777,
        0o755
    );

    // A unit runs from it: a relative command, in the artifact's directory.
    let r1 = uuid::Uuid::now_v7();
    let out = marks.path().join("out");
    let unit = UnitItem {
        user: Default::default(),
        limits: Default::default(),
        stateful: false,
        artifact: Some(v1.clone()),
        revision: Some(r1),
        name: "app-0".into(),
        module: "app".into(),
        command: "run.sh".into(),
        args: vec![],
        env: [("OUT".to_owned(), out.to_string_lossy().into_owned())].into(),
        working_dir: None,
        restart: RestartPolicy::Always,
        desired: DesiredState::Running,
        probes: Vec::new(),
    };
    let inventory = |units: Vec<UnitItem>| DeclarationItems {
        units,
        ..Default::default()
    };
    declare(
        &ch,
        &controller,
        &node,
        Section::Inventory,
        1,
        inventory(vec![unit.clone()]),
    )
    .await?;
    let units = wait_units(&mut reports, "the artifact's unit running", |u| {
        u.iter()
            .any(|s| s.name == "app-0" && s.state == UnitState::Running && s.pid.is_some())
    })
    .await?;
    let status = units.iter().find(|s| s.name == "app-0").context("app-0")?;
    assert_eq!(status.revision, Some(r1), "the revision is echoed");
    let pid = status.pid.context("pid")?;
    wait_for("the unit's mark", || {
        std::fs::read_to_string(&out).is_ok_and(|s| s.starts_with("v1 "))
    })
    .await?;
    let said = std::fs::read_to_string(&out)?;
    let dir = cache(&v1).canonicalize()?;
    assert_eq!(
        said.trim(),
        format!("v1 {} {}", cache(&v1).display(), dir.display()),
        "MESH_ARTIFACT_DIR and the working dir are the artifact's"
    );

    // (e) Cached: not fetched again. Its bytes in the registry are now
    // garbage; declaring it again is still applied, and one fetch was counted.
    std::fs::write(blob_data(&v1), b"tampered after it was cached")?;
    declare(
        &ch,
        &controller,
        &node,
        Section::Delivery,
        2,
        delivery(vec![item_of(&v1)]),
    )
    .await?;
    let a = wait_applied(&mut reports, Section::Delivery, 2).await?;
    assert_eq!(a.outcome, Outcome::Applied, "{a:?}");
    let m = scrape(metrics_port).await?;
    assert_eq!(
        metric(&m, "mesh_agent_artifact_fetches_total{outcome=\"ok\"}"),
        Some(1.0),
        "{m}"
    );
    assert_eq!(metric(&m, "mesh_agent_artifacts_cached"), Some(1.0), "{m}");

    // (b) A tampered blob: a digest mismatch naming both digests, nothing
    // cached, the running unit of v1 untouched.
    let v2_bytes = artifact_tar("v2");
    let v2 = push(v2_bytes, Some(controller.clone())).await?;
    let evil = artifact_tar("evil");
    std::fs::write(blob_data(&v2), &evil)?;
    declare(
        &ch,
        &controller,
        &node,
        Section::Delivery,
        3,
        delivery(vec![item_of(&v1), item_of(&v2)]),
    )
    .await?;
    let a = wait_applied(&mut reports, Section::Delivery, 3).await?;
    assert_eq!(a.outcome, Outcome::Failed, "{a:?}");
    assert!(item(&a, &format!("artifact:{v1}"))?.ok);
    let bad = item(&a, &format!("artifact:{v2}"))?;
    let why = bad.error.as_deref().unwrap_or("");
    assert!(!bad.ok, "{bad:?}");
    assert!(why.contains("digest mismatch"), "{why}");
    assert!(why.contains(v2.as_str()), "{why}");
    assert!(why.contains(ArtifactDigest::of(&evil).as_str()), "{why}");
    assert!(!cache(&v2).exists(), "a tampered artifact was cached");
    let tmp = state.path().join("artifacts/tmp");
    assert!(
        std::fs::read_dir(&tmp).map_or(true, |mut d| d.next().is_none()),
        "leftovers in {}",
        tmp.display()
    );
    assert!(alive(pid), "the running unit was disturbed");

    // (c) No signature.
    let v3 = push(artifact_tar("v3"), None).await?;
    declare(
        &ch,
        &controller,
        &node,
        Section::Delivery,
        4,
        delivery(vec![item_of(&v3)]),
    )
    .await?;
    let a = wait_applied(&mut reports, Section::Delivery, 4).await?;
    assert_eq!(a.outcome, Outcome::Failed, "{a:?}");
    let why = item(&a, &format!("artifact:{v3}"))?
        .error
        .clone()
        .unwrap_or_default();
    assert!(why.contains("no signature"), "{why}");
    assert!(why.contains(&v3.signature_tag()), "{why}");
    assert!(!cache(&v3).exists());

    // (d) Signed by a key this mesh does not trust.
    let stranger = DeclarationSigner::from_seed(rand::random());
    let v4 = push(artifact_tar("v4"), Some(stranger)).await?;
    declare(
        &ch,
        &controller,
        &node,
        Section::Delivery,
        5,
        delivery(vec![item_of(&v4)]),
    )
    .await?;
    let a = wait_applied(&mut reports, Section::Delivery, 5).await?;
    assert_eq!(a.outcome, Outcome::Failed, "{a:?}");
    let why = item(&a, &format!("artifact:{v4}"))?
        .error
        .clone()
        .unwrap_or_default();
    assert!(why.contains("does not trust"), "{why}");
    assert!(!cache(&v4).exists());
    let m = scrape(metrics_port).await?;
    for (outcome, n) in [
        ("ok", 1.0),
        ("digest_mismatch", 1.0),
        ("no_signature", 1.0),
        ("untrusted", 1.0),
    ] {
        assert_eq!(
            metric(
                &m,
                &format!("mesh_agent_artifact_fetches_total{{outcome=\"{outcome}\"}}")
            ),
            Some(n),
            "{outcome}: {m}"
        );
    }
    assert!(alive(pid), "the running unit was disturbed");

    // (g) A section that declares its trusted keys (`artifact_keys`,
    // decision 0048) is verified against them alone: the controller's
    // signature is not enough any more, an operator's declared key is, and
    // an empty list trusts nobody.
    let operator = DeclarationSigner::from_seed(rand::random());
    let keyed =
        |artifacts: Vec<ArtifactItem>, keys: &[(&str, &DeclarationSigner)]| DeclarationItems {
            artifacts,
            artifact_keys: Some(
                keys.iter()
                    .map(|(name, s)| TrustedArtifactKey {
                        name: (*name).to_owned(),
                        key: s.public_key_hex(),
                    })
                    .collect(),
            ),
            ..Default::default()
        };
    let v5 = push(artifact_tar("v5"), Some(controller.clone())).await?;
    declare(
        &ch,
        &controller,
        &node,
        Section::Delivery,
        6,
        keyed(vec![item_of(&v5)], &[("alice", &operator)]),
    )
    .await?;
    let a = wait_applied(&mut reports, Section::Delivery, 6).await?;
    assert_eq!(a.outcome, Outcome::Failed, "{a:?}");
    let why = item(&a, &format!("artifact:{v5}"))?
        .error
        .clone()
        .unwrap_or_default();
    assert!(why.contains("no trusted signature"), "{why}");
    assert!(!cache(&v5).exists());
    reg.push_signature(&repo, &ArtifactSignature::sign(&operator, &v5))
        .await?;
    declare(
        &ch,
        &controller,
        &node,
        Section::Delivery,
        7,
        keyed(vec![item_of(&v5)], &[("alice", &operator)]),
    )
    .await?;
    let a = wait_applied(&mut reports, Section::Delivery, 7).await?;
    assert_eq!(a.outcome, Outcome::Applied, "{a:?}");
    assert!(cache(&v5).is_dir(), "signed by a declared key: cached");
    let v6 = push(artifact_tar("v6"), Some(operator.clone())).await?;
    declare(
        &ch,
        &controller,
        &node,
        Section::Delivery,
        8,
        keyed(vec![item_of(&v5), item_of(&v6)], &[]),
    )
    .await?;
    let a = wait_applied(&mut reports, Section::Delivery, 8).await?;
    assert_eq!(a.outcome, Outcome::Failed, "{a:?}");
    assert!(item(&a, &format!("artifact:{v5}"))?.ok, "cached already");
    let why = item(&a, &format!("artifact:{v6}"))?
        .error
        .clone()
        .unwrap_or_default();
    assert!(why.contains("no trusted signature"), "{why}");
    assert!(!cache(&v6).exists());
    assert!(alive(pid), "the running unit was disturbed");

    // (f) The agent restarts: the unit is adopted, same pid, same revision.
    let _ = stop.send(());
    timeout(DEADLINE, agent).await???;
    assert!(alive(pid), "the agent's stop stopped the unit");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let agent = tokio::spawn(mesh_host_agent::run(config(), async {
        let _ = stopped.await;
    }));
    let units = wait_units(&mut reports, "the unit adopted", |u| {
        u.iter()
            .any(|s| s.name == "app-0" && s.state == UnitState::Running)
    })
    .await?;
    let status = units.iter().find(|s| s.name == "app-0").context("app-0")?;
    assert_eq!(
        status.pid,
        Some(pid),
        "the agent's restart restarted the unit"
    );
    assert_eq!(status.restarts, 0);
    assert_eq!(status.revision, Some(r1));

    // A new revision of the same artifact is a new spec: restarted.
    let r2 = uuid::Uuid::now_v7();
    let unit2 = UnitItem {
        user: Default::default(),
        limits: Default::default(),
        stateful: false,
        revision: Some(r2),
        ..unit.clone()
    };
    declare(
        &ch,
        &controller,
        &node,
        Section::Inventory,
        2,
        inventory(vec![unit2]),
    )
    .await?;
    let units = wait_units(&mut reports, "the new revision running", |u| {
        u.iter().any(|s| {
            s.name == "app-0"
                && s.state == UnitState::Running
                && s.revision == Some(r2)
                && s.pid.is_some_and(|p| p != pid)
        })
    })
    .await?;
    let pid2 = units
        .iter()
        .find(|s| s.name == "app-0")
        .and_then(|s| s.pid)
        .context("pid")?;
    wait_for("the old revision's process to end", || !alive(pid)).await?;

    // Cleanup: nothing declared, nothing runs.
    declare(
        &ch,
        &controller,
        &node,
        Section::Inventory,
        3,
        inventory(vec![]),
    )
    .await?;
    wait_units(&mut reports, "no units", |u| u.is_empty()).await?;
    wait_for("the unit to stop", || !alive(pid2)).await?;
    let _ = stop.send(());
    timeout(DEADLINE, agent).await???;
    let _ = admin.close(200, "done".into()).await;
    env.teardown().await
}

/// A unit whose artifact is not cached does not start (failed, no restart
/// loop), and starts once the delivery section caches it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unit_waits_for_its_artifact() -> anyhow::Result<()> {
    let registry_url = mesh_testkit::registry_url()?;
    let reg = Registry::new(&registry_url, reqwest::Client::new())?;
    let repo = format!("mesh-test/agent-wait-{:012x}", rand::random::<u64>() >> 16);
    let env = TestEnv::new().await?;
    let creds = env.add_node("wait").await?;
    let node = creds.node.clone();
    let (admin, ch, mut reports) = controller_side(&env).await?;
    declaration_queue_for(&ch, &node).await?;
    let controller = env.signer().clone();
    let d = reg.push_artifact(&repo, &artifact_tar("w")).await?;
    reg.push_signature(&repo, &ArtifactSignature::sign(&controller, &d))
        .await?;

    let state = tempfile::tempdir()?;
    let root = mesh_testkit::units_tempdir()?;
    let marks = mesh_testkit::units_tempdir()?;
    mesh_testkit::open_to_units(marks.path())?;
    creds.write_to(state.path())?;
    let config = Config {
        state_dir: state.path().to_owned(),
        root: root.path().to_owned(),
        heartbeat_interval: Duration::from_millis(500),
        reconnect_min: Duration::from_millis(50),
        reconnect_max: Duration::from_millis(400),
        units: mesh_host_agent::units::UnitsConfig {
            restart_backoff_min: Duration::from_millis(50),
            stop_timeout: Duration::from_secs(2),
            shim_program: Some(env!("CARGO_BIN_EXE_mesh-agent").into()),
            ..Default::default()
        },
        ..Config::default()
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let agent = tokio::spawn(mesh_host_agent::run(config, async {
        let _ = stopped.await;
    }));
    let out = marks.path().join("out");
    let unit = UnitItem {
        user: Default::default(),
        limits: Default::default(),
        stateful: false,
        artifact: Some(d.clone()),
        revision: None,
        name: "w-0".into(),
        module: "w".into(),
        command: "run.sh".into(),
        args: vec![],
        env: [("OUT".to_owned(), out.to_string_lossy().into_owned())].into(),
        working_dir: None,
        restart: RestartPolicy::Always,
        desired: DesiredState::Running,
        probes: Vec::new(),
    };
    let items = DeclarationItems {
        units: vec![unit],
        ..Default::default()
    };
    declare(&ch, &controller, &node, Section::Inventory, 1, items).await?;
    let a = wait_applied(&mut reports, Section::Inventory, 1).await?;
    assert_eq!(a.outcome, Outcome::Applied, "{a:?}");
    let why = item(&a, "w-0")?.error.clone().unwrap_or_default();
    assert!(
        why.contains("not cached") && why.contains(d.as_str()),
        "{why}"
    );
    let units = wait_units(&mut reports, "the unit failed without its artifact", |u| {
        u.iter()
            .any(|s| s.name == "w-0" && s.state == UnitState::Failed)
    })
    .await?;
    let s = units.iter().find(|s| s.name == "w-0").context("w-0")?;
    assert_eq!((s.pid, s.restarts), (None, 0), "{s:?}");
    assert!(!out.exists());

    let items = DeclarationItems {
        artifacts: vec![ArtifactItem {
            digest: d.clone(),
            registry: registry_url.clone(),
            repository: repo.clone(),
        }],
        ..Default::default()
    };
    declare(&ch, &controller, &node, Section::Delivery, 1, items).await?;
    let a = wait_applied(&mut reports, Section::Delivery, 1).await?;
    assert_eq!(a.outcome, Outcome::Applied, "{a:?}");
    let units = wait_units(&mut reports, "the unit running once cached", |u| {
        u.iter()
            .any(|s| s.name == "w-0" && s.state == UnitState::Running && s.pid.is_some())
    })
    .await?;
    let pid = units
        .iter()
        .find(|s| s.name == "w-0")
        .and_then(|s| s.pid)
        .context("pid")?;
    wait_for("the unit's mark", || out.exists()).await?;

    declare(
        &ch,
        &controller,
        &node,
        Section::Inventory,
        2,
        DeclarationItems::default(),
    )
    .await?;
    wait_units(&mut reports, "no units", |u| u.is_empty()).await?;
    wait_for("the unit to stop", || !alive(pid)).await?;
    let _ = stop.send(());
    timeout(DEADLINE, agent).await???;
    let _ = admin.close(200, "done".into()).await;
    env.teardown().await
}

/// A loopback proxy in front of `upstream` (host:port) that holds every new
/// connection for `delay` before it forwards a byte: a slow registry. Ends
/// with the test's runtime.
async fn slow_proxy(upstream: String, delay: Duration) -> anyhow::Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            let upstream = upstream.clone();
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                if let Ok(mut server) = tokio::net::TcpStream::connect(&upstream).await {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                }
            });
        }
    });
    Ok(url)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_nodes_lease_goes_on_while_it_pulls_an_artifact() -> anyhow::Result<()> {
    let registry_url = mesh_testkit::registry_url()?;
    let reg = Registry::new(&registry_url, reqwest::Client::new())?;
    let repo = format!("mesh-test/agent-slow-{:012x}", rand::random::<u64>() >> 16);
    let env = TestEnv::new().await?;
    let creds = env.add_node("slow").await?;
    let node = creds.node.clone();
    let (admin, ch, mut reports) = controller_side(&env).await?;
    declaration_queue_for(&ch, &node).await?;
    let controller = env.signer().clone();
    let d = reg.push_artifact(&repo, &artifact_tar("s")).await?;
    reg.push_signature(&repo, &ArtifactSignature::sign(&controller, &d))
        .await?;
    // Each of the pull's connections (signature, then blob) waits 2 s.
    let upstream = registry_url.trim_start_matches("http://").to_owned();
    let slow = slow_proxy(upstream, Duration::from_secs(2)).await?;

    let state = tempfile::tempdir()?;
    let root = mesh_testkit::units_tempdir()?;
    creds.write_to(state.path())?;
    let config = Config {
        state_dir: state.path().to_owned(),
        root: root.path().to_owned(),
        heartbeat_interval: Duration::from_millis(500),
        reconnect_min: Duration::from_millis(50),
        reconnect_max: Duration::from_millis(400),
        ..Config::default()
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let agent = tokio::spawn(mesh_host_agent::run(config, async {
        let _ = stopped.await;
    }));
    // The agent is up and beating before the pull starts.
    wait_report(&mut reports, "a first heartbeat", |r| {
        matches!(r, Report::Heartbeat(_)).then_some(())
    })
    .await?;
    let items = DeclarationItems {
        artifacts: vec![ArtifactItem {
            digest: d.clone(),
            registry: slow,
            repository: repo.clone(),
        }],
        ..Default::default()
    };
    declare(&ch, &controller, &node, Section::Delivery, 1, items).await?;
    // Count the heartbeats between the declaration and its applied report.
    let mut beats = 0;
    let until = Instant::now() + DEADLINE;
    let applied = loop {
        let left = until.saturating_duration_since(Instant::now());
        let delivery = match timeout(left, reports.next()).await {
            Ok(Some(d)) => d?,
            _ => bail!("no applied report of the delivery section within {DEADLINE:?}"),
        };
        match Envelope::<Report>::decode(&delivery.data, MAX_REPORT_BYTES)?.body {
            Report::Heartbeat(_) => beats += 1,
            Report::Applied(a) if a.section == Some(Section::Delivery) => break a,
            _ => {}
        }
    };
    assert_eq!(applied.outcome, Outcome::Applied, "{applied:?}");
    // At least 4 s of pulling at one beat per 500 ms: the lease never lapsed.
    assert!(beats >= 4, "only {beats} heartbeats while the node pulled");
    let _ = stop.send(());
    timeout(DEADLINE, agent).await???;
    let _ = admin.close(200, "done".into()).await;
    env.teardown().await
}
