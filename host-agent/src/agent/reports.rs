//! The outgoing reports: each kind built from the agent's state, fitted to
//! the size limit ([`super::fit`]), and queued in the bounded report buffer
//! ([`crate::buffer`]) until the broker confirms it (`applied` reports also
//! kept in the store, so a restart loses none). Heartbeats and logs answers
//! are transient: published at once, never buffered.
//!
//! What a report states and when is decided here; how it reaches the broker
//! is [`super::channel`]'s, and when the session sends the buffer is
//! [`super::session`]'s.

use std::time::Duration;

use lapin::Channel;
use mesh_protocol::{
    Applied, Envelope, Health, Heartbeat, ItemOutcome, Outage, Outcome, Report, ReportKind,
    ResourceStatusState, Resources, Section,
};
use tokio::time::Instant;
use tracing::{debug, error, info, warn};
use uuid::Uuid;

use super::fit::{fit_applied, fit_health, fit_resources, fit_units};
use super::{Agent, channel};
use crate::buffer::Outgoing;
use crate::facts;
use crate::store::PendingReport;

impl Agent {
    pub(super) fn envelope(&mut self, report: Report) -> Outgoing {
        let seq = self.store.next_seq();
        let env = Envelope::new(self.creds.node.clone(), seq, report);
        Outgoing {
            id: env.id,
            kind: env.body.report_kind(),
            seq,
            payload: env.encode(),
        }
    }

    pub(super) fn push(&mut self, out: Outgoing) {
        let dropped = self.buffer.push(out);
        for d in &dropped.superseded {
            debug!(message_id = %d.id, kind = d.kind.as_str(), "a buffered report was superseded by a newer one");
        }
        for d in &dropped.evicted {
            if d.kind == ReportKind::Applied {
                warn!(message_id = %d.id, "report buffer full: dropped an applied report");
                if let Err(e) = self.store.remove_pending(&[d.id]) {
                    error!(error = %e, "cannot update the store");
                }
            } else {
                debug!(message_id = %d.id, kind = d.kind.as_str(), "report buffer full: dropped a report");
            }
        }
        if let Some(o) = &mut self.outage {
            o.dropped = o.dropped.saturating_add(dropped.evicted.len() as u64);
        }
        self.metrics.set_buffered(self.buffer.len());
    }

    /// The hello of a (re)connect; the first after an outage states it.
    pub(super) fn push_hello(&mut self) {
        let mut hello = facts::hello(
            self.config.hostname.as_deref(),
            &self.config.labels,
            self.store.applied_generations(),
            self.applier.seal_public_key().map(|k| k.to_hex()),
            self.connectivity.as_ref().and_then(|c| c.facts()),
        );
        hello.metrics = self.config.metrics_listen.map(|a| a.to_string().into());
        hello.outage = self.outage.map(|o| Outage {
            since: o.since,
            seconds: o.at.elapsed().as_secs(),
            buffered: self.buffer.len() as u64,
            dropped: o.dropped,
        });
        if let Some(o) = &hello.outage {
            info!(
                since = %o.since,
                seconds = o.seconds,
                buffered = o.buffered,
                dropped = o.dropped,
                "reached the broker again after an outage"
            );
        }
        let out = self.envelope(Report::Hello(hello));
        if self.outage.is_some() {
            self.outage_hello = Some(out.id);
        }
        self.push(out);
    }

    /// State every probe's result, whole: after a change (`summary` false),
    /// or periodically and after a connect (`summary` true; stated as a
    /// change still if a change is waiting to be stated or confirmed, since
    /// it replaces that report in the buffer).
    pub(super) fn push_health(&mut self, summary: bool) {
        let changed = self.health.changed();
        let Some(probes) = self.health.take() else {
            return;
        };
        let summary = summary && !changed && self.health_change.is_none();
        let health = fit_health(Health { probes, summary }, &self.creds.node);
        let out = self.envelope(Report::Health(health));
        if !summary {
            self.health_change = Some(out.id);
        }
        self.push(out);
    }

    /// State the connectivity section's overlay and firewall items again, at
    /// the generation applied, when a check changed their outcome.
    pub(super) fn restate_connectivity(&mut self, items: Vec<ItemOutcome>) {
        let generation = self.store.section(Section::Connectivity).generation;
        if generation == 0 {
            return;
        }
        let error = items.iter().find(|i| !i.ok).map(|i| {
            format!(
                "{}: {}",
                i.item,
                i.error.as_deref().unwrap_or("not applied")
            )
        });
        info!(
            generation,
            ok = error.is_none(),
            "connectivity changed; stating it again"
        );
        self.push_applied(Applied {
            section: Some(Section::Connectivity),
            generation: Some(generation),
            outcome: Outcome::Applied,
            items,
            error,
            unsupported_section: None,
        });
    }

    /// State the certificates asked for and held: on connect and after a
    /// change (`force`), and when a renewal falls due.
    pub(super) fn push_certificates(&mut self, force: bool) {
        let Some(certs) = &mut self.certs else {
            return;
        };
        self.metrics.set_certificate_expiries(&certs.expiries());
        if let Some(report) = certs.report(chrono::Utc::now(), force) {
            for r in &report.requests {
                info!(name = %r.name, "asking for a certificate");
            }
            let out = self.envelope(Report::Certificates(report));
            self.push(out);
        }
    }

    /// When the next certificate falls due (far away when none will).
    pub(super) fn certs_due(&self) -> Instant {
        let due = self.certs.as_ref().and_then(crate::certs::Certs::next_due);
        let wait = due.map_or(Duration::from_secs(3600), |at| {
            (at - chrono::Utc::now()).to_std().unwrap_or(Duration::ZERO)
        });
        Instant::now() + wait.max(Duration::from_millis(50))
    }

    /// A provisioning pass is done: keep and state what it found, if that
    /// differs from what was last stated (or it answers a newer generation).
    pub(super) fn resources_found(&mut self, found: Resources) {
        let before = self.store.data().resources.clone();
        if before.as_ref() == Some(&found) {
            return;
        }
        for s in &found.resources {
            let was = before
                .as_ref()
                .and_then(|b| b.resources.iter().find(|r| r.grant == s.grant));
            if was == Some(s) {
                continue;
            }
            // Reasons are the servers' words, never a credential.
            let reason = s.reason.as_deref().unwrap_or("");
            match s.state {
                ResourceStatusState::Failed => {
                    warn!(grant = %s.grant, state = s.state.as_str(), reason, "resource failed")
                }
                ResourceStatusState::Waiting => {
                    info!(grant = %s.grant, state = s.state.as_str(), reason, "resource waiting")
                }
                _ => info!(
                    grant = %s.grant,
                    state = s.state.as_str(),
                    credential_version = ?s.credential_version,
                    recreated = s.recreated,
                    "resource reconciled"
                ),
            }
        }
        self.metrics.set_resources(&found.resources);
        if let Err(e) = self.store.set_resources(found) {
            // Stated from memory all the same; the file keeps the older findings.
            error!(error = %e, "cannot keep what the provisioning pass found; stated anyway");
        }
        self.push_resources();
    }

    /// State what the last provisioning pass found (after a connect, and
    /// when it changed). Nothing before the first pass.
    pub(super) fn push_resources(&mut self) {
        let Some(found) = self.store.data().resources.clone() else {
            return;
        };
        let found = fit_resources(found, &self.creds.node);
        let out = self.envelope(Report::Resources(found));
        self.push(out);
    }

    /// State every unit, now (after a connect, and when [`Reporter::due`]).
    pub(super) fn push_units(&mut self) {
        let units = fit_units(self.reporter.take(), &self.creds.node);
        let out = self.envelope(Report::Units(units));
        self.push(out);
    }

    /// Publish one heartbeat: transient (delivery mode 1); the next one
    /// follows (decision 0023). Returns its confirm, for the caller to let
    /// settle without waiting on it.
    pub(super) async fn beat(&mut self, ch: &Channel) -> Option<lapin::PublisherConfirm> {
        let interval_ms = u64::try_from(self.interval().as_millis()).unwrap_or(u64::MAX);
        let out = self.envelope(Report::Heartbeat(Heartbeat {
            interval_ms: Some(interval_ms),
            applied: self.store.applied_generations(),
        }));
        self.publish_transient(ch, &out, None).await
    }

    /// Publish one transient report (delivery mode 1, never buffered: a
    /// heartbeat, whose next one follows, and a logs answer, which is of use
    /// only to the request waiting for it), expiring after `expiration_ms`
    /// when given. Returns its confirm, for the caller to let settle without
    /// waiting on it.
    pub(super) async fn publish_transient(
        &self,
        ch: &Channel,
        out: &Outgoing,
        expiration_ms: Option<u64>,
    ) -> Option<lapin::PublisherConfirm> {
        match channel::publish_transient(ch, &self.creds.node, out, expiration_ms).await {
            Ok(confirm) => {
                self.metrics.report_published(out.kind.as_str());
                Some(confirm)
            }
            Err(e) => {
                debug!(error = %e, kind = out.kind.as_str(), "transient report not published");
                None
            }
        }
    }

    /// Keep an applied report: in the store (so a restart does not lose it) and in
    /// the buffer. Shrinks it if needed to fit the report size limit.
    pub(super) fn push_applied(&mut self, applied: Applied) {
        let applied = fit_applied(applied, &self.creds.node);
        let out = self.envelope(Report::Applied(applied));
        let pending = PendingReport {
            id: out.id,
            kind: out.kind.as_str().to_owned(),
            seq: out.seq,
            payload: String::from_utf8_lossy(&out.payload).into_owned(),
        };
        if let Err(e) = self.store.add_pending(pending, self.config.report_buffer) {
            error!(error = %e, "cannot persist the applied report; keeping it in memory only");
        }
        self.push(out);
    }

    /// The broker confirmed report `id`: it leaves the buffer (and the
    /// store, for an `applied` one), and what waited on it is stated.
    pub(super) fn report_confirmed(&mut self, id: Uuid) {
        self.metrics.confirmed_now();
        if self.health_change == Some(id) {
            self.health_change = None;
        }
        if self.outage_hello == Some(id) {
            self.outage_hello = None;
            self.outage = None;
        }
        if let Some(out) = self.buffer.confirmed(id) {
            self.metrics.report_published(out.kind.as_str());
            debug!(message_id = %id, kind = out.kind.as_str(), "report confirmed");
            if out.kind == ReportKind::Applied
                && let Err(e) = self.store.remove_pending(&[id])
            {
                error!(error = %e, "cannot update the store");
            }
        }
        self.metrics.set_buffered(self.buffer.len());
    }
}
