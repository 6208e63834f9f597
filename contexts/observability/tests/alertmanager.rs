//! Alerts delivered to Alertmanager (issue 35) against a real PostgreSQL and
//! a real HTTP listener standing in for Alertmanager's `POST /api/v2/alerts`
//! (it records what it accepts; while "down" it answers 503 or is not
//! listening at all).

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use chrono::Utc;
use mesh_observability::{AlertPoster, Observability, Observations, SCHEMA, Settings};
use mesh_plumbing::{Context, inbox};
use mesh_protocol::{
    Labels, LivenessState, NodeId, NodeLabelsChanged, NodeLiveness, RecordEvent, RecordKind,
};
use mesh_testkit::TestEnv;
use serde_json::Value;
use sqlx::postgres::PgPoolOptions;

/// The receiver: what it accepted, in order; `down` answers 503.
#[derive(Clone, Default)]
struct Receiver {
    got: Arc<Mutex<Vec<Value>>>,
    down: Arc<AtomicBool>,
}

async fn accept(State(r): State<Receiver>, Json(alerts): Json<Vec<Value>>) -> StatusCode {
    if r.down.load(Ordering::SeqCst) {
        return StatusCode::SERVICE_UNAVAILABLE;
    }
    r.got.lock().unwrap().extend(alerts);
    StatusCode::OK
}

async fn receiver() -> (Receiver, String) {
    let r = Receiver::default();
    let app = axum::Router::new()
        .route("/api/v2/alerts", post(accept))
        .with_state(r.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (r, url)
}

/// The controller's poster, in miniature: a plain HTTP client.
struct Http(reqwest::Client);

impl AlertPoster for Http {
    fn post<'a>(
        &'a self,
        url: &'a str,
        body: Vec<u8>,
    ) -> Pin<Box<dyn Future<Output = Result<(), String>> + Send + 'a>> {
        Box::pin(async move {
            let r = self
                .0
                .post(url)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .map_err(|e| e.to_string())?;
            if r.status().is_success() {
                Ok(())
            } else {
                Err(format!("answered {}", r.status()))
            }
        })
    }
}

async fn events(obs: &Observability, events: &[RecordEvent]) {
    let mut tx = obs.pool().begin().await.unwrap();
    let ids: Vec<_> = events.iter().map(|e| e.id).collect();
    inbox::claim(&mut tx, SCHEMA, &ids).await.unwrap();
    let refs: Vec<&RecordEvent> = events.iter().collect();
    obs.handle_events(&mut tx, &refs).await.unwrap();
    tx.commit().await.unwrap();
}

fn liveness(node: &NodeId, state: LivenessState) -> RecordEvent {
    RecordEvent::new(
        NodeLiveness {
            node: node.clone(),
            state,
            at: Utc::now(),
            last_heard: Some(Utc::now()),
        }
        .into_kind(),
    )
}

#[tokio::test]
async fn alerts_reach_every_alertmanager_and_a_down_one_loses_nothing() {
    let env = TestEnv::new().await.unwrap();
    let url = env.database_url(SCHEMA);
    mesh_observability::migrate(&url).await.unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .unwrap();
    let (one, one_url) = receiver().await;
    let (two, two_url) = receiver().await;
    let obs = Observability::new(
        pool.clone(),
        mesh_plumbing::OutboxSignal::default(),
        Settings {
            alertmanager_urls: vec![one_url.clone(), format!("{two_url}/")],
            dashboard_url: Some("https://controller.example:7443/dashboard".into()),
            ..Settings::default()
        },
    );
    let poster = Http(reqwest::Client::new());
    let a = NodeId::parse(&format!("{}-a", env.id())).unwrap();
    events(
        &obs,
        &[
            RecordEvent::new(RecordKind::NodeJoined(NodeLabelsChanged {
                node: a.clone(),
                labels: Labels::default(),
                version: 1,
            })),
            liveness(&a, LivenessState::Unreachable),
        ],
    )
    .await;
    assert_eq!(
        obs.evaluate(&Observations::default()).await.unwrap().raised,
        1
    );

    // Both accept: the open alert with its labels and annotations.
    let d = obs.deliver_alerts(&poster, false).await.unwrap();
    assert_eq!((d.sent, d.failed, d.pending), (2, 0, 0), "{d:?}");
    for r in [&one, &two] {
        let got = r.got.lock().unwrap().clone();
        assert_eq!(got.len(), 1, "{got:?}");
        let alert = &got[0];
        assert_eq!(alert["labels"]["alertname"], "node_unreachable");
        assert_eq!(alert["labels"]["node"], a.as_str());
        assert_eq!(alert["labels"]["subject"], format!("node/{a}"));
        assert!(alert["labels"]["severity"].is_string(), "{alert}");
        assert!(
            alert["annotations"]["message"]
                .as_str()
                .unwrap()
                .contains(a.as_str()),
            "{alert}"
        );
        assert_eq!(
            alert["annotations"]["dashboard"],
            "https://controller.example:7443/dashboard#alerts"
        );
        assert!(alert["startsAt"].is_string() && alert.get("endsAt").is_none());
    }
    // Nothing pending: a round without resend posts nothing; with resend,
    // the open alert again (Alertmanager forgets one not re-sent).
    let d = obs.deliver_alerts(&poster, false).await.unwrap();
    assert_eq!((d.sent, d.failed), (0, 0));
    let d = obs.deliver_alerts(&poster, true).await.unwrap();
    assert_eq!((d.sent, d.failed), (2, 0));
    assert_eq!(one.got.lock().unwrap().len(), 2);

    // Two goes down; meanwhile the node comes back: the alert resolves.
    two.down.store(true, Ordering::SeqCst);
    events(&obs, &[liveness(&a, LivenessState::Alive)]).await;
    assert_eq!(
        obs.evaluate(&Observations::default())
            .await
            .unwrap()
            .resolved,
        1
    );
    let d = obs.deliver_alerts(&poster, false).await.unwrap();
    assert_eq!((d.sent, d.failed, d.pending), (1, 1, 1), "{d:?}");
    assert!(d.error.unwrap().contains("503"));
    // Still down at the next round: still pending, nothing lost.
    let d = obs.deliver_alerts(&poster, false).await.unwrap();
    assert_eq!((d.failed, d.pending), (1, 1));
    // Back: the alert is delivered, resolved (its endsAt), and the mark goes.
    two.down.store(false, Ordering::SeqCst);
    let d = obs.deliver_alerts(&poster, false).await.unwrap();
    assert_eq!((d.sent, d.failed, d.pending), (2, 0, 0), "{d:?}");
    let got = two.got.lock().unwrap().clone();
    let last = got.last().unwrap();
    assert_eq!(last["labels"]["alertname"], "node_unreachable");
    assert!(last["endsAt"].is_string(), "{last}");

    // An Alertmanager not listening at all, through an alert's whole life:
    // the alert opened and resolved while it was away reaches it, resolved.
    let gone = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let lone = Observability::new(
        pool.clone(),
        mesh_plumbing::OutboxSignal::default(),
        Settings {
            alertmanager_urls: vec![format!("http://127.0.0.1:{gone}")],
            ..Settings::default()
        },
    );
    events(&lone, &[liveness(&a, LivenessState::Unreachable)]).await;
    lone.evaluate(&Observations::default()).await.unwrap();
    let d = lone.deliver_alerts(&poster, true).await.unwrap();
    assert_eq!((d.sent, d.failed, d.pending), (0, 1, 1), "{d:?}");
    events(&lone, &[liveness(&a, LivenessState::Alive)]).await;
    lone.evaluate(&Observations::default()).await.unwrap();
    let d = lone.deliver_alerts(&poster, true).await.unwrap();
    assert_eq!((d.failed, d.pending), (1, 1), "{d:?}");
    // It returns (the first context's receivers stand in for it).
    let d = obs.deliver_alerts(&poster, false).await.unwrap();
    assert_eq!((d.sent, d.failed, d.pending), (2, 0, 0), "{d:?}");
    let got = one.got.lock().unwrap().clone();
    let last = got.last().unwrap();
    assert!(last["endsAt"].is_string(), "{last}");
    env.teardown().await.unwrap();
}
