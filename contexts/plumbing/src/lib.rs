//! Plumbing every bounded context uses: the [`Context`] trait the controller's
//! router calls, the inbox (at-most-once effect of at-least-once delivery), the
//! outbox (declarations and record events written in the handler's transaction),
//! the declared section's lifecycle ([`section`]: digest, generation, declare,
//! catch up on hello and heartbeat, resync, and its table's one definition),
//! the migrations runner, problem+json API errors and their OpenAPI responses,
//! ETags and preconditions (`etag`), and the audit entry every
//! operator mutation writes in its own transaction (`audit`), and the reads
//! that tolerate lag, served by a streaming replica when it is usable (`reads`).
//!
//! This crate knows PostgreSQL and axum, never AMQP: publishing what the outbox
//! holds is the controller's relay. It knows no particular context.

pub mod api;
pub mod applied;
pub mod audit;
mod context;
pub mod etag;
pub mod in_step;
pub mod inbox;
mod migrate;
pub mod openapi;
pub mod outbox;
pub mod reads;
pub mod section;

pub use context::{Context, HandlerError, OutboxSignal, reachable};
pub use in_step::InStep;
pub use migrate::{MigrateError, migrate};
