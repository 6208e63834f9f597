//! Conformance probe: proves, against the live broker, that RabbitMQ enforces the
//! three checks the mesh's security boundary rests on, before any mesh state is
//! written. It works in a temporary vhost with a temporary restricted user and
//! removes both whatever the outcome.
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

/// Runs every check with `admin`'s RabbitMQ administrator account; cleans up.
pub async fn run(admin: &AdminCredentials) -> Result<ProbeReport, ProbeError> {
    let rabbit = Rabbit::new(admin);
    rabbit.wait_ready(Duration::from_secs(60)).await?;
    let id = hex::encode(rand::random::<[u8; 4]>());
    let vhost = format!("mesh-probe-{id}");
    let user = format!("mesh-probe-{id}");
    let result = checks(admin, &rabbit, &vhost, &user).await;
    let c1 = rabbit.delete_vhost(&vhost).await;
    let c2 = rabbit.delete_user(&user).await;
    let passed = result?;
    c1?;
    c2?;
    Ok(ProbeReport {
        vhost,
        user,
        passed,
    })
}

async fn checks(
    admin: &AdminCredentials,
    rabbit: &Rabbit,
    vhost: &str,
    user: &str,
) -> Result<Vec<Passed>, ProbeError> {
    let mut steps = Steps::default();
    let secret = Secret::generate();
    rabbit.ensure_vhost(vhost, &mut steps).await?;
    rabbit
        .ensure_exchange(vhost, ALLOWED_EXCHANGE, "topic")
        .await?;
    rabbit
        .ensure_exchange(vhost, FORBIDDEN_EXCHANGE, "topic")
        .await?;
    rabbit.ensure_user(user, &secret, "", &mut steps).await?;
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
