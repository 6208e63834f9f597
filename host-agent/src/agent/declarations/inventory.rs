//! The inventory section: besides its files, the units the node runs (the
//! supervisor is told the whole list once it is recorded), the heartbeat
//! plan, and the mesh's endpoints the agent connects to (decision 0044).

use lapin::Channel;
use mesh_protocol::{Declaration, Endpoints, HeartbeatPlan, Outcome};
use tracing::{error, info};

use super::SectionKind;
use crate::agent::Agent;
use crate::apply::ApplyReport;
use crate::store::SectionState;

/// What an inventory declaration brings beyond its files and units.
pub(super) struct Inventory {
    plan: Option<HeartbeatPlan>,
    endpoints: Option<Endpoints>,
}

impl SectionKind for Inventory {
    fn take(decl: &Declaration) -> Self {
        Inventory {
            plan: decl.items.heartbeat,
            endpoints: decl.items.endpoints.clone(),
        }
    }

    async fn settle(
        &mut self,
        agent: &mut Agent,
        report: &mut ApplyReport,
        _prev: &SectionState,
        _publisher: &Channel,
    ) {
        if report.outcome == Outcome::Applied {
            agent.mark_uncached(report);
            agent.set_plan(self.plan);
        }
        // A valid, newer section's endpoints are kept even when an item of it
        // failed (a unit): they do not depend on the rest.
        agent.set_endpoints(self.endpoints.take());
    }

    fn recorded(self, agent: &mut Agent, state: &SectionState) {
        // Level-triggered: the supervisor compares the whole list with what runs.
        agent.units.declare(&state.units);
        // A certificate per module the node runs.
        if let Some(certs) = &mut agent.certs
            && certs.set_modules(state.units.iter().map(|u| u.module.as_str()))
        {
            agent.push_certificates(true);
        }
    }
}

impl Agent {
    /// A unit whose artifact is not cached is declared (it starts once the
    /// cache gains it), but its item says why it does not run yet.
    fn mark_uncached(&self, report: &mut ApplyReport) {
        let Some(state) = &report.state else {
            return;
        };
        for unit in &state.units {
            if let Some(d) = &unit.artifact
                && !crate::artifacts::is_cached(&self.config.state_dir, d)
                && let Some(i) = report.items.iter_mut().find(|i| i.item == unit.name)
            {
                i.ok = false;
                i.error = Some(format!(
                    "artifact {d} is not cached: the unit starts once the delivery section caches it"
                ));
            }
        }
    }

    /// Keep the plan an applied inventory section declared (none: back to the
    /// configured interval), and beat at it from now on.
    fn set_plan(&mut self, plan: Option<HeartbeatPlan>) {
        if plan == self.plan {
            return;
        }
        if let Err(e) = crate::plan::save(&self.config.state_dir, plan) {
            error!(error = %e, "cannot keep the heartbeat plan; it holds until the agent restarts");
        }
        self.plan = plan;
        self.retime = true;
        info!(
            interval_ms = self.interval().as_millis() as u64,
            "heartbeat interval changed"
        );
    }

    /// Keep the mesh's endpoints an applied inventory section declared
    /// (none: it declared none, and none are kept). They were validated
    /// with the declaration (an invalid one rejects it: nothing is kept).
    fn set_endpoints(&mut self, endpoints: Option<Endpoints>) {
        let shown = endpoints
            .as_ref()
            .map(|e| (e.brokers.join(","), e.api.join(",")));
        match self.store.set_endpoints(endpoints) {
            Ok(false) => {}
            Ok(true) => {
                let (brokers, api) = shown.unwrap_or_default();
                info!(%brokers, %api, "kept the mesh's endpoints the controller declared");
            }
            Err(e) => {
                error!(error = %e, "cannot keep the mesh's endpoints; the ones kept before stay");
            }
        }
    }
}
