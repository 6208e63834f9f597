//! The bundle: raises the foundation of a mesh on its first host, before any
//! controller exists. It checks that the broker enforces the security boundary the
//! design relies on ([`probe`]), provisions the database, roles, schemas, vhost and
//! broker users ([`provision`]), and writes the credential files (each defined once
//! in `mesh-credentials`, which their readers use too).
//!
//! The test kit (`mesh-testkit`, a dev-dependency) composes these same production
//! functions under unique names for each test, so tests of every crate run against
//! real PostgreSQL and RabbitMQ in parallel.
//!
//! [`carry`] packs the foundation's Debian packages and the mesh's own into one
//! archive and verifies it, so `bundle/up --from` raises the foundation with no
//! network.
//!
//! [`backup`] writes one consistent, sealed archive of a mesh's schemas, keys
//! and broker definitions, and restores it on a new host.

pub mod backup;
pub mod carry;
pub mod probe;
pub mod provision;
pub mod s3;
pub mod tls;

/// Every bounded context of the mesh. Each owns the PostgreSQL schema of the same
/// name and connects as its own role `<prefix>_<context>`.
pub const CONTEXTS: [&str; 7] = [
    "inventory",
    "identity",
    "config",
    "connectivity",
    "provisioning",
    "delivery",
    "observability",
];

/// A fresh secret: 32 random bytes, hex encoded (64 characters, URL safe).
pub fn generate_password() -> String {
    hex::encode(rand::random::<[u8; 32]>())
}
