//! `mesh_testkit::skip` cannot pass silently: it writes every skip to the
//! file `$MESH_SKIP_LOG` names (bundle/test fails when that file is not
//! empty), and under `MESH_REQUIRE_ALL` it is an error. Each case runs this
//! test binary again as a child, with the environment of the case, so the
//! variables never touch other tests.

use std::process::Command;

/// The child: gives up as a test that cannot run here does. Ignored: it is
/// run only by the test below, never counted as a test of its own.
#[test]
#[ignore = "the child of every_skip_is_written_down_and_fails_under_require_all"]
fn child_that_skips() -> anyhow::Result<()> {
    mesh_testkit::skip("a tool this machine lacks")
}

fn child(require_all: bool, log: &std::path::Path) -> anyhow::Result<bool> {
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args(["--exact", "child_that_skips", "--ignored"])
        .env(mesh_testkit::SKIP_LOG_ENV, log);
    if require_all {
        cmd.env("MESH_REQUIRE_ALL", "1");
    } else {
        cmd.env_remove("MESH_REQUIRE_ALL");
    }
    Ok(cmd.output()?.status.success())
}

#[test]
fn every_skip_is_written_down_and_fails_under_require_all() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let log = dir.path().join("skips.log");
    assert!(
        child(false, &log)?,
        "without MESH_REQUIRE_ALL a skip passes"
    );
    assert_eq!(
        std::fs::read_to_string(&log)?,
        "child_that_skips: a tool this machine lacks\n"
    );
    assert!(!child(true, &log)?, "under MESH_REQUIRE_ALL a skip fails");
    assert_eq!(std::fs::read_to_string(&log)?.lines().count(), 2);
    Ok(())
}
