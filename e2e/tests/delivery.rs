//! At-least-once delivery with exactly one effect, crash safety of ack-after-commit,
//! and bad input kept in the dead-letter queue while valid traffic goes on.

use std::time::Duration;

use mesh_e2e::{Mesh, drain_dead_letters, hello, joined_events, publish_as, wait_for};
use serde_json::json;

const WITHIN: Duration = Duration::from_secs(30);

async fn node_listed(mesh: &Mesh, node: &str) -> anyhow::Result<()> {
    wait_for(&format!("{node} to be listed"), WITHIN, || async {
        let (status, _) = mesh.get(&format!("/v1/nodes/{node}")).await?;
        Ok((status == 200).then_some(()))
    })
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn the_same_report_delivered_twice_has_one_effect() -> anyhow::Result<()> {
    let mesh = Mesh::start().await?;
    let a = mesh.env.add_node("dup").await?;
    let sentinel = mesh.env.add_node("sentinel").await?;
    let report = hello(a.node.as_str(), &[("role", "web")]).encode();
    let key = format!("{}.hello", a.node);

    // Twice back to back (likely one batch), and once more after it was handled.
    publish_as(&a, &key, &report, true).await?;
    publish_as(&a, &key, &report, true).await?;
    node_listed(&mesh, a.node.as_str()).await?;
    publish_as(&a, &key, &report, true).await?;
    // The queue is handled in order: once the sentinel is listed, the third copy was handled too.
    publish_as(
        &sentinel,
        &format!("{}.hello", sentinel.node),
        &hello(sentinel.node.as_str(), &[]).encode(),
        true,
    )
    .await?;
    node_listed(&mesh, sentinel.node.as_str()).await?;

    assert_eq!(joined_events(&mesh, a.node.as_str()).await?, 1);
    mesh.teardown().await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_controller_killed_after_commit_before_ack_loses_and_doubles_nothing()
-> anyhow::Result<()> {
    let mut mesh = Mesh::start().await?;
    mesh.kill_controller();
    // This controller exits right after committing the first hello, before its ack.
    mesh.start_controller(&[("MESH_FAILPOINT_EXIT_AFTER_COMMIT", "hello")])
        .await?;
    let node = mesh.add_agent("crash", &[("role", "web")]).await?;
    let mut dead = mesh.take_controller().expect("controller running");
    let status = dead.wait_exit(WITHIN).await?;
    assert_eq!(
        status.code(),
        Some(86),
        "the failpoint did not fire: {}",
        mesh.controller_log()
    );

    // Declared while no controller runs: stored by nobody yet, so declare after restart.
    mesh.start_controller(&[]).await?;
    node_listed(&mesh, &node).await?;
    mesh.put("/v1/files/f", &json!({"path": "/f", "content": "after crash", "mode": "0644", "selector": {"role": "web"}}))
        .await?;
    let path = mesh.agent(&node).file("/f");
    wait_for("the file to arrive after the crash", WITHIN, || {
        let ok = std::fs::read_to_string(&path)
            .map(|t| t == "after crash")
            .unwrap_or(false);
        async move { Ok(ok.then_some(())) }
    })
    .await?;
    // The redelivered hello was recognised by the inbox: one joined event, not two.
    assert_eq!(joined_events(&mesh, &node).await?, 1);
    mesh.teardown().await
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_reports_are_dead_lettered_with_a_reason_and_valid_traffic_goes_on()
-> anyhow::Result<()> {
    let mesh = Mesh::start().await?;
    let a = mesh.env.add_node("bad").await?;
    let b = mesh.env.add_node("victim").await?;
    let key = format!("{}.hello", a.node);

    publish_as(&a, &key, b"{ this is not json", true).await?;
    let huge = hello(a.node.as_str(), &[("pad", &"x".repeat(200))]);
    let mut oversized = huge.encode();
    oversized.extend(std::iter::repeat_n(b' ', 70 * 1024));
    publish_as(&a, &key, &oversized, true).await?;
    publish_as(&a, &key, &hello(a.node.as_str(), &[]).encode(), false).await?;
    publish_as(&a, &key, &hello(b.node.as_str(), &[]).encode(), true).await?;
    // Valid traffic after the poison.
    publish_as(
        &a,
        &key,
        &hello(a.node.as_str(), &[("ok", "yes")]).encode(),
        true,
    )
    .await?;
    node_listed(&mesh, a.node.as_str()).await?;

    let codes = std::sync::Mutex::new(Vec::new());
    wait_for("four dead letters", WITHIN, || async {
        let got = drain_dead_letters(&mesh.env.controller_amqp_url()).await?;
        let mut codes = codes.lock().expect("not poisoned");
        codes.extend(got);
        Ok((codes.len() >= 4).then_some(()))
    })
    .await?;
    let codes = codes.into_inner().expect("not poisoned");
    let mut got: Vec<&str> = codes.iter().map(|(c, _, _)| c.as_str()).collect();
    got.sort();
    assert_eq!(
        got,
        ["impersonation", "malformed", "too_large", "unauthenticated"],
        "{codes:?}"
    );
    let impersonation = codes
        .iter()
        .find(|(c, _, _)| c == "impersonation")
        .expect("present");
    assert!(
        impersonation.1.contains(b.node.as_str()),
        "reason names the claimed node: {impersonation:?}"
    );
    assert_eq!(impersonation.2.as_deref(), Some(a.node.as_str()));
    // The victim was never created by the impersonating report.
    assert_eq!(mesh.get(&format!("/v1/nodes/{}", b.node)).await?.0, 404);
    mesh.teardown().await
}
