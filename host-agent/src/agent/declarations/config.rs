//! The config section: files only (settings, secrets); one applied may
//! bring a grant's credential file, which the provisioning worker is told
//! to look at again.

use lapin::Channel;
use mesh_protocol::{Declaration, Outcome};

use super::SectionKind;
use crate::agent::Agent;
use crate::apply::ApplyReport;
use crate::store::SectionState;

/// A config declaration: nothing beyond its files.
pub(super) struct Config;

impl SectionKind for Config {
    fn take(_decl: &Declaration) -> Self {
        Config
    }

    async fn settle(
        &mut self,
        agent: &mut Agent,
        report: &mut ApplyReport,
        _prev: &SectionState,
        _publisher: &Channel,
    ) {
        // A config section may bring a grant's credential file.
        if report.outcome == Outcome::Applied {
            agent.resources.kick();
        }
    }
}
