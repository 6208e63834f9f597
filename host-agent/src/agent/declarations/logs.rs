//! A logs request: the controller asks, for an operator, for the output of
//! this node's units of one module. It arrives on the declaration queue,
//! signed as a declaration is, and is answered with a transient `logs`
//! report, never buffered.

use lapin::Channel;
use lapin::message::Delivery;
use mesh_protocol::{Envelope, LogsRequest, Report, Section};
use tracing::{info, warn};

use crate::agent::Agent;

impl Agent {
    /// Check a logs request's signature as a declaration's: only the
    /// controller may ask a node for its units' output.
    pub(super) fn verify_logs_request(
        &self,
        delivery: &Delivery,
    ) -> Result<(), mesh_protocol::SignatureError> {
        let signature = super::signature(delivery);
        self.creds
            .controller_key
            .verify_hex(&delivery.data, signature.as_deref())
    }

    /// Answer a (verified) logs request with the output of this node's
    /// units of its module: a `logs` report, transient, published at once
    /// and never buffered (nobody waits for it after its expiration). A
    /// request that cannot be read, or is for another node, is not
    /// answered (the controller's wait ends it).
    pub(super) async fn answer_logs(
        &mut self,
        bytes: &[u8],
        publisher: &Channel,
    ) -> Option<lapin::PublisherConfirm> {
        let env = match Envelope::<LogsRequest>::decode(bytes, mesh_protocol::MAX_DECLARATION_BYTES)
        {
            Ok(env) => env,
            Err(e) => {
                warn!(error = %e, "logs request cannot be read; not answered");
                return None;
            }
        };
        if env.node != self.creds.node {
            warn!(to = %env.node, "logs request for another node; not answered");
            return None;
        }
        let units: Vec<String> = self
            .store
            .section(Section::Inventory)
            .units
            .iter()
            .filter(|u| u.module == env.body.module)
            .map(|u| u.name.clone())
            .collect();
        let units_dir = self.config.state_dir.join(crate::units::UNITS_DIR);
        let request = env.body.clone();
        let node = self.creds.node.clone();
        let id = env.id;
        let answer = tokio::task::spawn_blocking(move || {
            crate::logs::answer(&units_dir, &node, id, &request, &units)
        })
        .await
        .unwrap_or_else(|e| mesh_protocol::Logs {
            request: id,
            module: env.body.module.clone(),
            units: Vec::new(),
            error: Some(format!("reading the output failed: {e}")),
        });
        info!(request = %id, module = %answer.module, units = answer.units.len(), error = answer.error.as_deref().unwrap_or(""), "answering a logs request");
        let out = self.envelope(Report::Logs(answer));
        self.publish_transient(
            publisher,
            &out,
            Some(mesh_protocol::topology::LOGS_ANSWER_EXPIRATION_MS),
        )
        .await
    }
}
