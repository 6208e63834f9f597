//! The provisioning section: the resources of the grants this node
//! provides, handed to the background worker ([`crate::provision::worker`])
//! once recorded, never waited on.

use mesh_protocol::Declaration;

use super::SectionKind;
use crate::agent::Agent;
use crate::provision::worker::Declared;
use crate::store::SectionState;

/// A provisioning declaration: its resources are in the recorded state.
pub(super) struct Provisioning;

impl SectionKind for Provisioning {
    fn take(_decl: &Declaration) -> Self {
        Provisioning
    }

    fn recorded(self, agent: &mut Agent, state: &SectionState) {
        // Handed over, never waited on: the worker passes in the background.
        agent.resources.declare(Declared {
            generation: state.generation,
            resources: state.resources.clone(),
        });
    }
}
