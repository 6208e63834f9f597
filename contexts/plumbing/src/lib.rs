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
//! It also holds the shape every context shares, written once: a context's
//! error implements [`ContextError`] (its problem+json answer and which of its
//! failures may pass) and plumbing derives `From<Error>` for
//! [`api::Problem`] and [`HandlerError`] from it ([`error`]); a record event
//! handler overrides [`Context::handle_event`] or [`Context::handle_events`],
//! the other delegates; a route's query is [`api::ApiQuery`], a list route's
//! is [`page::ListQuery`] (`limit`, `after` and its filters, one convention);
//! the path parameters many routes share (a node's id, a module's name) are
//! [`path`]'s extractors, parsed and documented once.
//!
//! This crate knows PostgreSQL and axum, never AMQP: publishing what the outbox
//! holds is the controller's relay. It knows no particular context.

pub mod api;
pub mod applied;
pub mod audit;
mod context;
pub mod error;
pub mod etag;
pub mod in_step;
pub mod inbox;
mod migrate;
pub mod openapi;
pub mod outbox;
pub mod page;
pub mod path;
pub mod reads;
pub mod section;

pub use context::{Context, HandlerError, OutboxSignal, reachable};
pub use error::ContextError;
pub use in_step::InStep;
pub use migrate::{MigrateError, migrate};
