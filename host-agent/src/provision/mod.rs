//! Resource grants on a provider's node (decision 0039): the agent creates,
//! revokes and deletes a grant's database, vhost or bucket through the
//! server's own administrative CLI (`psql`, `rabbitmqctl`, `garage`) on this
//! node. It links no database driver and no client of the provider's
//! protocol: it runs the server's tools, each under a timeout.
//!
//! Guarantees: [`reconcile`] is idempotent and level-triggered: it makes the
//! server match one [`ResourceItem`] whatever it finds there.
//! Passwords are never in a command line, never logged, and never in a
//! reason (`psql` reads its SQL from stdin, in terse verbosity, with the
//! server's statement logging off for the session).
//!
//! Garage's `garage key import` takes the secret in argv: its key is
//! imported through the admin API instead (see `garage.rs`).

use std::collections::HashMap;
use std::time::Duration;

use mesh_protocol::{
    CREDENTIAL_VERSION_KEY, MAX_REASON_CHARS, ResourceItem, ResourceKind, ResourceState,
    ResourceStatus, ResourceStatusState, Secret,
};
use uuid::Uuid;

mod garage;
mod postgres;
mod rabbitmq;
pub mod worker;

/// How long one CLI command may take before the server counts as not
/// answering.
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

/// Why a driver could not bring the server to the item.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    /// The server is not answering (socket missing, connection refused,
    /// node down, timeout): the grant waits and is tried again.
    #[error("server not answering: {0}")]
    Unavailable(String),
    /// The server refused a statement or an option, in its own words: the
    /// grant fails until its declaration changes.
    #[error("{0}")]
    Refused(String),
    /// The server refused for a passing reason (its catalog changed under
    /// the statement, a deadlock): the grant waits and is tried again on the
    /// next pass, which looks afresh.
    #[error("{0} (tried again)")]
    Transient(String),
}

impl DriverError {
    fn state(&self) -> ResourceStatusState {
        match self {
            DriverError::Unavailable(_) | DriverError::Transient(_) => ResourceStatusState::Waiting,
            DriverError::Refused(_) => ResourceStatusState::Failed,
        }
    }
}

/// A grant's credential file as config delivers it (`KEY=VALUE` lines).
#[derive(Debug, Clone)]
pub struct CredentialFile {
    pub version: i64,
    pub password: Secret<String>,
}

impl CredentialFile {
    /// Read the version ([`CREDENTIAL_VERSION_KEY`]) and the kind's password
    /// key. The error never quotes a value.
    pub fn parse(kind: ResourceKind, text: &str) -> Result<CredentialFile, String> {
        let mut version = None;
        let mut password = None;
        for line in text.lines() {
            let line = line.trim_end_matches('\r');
            if line.trim_start().starts_with('#') {
                continue;
            }
            let Some((key, value)) = line.split_once('=') else {
                continue;
            };
            let key = key.trim();
            let value = unquote(value.trim());
            if key == CREDENTIAL_VERSION_KEY {
                version = Some(
                    value
                        .parse::<i64>()
                        .map_err(|_| format!("{CREDENTIAL_VERSION_KEY} is not an integer"))?,
                );
            } else if key == kind.password_key() {
                password = Some(value.to_owned());
            }
        }
        let version = version.ok_or_else(|| format!("no {CREDENTIAL_VERSION_KEY}"))?;
        let password = password.ok_or_else(|| format!("no {}", kind.password_key()))?;
        if password.is_empty() || password.chars().any(|c| c.is_control()) {
            return Err(format!(
                "{} is empty or has control characters",
                kind.password_key()
            ));
        }
        Ok(CredentialFile {
            version,
            password: Secret::new(password),
        })
    }
}

fn unquote(v: &str) -> &str {
    for q in ['"', '\''] {
        if v.len() >= 2 && v.starts_with(q) && v.ends_with(q) {
            return &v[1..v.len() - 1];
        }
    }
    v
}

/// A reason for a report: at most [`MAX_REASON_CHARS`] characters.
pub(crate) fn truncate_reason(s: &str) -> String {
    let s = s.trim();
    if s.chars().count() <= MAX_REASON_CHARS {
        s.to_owned()
    } else {
        s.chars().take(MAX_REASON_CHARS - 1).chain(['…']).collect()
    }
}

fn status(item: &ResourceItem, state: ResourceStatusState) -> ResourceStatus {
    ResourceStatus {
        grant: item.grant,
        state,
        credential_version: None,
        reason: None,
        recreated: false,
    }
}

fn from_error(item: &ResourceItem, e: DriverError) -> ResourceStatus {
    let mut s = status(item, e.state());
    s.reason = Some(truncate_reason(&e.to_string()));
    s
}

/// Whether the item's database, vhost or bucket exists on the server.
pub async fn exists(item: &ResourceItem) -> Result<bool, DriverError> {
    match item.kind {
        ResourceKind::PostgresDatabase => postgres::exists(item).await,
        ResourceKind::AmqpVhost => rabbitmq::exists(item).await,
        ResourceKind::S3Bucket => garage::exists(item).await,
    }
}

/// Bring the server to one item; idempotent.
pub async fn reconcile(item: &ResourceItem, credential: Option<&CredentialFile>) -> ResourceStatus {
    if item.admin.kind() != item.kind {
        return from_error(
            item,
            DriverError::Refused(format!("admin access does not administer a {}", item.kind)),
        );
    }
    match item.state {
        ResourceState::Present => {
            let Some(cred) = credential.filter(|c| c.version >= item.credential_version) else {
                let mut s = status(item, ResourceStatusState::Waiting);
                s.reason = Some(format!(
                    "credential version {} {}",
                    item.credential_version,
                    mesh_protocol::CREDENTIAL_NOT_YET_DELIVERED
                ));
                return s;
            };
            let r = match item.kind {
                ResourceKind::PostgresDatabase => postgres::ensure(item, &cred.password).await,
                ResourceKind::AmqpVhost => rabbitmq::ensure(item, &cred.password).await,
                ResourceKind::S3Bucket => garage::ensure(item, &cred.password).await,
            };
            match r {
                Ok(()) => {
                    let mut s = status(item, ResourceStatusState::Ready);
                    s.credential_version = Some(cred.version);
                    s
                }
                Err(e) => from_error(item, e),
            }
        }
        ResourceState::Revoked => {
            let r = match item.kind {
                ResourceKind::PostgresDatabase => postgres::revoke(item).await,
                ResourceKind::AmqpVhost => rabbitmq::revoke(item).await,
                ResourceKind::S3Bucket => garage::revoke(item).await,
            };
            match r {
                Ok(()) => status(item, ResourceStatusState::Revoked),
                Err(e) => from_error(item, e),
            }
        }
        ResourceState::Deleted => {
            let r = match item.kind {
                ResourceKind::PostgresDatabase => postgres::delete(item).await,
                ResourceKind::AmqpVhost => rabbitmq::delete(item).await,
                ResourceKind::S3Bucket => garage::delete(item).await,
            };
            match r {
                Ok(()) => status(item, ResourceStatusState::Deleted),
                Err(e) => from_error(item, e),
            }
        }
    }
}

#[derive(Default)]
struct Memory {
    /// The credential version the resource was last ready at.
    ready_at: Option<i64>,
    /// Found missing after being ready at this version: `recreated` until
    /// the item's credential version exceeds it.
    recreated_at: Option<i64>,
    /// The last item that failed, and its status: not retried until the
    /// item changes.
    failed: Option<(ResourceItem, ResourceStatus)>,
}

/// Reconciles a provisioning section's items pass after pass, remembering
/// in memory what one [`reconcile`] cannot know: that a resource was ready
/// before (so that finding it missing means it was `recreated`) and which
/// item failed (not retried until it changes).
#[derive(Default)]
pub struct Provisioner {
    memory: HashMap<Uuid, Memory>,
}

impl Provisioner {
    pub fn new() -> Provisioner {
        Provisioner::default()
    }

    /// Take up what an earlier process found (the store's last `resources`
    /// report): a resource that was ready and is now missing is then
    /// `recreated`, as if this process had seen it ready. A failed one is
    /// tried again (a restart is a fresh look).
    pub fn remember(&mut self, found: &[ResourceStatus]) {
        for s in found {
            let mem = self.memory.entry(s.grant).or_default();
            if s.state == ResourceStatusState::Ready {
                mem.ready_at = s.credential_version;
                if s.recreated {
                    mem.recreated_at = s.credential_version;
                }
            }
        }
    }

    /// One pass over every item; `read_credential` reads a credential file
    /// by its declared path (None: not there yet).
    pub async fn pass(
        &mut self,
        items: &[ResourceItem],
        read_credential: impl Fn(&str) -> Option<String>,
    ) -> Vec<ResourceStatus> {
        self.memory
            .retain(|grant, _| items.iter().any(|i| i.grant == *grant));
        let mut out = Vec::with_capacity(items.len());
        for item in items {
            let mem = self.memory.entry(item.grant).or_default();
            if let Some((failed_item, failed_status)) = &mem.failed {
                if failed_item == item {
                    out.push(failed_status.clone());
                    continue;
                }
                mem.failed = None;
            }
            let mut credential_error = None;
            let credential = match item.credential.as_deref().and_then(&read_credential) {
                Some(text) => match CredentialFile::parse(item.kind, &text) {
                    Ok(c) => Some(c),
                    Err(e) => {
                        credential_error = Some(e);
                        None
                    }
                },
                None => None,
            };
            if item.state == ResourceState::Present
                && let Some(v) = mem.ready_at
                && let Ok(false) = exists(item).await
            {
                mem.recreated_at = Some(v);
            }
            let mut s = match credential_error {
                Some(e) if item.state == ResourceState::Present => {
                    let mut s = status(item, ResourceStatusState::Waiting);
                    s.reason = Some(truncate_reason(&format!("credential file: {e}")));
                    s
                }
                _ => reconcile(item, credential.as_ref()).await,
            };
            if item.state != ResourceState::Present {
                mem.ready_at = None;
                mem.recreated_at = None;
            }
            if let Some(v) = mem.recreated_at {
                if item.credential_version > v {
                    mem.recreated_at = None;
                } else {
                    s.recreated = true;
                }
            }
            match s.state {
                ResourceStatusState::Ready => mem.ready_at = s.credential_version,
                ResourceStatusState::Failed => mem.failed = Some((item.clone(), s.clone())),
                _ => {}
            }
            out.push(s);
        }
        out
    }
}

/// Run one CLI command with `stdin` fed to it, under [`COMMAND_TIMEOUT`]:
/// (exit code, stdout, stderr). A spawn failure or a timeout is
/// [`DriverError::Unavailable`].
pub(crate) async fn run(
    mut cmd: tokio::process::Command,
    stdin: &str,
) -> Result<(Option<i32>, String, String), DriverError> {
    use std::process::Stdio;
    use tokio::io::AsyncWriteExt;
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let program = cmd.as_std().get_program().to_string_lossy().into_owned();
    let mut child = cmd
        .spawn()
        .map_err(|e| DriverError::Unavailable(format!("cannot run {program}: {e}")))?;
    let input = stdin.as_bytes().to_vec();
    let mut pipe = child.stdin.take();
    let work = async move {
        if let Some(p) = pipe.as_mut() {
            // A write error means the command exited early; its status says why.
            let _ = p.write_all(&input).await;
        }
        drop(pipe);
        child.wait_with_output().await
    };
    match tokio::time::timeout(COMMAND_TIMEOUT, work).await {
        Err(_) => Err(DriverError::Unavailable(format!(
            "{program} did not finish within {}s",
            COMMAND_TIMEOUT.as_secs()
        ))),
        Ok(Err(e)) => Err(DriverError::Unavailable(format!("{program}: {e}"))),
        Ok(Ok(out)) => Ok((
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_credential_file() {
        let c = CredentialFile::parse(
            ResourceKind::PostgresDatabase,
            "PGHOST=db\nPGPASSWORD='s3cret'\nMESH_CREDENTIAL_VERSION=3\n",
        )
        .unwrap();
        assert_eq!(c.version, 3);
        assert_eq!(c.password.expose(), "s3cret");
        assert!(!format!("{c:?}").contains("s3cret"));
        assert!(CredentialFile::parse(ResourceKind::PostgresDatabase, "PGPASSWORD=x\n").is_err());
        assert!(
            CredentialFile::parse(
                ResourceKind::AmqpVhost,
                "PGPASSWORD=x\nMESH_CREDENTIAL_VERSION=1"
            )
            .is_err()
        );
    }

    #[test]
    fn reasons_are_bounded() {
        let long = "x".repeat(MAX_REASON_CHARS * 2);
        assert_eq!(truncate_reason(&long).chars().count(), MAX_REASON_CHARS);
    }
}
