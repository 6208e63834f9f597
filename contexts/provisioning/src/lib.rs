//! The provisioning context (decision 0039): resource grants between modules.
//!
//! Built so far: its schema's history (`migrations/provisioning/`: plumbing's
//! inbox and outbox, the section table; [`migrate`]) and its pure core,
//! [`plan`] — which provider module serves each requirement (or why none
//! can), the names a grant's resource and user take on the provider's
//! server, and the credential file the consumer and the provider's agent
//! read. The grants table, the section's reconcile, the reports handler and
//! the routes are not built yet; docs/ARCHITECTURE.md says what they follow.

pub mod plan;

use mesh_plumbing::MigrateError;
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

// refinery names a Rust migration's module after its file (`V2__sections`).
#[allow(non_snake_case)]
mod embedded {
    refinery::embed_migrations!("../../migrations/provisioning");
}

/// Apply the provisioning migrations, connected as the provisioning role
/// (`url`). Returns the migrations applied now (none when up to date).
pub async fn migrate(url: &str) -> Result<Vec<String>, MigrateError> {
    mesh_plumbing::migrate(url, SCHEMA, embedded::migrations::runner()).await
}
