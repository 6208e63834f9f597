//! Test kit: one isolated mesh environment per test, against the real PostgreSQL
//! and RabbitMQ of this machine.
//!
//! [`TestEnv::new`] provisions, under a unique id `t` + 8 hex digits, a database
//! `mesh_<id>` with the seven context schemas each owned by its role
//! `mesh_<id>_<context>`, a vhost `mesh_<id>` and a controller broker user
//! `mesh_<id>-controller`; [`TestEnv::add_node`] adds node users `<id>-<suffix>`.
//! Tests in parallel never share a name. [`TestEnv::teardown`] removes all of it;
//! dropping a `TestEnv` without teardown does the same, best effort, on a separate
//! thread with its own runtime (so it works inside and outside async contexts).
//!
//! Admin access comes from `$MESH_ADMIN_CREDENTIALS` or
//! `/etc/mesh/admin-credentials.toml` (written by `bundle/up`), else from this
//! machine's defaults (see [`AdminCredentials::local_defaults`]).

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use mesh_protocol::{DeclarationSigner, NodeId};

use crate::CONTEXTS;
use crate::credentials::{AdminCredentials, ControllerCredentials, to_toml, write_secret_file};
use crate::provision::{self, Names, Rabbit, Secret, Secrets, Steps};

/// One test's isolated environment.
pub struct TestEnv {
    id: String,
    admin: AdminCredentials,
    names: Names,
    secrets: Secrets,
    /// The controller's declaration-signing key of this environment; its file is
    /// `<key_dir>/controller-signing.key`.
    signer: DeclarationSigner,
    key_dir: PathBuf,
    /// The first admin API token (its hash goes into the controller credentials).
    admin_token: String,
    torn_down: bool,
}

/// A node's broker credentials, as the agent stores them.
#[derive(Clone, Debug)]
pub struct NodeCredentials {
    pub node: NodeId,
    /// `amqp://<node>:<password>@host:port/<vhost>`.
    pub broker_url: String,
    pub password: String,
    /// The controller's declaration-signing public key (hex) the agent verifies
    /// every declaration against.
    pub controller_key: String,
}

impl NodeCredentials {
    /// Writes `<state_dir>/credentials.toml` (mode 0600) in the agent's format:
    /// `node`, `broker_url` and `controller_key`.
    pub fn write_to(&self, state_dir: &Path) -> anyhow::Result<()> {
        #[derive(serde::Serialize)]
        struct File<'a> {
            node: &'a str,
            broker_url: &'a str,
            controller_key: &'a str,
        }
        let text = to_toml(&File {
            node: self.node.as_str(),
            broker_url: &self.broker_url,
            controller_key: &self.controller_key,
        })?;
        write_secret_file(&state_dir.join("credentials.toml"), &text)?;
        Ok(())
    }
}

impl TestEnv {
    /// A fresh database with the seven roles and schemas, a vhost and a controller
    /// user with full permissions on it.
    pub async fn new() -> anyhow::Result<TestEnv> {
        let admin = AdminCredentials::load_or_local_defaults()?;
        let id = format!("t{}", hex::encode(rand::random::<[u8; 4]>()));
        let names = Names::for_test(&id);
        let key_dir = std::env::temp_dir().join(format!("mesh-{id}"));
        let signer = DeclarationSigner::from_seed(rand::random());
        let env = TestEnv {
            id,
            admin,
            names,
            secrets: Secrets::generate(),
            signer,
            key_dir,
            admin_token: mesh_protocol::new_token("mesh_at_", rand::random()),
            torn_down: false,
        };
        write_secret_file(&env.signing_key_path(), &env.signer.to_hex())
            .context("writing the test signing key")?;
        // On failure `env` is dropped, which removes whatever was created.
        provision::provision(&env.admin, &env.names, &env.secrets)
            .await
            .with_context(|| format!("provisioning test environment {}", env.id))?;
        Ok(env)
    }

    /// The unique id, `t` + 8 hex digits.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The database URL of `context`'s own role on this environment's database.
    ///
    /// # Panics
    /// When `context` is not one of [`CONTEXTS`] (a bug in the test).
    pub fn database_url(&self, context: &str) -> String {
        let secret = self
            .secrets
            .roles
            .get(context)
            .unwrap_or_else(|| panic!("unknown context `{context}`; known: {CONTEXTS:?}"));
        provision::postgres_url(
            &self.admin,
            &self.names.role(context),
            &secret.value,
            &self.names.database,
        )
        .unwrap_or_else(|e| panic!("{e}"))
    }

    /// The admin role's URL on this environment's database.
    pub fn admin_database_url(&self) -> String {
        provision::admin_url_on(&self.admin, &self.names.database).unwrap_or_else(|e| panic!("{e}"))
    }

    /// The controller's credentials for this environment (all seven databases,
    /// the signing key file, the identity management account, the first admin
    /// token's hash).
    pub fn controller_credentials(&self) -> ControllerCredentials {
        let mut c = provision::controller_credentials(&self.admin, &self.names, &self.secrets)
            .unwrap_or_else(|e| panic!("{e}"));
        c.signing_key_file = Some(self.signing_key_path().to_string_lossy().into_owned());
        c.bootstrap_admin_token_sha256 = Some(mesh_protocol::token_sha256_hex(&self.admin_token));
        c
    }

    /// Where this environment's controller signing key is (mode 0600).
    pub fn signing_key_path(&self) -> PathBuf {
        self.key_dir.join(crate::credentials::SIGNING_KEY_FILE)
    }

    /// This environment's controller signing key (tests sign or forge with it).
    pub fn signer(&self) -> &DeclarationSigner {
        &self.signer
    }

    /// The controller's public key (hex), as agents hold it.
    pub fn controller_public_key(&self) -> String {
        self.signer.public_key_hex()
    }

    /// The first admin API token: the controller creates `bootstrap-admin` with
    /// its hash at start.
    pub fn admin_token(&self) -> &str {
        &self.admin_token
    }

    /// The identity context's management API account of this environment.
    pub fn identity_management(&self) -> crate::credentials::BrokerManagement {
        self.controller_credentials()
            .broker_management
            .unwrap_or_else(|| panic!("provisioning always sets broker_management"))
    }

    /// Writes [`TestEnv::controller_credentials`] as TOML to `path` (mode 0600).
    pub fn write_controller_credentials(&self, path: &Path) -> anyhow::Result<()> {
        let text = to_toml(&self.controller_credentials())?;
        write_secret_file(path, &text)?;
        Ok(())
    }

    /// The controller user's AMQP URL on this environment's vhost.
    pub fn controller_amqp_url(&self) -> String {
        self.controller_credentials().broker_url
    }

    /// The admin user's AMQP URL on this environment's vhost (full permissions
    /// there), for inspecting queues and publishing test messages.
    pub fn admin_amqp_url(&self) -> String {
        provision::amqp_url(
            &self.admin,
            &self.admin.rabbitmq_user,
            &self.admin.rabbitmq_password,
            &self.names.vhost,
        )
        .unwrap_or_else(|e| panic!("{e}"))
    }

    /// This environment's vhost.
    pub fn vhost(&self) -> &str {
        &self.names.vhost
    }

    /// The admin credentials in use (for tests that inspect the broker's API).
    pub fn admin_credentials(&self) -> &AdminCredentials {
        &self.admin
    }

    /// The environment's names (database, role prefix, vhost, controller user).
    pub fn names(&self) -> &Names {
        &self.names
    }

    /// A node user `<id>-<suffix>` with a node's permissions on this vhost: write
    /// `reports` with routing keys `<node>.*`, read `decl.<node>`, configure nothing.
    pub async fn add_node(&self, suffix: &str) -> anyhow::Result<NodeCredentials> {
        let node = NodeId::parse(&format!("{}-{suffix}", self.id))
            .with_context(|| format!("node suffix `{suffix}`"))?;
        let secret = Secret::generate();
        let rabbit = Rabbit::new(&self.admin);
        provision::ensure_node_user(
            &rabbit,
            &self.names.vhost,
            &node,
            &secret,
            &mut Steps::default(),
        )
        .await?;
        let broker_url =
            provision::amqp_url(&self.admin, node.as_str(), &secret.value, &self.names.vhost)?;
        Ok(NodeCredentials {
            node,
            broker_url,
            password: secret.value,
            controller_key: self.controller_public_key(),
        })
    }

    /// Drops the database (terminating its sessions), the roles, the vhost, the
    /// controller user and every node user of this environment.
    pub async fn teardown(mut self) -> anyhow::Result<()> {
        self.torn_down = true;
        cleanup(&self.admin, &self.id, &self.names).await
    }
}

fn remove_key_dir(id: &str) {
    let _ = std::fs::remove_dir_all(std::env::temp_dir().join(format!("mesh-{id}")));
}

async fn cleanup(admin: &AdminCredentials, id: &str, names: &Names) -> anyhow::Result<()> {
    remove_key_dir(id);
    let rabbit = Rabbit::new(admin);
    // Broker first: deleting the vhost closes every connection to it.
    let mut first_err: Option<anyhow::Error> = None;
    if let Err(e) = rabbit.delete_vhost(&names.vhost).await {
        first_err.get_or_insert(e.into());
    }
    match rabbit.users().await {
        Ok(users) => {
            let node_prefix = format!("{id}-");
            for u in users.iter().filter(|u| {
                u.starts_with(&node_prefix)
                    || **u == names.controller_user
                    || **u == names.identity_user
            }) {
                if let Err(e) = rabbit.delete_user(u).await {
                    first_err.get_or_insert(e.into());
                }
            }
        }
        Err(e) => {
            first_err.get_or_insert(e.into());
        }
    }
    if let Err(e) = provision::drop_database_and_roles(admin, names).await {
        first_err.get_or_insert(e.into());
    }
    match first_err {
        Some(e) => Err(e.context(format!("tearing down test environment {id}"))),
        None => Ok(()),
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        if self.torn_down {
            return;
        }
        self.torn_down = true;
        let admin = self.admin.clone();
        let id = self.id.clone();
        let names = self.names.clone();
        let handle = std::thread::spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("testkit: cannot clean up {id}: no runtime: {e}");
                    return;
                }
            };
            if let Err(e) = rt.block_on(cleanup(&admin, &id, &names)) {
                eprintln!("testkit: cleanup of {id} failed: {e:#}");
            }
        });
        let _ = handle.join();
    }
}
