//! The conformance probe passes against this machine's broker and leaves nothing.

use mesh_bundle::provision::Rabbit;

#[tokio::test]
async fn probe_passes_and_cleans_up() {
    let admin = mesh_testkit::admin_credentials().unwrap();
    let report = mesh_bundle::probe::run(&admin).await.unwrap();
    let checks: Vec<_> = report.passed.iter().map(|p| p.check).collect();
    assert_eq!(
        checks,
        ["control", "user_id", "write-permission", "topic-permission"]
    );
    let rabbit = Rabbit::new(&admin);
    assert!(!rabbit.vhost_exists(&report.vhost).await.unwrap());
    assert!(!rabbit.user_exists(&report.user).await.unwrap());
}
