//! The declaration pipeline: a delivery of the node's queue is verified
//! (the controller's signature), decoded (a section this agent does not
//! know is stated as unsupported, a body that cannot be read as rejected),
//! applied ([`crate::apply::Applier`] writes the section's files and
//! computes its state, on the blocking pool), followed up by the section's
//! own kind ([`SectionKind`]: one file per section) and recorded in the
//! store; whatever happens becomes the `applied` report. A logs request
//! arrives on the same queue and is answered instead ([`logs`]).
//!
//! A new section is a new file here with an implementation of
//! [`SectionKind`], and an arm of [`Agent::apply_declaration`]'s match.

mod config;
mod connectivity;
mod delivery;
mod inventory;
mod logs;
mod provisioning;

use lapin::Channel;
use lapin::message::Delivery;
use lapin::options::BasicAckOptions;
use lapin::types::AMQPValue;
use mesh_protocol::topology::SIGNATURE_HEADER;
use mesh_protocol::{
    Applied, Declaration, DecodeError, Envelope, ItemOutcome, LogsRequest, Outcome, ProtocolRange,
    Section,
};
use tracing::{Instrument, debug, error, info, info_span, warn};

use super::Agent;
use super::fit::truncate;
use crate::apply::{self, ApplyReport};
use crate::facts;
use crate::store::SectionState;

/// What one kind of section does on the agent beyond what
/// [`crate::apply::Applier::apply`] does for every section (validate, write
/// the files, compute the state): one implementation per section kind,
/// each in its own file.
trait SectionKind: Send + Sized {
    /// Take from the declaration what the follow-up needs, before the
    /// declaration goes to the blocking pool.
    fn take(decl: &Declaration) -> Self;

    /// Once the section's files are applied, for a declaration that is
    /// newer (not stale) and valid (not rejected): do the section's own
    /// work and amend `report` with it. `prev` is the state the section
    /// had before; `publisher` carries heartbeats meanwhile.
    fn settle(
        &mut self,
        _agent: &mut Agent,
        _report: &mut ApplyReport,
        _prev: &SectionState,
        _publisher: &Channel,
    ) -> impl Future<Output = ()> + Send {
        async {}
    }

    /// Once the section's new state is recorded in the store (also after a
    /// rejection: the state then keeps what was applied before).
    fn recorded(self, _agent: &mut Agent, _state: &SectionState) {}
}

impl Agent {
    /// Handle one message of the declaration queue, then ack it: a logs
    /// request is answered (its answer's confirm returned, for the caller
    /// to let settle); anything else is a declaration, applied, its
    /// `applied` report kept.
    pub(super) async fn handle_delivery(
        &mut self,
        delivery: Delivery,
        publisher: &Channel,
    ) -> Result<Option<lapin::PublisherConfirm>, String> {
        let message_id = delivery
            .properties
            .message_id()
            .as_ref()
            .map(|m| m.as_str().to_owned())
            .unwrap_or_default();
        let logs = crate::logs::is_request(&delivery.data);
        let kind = if logs {
            LogsRequest::KIND
        } else {
            Declaration::KIND
        };
        let span =
            info_span!("declaration", message_id = %message_id, node = %self.creds.node, kind);
        async {
            let mut confirm = None;
            if logs {
                match self.verify_logs_request(&delivery) {
                    Ok(()) => confirm = self.answer_logs(&delivery.data, publisher).await,
                    Err(e) => {
                        error!(error = %e, "logs request refused: bad signature; not answered")
                    }
                }
            } else {
                let report = match self.verify(&delivery) {
                    Ok(()) => self.apply_bytes(&delivery.data, publisher).await,
                    Err(rejected) => rejected,
                };
                self.push_applied(report);
            }
            delivery
                .ack(BasicAckOptions::default())
                .await
                .map(|_| confirm)
                .map_err(|e| format!("ack failed: {e}"))
        }
        .instrument(span)
        .await
    }

    /// Check the controller's signature of a declaration (header
    /// `x-mesh-signature` over the exact body) against the key received at
    /// enrolment. Err is the `rejected` report: nothing of it is applied.
    fn verify(&mut self, delivery: &Delivery) -> Result<(), Applied> {
        let signature = signature(delivery);
        match self
            .creds
            .controller_key
            .verify_hex(&delivery.data, signature.as_deref())
        {
            Ok(()) => Ok(()),
            Err(e) => {
                let (section, generation) = apply::peek_section(&delivery.data);
                error!(error = %e, ?section, ?generation, "declaration rejected: bad signature");
                self.metrics.declaration_applied("rejected");
                Err(Applied {
                    section,
                    generation,
                    outcome: Outcome::Rejected,
                    items: Vec::new(),
                    error: Some(format!("signature: {e}")),
                    unsupported_section: None,
                })
            }
        }
    }

    /// Decode, apply, record. Never fails: every problem becomes the report.
    async fn apply_bytes(&mut self, bytes: &[u8], publisher: &Channel) -> Applied {
        let decl = match self.decode(bytes) {
            Ok(env) => env.body,
            Err(report) => return report,
        };
        self.apply_declaration(decl, publisher).await
    }

    /// Read a declaration for this node. Err is the `applied` report: a
    /// section of a newer controller (unsupported) or a body that cannot be
    /// read (rejected); nothing of it is applied.
    fn decode(&mut self, bytes: &[u8]) -> Result<Envelope<Declaration>, Applied> {
        match apply::decode(bytes, &self.creds.node) {
            Ok((env, unknown)) => {
                self.metrics
                    .unknown_fields(Declaration::KIND, unknown.count);
                if !unknown.is_empty() {
                    debug!(fields = ?unknown.paths, "declaration: ignored fields this agent does not know");
                }
                Ok(env)
            }
            // A section of a newer controller: nothing changes, and the
            // controller learns that this agent does not know it.
            Err(DecodeError::UnsupportedSection {
                section,
                generation,
            }) => {
                warn!(
                    section,
                    ?generation,
                    "declaration of a section this agent does not know"
                );
                self.metrics.declaration_applied("unsupported");
                Err(Applied {
                    section: None,
                    generation,
                    outcome: Outcome::Unsupported,
                    items: Vec::new(),
                    error: Some(format!(
                        "section `{section}` is not supported by mesh-agent {} (protocol {}); nothing was applied",
                        facts::AGENT_VERSION,
                        ProtocolRange::THIS
                    )),
                    unsupported_section: Some(section),
                })
            }
            Err(e) => {
                let (section, generation) = apply::peek_section(bytes);
                error!(error = %e, ?section, ?generation, size = bytes.len(), "declaration rejected");
                self.metrics.declaration_applied("rejected");
                Err(Applied {
                    section,
                    generation,
                    outcome: Outcome::Rejected,
                    items: Vec::new(),
                    error: Some(truncate(&e.to_string(), 2000)),
                    unsupported_section: None,
                })
            }
        }
    }

    /// Apply a declaration with its section's kind.
    async fn apply_declaration(&mut self, decl: Declaration, publisher: &Channel) -> Applied {
        match decl.section {
            Section::Inventory => {
                self.apply_section::<inventory::Inventory>(decl, publisher)
                    .await
            }
            Section::Config => self.apply_section::<config::Config>(decl, publisher).await,
            Section::Connectivity => {
                self.apply_section::<connectivity::Connectivity>(decl, publisher)
                    .await
            }
            Section::Delivery => {
                self.apply_section::<delivery::Delivery>(decl, publisher)
                    .await
            }
            Section::Provisioning => {
                self.apply_section::<provisioning::Provisioning>(decl, publisher)
                    .await
            }
        }
    }

    /// Apply `decl` (files, on the blocking pool), follow it up as its kind
    /// `S`, count and log the outcome, and record the section's new state.
    async fn apply_section<S: SectionKind>(
        &mut self,
        decl: Declaration,
        publisher: &Channel,
    ) -> Applied {
        let mut kind = S::take(&decl);
        let section = decl.section;
        let generation = decl.generation;
        let prev = self.store.section(section);
        let applier = self.applier.clone();
        let before = prev.clone();
        let mut report: ApplyReport =
            match tokio::task::spawn_blocking(move || applier.apply(&decl, &before)).await {
                Ok(r) => r,
                Err(e) => {
                    error!(error = %e, "applying panicked");
                    return Applied {
                        section: Some(section),
                        generation: Some(generation),
                        outcome: Outcome::Failed,
                        items: Vec::new(),
                        error: Some("the applier panicked".into()),
                        unsupported_section: None,
                    };
                }
            };
        if !report.stale && report.outcome != Outcome::Rejected {
            kind.settle(self, &mut report, &prev, publisher).await;
        }
        self.count_applied(&report, generation);
        if let Some(state) = report.state.take() {
            self.metrics
                .set_applied_generation(section.as_str(), state.generation);
            if let Err(e) =
                self.store
                    .record(section, state.clone(), None, self.config.report_buffer)
            {
                error!(error = %e, "cannot record the applied state");
            }
            kind.recorded(self, &state);
        }
        Applied {
            section: Some(section),
            generation: Some(report.generation),
            outcome: report.outcome,
            items: report.items,
            error: report.error.map(|e| truncate(&e, 2000)),
            unsupported_section: None,
        }
    }

    /// Count a declaration's outcome in the metrics and say it in the log.
    fn count_applied(&self, report: &ApplyReport, generation: u64) {
        let section = report.section;
        let label = if report.stale {
            "stale"
        } else {
            match report.outcome {
                Outcome::Applied => "applied",
                Outcome::Failed => "failed",
                Outcome::Rejected => "rejected",
                Outcome::Unsupported => "unsupported",
            }
        };
        self.metrics.declaration_applied(label);
        if report.stale {
            info!(%section, declared = generation, applied = report.generation, "declaration not newer than what is applied; restating");
        } else if report.outcome == Outcome::Applied {
            info!(%section, generation, files = report.items.len(), "declaration applied");
        } else {
            warn!(%section, generation, outcome = label, error = report.error.as_deref().unwrap_or(""), "declaration not applied");
        }
    }
}

/// The first item of `items` that failed, as the report's error (unless it
/// has one already); then the items join the report's.
fn add_items(report: &mut ApplyReport, items: Vec<ItemOutcome>) {
    if report.error.is_none()
        && let Some(bad) = items.iter().find(|i| !i.ok)
    {
        report.error = Some(format!(
            "{}: {}",
            bad.item,
            bad.error.as_deref().unwrap_or("not applied")
        ));
    }
    report.items.extend(items);
}

/// The controller's signature of a delivery (header `x-mesh-signature`),
/// if it has one.
fn signature(delivery: &Delivery) -> Option<String> {
    delivery
        .properties
        .headers()
        .as_ref()
        .and_then(|h| match h.inner().get(SIGNATURE_HEADER) {
            Some(AMQPValue::LongString(s)) => Some(s.to_string()),
            _ => None,
        })
}
