//! Conformance probe: proves, against the live servers, what the mesh rests on,
//! before any mesh state is written. Each check that fails refuses the whole
//! probe with [`ProbeError::Failed`], which names the check.
//!
//! PostgreSQL (read-only: three `SHOW`s as any login role; it creates nothing):
//!
//! - `postgresql-version`: `server_version_num` is 140000 or more (PostgreSQL 14);
//! - `autovacuum`: `autovacuum` and `track_counts` are `on` (decision 0014: every
//!   heartbeat rewrites its node's row, and without vacuum the tables bloat).
//!
//! RabbitMQ, in a temporary vhost with a temporary restricted user, both removed
//! whatever the outcome:
//!
//! - `user_id`: a publish whose `user_id` is not the connection's user is refused
//!   (the channel is closed with 406 PRECONDITION_FAILED);
//! - `write-permission`: a publish to an exchange outside the user's write
//!   permission is refused (403 ACCESS_REFUSED);
//! - `topic-permission`: a publish with a routing key outside the user's topic
//!   permission is refused (403 ACCESS_REFUSED).
//!
//! A positive control (an allowed publish with the right `user_id` is confirmed)
//! runs first, so a broker that refuses everything does not pass.

use std::time::Duration;

use lapin::Confirmation;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

use sqlx::Connection as _;

use crate::provision::{self, ProvisionError, Rabbit, Secret, Steps};
use mesh_credentials::AdminCredentials;

const ALLOWED_EXCHANGE: &str = "probe-allowed";
const FORBIDDEN_EXCHANGE: &str = "probe-forbidden";
const STEP_TIMEOUT: Duration = Duration::from_secs(15);

#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("probe setup: {0}")]
    Setup(#[from] ProvisionError),
    #[error("probe setup: amqp: {0}")]
    Amqp(String),
    #[error("probe setup: postgresql: {0}")]
    Postgres(String),
    #[error("conformance check `{check}` failed: {detail}")]
    Failed { check: &'static str, detail: String },
}

/// One passed check, for the report.
#[derive(Debug, Clone)]
pub struct Passed {
    pub check: &'static str,
    pub detail: String,
}

/// What a successful probe did.
#[derive(Debug, Clone)]
pub struct ProbeReport {
    /// The temporary vhost it used (deleted again).
    pub vhost: String,
    /// The temporary user it used (deleted again).
    pub user: String,
    pub passed: Vec<Passed>,
}

/// Where the broker checks run: a vhost and a user the probe creates and
/// deletes again (neither may exist before).
#[derive(Debug, Clone)]
pub struct BrokerTarget {
    pub vhost: String,
    pub user: String,
    /// The user's tags: empty, as a node's user has none. (A user tagged
    /// `impersonator` may forge `user_id`; the probe must refuse that broker.)
    pub user_tags: String,
}

impl BrokerTarget {
    /// `mesh-probe-<8 hex digits>` for both, no tags.
    pub fn fresh() -> BrokerTarget {
        let name = format!("mesh-probe-{}", hex::encode(rand::random::<[u8; 4]>()));
        BrokerTarget {
            vhost: name.clone(),
            user: name,
            user_tags: String::new(),
        }
    }
}

/// Runs every check: PostgreSQL's with `admin.postgres_url` (any login role
/// will do), then the broker's with `admin`'s RabbitMQ administrator account.
/// Leaves nothing behind.
pub async fn run(admin: &AdminCredentials) -> Result<ProbeReport, ProbeError> {
    let mut passed = postgres(admin.postgres_url.expose()).await?;
    let broker = broker(admin, &BrokerTarget::fresh()).await?;
    passed.extend(broker.passed);
    Ok(ProbeReport { passed, ..broker })
}

/// The broker checks in `target`'s vhost as `target`'s user, both created for
/// the probe and deleted again whatever the outcome.
pub async fn broker(
    admin: &AdminCredentials,
    target: &BrokerTarget,
) -> Result<ProbeReport, ProbeError> {
    let rabbit = Rabbit::new(admin);
    rabbit.wait_ready(Duration::from_secs(60)).await?;
    let result = checks(admin, &rabbit, target).await;
    let c1 = rabbit.delete_vhost(&target.vhost).await;
    let c2 = rabbit.delete_user(&target.user).await;
    let passed = result?;
    c1?;
    c2?;
    Ok(ProbeReport {
        vhost: target.vhost.clone(),
        user: target.user.clone(),
        passed,
    })
}

/// PostgreSQL 14 is the oldest the mesh runs on.
pub const MIN_SERVER_VERSION_NUM: i64 = 140_000;

/// The `postgresql-version` check on a `server_version_num` as the server
/// reports it (`150004` is 15.4, `90624` is 9.6.24).
pub fn check_server_version(server_version_num: &str) -> Result<Passed, ProbeError> {
    const CHECK: &str = "postgresql-version";
    let text = server_version_num.trim();
    let n: i64 = text.parse().map_err(|_| ProbeError::Failed {
        check: CHECK,
        detail: format!("server_version_num `{text}` is not a number"),
    })?;
    // 10 and later: major * 10000 + minor; before: major * 10000 + minor * 100 + patch.
    let version = if n >= 100_000 {
        format!("{}.{}", n / 10_000, n % 10_000)
    } else {
        format!("{}.{}.{}", n / 10_000, n / 100 % 100, n % 100)
    };
    if n < MIN_SERVER_VERSION_NUM {
        return Err(ProbeError::Failed {
            check: CHECK,
            detail: format!(
                "server_version_num {n} (PostgreSQL {version}) is older than \
                 {MIN_SERVER_VERSION_NUM}: PostgreSQL 14 or newer is required"
            ),
        });
    }
    Ok(Passed {
        check: CHECK,
        detail: format!(
            "server_version_num {n} (PostgreSQL {version}) >= {MIN_SERVER_VERSION_NUM}"
        ),
    })
}

/// The `autovacuum` check on the values of `SHOW autovacuum` and
/// `SHOW track_counts` (autovacuum needs the statistics it counts).
pub fn check_autovacuum(autovacuum: &str, track_counts: &str) -> Result<Passed, ProbeError> {
    const CHECK: &str = "autovacuum";
    let off: Vec<String> = [("autovacuum", autovacuum), ("track_counts", track_counts)]
        .into_iter()
        .filter(|(_, v)| v.trim() != "on")
        .map(|(k, v)| format!("{k} = {}", v.trim()))
        .collect();
    if !off.is_empty() {
        return Err(ProbeError::Failed {
            check: CHECK,
            detail: format!(
                "{}: every heartbeat rewrites its node's row, and without vacuum the \
                 tables bloat (decision 0014); `bundle/up` turns both on",
                off.join(", ")
            ),
        });
    }
    Ok(Passed {
        check: CHECK,
        detail: "autovacuum = on, track_counts = on".into(),
    })
}

/// The PostgreSQL checks against the server at `url`: three `SHOW`s, nothing
/// created.
pub async fn postgres(url: &str) -> Result<Vec<Passed>, ProbeError> {
    let redacted = provision::redact(url);
    let mut conn = tokio::time::timeout(STEP_TIMEOUT, sqlx::PgConnection::connect(url))
        .await
        .map_err(|_| ProbeError::Postgres(format!("connecting to {redacted} timed out")))?
        .map_err(|e| ProbeError::Postgres(format!("connecting to {redacted}: {e}")))?;
    let mut show = async |setting: &str| -> Result<String, ProbeError> {
        sqlx::query_scalar::<_, String>(sqlx::AssertSqlSafe(format!("SHOW {setting}")))
            .fetch_one(&mut conn)
            .await
            .map_err(|e| ProbeError::Postgres(format!("SHOW {setting}: {e}")))
    };
    let version = show("server_version_num").await;
    let autovacuum = show("autovacuum").await;
    let track_counts = show("track_counts").await;
    let _ = conn.close().await;
    Ok(vec![
        check_server_version(&version?)?,
        check_autovacuum(&autovacuum?, &track_counts?)?,
    ])
}

async fn checks(
    admin: &AdminCredentials,
    rabbit: &Rabbit,
    target: &BrokerTarget,
) -> Result<Vec<Passed>, ProbeError> {
    let (vhost, user) = (target.vhost.as_str(), target.user.as_str());
    let mut steps = Steps::default();
    let secret = Secret::generate();
    rabbit.ensure_vhost(vhost, &mut steps).await?;
    rabbit
        .ensure_exchange(vhost, ALLOWED_EXCHANGE, "topic")
        .await?;
    rabbit
        .ensure_exchange(vhost, FORBIDDEN_EXCHANGE, "topic")
        .await?;
    rabbit
        .ensure_user(user, &secret, &target.user_tags, &mut steps)
        .await?;
    rabbit
        .ensure_permissions(
            vhost,
            user,
            "^$",
            &format!("^{ALLOWED_EXCHANGE}$"),
            "^$",
            &mut steps,
        )
        .await?;
    rabbit
        .ensure_topic_permissions(
            vhost,
            user,
            ALLOWED_EXCHANGE,
            &format!("^{user}\\."),
            &format!("^{user}\\."),
            &mut steps,
        )
        .await?;

    let url = provision::amqp_url(admin, user, &secret.value, vhost)?;
    let conn = tokio::time::timeout(
        STEP_TIMEOUT,
        Connection::connect(&url, ConnectionProperties::default()),
    )
    .await
    .map_err(|_| ProbeError::Amqp("connect timed out".into()))?
    .map_err(|e| ProbeError::Amqp(format!("connect as {user}: {e}")))?;

    let mut passed = Vec::new();
    let own_key = format!("{user}.probe");

    // Positive control.
    match publish(&conn, ALLOWED_EXCHANGE, &own_key, Some(user)).await? {
        Outcome::Confirmed => passed.push(Passed {
            check: "control",
            detail: "an allowed publish with the connection's own user_id is confirmed".into(),
        }),
        other => {
            return Err(ProbeError::Failed {
                check: "control",
                detail: format!("an allowed publish was not confirmed: {other:?}"),
            });
        }
    }

    type Check<'a> = (&'static str, &'a str, String, Option<&'a str>, u16, &'a str);
    let checks: [Check<'_>; 3] = [
        (
            "user_id",
            ALLOWED_EXCHANGE,
            own_key.clone(),
            Some("someone-else"),
            406,
            "a publish with user_id of another user",
        ),
        (
            "write-permission",
            FORBIDDEN_EXCHANGE,
            own_key.clone(),
            Some(user),
            403,
            "a publish to an exchange outside the write permission",
        ),
        (
            "topic-permission",
            ALLOWED_EXCHANGE,
            "someone-else.probe".to_string(),
            Some(user),
            403,
            "a publish with a routing key outside the topic permission",
        ),
    ];
    for (check, exchange, key, user_id, code, what) in checks {
        match publish(&conn, exchange, &key, user_id).await? {
            Outcome::Refused(c, text) if c == code => passed.push(Passed {
                check,
                detail: format!("{what} is refused ({c} {text})"),
            }),
            other => {
                let _ = conn.close(200, "probe failed".into()).await;
                return Err(ProbeError::Failed {
                    check,
                    detail: format!("{what} was not refused with {code}: {other:?}"),
                });
            }
        }
    }
    let _ = conn.close(200, "probe done".into()).await;
    Ok(passed)
}

// The fields are read through Debug, in failure messages.
#[allow(dead_code)]
#[derive(Debug)]
enum Outcome {
    Confirmed,
    Nacked,
    Refused(u16, String),
    OtherError(String),
}

fn classify(e: &lapin::Error) -> Outcome {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => {
            Outcome::Refused(amqp.get_id(), amqp.get_message().to_string())
        }
        _ => Outcome::OtherError(e.to_string()),
    }
}

/// Publishes once on a fresh confirming channel and reports what the broker did.
async fn publish(
    conn: &Connection,
    exchange: &str,
    key: &str,
    user_id: Option<&str>,
) -> Result<Outcome, ProbeError> {
    let channel: Channel = conn
        .create_channel()
        .await
        .map_err(|e| ProbeError::Amqp(format!("create channel: {e}")))?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(|e| ProbeError::Amqp(format!("confirm_select: {e}")))?;
    let mut props = BasicProperties::default().with_delivery_mode(2);
    if let Some(u) = user_id {
        props = props.with_user_id(u.into());
    }
    let attempt = async {
        let confirm = channel
            .basic_publish(
                exchange.into(),
                key.into(),
                BasicPublishOptions::default(),
                b"{\"probe\":true}",
                props,
            )
            .await;
        let confirm = match confirm {
            Ok(c) => c,
            Err(e) => return classify(&e),
        };
        match confirm.await {
            Ok(Confirmation::Ack(_)) => Outcome::Confirmed,
            Ok(Confirmation::Nack(_)) => Outcome::Nacked,
            Ok(Confirmation::NotRequested) => Outcome::OtherError("confirm not requested".into()),
            Err(e) => classify(&e),
        }
    };
    let outcome = tokio::time::timeout(STEP_TIMEOUT, attempt)
        .await
        .unwrap_or_else(|_| Outcome::OtherError("no answer from the broker in time".into()));
    if matches!(outcome, Outcome::Confirmed | Outcome::Nacked) {
        let _ = channel.close(200, "probe".into()).await;
    }
    Ok(outcome)
}
