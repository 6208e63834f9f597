//! Routing: which context handles which message. One exhaustive match per kind of
//! message, so adding a report kind is a compile error until it is routed.

use std::sync::Arc;

use mesh_config::Config;
use mesh_identity::Identity;
use mesh_inventory::Inventory;
use mesh_plumbing::section::{self, Declared};
use mesh_plumbing::{Context, HandlerError, OutboxSignal, inbox};
use mesh_protocol::{Envelope, RecordEvent, Report, ReportKind};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use crate::config::{ConfigError, Credentials, Settings};

#[derive(Debug, thiserror::Error)]
pub enum ContextsError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("connecting to the {context} database: {source}")]
    Connect {
        context: &'static str,
        source: sqlx::Error,
    },
    #[error(transparent)]
    Migrate(#[from] mesh_plumbing::MigrateError),
}

/// Every context the controller runs, each with its own pool (its own role).
pub struct Contexts {
    pub inventory: Arc<Inventory>,
    pub config: Arc<Config>,
    pub identity: Arc<Identity>,
}

async fn pool(
    creds: &Credentials,
    context: &'static str,
    size: u32,
) -> Result<PgPool, ContextsError> {
    let url = creds.database(context)?;
    PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(std::time::Duration::from_secs(5))
        .connect_lazy(url.expose())
        .map_err(|source| ContextsError::Connect { context, source })
}

impl Contexts {
    /// Apply every context's migrations, each as its own role into its own schema.
    pub async fn migrate(
        creds: &Credentials,
    ) -> Result<Vec<(&'static str, Vec<String>)>, ContextsError> {
        Ok(vec![
            (
                Inventory::SCHEMA,
                mesh_inventory::migrate(creds.database(Inventory::SCHEMA)?.expose()).await?,
            ),
            (
                Config::SCHEMA,
                mesh_config::migrate(creds.database(Config::SCHEMA)?.expose()).await?,
            ),
            (
                Identity::SCHEMA,
                mesh_identity::migrate(creds.database(Identity::SCHEMA)?.expose()).await?,
            ),
        ])
    }

    pub async fn connect(
        creds: &Credentials,
        settings: &Settings,
        signal: OutboxSignal,
    ) -> Result<Contexts, ContextsError> {
        let inventory = Inventory::new(
            pool(creds, Inventory::SCHEMA, settings.pool_size).await?,
            signal.clone(),
            mesh_inventory::InventorySettings {
                grace: settings.grace(),
                max_unreachable_share: settings.max_unreachable_share,
                controller_node: settings
                    .controller_node
                    .as_deref()
                    .map(mesh_protocol::NodeId::parse)
                    .transpose()
                    .map_err(|e| ConfigError::Invalid {
                        field: "controller_node",
                        message: e.to_string(),
                    })?,
                resend_after: std::time::Duration::from_secs(settings.resend_after_secs),
                ..mesh_inventory::InventorySettings::default()
            },
        );
        let config_settings = mesh_config::ConfigSettings {
            resend_after: std::time::Duration::from_secs(settings.resend_after_secs),
        };
        let config = Config::new(
            pool(creds, Config::SCHEMA, settings.pool_size).await?,
            signal.clone(),
            config_settings,
        );
        let identity = Identity::new(
            pool(creds, Identity::SCHEMA, settings.pool_size).await?,
            signal,
            mesh_identity::IdentitySettings::new(creds.signer()?.public_key_hex()),
            Arc::new(crate::accounts::RabbitAccounts::from_credentials(creds)?),
        );
        Ok(Contexts {
            inventory: Arc::new(inventory),
            config: Arc::new(config),
            identity: Arc::new(identity),
        })
    }

    /// Every context's schema and pool, for the outbox relay and housekeeping.
    pub fn schemas(&self) -> Vec<(&'static str, &PgPool)> {
        vec![
            (Inventory::SCHEMA, self.inventory.pool()),
            (Config::SCHEMA, self.config.pool()),
            (Identity::SCHEMA, self.identity.pool()),
        ]
    }

    /// The pool of the context named `schema` (the auth layer writes audit
    /// events to the outbox of the context that served the request).
    pub fn pool_of(&self, schema: &str) -> Option<&PgPool> {
        self.schemas()
            .into_iter()
            .find(|(s, _)| *s == schema)
            .map(|(_, p)| p)
    }

    /// Record routing-key patterns per context, for declaring record queues.
    pub fn record_subscriptions(&self) -> Vec<(&'static str, &'static [&'static str])> {
        vec![
            (Inventory::SCHEMA, self.inventory.subscriptions()),
            (Config::SCHEMA, self.config.subscriptions()),
            (Identity::SCHEMA, self.identity.subscriptions()),
        ]
    }

    /// Recompute every node's section of every context that declares one and
    /// declare what differs from what is stored (`section::resync`): the
    /// periodic repair of anything missed. One context's failure does not stop
    /// the others'.
    pub async fn resync_sections(&self) -> Vec<(&'static str, Result<Declared, String>)> {
        vec![
            (
                Inventory::SCHEMA,
                section::resync(&*self.inventory)
                    .await
                    .map_err(|e| e.to_string()),
            ),
            (
                Config::SCHEMA,
                section::resync(&*self.config)
                    .await
                    .map_err(|e| e.to_string()),
            ),
        ]
    }

    /// Hand a batch of authenticated reports of one kind to every context that
    /// owns a part of them. Each context commits its own transaction (its state,
    /// its inbox, its outbox); the caller acknowledges only after all committed.
    pub async fn route_reports(
        &self,
        kind: ReportKind,
        batch: &[Envelope<Report>],
    ) -> Result<(), HandlerError> {
        match kind {
            // hello: facts and labels (inventory); every context catches the node
            // up on its section (mesh_plumbing::section).
            ReportKind::Hello => {
                both(
                    run(&*self.inventory, batch, true),
                    run(&*self.config, batch, true),
                )
                .await
            }
            // heartbeat: liveness (inventory); every context re-sends its section
            // to a node behind (mesh_plumbing::section).
            // Idempotent by nature (last_seen only grows), so no inbox row per
            // heartbeat: that would double the cost of the hottest path.
            ReportKind::Heartbeat => {
                both(
                    run(&*self.inventory, batch, false),
                    run(&*self.config, batch, false),
                )
                .await
            }
            // units: what runs where (inventory owns assignments and units).
            ReportKind::Units => run(&*self.inventory, batch, true).await,
            // applied: what the node applied of each section (inventory records it
            // for every section; decision 0015).
            ReportKind::Applied => run(&*self.inventory, batch, true).await,
        }
    }

    /// Hand record events to the context whose record queue they came from.
    pub async fn route_events(
        &self,
        context: &str,
        events: &[RecordEvent],
    ) -> Result<(), HandlerError> {
        match context {
            c if c == Inventory::SCHEMA => run_events(&*self.inventory, events).await,
            c if c == Config::SCHEMA => run_events(&*self.config, events).await,
            c if c == Identity::SCHEMA => run_events(&*self.identity, events).await,
            other => Err(HandlerError::Permanent(format!(
                "no context named `{other}`"
            ))),
        }
    }
}

/// Two contexts' transactions at once: they share nothing (own pools, own
/// schemas), and one consumer per queue is bound by the latency of a batch, so
/// running them side by side instead of one after the other shortens every
/// batch (docs/benchmarks.md). Both must commit before the batch is acked; if
/// one fails, the retry repeats both, which the inbox (or, for heartbeats,
/// idempotence) makes harmless, as before.
async fn both(
    a: impl Future<Output = Result<(), HandlerError>>,
    b: impl Future<Output = Result<(), HandlerError>>,
) -> Result<(), HandlerError> {
    let (a, b) = tokio::join!(a, b);
    a.and(b)
}

async fn run<C: Context>(
    ctx: &C,
    batch: &[Envelope<Report>],
    use_inbox: bool,
) -> Result<(), HandlerError> {
    let mut tx = ctx.pool().begin().await?;
    if use_inbox {
        let ids: Vec<_> = batch.iter().map(|e| e.id).collect();
        let mut fresh = inbox::claim(&mut tx, C::SCHEMA, &ids).await?;
        // `remove` keeps one copy of a message delivered twice within the batch.
        let fresh: Vec<Envelope<Report>> = batch
            .iter()
            .filter(|e| fresh.remove(&e.id))
            .cloned()
            .collect();
        if fresh.len() < batch.len() {
            tracing::debug!(
                context = C::SCHEMA,
                duplicates = batch.len() - fresh.len(),
                "inbox filtered redeliveries"
            );
        }
        if !fresh.is_empty() {
            ctx.handle_reports(&mut tx, &fresh).await?;
        }
    } else {
        ctx.handle_reports(&mut tx, batch).await?;
    }
    tx.commit().await?;
    Ok(())
}

async fn run_events<C: Context>(ctx: &C, events: &[RecordEvent]) -> Result<(), HandlerError> {
    let mut tx = ctx.pool().begin().await?;
    let ids: Vec<_> = events.iter().map(|e| e.id).collect();
    let mut fresh = inbox::claim(&mut tx, C::SCHEMA, &ids).await?;
    for event in events.iter().filter(|e| fresh.remove(&e.id)) {
        ctx.handle_event(&mut tx, event).await?;
    }
    tx.commit().await?;
    Ok(())
}
