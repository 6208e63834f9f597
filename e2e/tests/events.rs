//! The event stream end to end (issue 13, part 4): a real controller, nodes
//! enrolled the real way (identity writes `identity.node.enrolled` to the
//! record, the observability context appends it), read by a real HTTP client
//! as server-sent events with a viewer's token. A client that left and
//! resumes with `Last-Event-ID` gets exactly what it missed, in order; a
//! position older than the retention window is 410; a malformed one is 400.

use std::time::{Duration, Instant};

use mesh_e2e::{Mesh, wait_for};
use serde_json::Value;

const WITHIN: Duration = Duration::from_secs(30);

/// One SSE event: its id, name and JSON data.
#[derive(Debug, Clone, PartialEq)]
struct Sse {
    id: Option<String>,
    event: String,
    data: Value,
}

fn parse(text: &str) -> Vec<Sse> {
    text.split("\n\n")
        .filter_map(|block| {
            let (mut id, mut event, mut data) = (None, None, String::new());
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

fn client() -> anyhow::Result<reqwest::Client> {
    // No overall timeout: a following stream stays open.
    Ok(reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(5))
        .build()?)
}

/// Open the stream at `query`, resuming after `last` if given, and read until
/// `n` events arrived (or the deadline passes); then disconnect.
async fn read(
    mesh: &Mesh,
    token: &str,
    query: &str,
    last: Option<&str>,
    n: usize,
) -> anyhow::Result<Vec<Sse>> {
    let mut req = client()?
        .get(format!("{}/v1/events?{query}", mesh.api))
        .bearer_auth(token);
    if let Some(last) = last {
        req = req.header("Last-Event-ID", last);
    }
    let mut resp = req.send().await?;
    anyhow::ensure!(resp.status() == 200, "GET /v1/events: {}", resp.status());
    anyhow::ensure!(
        resp.headers()["content-type"] == "text/event-stream",
        "content type {:?}",
        resp.headers()["content-type"]
    );
    let deadline = Instant::now() + WITHIN;
    let mut text = String::new();
    loop {
        let got = parse(&text);
        if got.len() >= n {
            return Ok(got);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, resp.chunk()).await {
            Ok(Ok(Some(chunk))) => text.push_str(std::str::from_utf8(&chunk)?),
            Ok(Ok(None)) => anyhow::bail!("the stream ended after {got:?}"),
            Ok(Err(e)) => return Err(e.into()),
            Err(_) => anyhow::bail!("{n} events did not arrive in {WITHIN:?}; got {got:?}"),
        }
    }
}

/// Every kept event after `after` (`follow=false`: the stream ends).
async fn all(mesh: &Mesh, token: &str, query: &str) -> anyhow::Result<Vec<Sse>> {
    let resp = client()?
        .get(format!("{}/v1/events?follow=false&{query}", mesh.api))
        .bearer_auth(token)
        .timeout(WITHIN)
        .send()
        .await?;
    anyhow::ensure!(resp.status() == 200, "GET /v1/events: {}", resp.status());
    Ok(parse(&resp.text().await?))
}

fn enrolled(events: &[Sse]) -> Vec<String> {
    events
        .iter()
        .filter(|e| e.event == "identity.node.enrolled")
        .filter_map(|e| e.data["node"].as_str().map(str::to_owned))
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_resumes_with_last_event_id_gets_exactly_what_it_missed_in_order()
-> anyhow::Result<()> {
    let mesh = Mesh::start().await?;
    let viewer = mesh.create_token("events-viewer", "viewer").await?;
    let (a, _) = mesh.join_node("a").await?;
    let (b, _) = mesh.join_node("b").await?;
    let seen = wait_for("both enrolments on the stream", WITHIN, || async {
        let got = all(&mesh, &viewer, "after=0&context=identity").await?;
        Ok((enrolled(&got).len() >= 2).then_some(got))
    })
    .await?;
    assert_eq!(enrolled(&seen), vec![a.clone(), b.clone()]);

    // The client read the first, disconnected; b, c and d happened since.
    let first = read(&mesh, &viewer, "after=0&context=identity", None, 1).await?;
    let last = first[0].id.clone().expect("every event has an id");
    let (c, _) = mesh.join_node("c").await?;
    let (d, _) = mesh.join_node("d").await?;
    let resumed = read(&mesh, &viewer, "context=identity", Some(&last), 3).await?;
    assert_eq!(enrolled(&resumed), vec![b.clone(), c.clone(), d.clone()]);
    let positions: Vec<i64> = resumed
        .iter()
        .map(|e| e.id.as_deref().unwrap_or("").parse())
        .collect::<Result<_, _>>()?;
    assert!(positions.windows(2).all(|w| w[0] < w[1]), "{positions:?}");
    assert!(positions[0] > last.parse::<i64>()?);

    // A live follower sees a new enrolment as it happens.
    let live = tokio::spawn({
        let api = mesh.api.clone();
        let viewer = viewer.clone();
        async move {
            let mut resp = client()?
                .get(format!("{api}/v1/events?kind=node.enrolled"))
                .bearer_auth(&viewer)
                .send()
                .await?;
            let mut text = String::new();
            while parse(&text).is_empty() {
                let chunk = tokio::time::timeout(WITHIN, resp.chunk())
                    .await??
                    .ok_or_else(|| anyhow::anyhow!("the stream ended"))?;
                text.push_str(std::str::from_utf8(&chunk)?);
            }
            anyhow::Ok(parse(&text))
        }
    });
    // The follower starts at the newest event; give it time to connect.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (e, _) = mesh.join_node("e").await?;
    assert_eq!(enrolled(&live.await??), vec![e]);

    // Filters: one node's events only.
    let only_c = all(&mesh, &viewer, &format!("after=0&node={c}")).await?;
    assert_eq!(enrolled(&only_c), vec![c]);

    // A malformed position is refused, naming the header.
    let (status, _, problem) = mesh
        .request(
            reqwest::Method::GET,
            "/v1/events",
            &[("Last-Event-ID", "not-a-position")],
            None,
        )
        .await?;
    assert_eq!(status, 400, "{problem}");
    assert_eq!(problem["field"], "Last-Event-ID");
    // No token, no stream.
    let (status, _) = mesh
        .request_as(reqwest::Method::GET, "/v1/events", None, None)
        .await?;
    assert_eq!(status, 401);
    mesh.teardown().await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_position_older_than_the_retention_window_is_gone() -> anyhow::Result<()> {
    let mut mesh = Mesh::prepare().await?;
    let path = mesh.dir.path().join("controller.toml");
    let mut toml = std::fs::read_to_string(&path)?;
    toml.push_str("event_retention_secs = 1\n");
    std::fs::write(&path, toml)?;
    mesh.start_controller(&[]).await?;
    let viewer = mesh.create_token("events-viewer", "viewer").await?;
    mesh.join_node("a").await?;
    let first = wait_for("the enrolment on the stream", WITHIN, || async {
        let got = all(&mesh, &viewer, "after=0").await?;
        Ok(got
            .into_iter()
            .find(|e| e.event == "identity.node.enrolled"))
    })
    .await?;
    let position = first.id.clone().expect("an id");
    // Past the window, the next events appended prune it.
    let stale = (position.parse::<i64>()? - 1).to_string();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let status = wait_for("the first position pruned", WITHIN, || async {
        mesh.join_node(&format!("p{}", rand_suffix())).await?;
        let (status, _, problem) = mesh
            .request(
                reqwest::Method::GET,
                "/v1/events?follow=false",
                &[("Last-Event-ID", &stale)],
                None,
            )
            .await?;
        Ok((status == 410).then_some(problem))
    })
    .await?;
    assert_eq!(status["field"], "Last-Event-ID");
    assert!(
        status["detail"].as_str().unwrap_or("").contains("re-list"),
        "{status}"
    );
    mesh.teardown().await
}

fn rand_suffix() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() % 1_000_000)
        .unwrap_or(0)
}
