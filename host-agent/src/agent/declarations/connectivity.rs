//! The connectivity section: besides its files (names, hosts), the overlay
//! and the firewall ([`crate::connectivity`]) and the node's certificates
//! ([`crate::certs`]), each with an item of its own in the report.

use lapin::Channel;
use mesh_protocol::{CertificateItem, Declaration, FirewallPlan, OverlayPlan};

use super::{SectionKind, add_items};
use crate::agent::Agent;
use crate::apply::ApplyReport;
use crate::store::SectionState;

/// What a connectivity declaration brings beyond its files.
pub(super) struct Connectivity {
    overlay: Option<OverlayPlan>,
    firewall: Option<FirewallPlan>,
    certificates: Vec<CertificateItem>,
}

impl SectionKind for Connectivity {
    fn take(decl: &Declaration) -> Self {
        Connectivity {
            overlay: decl.items.overlay.clone(),
            firewall: decl.items.firewall.clone(),
            certificates: decl.items.certificates.clone(),
        }
    }

    /// The overlay and firewall follow the section's files; then the
    /// certificates it declares are installed, and the certificates stated
    /// again.
    async fn settle(
        &mut self,
        agent: &mut Agent,
        report: &mut ApplyReport,
        _prev: &SectionState,
        _publisher: &Channel,
    ) {
        if let Some(c) = &agent.connectivity {
            let items = c.apply(self.overlay.take(), self.firewall.take()).await;
            add_items(report, items);
        }
        if let Some(certs) = &mut agent.certs {
            let items = certs.install(&self.certificates);
            add_items(report, items);
            agent.push_certificates(true);
        }
    }
}
