//! The audit entry of an operator's request, written where the change is.
//!
//! The controller's auth layer authenticates a request and puts an [`Audit`]
//! (who, which route, which path, which request) in its extensions. A mutating
//! handler takes it as an extractor and hands it to the context's method that
//! makes the change, which calls [`record_ok`] in the same transaction, just
//! before commit: the `<context>.operator.audit` event lands in the context's
//! outbox atomically with the change, so a crash can lose neither without the
//! other (docs/decisions/0018). The relay publishes it; identity appends it to
//! the audit log.
//!
//! A request that changed nothing (refused with 403, or failed with any other
//! status) has no transaction to join: the auth layer writes its entry after the
//! response with [`record_outcome`], on the context's pool, through this module,
//! so the controller writes no context's table itself.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use axum::extract::FromRequestParts;
use axum::http::StatusCode;
use axum::http::request::Parts;
use chrono::Utc;
use mesh_protocol::{AuditEntry, RecordEvent, RecordKind};
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use crate::api::{Principal, Problem};
use crate::outbox;

/// The longest target path an entry keeps (a longer one is cut).
pub const MAX_TARGET_CHARS: usize = 1024;

/// The longest detail an entry keeps (a longer one is cut).
pub const MAX_DETAIL_CHARS: usize = 512;

/// How a request ended, as its audit entry says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// 2xx: the change committed.
    Ok,
    /// 403: the principal's role was not enough.
    Denied,
    /// Any other status: nothing changed.
    Failed,
}

impl Outcome {
    pub fn of(status: StatusCode) -> Outcome {
        if status.is_success() {
            Outcome::Ok
        } else if status == StatusCode::FORBIDDEN {
            Outcome::Denied
        } else {
            Outcome::Failed
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Denied => "denied",
            Outcome::Failed => "failed",
        }
    }
}

#[derive(Debug)]
struct Inner {
    principal: Principal,
    action: String,
    target: String,
    request_id: Uuid,
    /// Set by [`record_ok`]: the handler wrote the `ok` entry in its transaction.
    recorded: AtomicBool,
    /// What the handler noted for the entry ([`Audit::note`]).
    detail: Mutex<Option<String>>,
}

/// Who does what to which path in which request: what an audit entry says.
/// Cheap to clone; clones share whether the `ok` entry was written.
///
/// As an extractor, it is the one the auth layer put in the request; a route
/// not behind the auth layer has none and answers 500 (a wiring bug, never an
/// unaudited change).
#[derive(Debug, Clone)]
pub struct Audit(Arc<Inner>);

impl Audit {
    /// `action` is the method and route pattern (`PUT /v1/files/{name}`),
    /// `target` the concrete path (`/v1/files/motd`).
    pub fn new(principal: Principal, action: String, target: &str, request_id: Uuid) -> Audit {
        Audit(Arc::new(Inner {
            principal,
            action,
            target: target.chars().take(MAX_TARGET_CHARS).collect(),
            request_id,
            recorded: AtomicBool::new(false),
            detail: Mutex::new(None),
        }))
    }

    /// Say in the entry what the route alone does not (its `detail`), e.g.
    /// that the module written runs as root. A handler notes it before it
    /// answers, whatever the outcome: the `ok` entry written in the change's
    /// transaction carries it, and so does the entry of a refusal the auth
    /// layer writes after the response. The last note wins.
    pub fn note(&self, detail: impl Into<String>) {
        let detail: String = detail.into().chars().take(MAX_DETAIL_CHARS).collect();
        let mut slot = self
            .0
            .detail
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *slot = Some(detail);
    }

    /// What [`Audit::note`] said, if anything.
    pub fn detail(&self) -> Option<String> {
        self.0
            .detail
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    pub fn principal(&self) -> &Principal {
        &self.0.principal
    }

    pub fn action(&self) -> &str {
        &self.0.action
    }

    pub fn target(&self) -> &str {
        &self.0.target
    }

    pub fn request_id(&self) -> Uuid {
        self.0.request_id
    }

    /// True once [`record_ok`] wrote this request's `ok` entry in a transaction.
    pub fn recorded(&self) -> bool {
        self.0.recorded.load(Ordering::Acquire)
    }

    /// The entry for this request with `outcome` and `status`.
    pub fn entry(&self, outcome: Outcome, status: StatusCode) -> AuditEntry {
        AuditEntry {
            principal_id: self.0.principal.id,
            principal: self.0.principal.name.clone(),
            role: self.0.principal.role.as_str().to_owned(),
            action: self.0.action.clone(),
            target: self.0.target.clone(),
            request_id: self.0.request_id,
            at: Utc::now(),
            outcome: outcome.as_str().to_owned(),
            status: status.as_u16(),
            detail: self.detail(),
        }
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Audit {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts.extensions.get::<Audit>().cloned().ok_or_else(|| {
            Problem::internal(format!(
                "{} {} is not behind the auth layer: no audit context, so no change",
                parts.method,
                parts.uri.path()
            ))
        })
    }
}

/// Write the `ok` entry of `audit` to `schema`'s outbox inside `tx`, the
/// transaction that makes the change: call it once, just before commit. The
/// entry's status is 200 for every success: it is written before the response
/// exists (docs/decisions/0018).
pub async fn record_ok(
    tx: &mut PgConnection,
    schema: &str,
    audit: &Audit,
) -> Result<(), sqlx::Error> {
    let event = RecordEvent::new(RecordKind::OperatorAudit {
        context: schema.to_owned(),
        entry: audit.entry(Outcome::Ok, StatusCode::OK),
    });
    outbox::record(tx, schema, &event).await?;
    audit.0.recorded.store(true, Ordering::Release);
    Ok(())
}

/// Write the entry of a request that ended with `status` to `schema`'s outbox
/// in a transaction of its own on `pool`: for requests whose entry no handler's
/// transaction carries (403, 4xx, 5xx), after the response.
pub async fn record_outcome(
    pool: &PgPool,
    schema: &str,
    audit: &Audit,
    status: StatusCode,
) -> Result<(), sqlx::Error> {
    let event = RecordEvent::new(RecordKind::OperatorAudit {
        context: schema.to_owned(),
        entry: audit.entry(Outcome::of(status), status),
    });
    let mut tx = pool.begin().await?;
    outbox::record(&mut tx, schema, &event).await?;
    tx.commit().await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::Role;

    #[test]
    fn outcomes_follow_the_status() {
        assert_eq!(Outcome::of(StatusCode::OK), Outcome::Ok);
        assert_eq!(Outcome::of(StatusCode::CREATED), Outcome::Ok);
        assert_eq!(Outcome::of(StatusCode::NO_CONTENT), Outcome::Ok);
        assert_eq!(Outcome::of(StatusCode::FORBIDDEN), Outcome::Denied);
        assert_eq!(Outcome::of(StatusCode::NOT_FOUND), Outcome::Failed);
        assert_eq!(
            Outcome::of(StatusCode::INTERNAL_SERVER_ERROR),
            Outcome::Failed
        );
    }

    #[test]
    fn an_entry_names_who_what_and_where() {
        let principal = Principal {
            id: Uuid::now_v7(),
            name: "ci".into(),
            role: Role::Operator,
        };
        let long = format!("/v1/files/{}", "x".repeat(2000));
        let audit = Audit::new(
            principal.clone(),
            "PUT /v1/files/{name}".into(),
            &long,
            Uuid::now_v7(),
        );
        let e = audit.entry(Outcome::Denied, StatusCode::FORBIDDEN);
        assert_eq!(e.principal_id, principal.id);
        assert_eq!(e.principal, "ci");
        assert_eq!(e.role, "operator");
        assert_eq!(e.action, "PUT /v1/files/{name}");
        assert_eq!(e.target.chars().count(), MAX_TARGET_CHARS);
        assert_eq!(e.request_id, audit.request_id());
        assert_eq!((e.outcome.as_str(), e.status), ("denied", 403));
        assert!(!audit.clone().recorded());
        assert_eq!(e.detail, None);
        audit.clone().note("runs as root".repeat(100));
        let e = audit.entry(Outcome::Ok, StatusCode::OK);
        let detail = e.detail.unwrap_or_default();
        assert!(detail.starts_with("runs as root"), "{detail}");
        assert_eq!(detail.chars().count(), MAX_DETAIL_CHARS);
    }
}
