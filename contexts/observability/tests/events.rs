//! The observability context against a real PostgreSQL, one fresh database
//! per test, fed record events the way the controller's router feeds them
//! (inbox first, one transaction, then `committed`), and read through its
//! HTTP route as server-sent events.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use futures_util::StreamExt;
use mesh_observability::{Observability, SCHEMA, Settings};
use mesh_plumbing::{Context, inbox};
use mesh_protocol::{Labels, NodeId, NodeLabelsChanged, RecordEvent, RecordKind};
use mesh_testkit::TestEnv;
use sqlx::postgres::PgPoolOptions;
use tower::ServiceExt;

struct Fixture {
    env: TestEnv,
    obs: Arc<Observability>,
    app: axum::Router,
}

async fn setup(settings: Settings) -> Fixture {
    let env = TestEnv::new().await.unwrap();
    let url = env.database_url(SCHEMA);
    assert!(!mesh_observability::migrate(&url).await.unwrap().is_empty());
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
    Fixture { env, obs, app }
}

impl Fixture {
    fn node(&self, suffix: &str) -> NodeId {
        NodeId::parse(&format!("{}-{suffix}", self.env.id())).unwrap()
    }

    /// As the router does: inbox claim, handler, commit, then the wake-up.
    async fn feed(&self, events: &[RecordEvent]) {
        let mut tx = self.obs.pool().begin().await.unwrap();
        let ids: Vec<_> = events.iter().map(|e| e.id).collect();
        let mut fresh = inbox::claim(&mut tx, SCHEMA, &ids).await.unwrap();
        let fresh: Vec<&RecordEvent> = events.iter().filter(|e| fresh.remove(&e.id)).collect();
        if !fresh.is_empty() {
            self.obs.handle_events(&mut tx, &fresh).await.unwrap();
        }
        tx.commit().await.unwrap();
        self.obs.committed();
    }

    async fn get(&self, uri: &str, last: Option<&str>) -> axum::response::Response {
        let mut req = Request::get(uri);
        if let Some(last) = last {
            req = req.header("Last-Event-ID", last);
        }
        self.app
            .clone()
            .oneshot(req.body(Body::empty()).unwrap())
            .await
            .unwrap()
    }
}

fn joined(node: &NodeId) -> RecordEvent {
    RecordEvent::new(RecordKind::NodeJoined(NodeLabelsChanged {
        node: node.clone(),
        labels: Labels::default(),
        version: 1,
    }))
}

fn updated(node: &NodeId) -> RecordEvent {
    RecordEvent::new(RecordKind::NodeUpdated(NodeLabelsChanged {
        node: node.clone(),
        labels: Labels::default(),
        version: 2,
    }))
}

/// One SSE event as read off the wire.
#[derive(Debug, Clone, PartialEq)]
struct Sse {
    id: Option<String>,
    event: String,
    data: serde_json::Value,
}

fn parse(text: &str) -> Vec<Sse> {
    text.split("\n\n")
        .filter_map(|block| {
            let mut id = None;
            let mut event = None;
            let mut data = String::new();
            for line in block.lines() {
                if let Some(v) = line.strip_prefix("id: ") {
                    id = Some(v.to_owned());
                } else if let Some(v) = line.strip_prefix("event: ") {
                    event = Some(v.to_owned());
                } else if let Some(v) = line.strip_prefix("data: ") {
                    data.push_str(v);
                }
            }
            Some(Sse {
                id,
                event: event?,
                data: serde_json::from_str(&data).ok()?,
            })
        })
        .collect()
}

/// The whole body of a stream that ends (`follow=false`).
async fn all(resp: axum::response::Response) -> Vec<Sse> {
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(
        resp.headers()["content-type"].to_str().unwrap(),
        "text/event-stream"
    );
    let bytes = tokio::time::timeout(
        Duration::from_secs(10),
        axum::body::to_bytes(resp.into_body(), usize::MAX),
    )
    .await
    .expect("a follow=false stream ends")
    .unwrap();
    parse(std::str::from_utf8(&bytes).unwrap())
}

fn ids(events: &[Sse]) -> Vec<String> {
    events
        .iter()
        .map(|e| e.data["id"].as_str().unwrap().to_owned())
        .collect()
}

async fn problem(resp: axum::response::Response) -> (StatusCode, serde_json::Value) {
    let status = resp.status();
    assert_eq!(
        resp.headers()["content-type"].to_str().unwrap(),
        "application/problem+json"
    );
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, serde_json::from_slice(&bytes).unwrap())
}

#[tokio::test]
async fn resuming_with_last_event_id_sends_exactly_the_missed_events_in_order() {
    let f = setup(Settings::default()).await;
    let (a, b) = (f.node("a"), f.node("b"));
    let first = [joined(&a), joined(&b), updated(&a)];
    f.feed(&first).await;
    // A redelivery is appended once.
    f.feed(&first[..1]).await;

    let seen = all(f.get("/v1/events?after=0&follow=false", None).await).await;
    assert_eq!(
        ids(&seen),
        first.iter().map(|e| e.id.to_string()).collect::<Vec<_>>()
    );
    assert_eq!(seen[0].event, "inventory.node.joined");
    assert_eq!(seen[2].event, "inventory.node.updated");
    assert_eq!(seen[0].data["node"], a.as_str());
    assert_eq!(seen[0].data["body"]["node"], a.as_str());
    let positions: Vec<i64> = seen
        .iter()
        .map(|e| e.id.as_ref().unwrap().parse().unwrap())
        .collect();
    assert!(positions.windows(2).all(|w| w[0] < w[1]), "{positions:?}");

    // The client read two, left, and more happened.
    let last = seen[1].id.clone().unwrap();
    let later = [joined(&f.node("c")), updated(&b)];
    f.feed(&later).await;
    let resumed = all(f.get("/v1/events?follow=false", Some(&last)).await).await;
    let missed: Vec<String> = [&first[2], &later[0], &later[1]]
        .iter()
        .map(|e| e.id.to_string())
        .collect();
    assert_eq!(ids(&resumed), missed);
    // `after` does the same for clients that cannot set the header.
    let by_query = all(f
        .get(&format!("/v1/events?follow=false&after={last}"), None)
        .await)
    .await;
    assert_eq!(by_query, resumed);
}

#[tokio::test]
async fn a_following_stream_receives_new_events_live() {
    let f = setup(Settings::default()).await;
    f.feed(&[joined(&f.node("old"))]).await;
    // Without a position the stream starts at the newest event.
    let resp = f.get("/v1/events", None).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body().into_data_stream();
    let new = joined(&f.node("new"));
    f.feed(std::slice::from_ref(&new)).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    let mut text = String::new();
    loop {
        let chunk = tokio::time::timeout_at(deadline, body.next())
            .await
            .expect("the new event arrives before the deadline (well before the 5 s poll)")
            .expect("the stream stays open")
            .unwrap();
        text.push_str(std::str::from_utf8(&chunk).unwrap());
        let got = parse(&text);
        if !got.is_empty() {
            assert_eq!(ids(&got), vec![new.id.to_string()]);
            break;
        }
    }
}

#[tokio::test]
async fn filters_by_context_kind_and_node() {
    let f = setup(Settings::default()).await;
    let (a, b) = (f.node("a"), f.node("b"));
    let events = [joined(&a), joined(&b), updated(&a)];
    f.feed(&events).await;
    let got = all(f
        .get(&format!("/v1/events?after=0&follow=false&node={a}"), None)
        .await)
    .await;
    assert_eq!(
        ids(&got),
        vec![events[0].id.to_string(), events[2].id.to_string()]
    );
    let got = all(f
        .get("/v1/events?after=0&follow=false&kind=node.updated", None)
        .await)
    .await;
    assert_eq!(ids(&got), vec![events[2].id.to_string()]);
    let got = all(f
        .get(
            "/v1/events?after=0&follow=false&context=inventory&kind=node.joined",
            None,
        )
        .await)
    .await;
    assert_eq!(
        ids(&got),
        vec![events[0].id.to_string(), events[1].id.to_string()]
    );
    let got = all(f
        .get("/v1/events?after=0&follow=false&context=identity", None)
        .await)
    .await;
    assert!(got.is_empty());
    let got = all(f
        .get("/v1/events?after=0&follow=false&module=web", None)
        .await)
    .await;
    assert!(got.is_empty());
}

#[tokio::test]
async fn a_pruned_position_is_gone_and_a_malformed_one_is_refused() {
    let f = setup(Settings {
        retention: Duration::ZERO,
        ..Settings::default()
    })
    .await;
    // With no retention the batch after these prunes them.
    f.feed(&[joined(&f.node("a")), joined(&f.node("b"))]).await;
    f.obs.prune().await.unwrap();
    let (status, p) = problem(f.get("/v1/events?follow=false", Some("1")).await).await;
    assert_eq!(status, StatusCode::GONE);
    assert_eq!(p["field"], "Last-Event-ID");
    assert!(p["detail"].as_str().unwrap().contains("re-list"), "{p}");
    // The newest pruned position is still a valid place to resume from.
    let got = all(f.get("/v1/events?follow=false", Some("2")).await).await;
    assert!(got.is_empty());

    let (status, p) = problem(f.get("/v1/events", Some("yesterday")).await).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(p["field"], "Last-Event-ID");
    let (status, p) = problem(f.get("/v1/events?after=-3", None).await).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(p["field"], "after");
    let (status, p) = problem(f.get("/v1/events?node=Not%20A%20Node", None).await).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(p["field"], "node");
}

#[tokio::test]
async fn a_slow_client_is_dropped_with_a_reason_and_streams_are_bounded() {
    let f = setup(Settings {
        stream_buffer: 2,
        page: 10,
        max_streams: 1,
        ..Settings::default()
    })
    .await;
    let events: Vec<_> = (0..6).map(|i| joined(&f.node(&format!("n{i}")))).collect();
    f.feed(&events).await;
    // The client does not read while its reader fills the buffer.
    let resp = f.get("/v1/events?after=0", None).await;
    assert_eq!(resp.status(), StatusCode::OK);
    // The one slot is taken.
    let (status, _) = problem(f.get("/v1/events", None).await).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let got = all(resp).await;
    let (last, delivered) = got.split_last().unwrap();
    assert_eq!(last.event, "dropped");
    assert_eq!(last.id, None);
    assert!(
        last.data["reason"].as_str().unwrap().contains("too slow"),
        "{last:?}"
    );
    assert_eq!(ids(delivered), ids_of(&events[..2]));
    // The dropped client's slot is free again.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let resp = f.get("/v1/events?follow=false", None).await;
        if resp.status() == StatusCode::OK {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the slot is never freed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn ids_of(events: &[RecordEvent]) -> Vec<String> {
    events.iter().map(|e| e.id.to_string()).collect()
}
