//! Alerts delivered to Alertmanager (issue 35, decision 0053): every change
//! of an alert marks it pending in `observability.alertmanager_pending`, in
//! the transaction that made the change (a trigger on the alerts table; the
//! context's outbox for Alertmanager). [`Observability::deliver_alerts`]
//! posts the pending ones, as they are now, to `POST /api/v2/alerts` of
//! every Alertmanager, and on each `resend` round every open alert too
//! (Alertmanager forgets an alert not re-sent within its `resolve_timeout`,
//! 5 minutes by default). A resolved alert carries `endsAt`.
//!
//! The context speaks no HTTP itself: the controller hands it an
//! [`AlertPoster`] (its HTTP client), as it hands delivery its artifact store.
//!
//! Guarantees: a mark is removed only once every Alertmanager accepted the
//! alert's latest state, and only if no newer change came meanwhile; an
//! Alertmanager that is down delays delivery and loses nothing (an alert
//! opened and resolved meanwhile is delivered once, resolved). Caveat: a
//! resolved alert pruned (`alert_retention`) before any Alertmanager came
//! back is never delivered.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;

use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

use crate::{Error, Observability};

/// The most alerts one post carries (and one round reads of each kind).
const BATCH: i64 = 500;

/// Posts a JSON body to a URL: the controller's HTTP client.
pub trait AlertPoster: Send + Sync {
    /// Post `body` (JSON) to `url`; an error says why it was not accepted
    /// (unreachable, not 2xx).
    fn post<'a>(
        &'a self,
        url: &'a str,
        body: Vec<u8>,
    ) -> Pin<Box<dyn Future<Output = Result<(), String>> + Send + 'a>>;
}

/// What one delivery round did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Delivered {
    /// Alerts accepted, counted once per Alertmanager.
    pub sent: u64,
    /// Posts that failed, one per Alertmanager and round.
    pub failed: u64,
    /// Alert changes still waiting after the round.
    pub pending: i64,
    /// Why the last failed post failed (for the log).
    pub error: Option<String>,
}

/// One alert as Alertmanager's v2 API takes it (`postableAlert`).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PostableAlert {
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
    pub starts_at: DateTime<Utc>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ends_at: Option<DateTime<Utc>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[serde(rename = "generatorURL")]
    pub generator_url: Option<String>,
}

type AlertRow = (
    Uuid,
    String,
    String,
    String,
    String,
    DateTime<Utc>,
    Option<DateTime<Utc>>,
);

/// An alert's labels and annotations: `alertname` its kind, `severity`,
/// `subject`, and `node`/`module`/`unit`/`queue` as its subject names them
/// (`node/<n>`, `unit/<n>/<u>`, `module/<m>`, `queue/<q>`).
pub fn postable(row: &AlertRow, dashboard: Option<&str>) -> PostableAlert {
    let (_, kind, severity, subject, message, since, resolved_at) = row;
    let mut labels = BTreeMap::from([
        ("alertname".to_owned(), kind.clone()),
        ("severity".to_owned(), severity.clone()),
        ("subject".to_owned(), subject.clone()),
        ("source".to_owned(), "mesh-controller".to_owned()),
    ]);
    let parts: Vec<&str> = subject.splitn(3, '/').collect();
    match parts.as_slice() {
        ["node", node] => {
            labels.insert("node".to_owned(), (*node).to_owned());
        }
        ["unit", node, unit] => {
            labels.insert("node".to_owned(), (*node).to_owned());
            labels.insert("unit".to_owned(), (*unit).to_owned());
            // A replica's unit is `<module>-<replica>`.
            if let Some((module, replica)) = unit.rsplit_once('-')
                && replica.bytes().all(|b| b.is_ascii_digit())
            {
                labels.insert("module".to_owned(), module.to_owned());
            }
        }
        ["module", module] => {
            labels.insert("module".to_owned(), (*module).to_owned());
        }
        ["queue", queue] => {
            labels.insert("queue".to_owned(), (*queue).to_owned());
        }
        _ => {}
    }
    let mut annotations = BTreeMap::from([("message".to_owned(), message.clone())]);
    let link = dashboard.map(|d| format!("{}#alerts", d.trim_end_matches('/')));
    if let Some(link) = &link {
        annotations.insert("dashboard".to_owned(), link.clone());
    }
    PostableAlert {
        labels,
        annotations,
        starts_at: *since,
        ends_at: *resolved_at,
        generator_url: link,
    }
}

impl Observability {
    /// One delivery round to the settings' `alertmanager_urls`: the pending
    /// alert changes, and with `resend` every open alert too (decision 0053:
    /// a pending mark per change, cleared once every Alertmanager took it).
    pub async fn deliver_alerts(
        &self,
        poster: &dyn AlertPoster,
        resend: bool,
    ) -> Result<Delivered, Error> {
        let urls = &self.settings.alertmanager_urls;
        let dashboard = self.settings.dashboard_url.as_deref();
        let mut out = Delivered::default();
        if urls.is_empty() {
            return Ok(out);
        }
        let pending: Vec<(Uuid, DateTime<Utc>)> = sqlx::query_as(
            "SELECT alert, changed_at FROM observability.alertmanager_pending \
             ORDER BY changed_at LIMIT $1",
        )
        .bind(BATCH)
        .fetch_all(&self.pool)
        .await?;
        let ids: Vec<Uuid> = pending.iter().map(|p| p.0).collect();
        let mut rows: Vec<AlertRow> = sqlx::query_as(
            "SELECT id, kind, severity, subject, message, since, resolved_at \
             FROM observability.alerts WHERE id = ANY($1) ORDER BY since, id",
        )
        .bind(&ids)
        .fetch_all(&self.pool)
        .await?;
        if resend {
            let open: Vec<AlertRow> = sqlx::query_as(
                "SELECT id, kind, severity, subject, message, since, resolved_at \
                 FROM observability.alerts WHERE resolved_at IS NULL AND NOT (id = ANY($1)) \
                 ORDER BY since, id LIMIT $2",
            )
            .bind(&ids)
            .bind(BATCH)
            .fetch_all(&self.pool)
            .await?;
            rows.extend(open);
        }
        if !rows.is_empty() {
            let alerts: Vec<PostableAlert> = rows.iter().map(|r| postable(r, dashboard)).collect();
            let body = serde_json::to_vec(&alerts).map_err(|e| Error::Corrupt {
                what: "an alert for Alertmanager".to_owned(),
                reason: e.to_string(),
            })?;
            let mut all = true;
            for url in urls {
                let endpoint = format!("{}/api/v2/alerts", url.trim_end_matches('/'));
                match poster.post(&endpoint, body.clone()).await {
                    Ok(()) => out.sent += alerts.len() as u64,
                    Err(e) => {
                        all = false;
                        out.failed += 1;
                        out.error = Some(format!("{endpoint}: {e}"));
                    }
                }
            }
            if all && !pending.is_empty() {
                let (ids, at): (Vec<Uuid>, Vec<DateTime<Utc>>) = pending.into_iter().unzip();
                sqlx::query(
                    "DELETE FROM observability.alertmanager_pending p \
                     USING UNNEST($1::uuid[], $2::timestamptz[]) AS d(alert, changed_at) \
                     WHERE p.alert = d.alert AND p.changed_at = d.changed_at",
                )
                .bind(ids)
                .bind(at)
                .execute(&self.pool)
                .await?;
            }
        }
        out.pending = sqlx::query_scalar("SELECT count(*) FROM observability.alertmanager_pending")
            .fetch_one(&self.pool)
            .await?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(subject: &str, resolved: bool) -> AlertRow {
        let at = DateTime::parse_from_rfc3339("2026-01-01T00:00:00Z")
            .unwrap()
            .with_timezone(&Utc);
        (
            Uuid::nil(),
            "unit_crash_looping".into(),
            "warning".into(),
            subject.into(),
            "it loops".into(),
            at,
            resolved.then_some(at),
        )
    }

    #[test]
    fn labels_name_the_subject_and_a_resolved_alert_ends() {
        let a = postable(
            &row("unit/n1/web-2", true),
            Some("https://c:7443/dashboard"),
        );
        let v = serde_json::to_value(&a).unwrap();
        assert_eq!(v["labels"]["alertname"], "unit_crash_looping");
        assert_eq!(v["labels"]["node"], "n1");
        assert_eq!(v["labels"]["module"], "web");
        assert_eq!(v["labels"]["unit"], "web-2");
        assert_eq!(v["annotations"]["message"], "it loops");
        assert_eq!(
            v["annotations"]["dashboard"],
            "https://c:7443/dashboard#alerts"
        );
        assert_eq!(v["endsAt"], "2026-01-01T00:00:00Z");
        assert_eq!(v["generatorURL"], "https://c:7443/dashboard#alerts");
        let open = serde_json::to_value(postable(&row("controller", false), None)).unwrap();
        assert!(open.get("endsAt").is_none() && open.get("generatorURL").is_none());
        assert!(open["labels"].get("node").is_none());
    }
}
