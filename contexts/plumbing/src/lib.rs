//! Plumbing every bounded context uses: the [`Context`] trait the controller's
//! router calls, the inbox (at-most-once effect of at-least-once delivery), the
//! outbox (declarations and record events written in the handler's transaction),
//! the migrations runner, problem+json API errors and their OpenAPI responses.
//!
//! This crate knows PostgreSQL and axum, never AMQP: publishing what the outbox
//! holds is the controller's relay. It knows no particular context.

pub mod api;
pub mod applied;
mod context;
pub mod inbox;
mod migrate;
pub mod openapi;
pub mod outbox;

pub use context::{Context, HandlerError, OutboxSignal};
pub use migrate::{MigrateError, migrate};
