//! The contexts the controller runs and how they are built: one pool per
//! context (its own role), their settings from the controller's, their
//! migrations, and what the relay, the API and the resync timer need of them
//! (schemas, pools, record subscriptions, section resync). Routing messages to
//! them is [`crate::router`].

use std::sync::Arc;

use mesh_config::Config;
use mesh_connectivity::Connectivity;
use mesh_delivery::Delivery;
use mesh_identity::Identity;
use mesh_inventory::Inventory;
use mesh_observability::Observability;
use mesh_plumbing::section::{self, Declared};
use mesh_plumbing::{Context, InStep, OutboxSignal};
use mesh_provisioning::Provisioning;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use crate::config::{ConfigError, Credentials, Settings};
use crate::metrics::{HandlerLabels, Histograms};

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
    #[error("loading what was declared to each node: {0}")]
    Sections(#[from] section::SectionError),
    #[error("inventory: {0}")]
    Inventory(#[from] mesh_inventory::Error),
    #[error("the artifact registry (registry_url): {0}")]
    Registry(#[from] mesh_oci::OciError),
    #[error("the OIDC issuers' HTTP client (oidc_ca_file): {0}")]
    IssuerClient(#[from] reqwest::Error),
}

/// Every context the controller runs, each with its own pool (its own role).
pub struct Contexts {
    pub inventory: Arc<Inventory>,
    pub config: Arc<Config>,
    pub identity: Arc<Identity>,
    pub connectivity: Arc<Connectivity>,
    pub observability: Arc<Observability>,
    pub delivery: Arc<Delivery>,
    pub provisioning: Arc<Provisioning>,
    /// What was declared to each node: heartbeats in step with it stay in
    /// memory (filled by [`Contexts::load_in_step`], raised by the relay).
    pub in_step: Arc<InStep>,
    /// The read replica and the contexts' reads that tolerate lag (decision
    /// 0041): what the replica clock (`replica::run`) checks.
    pub replicas: Arc<crate::replica::Replicas>,
    /// How long each context's transaction takes per batch, by context and
    /// kind: `mesh_controller_handler_duration_seconds` once `app::run` put
    /// the registered family here (`Metrics::handler_seconds`).
    pub handler_seconds: Histograms<HandlerLabels>,
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
            (
                Connectivity::SCHEMA,
                mesh_connectivity::migrate(creds.database(Connectivity::SCHEMA)?.expose()).await?,
            ),
            (
                Observability::SCHEMA,
                mesh_observability::migrate(creds.database(Observability::SCHEMA)?.expose())
                    .await?,
            ),
            (
                Delivery::SCHEMA,
                mesh_delivery::migrate(creds.database(Delivery::SCHEMA)?.expose()).await?,
            ),
            (
                mesh_provisioning::SCHEMA,
                mesh_provisioning::migrate(creds.database(mesh_provisioning::SCHEMA)?.expose())
                    .await?,
            ),
        ])
    }

    pub async fn connect(
        creds: &Credentials,
        settings: &Settings,
        signal: OutboxSignal,
    ) -> Result<Contexts, ContextsError> {
        let replicas = Arc::new(crate::replica::Replicas::new(settings));
        let ca = creds.mesh_ca()?;
        // The mesh's endpoints every node is told (decision 0044).
        let endpoints = crate::config::Advertised::of(settings, creds).endpoints(
            settings,
            creds.broker_url.expose(),
            ca.is_some(),
        );
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
                heartbeat_floor: std::time::Duration::from_millis(settings.heartbeat_interval_ms),
                heartbeat_budget: settings.heartbeat_budget_per_sec,
                liveness_write: settings.liveness_write(),
                sweep_interval: settings.sweep_interval(),
                controller_metrics: Some(
                    crate::config::Advertised::of(settings, creds)
                        .metrics_target(settings, ca.is_some()),
                ),
                endpoints,
                label_trust: mesh_inventory::LabelTrust::new(
                    settings.trusted_stated_labels.iter().cloned(),
                ),
                ..mesh_inventory::InventorySettings::default()
            },
        );
        let reads = replicas.reads_for(creds, Inventory::SCHEMA, inventory.pool())?;
        let inventory = inventory.with_reads(reads);
        let config_settings = mesh_config::ConfigSettings {
            resend_after: std::time::Duration::from_secs(settings.resend_after_secs),
        };
        // The secrets master keyring: without one the controller runs and
        // refuses to keep secrets (bundle/up makes it).
        if creds.master_keys_file.is_none() {
            tracing::warn!(
                "no master_keys_file in the credentials: secrets are refused (run bundle/up again)"
            );
        }
        let keyring = mesh_config::Keyring::load(creds.master_keys_file.clone()).map_err(|e| {
            ConfigError::Parse {
                path: creds.path().to_owned(),
                message: e.to_string(),
            }
        })?;
        let config = Config::new(
            pool(creds, Config::SCHEMA, settings.pool_size).await?,
            signal.clone(),
            config_settings,
            keyring,
        );
        if ca.is_none() {
            tracing::warn!(
                "no mesh CA in the credentials: certificate requests wait until there is one"
            );
        }
        let connectivity = Connectivity::new(
            pool(creds, Connectivity::SCHEMA, settings.pool_size).await?,
            signal.clone(),
            mesh_connectivity::Settings {
                plan: settings.connectivity_plan()?,
                certificate_lifetime: std::time::Duration::from_secs(
                    settings.certificate_lifetime_secs,
                ),
                ca: ca.clone(),
                resend_after: std::time::Duration::from_secs(settings.resend_after_secs),
            },
        );
        // What a joining node is handed: the advertised endpoints and the mesh
        // CA, or, without a CA, the controller's own (loopback) broker address.
        let mut identity_settings =
            mesh_identity::IdentitySettings::new(creds.signer()?.public_key_hex());
        let advertised = crate::config::Advertised::of(settings, creds);
        let mut node_broker = None;
        if let Some(ca) = &ca {
            identity_settings.ca_pin = Some(ca.pin());
            identity_settings.ca_certificate = Some(ca.certificate_pem().to_owned());
            identity_settings.api_url = advertised.api.clone();
            node_broker = advertised.broker.clone();
            if advertised.api.is_some() && node_broker.is_none() {
                tracing::warn!(
                    "advertise_api is set but advertise_broker is not: nodes joining from other machines are refused the loopback broker address (set advertise_broker; bundle/up does)"
                );
            }
        } else if advertised.api.is_some() || advertised.broker.is_some() {
            tracing::warn!(
                "advertised endpoints are set but the credentials name no mesh CA: nodes are handed the controller's own broker address (run bundle/up again)"
            );
        }
        let observability = Observability::new(
            pool(creds, Observability::SCHEMA, settings.pool_size).await?,
            signal.clone(),
            mesh_observability::Settings {
                retention: std::time::Duration::from_secs(settings.event_retention_secs),
                max_streams: settings.event_streams,
                evaluate_every: std::time::Duration::from_millis(settings.evaluate_ms),
                probe_retention: std::time::Duration::from_secs(settings.probe_retention_secs),
                alert_retention: std::time::Duration::from_secs(settings.alert_retention_secs),
                crash_restarts: settings.crash_restarts,
                crash_window: std::time::Duration::from_secs(settings.crash_window_secs),
                oom_kills: settings.oom_kills,
                certificate_window: std::time::Duration::from_secs(settings.certificate_alert_secs),
                behind_after: std::time::Duration::from_secs(settings.behind_alert_secs),
                outage_window: std::time::Duration::from_secs(settings.outage_alert_secs),
                alertmanager_urls: settings.alertmanager_urls.clone(),
                alertmanager_resend: std::time::Duration::from_secs(
                    settings.alertmanager_resend_secs,
                ),
                dashboard_url: Some(format!(
                    "{}{}",
                    advertised
                        .api
                        .clone()
                        .filter(|_| ca.is_some())
                        .unwrap_or_else(|| format!("http://{}", settings.api_listen)),
                    crate::dashboard::PATH
                )),
                ..mesh_observability::Settings::default()
            },
        );
        let reads = replicas.reads_for(creds, Observability::SCHEMA, observability.pool())?;
        let observability = observability.with_reads(reads);
        let store = crate::artifacts::RegistryStore::new(
            &settings.registry_url,
            settings.registry_pull_url.as_deref(),
            Arc::new(creds.signer()?),
            settings.trust_controller_artifact_signatures,
        )?;
        let delivery = Delivery::new(
            pool(creds, Delivery::SCHEMA, settings.pool_size).await?,
            signal.clone(),
            mesh_delivery::Settings {
                artifact_max_bytes: settings.artifact_max_bytes,
                resend_after: std::time::Duration::from_secs(settings.resend_after_secs),
            },
            Arc::new(store),
        );
        // Resource grants (decision 0039): credentials are sealed under the
        // secrets master keyring (config's file, read at each issue).
        let provisioning = Provisioning::new(
            pool(creds, mesh_provisioning::SCHEMA, settings.pool_size).await?,
            signal.clone(),
            mesh_provisioning::Settings {
                retention: std::time::Duration::from_secs(settings.grant_retention_secs),
                resend_after: std::time::Duration::from_secs(settings.resend_after_secs),
                master_keys_file: creds.master_keys_file.clone(),
            },
        );
        let identity = Identity::new(
            pool(creds, Identity::SCHEMA, settings.pool_size).await?,
            signal,
            identity_settings,
            Arc::new(crate::accounts::RabbitAccounts::from_credentials(
                creds,
                node_broker.as_deref(),
            )?),
        );
        let reads = replicas.reads_for(creds, Identity::SCHEMA, identity.pool())?;
        let issuers = crate::oidc::IssuerClient::new(&settings.oidc_ca_file)?;
        let identity = identity
            .with_reads(reads)
            .with_issuer_fetch(Arc::new(issuers));
        Ok(Contexts {
            replicas,
            inventory: Arc::new(inventory),
            config: Arc::new(config),
            identity: Arc::new(identity),
            connectivity: Arc::new(connectivity),
            observability: Arc::new(observability),
            delivery: Arc::new(delivery),
            provisioning: Arc::new(provisioning),
            in_step: Arc::new(InStep::new()),
            handler_seconds: Histograms::new_with_constructor(crate::metrics::batch_buckets),
        })
    }

    /// Fill the in-step index from every context's section table (before
    /// consuming reports; the relay raises it from then on).
    pub async fn load_in_step(&self) -> Result<usize, section::SectionError> {
        use mesh_plumbing::section::SectionOwner;
        for (section, rows) in [
            (
                Inventory::SECTIONS.section,
                Inventory::SECTIONS
                    .generations(self.inventory.pool())
                    .await?,
            ),
            (
                Config::SECTIONS.section,
                Config::SECTIONS.generations(self.config.pool()).await?,
            ),
            (
                Connectivity::SECTIONS.section,
                Connectivity::SECTIONS
                    .generations(self.connectivity.pool())
                    .await?,
            ),
            (
                Delivery::SECTIONS.section,
                Delivery::SECTIONS.generations(self.delivery.pool()).await?,
            ),
            (
                Provisioning::SECTIONS.section,
                Provisioning::SECTIONS
                    .generations(self.provisioning.pool())
                    .await?,
            ),
        ] {
            self.in_step.load(section, rows);
        }
        Ok(self.in_step.len())
    }

    /// Every context's schema and pool, for the outbox relay and housekeeping.
    pub fn schemas(&self) -> Vec<(&'static str, &PgPool)> {
        vec![
            (Inventory::SCHEMA, self.inventory.pool()),
            (Config::SCHEMA, self.config.pool()),
            (Identity::SCHEMA, self.identity.pool()),
            (Connectivity::SCHEMA, self.connectivity.pool()),
            (Observability::SCHEMA, self.observability.pool()),
            (Delivery::SCHEMA, self.delivery.pool()),
            (Provisioning::SCHEMA, self.provisioning.pool()),
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
            (Connectivity::SCHEMA, self.connectivity.subscriptions()),
            (Observability::SCHEMA, self.observability.subscriptions()),
            (Delivery::SCHEMA, self.delivery.subscriptions()),
            (Provisioning::SCHEMA, self.provisioning.subscriptions()),
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
            (
                Connectivity::SCHEMA,
                section::resync(&*self.connectivity)
                    .await
                    .map_err(|e| e.to_string()),
            ),
            (
                Delivery::SCHEMA,
                section::resync(&*self.delivery)
                    .await
                    .map_err(|e| e.to_string()),
            ),
            // Its pass also ages revoked grants out of their retention.
            (
                Provisioning::SCHEMA,
                self.provisioning.resync().await.map_err(|e| e.to_string()),
            ),
        ]
    }
}
