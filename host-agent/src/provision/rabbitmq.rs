//! RabbitMQ: a vhost and a user with permissions on it alone, through
//! `rabbitmqctl -n <node>` with `HOME=<home>` (the Erlang cookie there).
//!
//! Passwords go on stdin: `add_user <name>` and `change_password <name>`
//! without the password argument read it from stdin (verified with
//! rabbitmqctl 3.10), so no password is ever in argv.
//!
//! Debian's `/usr/sbin/rabbitmqctl` is a wrapper that, run as root, `su`s to
//! the rabbitmq user and so ignores `HOME`: the unwrapped
//! `/usr/lib/rabbitmq/bin/rabbitmqctl` is used when it exists.

use std::path::Path;

use mesh_protocol::{ResourceItem, Secret};

use super::{DriverError, run, truncate_reason};

const UNWRAPPED: &str = "/usr/lib/rabbitmq/bin/rabbitmqctl";

async fn ctl(item: &ResourceItem, args: &[&str], stdin: &str) -> Result<String, DriverError> {
    let (Some(node), Some(home)) = (item.admin.node.as_deref(), item.admin.home.as_deref()) else {
        return Err(DriverError::Refused(
            "admin.node and admin.home are required".into(),
        ));
    };
    let program = if Path::new(UNWRAPPED).exists() {
        UNWRAPPED
    } else {
        "rabbitmqctl"
    };
    let mut cmd = tokio::process::Command::new(program);
    cmd.env("HOME", home)
        .arg("-n")
        .arg(node)
        .arg("-q")
        .args(args);
    let (code, stdout, stderr) = run(cmd, stdin).await?;
    if code == Some(0) {
        return Ok(stdout);
    }
    let unreachable = [
        "unable to perform an operation on node",
        "nodedown",
        "Target node is unreachable",
        "unable to connect",
        // The node answers but is still booting (or was stopped with
        // `stop_app`): it will be able to, soon.
        "requires the 'rabbit' app to be running",
        "is booting",
    ];
    if unreachable.iter().any(|m| stderr.contains(m)) {
        // The diagnostics that follow are long; the first lines say it.
        let head: String = stderr.lines().take(2).collect::<Vec<_>>().join(" ");
        Err(DriverError::Unavailable(truncate_reason(&head)))
    } else {
        Err(DriverError::Refused(truncate_reason(&stderr)))
    }
}

/// The first column of a `-q list_*` output (its header skipped).
async fn names(item: &ResourceItem, args: &[&str]) -> Result<Vec<String>, DriverError> {
    let out = ctl(item, args, "").await?;
    Ok(out
        .lines()
        .skip(1)
        .filter_map(|l| l.split('\t').next())
        .map(|s| s.trim().to_owned())
        .collect())
}

async fn user_exists(item: &ResourceItem) -> Result<bool, DriverError> {
    Ok(names(item, &["list_users"]).await?.contains(&item.user))
}

pub(super) async fn exists(item: &ResourceItem) -> Result<bool, DriverError> {
    Ok(names(item, &["list_vhosts", "name"])
        .await?
        .contains(&item.name))
}

pub(super) async fn ensure(
    item: &ResourceItem,
    password: &Secret<String>,
) -> Result<(), DriverError> {
    let mut limits = serde_json::Map::new();
    limits.insert("max-queues".into(), (-1).into());
    limits.insert("max-connections".into(), (-1).into());
    for (k, v) in &item.options {
        let key = match k.as_str() {
            "max_queues" => "max-queues",
            "max_connections" => "max-connections",
            other => {
                return Err(DriverError::Refused(format!(
                    "unknown option `{other}` for an amqp.vhost"
                )));
            }
        };
        let n: i64 = v
            .trim()
            .parse()
            .map_err(|_| DriverError::Refused(format!("{k}: `{v}` is not an integer")))?;
        limits.insert(key.into(), n.into());
    }
    // add_vhost of an existing vhost succeeds.
    ctl(item, &["add_vhost", &item.name], "").await?;
    let pw = format!("{}\n", password.expose());
    if user_exists(item).await? {
        ctl(item, &["change_password", &item.user], &pw).await?;
    } else {
        ctl(item, &["add_user", &item.user], &pw).await?;
    }
    ctl(
        item,
        &[
            "set_permissions",
            "-p",
            &item.name,
            &item.user,
            ".*",
            ".*",
            ".*",
        ],
        "",
    )
    .await?;
    let limits = serde_json::Value::Object(limits).to_string();
    ctl(item, &["set_vhost_limits", "-p", &item.name, &limits], "").await?;
    Ok(())
}

/// Deleting the user closes its connections (the broker does it when an
/// internal user is deleted: `320 CONNECTION_FORCED - user '…' is deleted`,
/// before `delete_user` returns; tests/provision.rs holds one open) and
/// keeps the vhost and its queues.
pub(super) async fn revoke(item: &ResourceItem) -> Result<(), DriverError> {
    if user_exists(item).await? {
        ctl(item, &["delete_user", &item.user], "").await?;
    }
    Ok(())
}

pub(super) async fn delete(item: &ResourceItem) -> Result<(), DriverError> {
    if exists(item).await? {
        ctl(item, &["delete_vhost", &item.name], "").await?;
    }
    revoke(item).await
}
