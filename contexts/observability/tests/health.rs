//! Health and alerts against a real PostgreSQL, one fresh database per test:
//! reports and record events fed the way the controller's router feeds them
//! (inbox, handler, commit), then an evaluation, read back through the
//! context's methods, its HTTP routes and the record events in its outbox.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use chrono::{DateTime, Utc};
use mesh_observability::{
    AlertList, AlertsParams, Behind, HealthView, Observability, Observations, QueueDepth, SCHEMA,
    Settings,
};
use mesh_plumbing::{Context, inbox};
use mesh_protocol::{
    CertificateIssued, Envelope, FleetCondition, FleetConditions, Health, HealthState, Hello,
    Labels, LivenessState, ModulePlacement, NodeId, NodeLabelsChanged, NodeLiveness, Outage,
    ProbeResult, ProbeState, RecordEvent, RecordKind, Report, UnitState, UnitStatus, Units,
};
use mesh_testkit::TestEnv;
use sqlx::postgres::PgPoolOptions;
use tower::ServiceExt;

struct Fixture {
    env: TestEnv,
    obs: Arc<Observability>,
    app: axum::Router,
    seq: std::sync::atomic::AtomicU64,
}

async fn setup(settings: Settings) -> Fixture {
    let env = TestEnv::new().await.unwrap();
    let url = env.database_url(SCHEMA);
    mesh_observability::migrate(&url).await.unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .unwrap();
    let obs = Arc::new(Observability::new(
        pool,
        mesh_plumbing::OutboxSignal::default(),
        settings,
    ));
    let (app, _) = obs.clone().routes().split_for_parts();
    Fixture {
        env,
        obs,
        app,
        seq: 1.into(),
    }
}

impl Fixture {
    fn node(&self, suffix: &str) -> NodeId {
        NodeId::parse(&format!("{}-{suffix}", self.env.id())).unwrap()
    }

    async fn events(&self, events: &[RecordEvent]) {
        let mut tx = self.obs.pool().begin().await.unwrap();
        let ids: Vec<_> = events.iter().map(|e| e.id).collect();
        let mut fresh = inbox::claim(&mut tx, SCHEMA, &ids).await.unwrap();
        let fresh: Vec<&RecordEvent> = events.iter().filter(|e| fresh.remove(&e.id)).collect();
        if !fresh.is_empty() {
            self.obs.handle_events(&mut tx, &fresh).await.unwrap();
        }
        tx.commit().await.unwrap();
    }

    async fn report(&self, node: &NodeId, report: Report) {
        let seq = self.seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let env = Envelope::new(node.clone(), seq, report);
        let mut tx = self.obs.pool().begin().await.unwrap();
        inbox::claim(&mut tx, SCHEMA, &[env.id]).await.unwrap();
        self.obs.handle_reports(&mut tx, &[env]).await.unwrap();
        tx.commit().await.unwrap();
    }

    async fn evaluate(&self) -> mesh_observability::Summary {
        self.obs.evaluate(&Observations::default()).await.unwrap()
    }

    async fn get<T: serde::de::DeserializeOwned>(&self, uri: &str) -> T {
        let res = self
            .app
            .clone()
            .oneshot(Request::get(uri).body(Body::empty()).unwrap())
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::OK, "{uri}");
        let bytes = axum::body::to_bytes(res.into_body(), 1 << 20)
            .await
            .unwrap();
        serde_json::from_slice(&bytes).unwrap()
    }

    async fn open(&self) -> Vec<serde_json::Value> {
        let v: serde_json::Value = self.get("/v1/alerts").await;
        v["alerts"].as_array().unwrap().clone()
    }

    /// The record events the context wrote, in order, as `(event, body)`.
    async fn outbox(&self) -> Vec<(String, serde_json::Value)> {
        let rows: Vec<(Vec<u8>,)> =
            sqlx::query_as("SELECT payload FROM observability.outbox ORDER BY id")
                .fetch_all(self.obs.pool())
                .await
                .unwrap();
        rows.into_iter()
            .map(|(p,)| {
                let e = RecordEvent::decode(&p).unwrap();
                let v: serde_json::Value = serde_json::from_slice(&p).unwrap();
                (e.routing_key(), v["body"].clone())
            })
            .collect()
    }
}

fn joined(node: &NodeId) -> RecordEvent {
    RecordEvent::new(RecordKind::NodeJoined(NodeLabelsChanged {
        node: node.clone(),
        labels: Labels::default(),
        version: 1,
    }))
}

fn placed(module: &str, version: i64, nodes: &[&NodeId]) -> RecordEvent {
    let mut nodes: Vec<NodeId> = nodes.iter().map(|n| (*n).clone()).collect();
    nodes.sort();
    RecordEvent::new(RecordKind::ModulePlaced(ModulePlacement {
        module: module.into(),
        version,
        nodes,
        settings_files: Vec::new(),
        ports: Vec::new(),
        requires: Vec::new(),
        provides: Vec::new(),
    }))
}

fn units(module: &str, unit: &str, state: UnitState, restarts: u32) -> Report {
    Report::Units(Units {
        units: vec![UnitStatus {
            reason: None,
            oom_kills: 0,
            uid: None,
            data_bytes: None,
            revision: None,
            name: unit.into(),
            module: module.into(),
            state,
            pid: Some(100),
            exit_code: None,
            restarts,
            started_at: None,
        }],
    })
}

fn probe(module: &str, unit: &str, state: ProbeState, detail: Option<&str>) -> Report {
    Report::Health(Health {
        probes: vec![ProbeResult {
            unit: unit.into(),
            module: module.into(),
            probe: "ready".into(),
            state,
            since: Utc::now(),
            checked_at: Some(Utc::now()),
            failures: if state == ProbeState::Unhealthy { 3 } else { 0 },
            detail: detail.map(str::to_owned),
        }],
        summary: false,
    })
}

fn hello(outage: Option<Outage>) -> Report {
    Report::Hello(Hello {
        hostname: "h".into(),
        arch: "x86_64".into(),
        cpus: 1,
        memory_bytes: 1 << 30,
        labels: Labels::default(),
        agent_version: "0.1.0".into(),
        public_key: None,
        seal_key: None,
        overlay: None,
        applied: Default::default(),
        protocol: None,
        outage,
        metrics: None,
    })
}

#[tokio::test]
async fn a_failing_probe_degrades_its_module_raises_an_alert_and_recovery_resolves_it() {
    let f = setup(Settings::default()).await;
    let (a, b) = (f.node("a"), f.node("b"));
    f.events(&[joined(&a), joined(&b), placed("web", 1, &[&a, &b])])
        .await;
    f.report(&a, units("web", "web-0", UnitState::Running, 0))
        .await;
    f.report(&b, units("web", "web-1", UnitState::Running, 0))
        .await;
    f.report(&a, probe("web", "web-0", ProbeState::Healthy, None))
        .await;
    f.report(&b, probe("web", "web-1", ProbeState::Healthy, None))
        .await;
    let s = f.evaluate().await;
    assert_eq!(s.modules.get("healthy"), Some(&1));
    assert!(f.open().await.is_empty());

    f.report(
        &a,
        probe("web", "web-0", ProbeState::Unhealthy, Some("HTTP 503")),
    )
    .await;
    let s = f.evaluate().await;
    assert_eq!(s.modules.get("degraded"), Some(&1));
    assert_eq!(s.raised, 1);
    let health: HealthView = f.get("/v1/health?module=web").await;
    let web = &health.modules[0];
    assert_eq!(web.health, HealthState::Degraded);
    let bad = web.replicas.iter().find(|r| r.node == a.as_str()).unwrap();
    assert_eq!(bad.health, HealthState::Unhealthy);
    assert_eq!(bad.probes[0].detail.as_deref(), Some("HTTP 503"));
    assert_eq!(bad.reason.as_deref(), Some("probe `ready`: HTTP 503"));
    let node_a = health.nodes.iter().find(|n| n.node == a.as_str()).unwrap();
    assert_eq!(node_a.health, HealthState::Degraded);
    let open = f.open().await;
    assert_eq!(open.len(), 1);
    assert_eq!(open[0]["kind"], "module_degraded");
    assert_eq!(open[0]["subject"], "module/web");
    assert!(
        open[0]["message"].as_str().unwrap().contains("HTTP 503"),
        "{}",
        open[0]["message"]
    );
    // Health went on the record for delivery's gate.
    let out = f.outbox().await;
    let health_events: Vec<_> = out
        .iter()
        .filter(|(k, _)| k == "observability.module.health")
        .collect();
    assert_eq!(health_events.last().unwrap().1["health"], "degraded");
    assert!(out.iter().any(|(k, _)| k == "observability.alert.raised"));

    // Evaluating again changes nothing and tells nothing.
    let s = f.evaluate().await;
    assert_eq!((s.raised, s.resolved, s.health_changed), (0, 0, 0));

    f.report(&a, probe("web", "web-0", ProbeState::Healthy, None))
        .await;
    let s = f.evaluate().await;
    assert_eq!(s.resolved, 1);
    assert!(f.open().await.is_empty());
    let resolved: AlertList = f
        .obs
        .alerts(
            &AlertsParams {
                state: Some("resolved".into()),
                ..Default::default()
            },
            None,
            100,
        )
        .await
        .unwrap();
    assert_eq!(resolved.alerts.len(), 1);
    assert!(resolved.alerts[0].resolved_at.is_some());
    let out = f.outbox().await;
    assert_eq!(out.last().unwrap().0, "observability.alert.resolved");
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn an_unreachable_node_is_alerted_with_its_duration_until_it_is_alive() {
    let f = setup(Settings::default()).await;
    let a = f.node("a");
    let heard: DateTime<Utc> = Utc::now() - chrono::Duration::days(6);
    f.events(&[
        joined(&a),
        RecordEvent::new(
            NodeLiveness {
                node: a.clone(),
                state: LivenessState::Unreachable,
                at: Utc::now(),
                last_heard: Some(heard),
            }
            .into_kind(),
        ),
    ])
    .await;
    f.evaluate().await;
    let open = f.open().await;
    assert_eq!(open[0]["kind"], "node_unreachable");
    let message = open[0]["message"].as_str().unwrap();
    assert!(
        message.starts_with(&format!("{a} unreachable for 6 days")),
        "{message}"
    );
    assert!(open[0]["duration_secs"].as_i64().unwrap() >= 6 * 86_400);
    f.events(&[RecordEvent::new(
        NodeLiveness {
            node: a.clone(),
            state: LivenessState::Alive,
            at: Utc::now(),
            last_heard: Some(heard),
        }
        .into_kind(),
    )])
    .await;
    assert_eq!(f.evaluate().await.resolved, 1);
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn a_unit_restarting_three_times_in_the_window_is_crash_looping() {
    let f = setup(Settings::default()).await;
    let a = f.node("a");
    f.events(&[joined(&a), placed("job", 1, &[&a])]).await;
    // The first report is the baseline: restarts before it are not counted.
    f.report(&a, units("job", "job", UnitState::Running, 40))
        .await;
    f.evaluate().await;
    assert!(f.open().await.is_empty());
    f.report(&a, units("job", "job", UnitState::Failed, 42))
        .await;
    f.evaluate().await;
    assert!(
        f.open()
            .await
            .iter()
            .all(|x| x["kind"] != "unit_crash_looping")
    );
    f.report(&a, units("job", "job", UnitState::Failed, 43))
        .await;
    f.evaluate().await;
    let open = f.open().await;
    let crash = open
        .iter()
        .find(|x| x["kind"] == "unit_crash_looping")
        .expect("crash loop alert");
    assert_eq!(crash["subject"], format!("unit/{a}/job"));
    assert!(crash["message"].as_str().unwrap().contains("3 times"));
    f.env.teardown().await.unwrap();
}

fn oom_killed(module: &str, unit: &str, kills: u32) -> Report {
    let Report::Units(mut u) = units(module, unit, UnitState::Running, kills) else {
        unreachable!()
    };
    u.units[0].oom_kills = kills;
    u.units[0].reason = (kills > 0).then(|| mesh_protocol::REASON_OOM_KILLED.to_owned());
    Report::Units(u)
}

#[tokio::test]
async fn a_unit_oom_killed_three_times_is_alerted_until_it_is_redeclared() {
    let f = setup(Settings::default()).await;
    let a = f.node("a");
    f.events(&[joined(&a), placed("db", 1, &[&a])]).await;
    for kills in [1, 2] {
        f.report(&a, oom_killed("db", "db", kills)).await;
        f.evaluate().await;
        assert!(
            f.open()
                .await
                .iter()
                .all(|x| x["kind"] != "unit_oom_killed"),
            "{kills} OOM kills are not yet an alert"
        );
    }
    // Each kill was a restart too: crash looping may be open beside it; only
    // this kind's alerts and events are counted.
    let fr = &f;
    let told = |kind: &'static str| async move {
        fr.outbox()
            .await
            .into_iter()
            .filter(|(k, b)| k == kind && b["kind"] == "unit_oom_killed")
            .count()
    };
    f.report(&a, oom_killed("db", "db", 3)).await;
    f.evaluate().await;
    let open = f.open().await;
    let oom = open
        .iter()
        .find(|x| x["kind"] == "unit_oom_killed")
        .expect("the OOM alert");
    assert_eq!(oom["subject"], format!("unit/{a}/db"));
    assert_eq!(oom["severity"], "warning");
    assert!(
        oom["message"]
            .as_str()
            .unwrap()
            .contains("OOM-killed 3 times"),
        "{oom}"
    );
    assert_eq!(told("observability.alert.raised").await, 1);
    // A fourth kill keeps the one alert open, its sentence current.
    f.report(&a, oom_killed("db", "db", 4)).await;
    f.evaluate().await;
    assert_eq!(told("observability.alert.raised").await, 1);
    let open = f.open().await;
    let oom: Vec<_> = open
        .iter()
        .filter(|x| x["kind"] == "unit_oom_killed")
        .collect();
    assert_eq!(oom.len(), 1);
    assert!(oom[0]["message"].as_str().unwrap().contains("4 times"));
    // Redeclared (a new limit, say): its node counts from 0 again.
    f.report(&a, oom_killed("db", "db", 0)).await;
    f.evaluate().await;
    assert!(
        f.open()
            .await
            .iter()
            .all(|x| x["kind"] != "unit_oom_killed")
    );
    assert_eq!(told("observability.alert.resolved").await, 1);
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn a_certificate_close_to_expiry_is_alerted_until_a_newer_one_is_issued() {
    let f = setup(Settings::default()).await;
    let a = f.node("a");
    // Issued `ago` days ago, expiring in `left` days.
    let issued = |serial: &str, ago: i64, left: i64| RecordEvent {
        id: uuid::Uuid::now_v7(),
        sent_at: Utc::now() - chrono::Duration::days(ago),
        kind: RecordKind::CertificateIssued(CertificateIssued {
            node: a.clone(),
            name: "node".into(),
            serial: serial.into(),
            not_after: Utc::now() + chrono::Duration::days(left),
        }),
    };
    // A fresh short-lived certificate is not alerted: a quarter of its
    // lifetime (renewal is due at two thirds) is still ahead.
    f.events(&[joined(&a), issued("00", 0, 1)]).await;
    f.evaluate().await;
    assert!(f.open().await.is_empty());
    // Three days left of ninety: renewal was missed.
    f.events(&[issued("01", 87, 3)]).await;
    f.evaluate().await;
    let open = f.open().await;
    assert_eq!(open[0]["kind"], "certificate_expiring");
    assert!(open[0]["message"].as_str().unwrap().contains("expires in"));
    f.events(&[issued("02", 0, 90)]).await;
    assert_eq!(f.evaluate().await.resolved, 1);
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn outages_nodes_report_are_one_controller_unreachable_alert_naming_each() {
    let f = setup(Settings {
        outage_window: Duration::from_secs(2),
        ..Settings::default()
    })
    .await;
    let (a, b) = (f.node("a"), f.node("b"));
    f.events(&[joined(&a), joined(&b)]).await;
    let since = Utc::now() - chrono::Duration::seconds(40);
    for (n, buffered) in [(&a, 7), (&b, 3)] {
        f.report(
            n,
            hello(Some(Outage {
                since,
                seconds: 40,
                buffered,
                dropped: 0,
            })),
        )
        .await;
    }
    f.evaluate().await;
    let open = f.open().await;
    assert_eq!(open.len(), 1);
    assert_eq!(open[0]["kind"], "controller_unreachable");
    let message = open[0]["message"].as_str().unwrap();
    assert!(
        message.contains(a.as_str()) && message.contains(b.as_str()),
        "{message}"
    );
    assert!(message.contains("7 reports buffered"), "{message}");
    // It is about the past: it resolves once the window has passed.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        f.evaluate().await;
        if f.open().await.is_empty() {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "never resolved");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn grant_conditions_are_kept_beside_fleet_conditions_and_become_alerts() {
    let f = setup(Settings::default()).await;
    let condition = |key: &str, kind: &str, module: &str| FleetCondition {
        key: key.into(),
        kind: kind.into(),
        node: None,
        module: Some(module.into()),
        stateful: false,
        message: format!("{kind} {key}"),
    };
    f.events(&[
        RecordEvent::new(RecordKind::FleetConditions(FleetConditions {
            version: 1,
            conditions: vec![condition("unplaced:web", "placement_unsatisfied", "web")],
        })),
        RecordEvent::new(RecordKind::GrantConditions(FleetConditions {
            version: 1,
            conditions: vec![
                condition("grant:1", "grant_waiting", "app"),
                condition("grant:2", "grant_failed", "app"),
            ],
        })),
    ])
    .await;
    f.evaluate().await;
    let mut kinds: Vec<String> = f
        .open()
        .await
        .iter()
        .map(|x| x["kind"].as_str().unwrap().to_owned())
        .collect();
    kinds.sort();
    assert_eq!(
        kinds,
        ["grant_failed", "grant_waiting", "module_below_replicas"],
        "each source's conditions are its own"
    );
    // Provisioning's next set replaces only its own: the failed grant is
    // over, inventory's condition stays.
    f.events(&[RecordEvent::new(RecordKind::GrantConditions(
        FleetConditions {
            version: 2,
            conditions: vec![condition("grant:1", "grant_waiting", "app")],
        },
    ))])
    .await;
    f.evaluate().await;
    let mut kinds: Vec<String> = f
        .open()
        .await
        .iter()
        .map(|x| x["kind"].as_str().unwrap().to_owned())
        .collect();
    kinds.sort();
    assert_eq!(kinds, ["grant_waiting", "module_below_replicas"]);
}

#[tokio::test]
async fn observations_raise_queue_and_behind_alerts_and_conditions_become_alerts() {
    let f = setup(Settings {
        behind_after: Duration::ZERO,
        ..Settings::default()
    })
    .await;
    let a = f.node("a");
    f.events(&[
        joined(&a),
        RecordEvent::new(RecordKind::FleetConditions(FleetConditions {
            version: 2,
            conditions: vec![FleetCondition {
                key: "pinned_unreachable:db".into(),
                kind: "pinned_unreachable".into(),
                node: Some(a.clone()),
                module: Some("db".into()),
                stateful: true,
                message: "stateful module `db` is pinned to unreachable node".into(),
            }],
        })),
    ])
    .await;
    let obs = Observations {
        queues: Some(vec![QueueDepth {
            queue: "dead-letter".into(),
            messages: 1,
            warn_above: 0,
            dead_letter: true,
        }]),
        behind: Some(vec![Behind {
            node: a.to_string(),
            section: "config".into(),
            declared: 5,
            applied: Some(3),
        }]),
    };
    f.obs.evaluate(&obs).await.unwrap();
    let kinds: Vec<String> = f
        .open()
        .await
        .iter()
        .map(|x| x["kind"].as_str().unwrap().to_owned())
        .collect();
    for k in [
        "dead_letter_queue",
        "node_behind",
        "stateful_module_unreachable",
    ] {
        assert!(kinds.contains(&k.to_owned()), "{k} not in {kinds:?}");
    }
    // Without observations, those alerts stay as they are.
    f.evaluate().await;
    assert_eq!(f.open().await.len(), 3);
    // The purged queue and the node in step resolve theirs; an older
    // conditions event changes nothing.
    f.events(&[RecordEvent::new(RecordKind::FleetConditions(
        FleetConditions {
            version: 1,
            conditions: Vec::new(),
        },
    ))])
    .await;
    f.obs
        .evaluate(&Observations {
            queues: Some(vec![QueueDepth {
                queue: "dead-letter".into(),
                messages: 0,
                warn_above: 0,
                dead_letter: true,
            }]),
            behind: Some(Vec::new()),
        })
        .await
        .unwrap();
    let open = f.open().await;
    assert_eq!(open.len(), 1);
    assert_eq!(open[0]["kind"], "stateful_module_unreachable");
    // Filters and pages.
    let by_kind: serde_json::Value = f.get("/v1/alerts?state=all&kind=dead_letter_queue").await;
    assert_eq!(by_kind["alerts"].as_array().unwrap().len(), 1);
    let page: serde_json::Value = f.get("/v1/alerts?state=all&limit=2").await;
    assert_eq!(page["alerts"].as_array().unwrap().len(), 2);
    let next = page["next"].as_str().unwrap();
    let rest: serde_json::Value = f
        .get(&format!("/v1/alerts?state=all&limit=2&after={next}"))
        .await;
    assert_eq!(rest["alerts"].as_array().unwrap().len(), 1);
    assert!(rest["next"].is_null());
    let bad = f
        .app
        .clone()
        .oneshot(
            Request::get("/v1/alerts?state=closed")
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(bad.status(), StatusCode::BAD_REQUEST);
    f.env.teardown().await.unwrap();
}

#[tokio::test]
async fn probe_history_and_resolved_alerts_are_pruned_past_their_retention() {
    let f = setup(Settings {
        probe_retention: Duration::from_secs(3600),
        alert_retention: Duration::from_secs(3600),
        ..Settings::default()
    })
    .await;
    let a = f.node("a");
    f.events(&[joined(&a), placed("web", 1, &[&a])]).await;
    f.report(&a, units("web", "web", UnitState::Running, 0))
        .await;
    f.report(
        &a,
        probe("web", "web", ProbeState::Unhealthy, Some("HTTP 500")),
    )
    .await;
    f.evaluate().await;
    f.report(&a, probe("web", "web", ProbeState::Healthy, None))
        .await;
    f.evaluate().await;
    let count = |sql: &'static str| {
        let pool = f.obs.pool().clone();
        async move {
            sqlx::query_scalar::<_, i64>(sql)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    assert_eq!(
        count("SELECT count(*) FROM observability.probe_history").await,
        2
    );
    assert_eq!(
        count("SELECT count(*) FROM observability.alerts WHERE resolved_at IS NOT NULL").await,
        1
    );
    // Age one of each past the retention.
    sqlx::query(
        "UPDATE observability.probe_history SET recorded_at = now() - interval '2 hours' \
         WHERE id = (SELECT min(id) FROM observability.probe_history)",
    )
    .execute(f.obs.pool())
    .await
    .unwrap();
    sqlx::query("UPDATE observability.alerts SET resolved_at = now() - interval '2 hours'")
        .execute(f.obs.pool())
        .await
        .unwrap();
    f.evaluate().await;
    assert_eq!(
        count("SELECT count(*) FROM observability.probe_history").await,
        1
    );
    assert_eq!(count("SELECT count(*) FROM observability.alerts").await, 0);
    f.env.teardown().await.unwrap();
}
