//! Idempotent provisioning of one mesh environment: a database with one schema and
//! role per context, a vhost and the controller's broker user; and of node users.
//!
//! PostgreSQL is driven over sqlx as the admin role (CREATEDB CREATEROLE);
//! RabbitMQ through its management HTTP API as an administrator. Every `ensure_*`
//! checks before it acts and reports whether it changed anything, so running the
//! same provisioning twice changes nothing the second time.

use std::collections::BTreeMap;
use std::time::Duration;

use mesh_broker_admin::{Management, Policy};
use mesh_protocol::topology;
use sqlx::{AssertSqlSafe, Connection, PgConnection};

use mesh_credentials::{
    AdminCredentials, AgentCredentials, BrokerManagement, ControllerCredentials, password_of,
};
use mesh_protocol::{NodeId, PublicKey};

use crate::CONTEXTS;

#[derive(Debug, thiserror::Error)]
pub enum ProvisionError {
    #[error("postgresql: {what}: {source}")]
    Postgres { what: String, source: sqlx::Error },
    #[error(transparent)]
    Rabbit(#[from] mesh_broker_admin::Error),
    #[error("invalid url `{url}`: {reason}")]
    Url { url: String, reason: String },
    #[error("check failed: {0}")]
    Check(String),
    /// A revoked node is given no credentials (decision 0050).
    #[error(
        "node {node} was revoked at {at} and gets no credentials until an admin re-admits it: run `meshctl node readmit {node}` (audited), then add it again"
    )]
    Revoked {
        node: NodeId,
        at: chrono::DateTime<chrono::Utc>,
    },
}

type Result<T> = std::result::Result<T, ProvisionError>;

fn pg(what: impl Into<String>) -> impl FnOnce(sqlx::Error) -> ProvisionError {
    let what = what.into();
    move |source| ProvisionError::Postgres { what, source }
}

/// `"name"`: a quoted SQL identifier.
pub fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

/// `'text'`: a quoted SQL string literal (standard_conforming_strings on).
pub fn quote_literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// The names of one environment: production or one test's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Names {
    pub database: String,
    /// Roles are `<role_prefix>_<context>`.
    pub role_prefix: String,
    pub vhost: String,
    pub controller_user: String,
    /// The management API user the identity context creates node users with
    /// (administrator tag, no vhost permissions). Never a valid node id.
    pub identity_user: String,
}

impl Names {
    /// db `mesh`, roles `mesh_<context>`, vhost `mesh`, broker user `mesh_controller` (never a valid node id).
    pub fn production() -> Names {
        Names {
            database: "mesh".into(),
            role_prefix: "mesh".into(),
            vhost: "mesh".into(),
            controller_user: "mesh_controller".into(),
            identity_user: "mesh_identity".into(),
        }
    }

    /// db, vhost and role prefix `mesh_<id>`, broker user `mesh_<id>-controller`.
    pub fn for_test(id: &str) -> Names {
        let base = format!("mesh_{id}");
        Names {
            database: base.clone(),
            role_prefix: base.clone(),
            vhost: base.clone(),
            controller_user: format!("{base}-controller"),
            identity_user: format!("{base}-identity"),
        }
    }

    pub fn role(&self, context: &str) -> String {
        format!("{}_{context}", self.role_prefix)
    }
}

/// A secret and whether it was just generated (not read from an existing file): a
/// fresh secret is (re)set on an account that already exists.
#[derive(Clone, Debug)]
pub struct Secret {
    pub value: String,
    pub fresh: bool,
}

impl Secret {
    pub fn generate() -> Secret {
        Secret {
            value: crate::generate_password(),
            fresh: true,
        }
    }
    pub fn known(value: String) -> Secret {
        Secret {
            value,
            fresh: false,
        }
    }
}

/// Passwords of one environment: the controller's broker user and each context role.
#[derive(Clone, Debug)]
pub struct Secrets {
    pub controller: Secret,
    /// The identity management user's password.
    pub identity: Secret,
    pub roles: BTreeMap<String, Secret>,
}

impl Secrets {
    pub fn generate() -> Secrets {
        Secrets {
            controller: Secret::generate(),
            identity: Secret::generate(),
            roles: CONTEXTS
                .iter()
                .map(|c| (c.to_string(), Secret::generate()))
                .collect(),
        }
    }

    /// Reuses the passwords of an existing controller credentials file; generates
    /// the ones it lacks.
    pub fn from_existing(existing: Option<&ControllerCredentials>) -> Secrets {
        let mut s = Secrets::generate();
        if let Some(c) = existing {
            if let Some(p) = password_of(c.broker_url.expose()) {
                s.controller = Secret::known(p);
            }
            if let Some(m) = &c.broker_management {
                s.identity = Secret::known(m.password.expose().clone());
            }
            for ctx in CONTEXTS {
                if let Some(p) = c.databases.get(ctx).and_then(|u| password_of(u.expose())) {
                    s.roles.insert(ctx.to_string(), Secret::known(p));
                }
            }
        }
        s
    }

    fn role(&self, context: &str) -> Result<&Secret> {
        self.roles
            .get(context)
            .ok_or_else(|| ProvisionError::Check(format!("no password for context {context}")))
    }
}

/// One step of provisioning and whether it changed anything.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    pub what: String,
    pub changed: bool,
}

#[derive(Default, Debug)]
pub struct Steps(pub Vec<Step>);

impl Steps {
    fn push(&mut self, what: impl Into<String>, changed: bool) {
        let step = Step {
            what: what.into(),
            changed,
        };
        tracing::debug!(what = %step.what, changed = step.changed, "provision step");
        self.0.push(step);
    }
    pub fn changed(&self) -> usize {
        self.0.iter().filter(|s| s.changed).count()
    }
}

fn parse_url(s: &str) -> Result<url::Url> {
    url::Url::parse(s).map_err(|e| ProvisionError::Url {
        url: redact(s),
        reason: e.to_string(),
    })
}

/// The URL without its password, for messages.
pub fn redact(s: &str) -> String {
    match url::Url::parse(s) {
        Ok(mut u) => {
            if u.password().is_some() {
                let _ = u.set_password(Some("***"));
            }
            u.to_string()
        }
        Err(_) => "<unparseable url>".into(),
    }
}

/// `admin.postgres_url` with the database replaced by `database`.
pub fn admin_url_on(admin: &AdminCredentials, database: &str) -> Result<String> {
    let mut u = parse_url(admin.postgres_url.expose())?;
    u.set_path(&format!("/{}", urlencoding::encode(database)));
    Ok(u.to_string())
}

/// `postgres://<user>:<password>@<admin's host:port>/<database>`.
pub fn postgres_url(
    admin: &AdminCredentials,
    user: &str,
    password: &str,
    database: &str,
) -> Result<String> {
    let u = parse_url(admin.postgres_url.expose())?;
    let host = u.host_str().unwrap_or("127.0.0.1");
    let port = u.port().unwrap_or(5432);
    Ok(format!(
        "postgres://{}:{}@{host}:{port}/{}",
        urlencoding::encode(user),
        urlencoding::encode(password),
        urlencoding::encode(database)
    ))
}

/// `amqp://<user>:<password>@<admin's amqp host:port>/<vhost percent-encoded>`.
pub fn amqp_url(
    admin: &AdminCredentials,
    user: &str,
    password: &str,
    vhost: &str,
) -> Result<String> {
    let u = parse_url(admin.amqp_url.expose())?;
    let host = u.host_str().unwrap_or("127.0.0.1");
    let port = u.port().unwrap_or(5672);
    Ok(format!(
        "amqp://{}:{}@{host}:{port}/{}",
        urlencoding::encode(user),
        urlencoding::encode(password),
        urlencoding::encode(vhost)
    ))
}

/// The controller's credentials for `names`.
pub fn controller_credentials(
    admin: &AdminCredentials,
    names: &Names,
    secrets: &Secrets,
) -> Result<ControllerCredentials> {
    let mut databases = BTreeMap::new();
    for ctx in CONTEXTS {
        let url = postgres_url(
            admin,
            &names.role(ctx),
            &secrets.role(ctx)?.value,
            &names.database,
        )?;
        databases.insert(ctx.to_string(), mesh_protocol::Secret::new(url));
    }
    let broker_url = amqp_url(
        admin,
        &names.controller_user,
        &secrets.controller.value,
        &names.vhost,
    )?;
    let mut creds = ControllerCredentials::new(mesh_protocol::Secret::new(broker_url), databases);
    creds.broker_management = Some(BrokerManagement {
        url: admin.rabbitmq_api.trim_end_matches('/').to_owned(),
        user: names.identity_user.clone(),
        password: mesh_protocol::Secret::new(secrets.identity.value.clone()),
    });
    Ok(creds)
}

// ---------------------------------------------------------------- PostgreSQL

/// Connects as the admin to `database`.
pub async fn connect_admin(admin: &AdminCredentials, database: &str) -> Result<PgConnection> {
    let url = admin_url_on(admin, database)?;
    PgConnection::connect(&url)
        .await
        .map_err(pg(format!("connect as admin to {}", redact(&url))))
}

async fn exec(conn: &mut PgConnection, sql: String) -> Result<()> {
    let what = sql
        .split(" PASSWORD ")
        .next()
        .unwrap_or_default()
        .to_string();
    sqlx::raw_sql(AssertSqlSafe(sql))
        .execute(&mut *conn)
        .await
        .map_err(pg(what))?;
    Ok(())
}

async fn exists(conn: &mut PgConnection, sql: &'static str, args: &[&str]) -> Result<bool> {
    let mut q = sqlx::query_scalar::<_, bool>(sql);
    for a in args {
        q = q.bind(a.to_string());
    }
    q.fetch_one(&mut *conn).await.map_err(pg(sql))
}

/// The server's `server_version_num` (e.g. 150004).
pub async fn server_version_num(conn: &mut PgConnection) -> Result<i64> {
    let v: String = sqlx::query_scalar("SHOW server_version_num")
        .fetch_one(&mut *conn)
        .await
        .map_err(pg("SHOW server_version_num"))?;
    v.trim()
        .parse()
        .map_err(|_| ProvisionError::Check(format!("server_version_num `{v}` is not a number")))
}

/// A LOGIN role with `password`; (re)sets the password of an existing role when
/// the secret is fresh. Makes the admin a member so it can give the role a schema.
pub async fn ensure_role(
    conn: &mut PgConnection,
    role: &str,
    secret: &Secret,
    steps: &mut Steps,
) -> Result<()> {
    let present = exists(
        conn,
        "SELECT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = $1)",
        &[role],
    )
    .await?;
    if !present {
        exec(
            conn,
            format!(
                "CREATE ROLE {} LOGIN PASSWORD {}",
                quote_ident(role),
                quote_literal(&secret.value)
            ),
        )
        .await?;
        steps.push(format!("postgresql role {role}: created"), true);
    } else if secret.fresh {
        exec(
            conn,
            format!(
                "ALTER ROLE {} LOGIN PASSWORD {}",
                quote_ident(role),
                quote_literal(&secret.value)
            ),
        )
        .await?;
        steps.push(format!("postgresql role {role}: password set"), true);
    } else {
        steps.push(format!("postgresql role {role}: exists"), false);
    }
    let member = exists(
        conn,
        "SELECT pg_has_role(current_user, $1, 'MEMBER')",
        &[role],
    )
    .await?;
    if !member {
        exec(conn, format!("GRANT {} TO CURRENT_USER", quote_ident(role))).await?;
        steps.push(format!("postgresql role {role}: admin made member"), true);
    }
    Ok(())
}

/// The database (owned by the admin), closed to PUBLIC, CONNECT for each context
/// role; PUBLIC stripped of the `public` schema; one schema per context owned by
/// its role.
pub async fn ensure_database(
    admin: &AdminCredentials,
    names: &Names,
    steps: &mut Steps,
) -> Result<()> {
    let db = names.database.as_str();
    let mut conn = connect_admin(admin, "postgres").await?;
    if !exists(
        &mut conn,
        "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)",
        &[db],
    )
    .await?
    {
        exec(&mut conn, format!("CREATE DATABASE {}", quote_ident(db))).await?;
        steps.push(format!("postgresql database {db}: created"), true);
    } else {
        steps.push(format!("postgresql database {db}: exists"), false);
    }
    let public_on_db = "SELECT EXISTS (SELECT 1 FROM pg_database d, \
         aclexplode(COALESCE(d.datacl, acldefault('d', d.datdba))) a \
         WHERE d.datname = $1 AND a.grantee = 0)";
    if exists(&mut conn, public_on_db, &[db]).await? {
        exec(
            &mut conn,
            format!("REVOKE ALL ON DATABASE {} FROM PUBLIC", quote_ident(db)),
        )
        .await?;
        if exists(&mut conn, public_on_db, &[db]).await? {
            return Err(ProvisionError::Check(format!(
                "REVOKE ALL ON DATABASE {db} FROM PUBLIC left privileges to PUBLIC"
            )));
        }
        steps.push(
            format!("postgresql database {db}: revoked from PUBLIC"),
            true,
        );
    }
    for ctx in CONTEXTS {
        let role = names.role(ctx);
        let has_connect = "SELECT EXISTS (SELECT 1 FROM pg_database d, \
             aclexplode(COALESCE(d.datacl, acldefault('d', d.datdba))) a \
             JOIN pg_roles r ON r.oid = a.grantee \
             WHERE d.datname = $1 AND r.rolname = $2 AND a.privilege_type = 'CONNECT')";
        if !exists(&mut conn, has_connect, &[db, &role]).await? {
            exec(
                &mut conn,
                format!(
                    "GRANT CONNECT ON DATABASE {} TO {}",
                    quote_ident(db),
                    quote_ident(&role)
                ),
            )
            .await?;
            steps.push(
                format!("postgresql database {db}: CONNECT granted to {role}"),
                true,
            );
        }
    }
    let _ = conn.close().await;

    let mut conn = connect_admin(admin, db).await?;
    let public_on_schema = "SELECT EXISTS (SELECT 1 FROM pg_namespace n, \
         aclexplode(COALESCE(n.nspacl, acldefault('n', n.nspowner))) a \
         WHERE n.nspname = 'public' AND a.grantee = 0)";
    if exists(&mut conn, public_on_schema, &[]).await? {
        exec(&mut conn, "REVOKE ALL ON SCHEMA public FROM PUBLIC".into()).await?;
        if exists(&mut conn, public_on_schema, &[]).await? {
            return Err(ProvisionError::Check(format!(
                "REVOKE ALL ON SCHEMA public FROM PUBLIC in {db} left privileges to PUBLIC \
                 (the admin role does not own schema public; PostgreSQL < 15?)"
            )));
        }
        steps.push(
            format!("postgresql {db}: schema public revoked from PUBLIC"),
            true,
        );
    }
    for ctx in CONTEXTS {
        let role = names.role(ctx);
        let owner: Option<String> = sqlx::query_scalar(
            "SELECT nspowner::regrole::text FROM pg_namespace WHERE nspname = $1",
        )
        .bind(ctx)
        .fetch_optional(&mut conn)
        .await
        .map_err(pg("schema owner"))?;
        match owner {
            None => {
                exec(
                    &mut conn,
                    format!(
                        "CREATE SCHEMA {} AUTHORIZATION {}",
                        quote_ident(ctx),
                        quote_ident(&role)
                    ),
                )
                .await?;
                steps.push(
                    format!("postgresql {db}: schema {ctx} created, owner {role}"),
                    true,
                );
            }
            Some(o) if o.trim_matches('"') == role => {
                steps.push(
                    format!("postgresql {db}: schema {ctx} exists, owner {role}"),
                    false,
                );
            }
            Some(_) => {
                exec(
                    &mut conn,
                    format!(
                        "ALTER SCHEMA {} OWNER TO {}",
                        quote_ident(ctx),
                        quote_ident(&role)
                    ),
                )
                .await?;
                steps.push(
                    format!("postgresql {db}: schema {ctx} owner set to {role}"),
                    true,
                );
            }
        }
    }
    let _ = conn.close().await;
    Ok(())
}

/// Drops the database (terminating its sessions) and every context role of `names`.
pub async fn drop_database_and_roles(admin: &AdminCredentials, names: &Names) -> Result<()> {
    let mut conn = connect_admin(admin, "postgres").await?;
    // `WITH (FORCE)` ends the database's other sessions, but a role that is not
    // a superuser may only end its own roles' sessions: a session of a context
    // role that is still closing (a process killed a moment ago) makes it fail.
    // Such sessions end by themselves; try again until a deadline.
    let drop = format!(
        "DROP DATABASE IF EXISTS {} WITH (FORCE)",
        quote_ident(&names.database)
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        match exec(&mut conn, drop.clone()).await {
            Ok(()) => break,
            Err(e) if std::time::Instant::now() < deadline => {
                tracing::debug!(error = %e, "database still in use; trying again");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => return Err(e),
        }
    }
    for ctx in CONTEXTS {
        exec(
            &mut conn,
            format!("DROP ROLE IF EXISTS {}", quote_ident(&names.role(ctx))),
        )
        .await?;
    }
    let _ = conn.close().await;
    Ok(())
}

// ---------------------------------------------------------------- RabbitMQ

/// The management API as the bundle's administrator, with idempotent `ensure_*`
/// steps on top of the shared client ([`mesh_broker_admin::Management`]).
#[derive(Clone, Debug)]
pub struct Rabbit {
    api: Management,
}

impl std::ops::Deref for Rabbit {
    type Target = Management;
    fn deref(&self) -> &Management {
        &self.api
    }
}

impl Rabbit {
    pub fn new(admin: &AdminCredentials) -> Rabbit {
        Rabbit {
            api: Management::new(
                &admin.rabbitmq_api,
                &admin.rabbitmq_user,
                admin.rabbitmq_password.expose(),
            ),
        }
    }

    /// Waits until the API answers `GET /api/overview` as this user.
    pub async fn wait_ready(&self, timeout: Duration) -> Result<()> {
        Ok(self.api.wait_ready(timeout).await?)
    }

    pub async fn vhost_exists(&self, vhost: &str) -> Result<bool> {
        Ok(self.api.vhost_exists(vhost).await?)
    }

    pub async fn ensure_vhost(&self, vhost: &str, steps: &mut Steps) -> Result<()> {
        if self.vhost_exists(vhost).await? {
            steps.push(format!("rabbitmq vhost {vhost}: exists"), false);
        } else {
            self.api.put_vhost(vhost).await?;
            steps.push(format!("rabbitmq vhost {vhost}: created"), true);
        }
        Ok(())
    }

    pub async fn delete_vhost(&self, vhost: &str) -> Result<bool> {
        Ok(self.api.delete_vhost(vhost).await?)
    }

    pub async fn user_exists(&self, user: &str) -> Result<bool> {
        Ok(self.api.user_info(user).await?.is_some())
    }

    /// All user names.
    pub async fn users(&self) -> Result<Vec<String>> {
        Ok(self.api.users().await?)
    }

    /// All vhost names.
    pub async fn vhosts(&self) -> Result<Vec<String>> {
        Ok(self.api.vhosts().await?)
    }

    /// A user with `tags` (comma separated, may be empty); the password is set when
    /// the user is created or the secret is fresh.
    pub async fn ensure_user(
        &self,
        user: &str,
        secret: &Secret,
        tags: &str,
        steps: &mut Steps,
    ) -> Result<()> {
        match self.api.user_info(user).await? {
            None => {
                self.api.put_user(user, &secret.value, tags).await?;
                steps.push(format!("rabbitmq user {user}: created"), true);
            }
            Some(info) => {
                let mut have = info.tag_list();
                have.sort();
                let mut want: Vec<String> = tags
                    .split(',')
                    .filter(|t| !t.is_empty())
                    .map(str::to_string)
                    .collect();
                want.sort();
                if secret.fresh || have != want {
                    self.api.put_user(user, &secret.value, tags).await?;
                    steps.push(format!("rabbitmq user {user}: password/tags set"), true);
                } else {
                    steps.push(format!("rabbitmq user {user}: exists"), false);
                }
            }
        }
        Ok(())
    }

    pub async fn delete_user(&self, user: &str) -> Result<bool> {
        Ok(self.api.delete_user(user).await?)
    }

    /// Permissions (configure, write, read regexes) of `user` on `vhost`.
    pub async fn ensure_permissions(
        &self,
        vhost: &str,
        user: &str,
        configure: &str,
        write: &str,
        read: &str,
        steps: &mut Steps,
    ) -> Result<()> {
        let want = mesh_broker_admin::Permissions {
            configure: configure.into(),
            write: write.into(),
            read: read.into(),
        };
        if self.api.permissions(vhost, user).await?.as_ref() == Some(&want) {
            steps.push(
                format!("rabbitmq permissions {user}@{vhost}: as wanted"),
                false,
            );
        } else {
            self.api
                .put_permissions(vhost, user, configure, write, read)
                .await?;
            steps.push(format!("rabbitmq permissions {user}@{vhost}: set"), true);
        }
        Ok(())
    }

    /// Topic permission (write, read routing-key regexes) of `user` on a topic
    /// `exchange` of `vhost`.
    pub async fn ensure_topic_permissions(
        &self,
        vhost: &str,
        user: &str,
        exchange: &str,
        write: &str,
        read: &str,
        steps: &mut Steps,
    ) -> Result<()> {
        let have = self.api.topic_permissions(vhost, user).await?;
        if have
            .iter()
            .any(|t| t.exchange == exchange && t.write == write && t.read == read)
        {
            steps.push(
                format!("rabbitmq topic permissions {user}@{vhost}/{exchange}: as wanted"),
                false,
            );
        } else {
            self.api
                .put_topic_permissions(vhost, user, exchange, write, read)
                .await?;
            steps.push(
                format!("rabbitmq topic permissions {user}@{vhost}/{exchange}: set"),
                true,
            );
        }
        Ok(())
    }

    /// The policy `name` on `vhost`, exactly as `want`.
    pub async fn ensure_policy(
        &self,
        vhost: &str,
        name: &str,
        want: &Policy,
        steps: &mut Steps,
    ) -> Result<()> {
        if self.api.policy(vhost, name).await?.as_ref() == Some(want) {
            steps.push(format!("rabbitmq policy {name}@{vhost}: as wanted"), false);
        } else {
            self.api.put_policy(vhost, name, want).await?;
            steps.push(format!("rabbitmq policy {name}@{vhost}: set"), true);
        }
        Ok(())
    }

    /// A durable exchange of `kind` (topic, direct, fanout) on `vhost`.
    pub async fn ensure_exchange(&self, vhost: &str, name: &str, kind: &str) -> Result<()> {
        Ok(self.api.put_exchange(vhost, name, kind).await?)
    }
}

// ---------------------------------------------------------------- environments

/// Provisions the whole environment `names`: PostgreSQL roles, database, schemas;
/// the vhost, the controller user with full permissions on it, and full
/// permissions for the admin user there (for inspection). Idempotent.
pub async fn provision(
    admin: &AdminCredentials,
    names: &Names,
    secrets: &Secrets,
) -> Result<Steps> {
    let mut steps = Steps::default();
    {
        let mut conn = connect_admin(admin, "postgres").await?;
        for ctx in CONTEXTS {
            ensure_role(&mut conn, &names.role(ctx), secrets.role(ctx)?, &mut steps).await?;
        }
        let _ = conn.close().await;
    }
    ensure_database(admin, names, &mut steps).await?;

    let rabbit = Rabbit::new(admin);
    rabbit.ensure_vhost(&names.vhost, &mut steps).await?;
    rabbit
        .ensure_user(&names.controller_user, &secrets.controller, "", &mut steps)
        .await?;
    rabbit
        .ensure_permissions(
            &names.vhost,
            &names.controller_user,
            ".*",
            ".*",
            ".*",
            &mut steps,
        )
        .await?;
    // `reports` gets its alternate exchange from a policy, which applies to an
    // exchange that exists already; an exchange argument would have to be there
    // from the first declare (decision 0021).
    rabbit
        .ensure_policy(
            &names.vhost,
            topology::REPORTS_POLICY,
            &reports_policy(),
            &mut steps,
        )
        .await?;
    // The identity context's management account: the administrator tag is what
    // RabbitMQ requires to create users and close connections (docs/decisions/0008);
    // it gets no permission on any vhost, so it cannot publish or consume.
    rabbit
        .ensure_user(
            &names.identity_user,
            &secrets.identity,
            "administrator",
            &mut steps,
        )
        .await?;
    rabbit
        .ensure_permissions(
            &names.vhost,
            &admin.rabbitmq_user,
            ".*",
            ".*",
            ".*",
            &mut steps,
        )
        .await?;
    Ok(steps)
}

/// The policy that makes [`topology::UNROUTABLE_EXCHANGE`] the alternate
/// exchange of [`topology::REPORTS_EXCHANGE`]: a report no queue takes is kept
/// (and dead-lettered by the controller) instead of dropped by the broker.
/// Priority 10, above a policy of priority 0 an operator may add for every
/// exchange (RabbitMQ applies only the highest-priority matching policy).
pub fn reports_policy() -> Policy {
    let mut definition = serde_json::Map::new();
    definition.insert(
        "alternate-exchange".into(),
        serde_json::Value::String(topology::UNROUTABLE_EXCHANGE.into()),
    );
    Policy {
        pattern: format!("^{}$", topology::REPORTS_EXCHANGE),
        apply_to: "exchanges".into(),
        definition,
        priority: 10,
    }
}

/// Node `node`'s broker permissions on `vhost`, exactly
/// [`mesh_protocol::topology::node_permissions`]: publish to `reports` with
/// routing keys `<node>.*` only, consume `decl.<node>` only, declare nothing.
pub async fn ensure_node_user(
    rabbit: &Rabbit,
    vhost: &str,
    node: &NodeId,
    secret: &Secret,
    steps: &mut Steps,
) -> Result<()> {
    let n = node.as_str();
    let p = mesh_protocol::topology::node_permissions(node);
    rabbit.ensure_user(n, secret, "", steps).await?;
    rabbit
        .ensure_permissions(vhost, n, &p.configure, &p.write, &p.read, steps)
        .await?;
    rabbit
        .ensure_topic_permissions(
            vhost,
            n,
            p.topic_exchange,
            &p.topic_write,
            &p.topic_read,
            steps,
        )
        .await?;
    Ok(())
}

/// When `node` was revoked, if it is revoked now (decision 0050): identity's
/// record (`identity.nodes`), read as the admin, a member of every context's
/// role. None when it is not revoked, or when no controller has created
/// identity's tables yet (then nothing was ever revoked).
pub async fn revoked_at(
    admin: &AdminCredentials,
    database: &str,
    node: &NodeId,
) -> Result<Option<chrono::DateTime<chrono::Utc>>> {
    let mut conn = connect_admin(admin, database).await?;
    let has_table = "SELECT to_regclass('identity.nodes') IS NOT NULL";
    if !exists(&mut conn, has_table, &[]).await? {
        return Ok(None);
    }
    let sql = "SELECT revoked_at FROM identity.nodes WHERE name = $1";
    let at: Option<Option<chrono::DateTime<chrono::Utc>>> = sqlx::query_scalar(sql)
        .bind(node.as_str())
        .fetch_optional(&mut conn)
        .await
        .map_err(pg(sql))?;
    Ok(at.flatten())
}

/// A node without the controller: its broker user on `vhost` with a node's
/// rights ([`ensure_node_user`]; `secret` is set on an existing user when it is
/// fresh), and the credentials file its agent runs with (`controller_key` is the
/// controller's public signing key). `mesh-bundle node-add` writes the result
/// into the agent's state directory; the test kit hands it to tests.
/// A node revoked in `database` is refused before anything is created or
/// changed ([`ProvisionError::Revoked`]): revocation is final until an admin
/// re-admits it (decision 0050).
pub async fn add_node(
    admin: &AdminCredentials,
    names: &Names,
    node: &NodeId,
    secret: &Secret,
    controller_key: &PublicKey,
    steps: &mut Steps,
) -> Result<AgentCredentials> {
    if let Some(at) = revoked_at(admin, &names.database, node).await? {
        return Err(ProvisionError::Revoked {
            node: node.clone(),
            at,
        });
    }
    let vhost = names.vhost.as_str();
    ensure_node_user(&Rabbit::new(admin), vhost, node, secret, steps).await?;
    Ok(AgentCredentials {
        node: node.clone(),
        broker_url: mesh_protocol::Secret::new(amqp_url(
            admin,
            node.as_str(),
            &secret.value,
            vhost,
        )?),
        controller_key: controller_key.clone(),
        // A node added without the controller reaches the broker on loopback
        // (the local mesh): plain, no CA.
        ca_certificate: None,
        api_url: None,
    })
}
