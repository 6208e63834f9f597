//! Garage: a bucket and an access key allowed on it alone, through
//! `garage -c <config>`; the key is imported through the admin API
//! (`POST /v2/ImportKey`, bearer `admin_token` of the same config file) so
//! that its secret is never in argv (`garage key import` takes it there).
//!
//! Every key of a grant is named `grant-<grant>`. Garage cannot change a
//! key's secret, so a rotated credential is a new key id: once the new key is
//! imported and allowed on the bucket, the grant's other keys are deleted
//! (their holders get 403 from then on); revoking deletes every key of the
//! grant. Keys are listed through the admin API (`GET /v2/ListKeys`) and
//! deleted with `garage key delete`.
//!
//! Caveat: Garage refuses to delete a non-empty bucket; a deleted grant's
//! bucket that still holds objects fails with Garage's reason.

use std::path::Path;

use mesh_protocol::{ResourceItem, Secret};

use super::{DriverError, run, truncate_reason};

const BUILT: &str = "/var/cache/mesh-ci/garage-2.5.0/bin/garage";

fn config(item: &ResourceItem) -> Result<&str, DriverError> {
    item.admin
        .config
        .as_deref()
        .ok_or_else(|| DriverError::Refused("admin.config is required".into()))
}

fn program() -> String {
    let on_path = std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join("garage"))
            .find(|f| f.is_file())
    });
    match on_path {
        Some(p) => p.to_string_lossy().into_owned(),
        None if Path::new(BUILT).exists() => BUILT.to_owned(),
        None => "garage".to_owned(),
    }
}

/// Ok(stdout), or Err(stderr) classified: an error the server answered
/// (`… returned <Code> (<status>)`) is refused, but for a server still
/// starting (its layout not applied yet, a 500 or 503 while it settles),
/// which, like anything else, is unavailable: the grant waits.
async fn garage(item: &ResourceItem, args: &[&str]) -> Result<Result<String, String>, DriverError> {
    let mut cmd = tokio::process::Command::new(program());
    // The CLI's own log lines (connections, handshakes) are not the reason.
    cmd.env("RUST_LOG", "error")
        .env("NO_COLOR", "1")
        .arg("-c")
        .arg(config(item)?)
        .args(args);
    let (code, stdout, stderr) = run(cmd, "").await?;
    let errors = error_lines(&stderr);
    if code == Some(0) {
        Ok(Ok(stdout))
    } else if errors.contains(" returned ") && !starting(&errors) {
        Ok(Err(errors))
    } else {
        Err(DriverError::Unavailable(truncate_reason(&errors)))
    }
}

/// The lines of the CLI's stderr that say what went wrong (`Error: …`), or
/// all of it when none does.
fn error_lines(stderr: &str) -> String {
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.trim_start().starts_with("Error"))
        .collect();
    if lines.is_empty() {
        stderr.trim().to_owned()
    } else {
        lines.join("\n")
    }
}

/// A server that answered but is not ready to serve yet.
fn starting(errors: &str) -> bool {
    ["Layout not ready", "(500)", "(503)", "Quorum"]
        .iter()
        .any(|m| errors.contains(m))
}

async fn must(item: &ResourceItem, args: &[&str]) -> Result<(), DriverError> {
    garage(item, args)
        .await?
        .map(|_| ())
        .map_err(|e| DriverError::Refused(truncate_reason(&e)))
}

async fn found(item: &ResourceItem, args: &[&str], missing: &str) -> Result<bool, DriverError> {
    match garage(item, args).await? {
        Ok(_) => Ok(true),
        Err(e) if e.contains(missing) => Ok(false),
        Err(e) => Err(DriverError::Refused(truncate_reason(&e))),
    }
}

pub(super) async fn exists(item: &ResourceItem) -> Result<bool, DriverError> {
    found(item, &["bucket", "info", &item.name], "NoSuchBucket").await
}

async fn key_exists(item: &ResourceItem) -> Result<bool, DriverError> {
    found(item, &["key", "info", &item.user], "NoSuchAccessKey").await
}

/// The admin API's address and bearer token, from the server's configuration.
async fn admin_api(item: &ResourceItem) -> Result<(String, Secret<String>), DriverError> {
    let text = tokio::fs::read_to_string(config(item)?)
        .await
        .map_err(|e| DriverError::Unavailable(format!("garage config: {e}")))?;
    let cfg: toml::Value =
        toml::from_str(&text).map_err(|e| DriverError::Refused(format!("garage config: {e}")))?;
    let admin = cfg.get("admin");
    let addr = admin
        .and_then(|a| a.get("api_bind_addr"))
        .and_then(|v| v.as_str());
    let token = admin
        .and_then(|a| a.get("admin_token"))
        .and_then(|v| v.as_str());
    let (Some(addr), Some(token)) = (addr, token) else {
        return Err(DriverError::Refused(
            "garage config: [admin] api_bind_addr and admin_token are required".into(),
        ));
    };
    Ok((addr.to_owned(), Secret::new(token.to_owned())))
}

fn key_name(item: &ResourceItem) -> String {
    format!("grant-{}", item.grant)
}

/// The ids of every key named for the item's grant.
async fn grant_keys(item: &ResourceItem) -> Result<Vec<String>, DriverError> {
    let (addr, token) = admin_api(item).await?;
    let resp = reqwest::Client::new()
        .get(format!("http://{addr}/v2/ListKeys"))
        .bearer_auth(token.expose())
        .timeout(super::COMMAND_TIMEOUT)
        .send()
        .await
        .map_err(|e| DriverError::Unavailable(format!("garage admin API: {e}")))?;
    let status = resp.status();
    if !status.is_success() {
        let text = resp.text().await.unwrap_or_default();
        return Err(DriverError::Refused(truncate_reason(&format!(
            "garage ListKeys: {status}: {text}"
        ))));
    }
    let keys: Vec<serde_json::Value> = resp
        .json()
        .await
        .map_err(|e| DriverError::Unavailable(format!("garage ListKeys: {e}")))?;
    let name = key_name(item);
    Ok(keys
        .iter()
        .filter(|k| k.get("name").and_then(|n| n.as_str()) == Some(name.as_str()))
        .filter_map(|k| k.get("id").and_then(|i| i.as_str()).map(str::to_owned))
        .collect())
}

/// Delete the grant's keys other than `keep`.
async fn delete_grant_keys(item: &ResourceItem, keep: Option<&str>) -> Result<(), DriverError> {
    for id in grant_keys(item).await? {
        if Some(id.as_str()) != keep {
            must(item, &["key", "delete", "--yes", &id]).await?;
        }
    }
    Ok(())
}

async fn import_key(item: &ResourceItem, secret: &Secret<String>) -> Result<(), DriverError> {
    let (addr, token) = admin_api(item).await?;
    let body = serde_json::json!({
        "accessKeyId": item.user,
        "secretAccessKey": secret.expose(),
        "name": key_name(item),
    });
    let resp = reqwest::Client::new()
        .post(format!("http://{addr}/v2/ImportKey"))
        .bearer_auth(token.expose())
        .timeout(super::COMMAND_TIMEOUT)
        .json(&body)
        .send()
        .await
        .map_err(|e| DriverError::Unavailable(format!("garage admin API: {e}")))?;
    if resp.status().is_success() {
        return Ok(());
    }
    let status = resp.status();
    let text = resp.text().await.unwrap_or_default();
    Err(DriverError::Refused(truncate_reason(&format!(
        "garage ImportKey: {status}: {text}"
    ))))
}

pub(super) async fn ensure(
    item: &ResourceItem,
    secret: &Secret<String>,
) -> Result<(), DriverError> {
    let mut max_size = "none".to_owned();
    for (k, v) in &item.options {
        match k.as_str() {
            "max_size" => max_size = v.clone(),
            other => {
                return Err(DriverError::Refused(format!(
                    "unknown option `{other}` for an s3.bucket"
                )));
            }
        }
    }
    if !exists(item).await? {
        must(item, &["bucket", "create", &item.name]).await?;
    }
    // An existing key keeps its secret (Garage cannot change a key's secret):
    // a rotated credential comes as a new key id.
    if !key_exists(item).await? {
        import_key(item, secret).await?;
    }
    must(
        item,
        &[
            "bucket", "allow", "--read", "--write", &item.name, "--key", &item.user,
        ],
    )
    .await?;
    must(
        item,
        &["bucket", "set-quotas", "--max-size", &max_size, &item.name],
    )
    .await?;
    // The new key works: the grant's older keys go.
    delete_grant_keys(item, Some(&item.user)).await
}

pub(super) async fn revoke(item: &ResourceItem) -> Result<(), DriverError> {
    if key_exists(item).await? {
        must(item, &["key", "delete", "--yes", &item.user]).await?;
    }
    delete_grant_keys(item, None).await
}

pub(super) async fn delete(item: &ResourceItem) -> Result<(), DriverError> {
    revoke(item).await?;
    if exists(item).await? {
        must(item, &["bucket", "delete", "--yes", &item.name]).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_starting_server_waits_and_its_log_is_not_the_reason() {
        let stderr = "\u{1b}[2m2026\u{1b}[0m INFO garage_net::netapp: Connected to 127.0.0.1:3901\nError: GetBucketInfo returned InternalError (500): Internal error: Layout not ready\n";
        let errors = error_lines(stderr);
        assert_eq!(
            errors,
            "Error: GetBucketInfo returned InternalError (500): Internal error: Layout not ready"
        );
        assert!(starting(&errors));
        assert!(!starting(
            "Error: CreateBucket returned InvalidRequest (400): bad quota"
        ));
    }
}
