//! The provisioning context (decision 0039): resource grants between modules.
//!
//! Built so far: its pure core, [`plan`] — which provider module serves each
//! requirement (or why none can), the names a grant's resource and user take
//! on the provider's server, and the credential file the consumer and the
//! provider's agent read. The schema, the section, the reports handler and
//! the routes are not built yet; docs/ARCHITECTURE.md says what they follow.

pub mod plan;

use mesh_plumbing::section::Sections;
use mesh_protocol::Section;

/// The context's schema (and its role's name): `bundle/up` provisions both.
pub const SCHEMA: &str = "provisioning";

/// The section it declares to provider nodes: their grants' `resources`.
pub const SECTIONS: Sections = Sections::new(SCHEMA, Section::Provisioning);

pub use plan::{
    Choice, Credential, ModuleFacts, Wanted, credential_file, new_credential, resolve,
    resource_name,
};
